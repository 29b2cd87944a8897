"""503 SlowDown from a real local HTTP server: the batch backs off as told, within its budget, and says why."""

from __future__ import annotations

import pytest
from http_stubs import ThrottlingServer

from hicache_core.storage import PageStatus, make_storage, page_hashes
from hicache_core.storage.pages import Span
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

pytest.importorskip("obstore", reason="the s3:// client is not installed: pip install obstore==0.12.1")


def _url(server: ThrottlingServer, **options: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"endpoint": server.endpoint, "key_id": "THROTTLEKEY",
                                             "secret": "throttle-secret", "timeout": 5, **options}.items())  # fmt: skip
    return f"s3://bucket/p?{query}"


def _bodies(n: int, size: int = 1000) -> list[list[Span]]:
    return [[Span(0, size, memoryview(bytearray([i % 251]) * size))] for i in range(n)]


def test_a_throttled_batch_waits_for_retry_after_and_stops_at_its_budget():
    server = ThrottlingServer(lambda n, method: True, retry_after="1")  # throttles everything, asks for 1 s
    try:
        backend = make_storage(_url(server, throttle_retries=4)).backend
        results = backend.put_objects([f"k{i}" for i in range(16)], _bodies(16))
        backend.close()
    finally:
        server.close()
    # 16 PUTs, then at most 4 more requests in all (one HEAD asking for Retry-After, three retries): not 16 x 3.
    methods = [m for m, _, _ in server.log]
    assert len(server.log) == 16 + 4, methods
    assert methods.count("HEAD") == 1 and methods.count("PUT") == 19
    first_wave_end = max(t for _, _, t in server.log[:16])
    retries = [t for m, _, t in server.log[17:]]
    assert min(retries) - first_wave_end >= 0.95, "a retry came before the server's Retry-After: 1"
    assert all(isinstance(r, BaseException) for r in results)
    text = str(results[0])
    assert "throttled" in text and "SlowDown" in text and "throttle_retries=4" in text and "wait 1 s" in text
    assert "space" not in text and "full" not in text.lower().replace("fully", "")


def test_a_batch_throttled_once_recovers_within_its_budget():
    puts = [0]

    def first_wave(n: int, method: str) -> bool:  # the 16 first PUTs throttled, without Retry-After
        puts[0] += method == "PUT"
        return method == "PUT" and puts[0] <= 16

    server = ThrottlingServer(first_wave, retry_after=None)
    try:
        backend = make_storage(_url(server, throttle_retries=20)).backend
        results = backend.put_objects([f"k{i}" for i in range(16)], _bodies(16))
        stats = backend.backend_stats()
        backend.close()
    finally:
        server.close()
    assert results == [None] * 16
    assert len(server.log) <= 16 + 20
    assert stats["throttled"] == 16


def test_throttled_pages_are_errors_that_say_so_not_full(tmp_path):
    server = ThrottlingServer(lambda n, method: True, retry_after="0")
    try:
        case = StorageCase("mha", "page_first", "plain", 4)
        host = make_pool(case, pages=16, seed=1)
        store = make_storage(_url(server, throttle_retries=2), host, model_id="m")
        keys = page_hashes(list(range(16)), 4)
        results = store.write_pages(keys, slots_of([1, 2, 3, 4], 4))
        store.close()
    finally:
        server.close()
    assert [r.status for r in results] == [PageStatus.ERROR] * 4, results
    assert all("throttled by the server" in r.detail for r in results)
    assert len(server.log) == 4 + 2
