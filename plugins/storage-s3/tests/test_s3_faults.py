"""S3 against a real SeaweedFS server, faulted: killed and restarted mid-transfer, paused, full; damaged objects.

Each fault ends as a clear error or a miss: nothing wrong is loaded, no call outlives its deadline,
no host slot is left reserved.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from s3_objects import read_object, write_object
from seaweedfs_server import start_seaweedfs

from hicache_core.storage import StorageController, make_storage, page_hashes
from hicache_core.storage.backend import PageStatus, StorageError
from hicache_core.testing import storage_faults as F
from hicache_core.testing.storage_kit import flipped_payload, make_pool, page_bytes, pool_image, slots_of


@pytest.fixture(scope="module")
def own_weed(tmp_path_factory):
    """A server of this module's own, which its tests pause, kill and restart (on the same ports and data)."""
    server = start_seaweedfs(tmp_path_factory.mktemp("weed-faults"))
    try:
        server.create_bucket("faults")
        yield server
    finally:
        server.stop()


@pytest.fixture
def weed(own_weed, s3_env):
    if own_weed.proc is None or own_weed.proc.poll() is not None:
        own_weed.start()
    yield own_weed
    if own_weed.proc is not None and own_weed.proc.poll() is None:
        own_weed.resume()  # a test that paused it and failed must not leave it stopped


def _url(server, **options):
    return server.url("faults", f"f{uuid.uuid4().hex[:8]}", timeout=2, connect_timeout=1, **options)


def test_server_killed_mid_backup(weed):
    F.kill_mid_backup(_url(weed), weed.pause, weed.kill)


def test_server_killed_mid_prefetch(weed):
    F.kill_mid_prefetch(_url(weed), weed.pause, weed.kill)


def test_server_restarted_keeps_pages_and_the_client_reconnects(weed):
    host, backend, toks, keys, src = F.stored_pages(_url(weed), salt=11)
    dst = host.alloc(2 * 64)
    weed.kill()
    results = backend.read_pages(keys[:2], dst)
    assert [r.status for r in results] == [PageStatus.ERROR] * 2 and "not reachable" in results[0].detail
    weed.start()  # same ports, same data directory: S3 pages are durable
    assert backend.batch_exists(keys) == len(keys)
    assert backend.batch_get_into(keys[:2], dst) == [True, True]
    for i in range(2):
        assert (page_bytes(host, int(dst[i * 64]) // 64) == page_bytes(host, int(src[i * 64]) // 64)).all()


def test_a_paused_server_is_a_timeout_within_the_deadline(weed):
    host, backend, toks, keys, src = F.stored_pages(_url(weed), n_pages=8, salt=12)
    before = pool_image(host)
    weed.pause()  # SIGSTOP: connections are accepted by the kernel, nothing answers
    try:
        t0 = time.monotonic()
        results = backend.read_pages(keys, host.alloc(8 * 64))
        with pytest.raises(TimeoutError, match="timed out"):
            backend.batch_exists(keys)
        took = time.monotonic() - t0
    finally:
        weed.resume()
    statuses = [r.status for r in results]
    # A page whose answer was already on its way when the signal landed may read OK: verified, as every
    # page read is. Nothing else: every other page is a timeout, never an error or wrong bytes.
    assert set(statuses) <= {PageStatus.TIMEOUT, PageStatus.OK} and PageStatus.TIMEOUT in statuses, results[:1]
    assert took < 2 * (2 + 1) + 3, f"two calls with a 2 s request timeout took {took:.1f} s"
    assert backend.get_stats().backend["timeouts"] >= statuses.count(PageStatus.TIMEOUT)
    del before


def test_slow_store_timeout_policy(weed):
    # Each read answers 0.3 s late (the kit's delay at the primitive): a pause-resume cycle of the real server
    # raced the prefetch's first batch on a busy machine; the paused server has its own test above.
    F.slow_store_timeout(_url(weed))


def test_truncated_flipped_and_foreign_objects_are_never_loaded(weed):
    host, backend, toks, keys, src = F.stored_pages(_url(weed), n_pages=6, salt=13)
    full = backend.namespace.keys(keys)
    data = read_object(backend, full[1])
    write_object(backend, full[1], data[: len(data) // 2])  # truncated
    flipped = bytearray(read_object(backend, full[2]))
    flipped[200] ^= 0x01
    write_object(backend, full[2], bytes(flipped))
    write_object(backend, full[3], read_object(backend, full[4]))  # another page's object under this key
    # A page another model stored under the same page hash: its key differs, so it is simply not found here.
    other = make_storage(backend.url.raw, host, model_id="another-model")
    assert all(r.ok for r in other.write_pages([keys[5]], src[5 * 64 : 6 * 64]))
    backend.backend.remove_objects([full[5]])  # the store is make_storage's; the object goes through its backend
    before = pool_image(host)
    dst = host.alloc(6 * 64)
    pages = [int(dst[i * 64]) // 64 for i in range(6)]
    results = backend.read_pages(keys, dst)
    # With a cluster key, a flipped byte and a page moved under another key both fail the page's MAC.
    flipped = flipped_payload(backend)[0]
    moved = PageStatus.AUTH_FAILED if backend.authenticated else PageStatus.MISMATCH
    assert [r.status for r in results] == [PageStatus.OK, PageStatus.MISMATCH, flipped, moved, PageStatus.OK,
                                           PageStatus.MISSING], results  # fmt: skip
    assert "bytes" in results[1].detail and "another key" in results[3].detail
    for i in (1, 5):  # a truncated object is never copied; a missing one has no bytes
        assert (page_bytes(host, pages[i]) == _flat(before, host, pages[i])).all()
    for i in (0, 4):
        assert (page_bytes(host, pages[i]) == page_bytes(host, int(src[i * 64]) // 64)).all()
    host.free(dst)
    with StorageController(backend, prefetch_policy="wait_complete") as ctl:
        free = host.available_size()
        res = ctl.prefetch(toks[: 6 * 64]).result(30)
    assert res.completed == 1 and host.available_size() == free - 64, "only the sound head is kept"
    other.close()


def _flat(image, host, page):
    from hicache_core.testing.cases import as_bytes
    from hicache_core.testing.storage_kit import flat_from

    return as_bytes(flat_from(image, host, page))


def test_missing_bucket_and_wrong_credentials_are_clear_errors(weed, capsys):
    from hicache_core.cli import main

    host = make_pool(F.BIG, pages=8)
    keys = page_hashes(list(range(2 * 64)), 64)
    nobucket = weed.url("no-such-bucket", "p", timeout=2)
    assert main(["storage", "check", nobucket]) == 1  # the store cannot do what was asked: a failure, on stderr
    out, err = capsys.readouterr()
    assert out == "" and "the bucket does not exist" in err and "Traceback" not in err
    backend = make_storage(nobucket, host, model_id="m")
    (w,) = backend.write_pages(keys[:1], slots_of([1], 64))
    (r,) = backend.read_pages(keys[:1], slots_of([2], 64))
    assert w.status is PageStatus.ERROR and r.status is PageStatus.ERROR
    assert "the bucket does not exist" in w.detail and "the bucket does not exist" in r.detail
    assert "'no-such-bucket'" in w.detail and "'no-such-bucket'" in r.detail
    # S3 answers a HEAD in a missing bucket as for a missing key: the first miss checks the bucket, and a
    # prefix lookup is an error naming it, never 0 pages forever.
    for _ in range(2):
        with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
            backend.batch_exists(keys)
    backend.close()
    wrong = weed.url("faults", "p", timeout=2, key_id="HICACHETESTKEY", secret="not-the-secret")
    assert main(["storage", "check", wrong]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "credentials were refused" in err and "not-the-secret" not in err and "Traceback" not in err
    backend = make_storage(wrong, host, model_id="m")
    assert "key_id=***" in repr(backend) and "HICACHETESTKEY" not in repr(backend) + repr(backend.backend)
    (r,) = backend.read_pages(keys[:1], slots_of([2], 64))
    assert r.status is PageStatus.ERROR and "credentials were refused" in r.detail
    with pytest.raises(Exception, match="credentials were refused"):
        backend.batch_exists(keys)
    backend.close()


def test_a_full_store_fails_writes_clearly_and_keeps_what_it_stored(tmp_path, s3_env):
    server = start_seaweedfs(tmp_path / "full", volume_size_mb=1, volume_max=1)
    try:
        server.create_bucket("full")
        host = make_pool(F.BIG, pages=34)
        backend = make_storage(server.url("full", "p", timeout=5, retries=0), host, model_id="full")
        stored, failed = [], []
        for r in range(12):
            keys = page_hashes([(r * 7919 + i) % 30000 for i in range(32 * 64)], 64, prior_hash=f"{r:064x}")
            results = backend.write_pages(keys, slots_of(list(range(1, 33)), 64))
            stored += [k for k, x in zip(keys, results) if x.ok]
            failed += [x for x in results if not x.ok]
            if failed:
                break
        assert failed, "a 1 MB volume took 12 x 32 pages of 12 KiB"
        assert all(x.status in (PageStatus.ERROR, PageStatus.FULL) for x in failed)
        assert "HTTP 5xx" in failed[0].detail or failed[0].status is PageStatus.FULL, failed[0].detail
        assert backend.get_stats().write_failed + backend.get_stats().write_refused_full == len(failed)
        got = backend.read_pages(stored[:4], slots_of([33, 32, 31, 30], 64))
        assert all(x.ok for x in got), got
        backend.close()
    finally:
        server.stop()


def test_two_servers_with_two_ranks_share_pages(seaweedfs, s3_bucket, s3_env, tmp_path):
    url = seaweedfs.url(s3_bucket, f"share{uuid.uuid4().hex[:6]}", timeout=5)
    a, b = F.two_servers_share(url, tmp_path)
    F.assert_shared(a, b)


def test_backup_and_prefetch_run_concurrently_without_mixing(seaweedfs, s3_bucket, s3_env):
    url = seaweedfs.url(s3_bucket, f"mix{uuid.uuid4().hex[:6]}")
    host, backend, toks, keys, src = F.stored_pages(url, n_pages=8, salt=21)
    errors = []

    def writer():
        try:
            more = page_hashes(list(range(8 * 64)), 64, prior_hash="ab" * 32)
            assert all(r.ok for r in backend.write_pages(more, src))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    dst = host.alloc(8 * 64)
    got = backend.read_pages(keys, dst)
    t.join(30)
    assert not errors and all(r.ok for r in got)
    for i in range(8):
        assert (page_bytes(host, int(dst[i * 64]) // 64) == page_bytes(host, int(src[i * 64]) // 64)).all()


def test_a_missing_key_in_a_bucket_that_exists_checks_the_bucket_once(weed):
    host = make_pool(F.BIG, pages=8)
    store = make_storage(_url(weed), host, model_id="m")
    keys = page_hashes(list(range(4 * 64)), 64, prior_hash="cd" * 32)
    assert store.batch_exists(keys) == 0
    assert store.batch_exists(keys) == 0
    # A batch's HEADs go at once (4 each time); one LIST, the first time only, found the bucket.
    assert store.backend.backend_stats()["requests"] == 2 * 4 + 1
    assert all(r.ok for r in store.write_pages(keys[:1], slots_of([1], 64)))
    assert store.batch_exists(keys) == 1
    store.close()


@pytest.mark.parametrize("retries", [0, 1])
def test_a_dropped_connection_is_retried_as_retries_allow(seaweedfs, s3_bucket, s3_env, retries):
    from http_stubs import Relay

    from hicache_core.storage.pages import Span

    cut: list[str] = []

    def drop(line: str) -> bool:  # the first PUT's connection is cut before any answer
        if line.startswith("PUT") and not cut:
            cut.append(line)
            return True
        return False

    relay = Relay(seaweedfs.port, drop=drop)
    try:
        url = f"s3://{s3_bucket}/drop{uuid.uuid4().hex[:6]}?endpoint={relay.endpoint}&timeout=5&retries={retries}"
        backend = make_storage(url).backend
        (result,) = backend.put_objects(["k"], [[Span(0, 5, memoryview(bytearray(b"hello")))]])
        found = backend.exists_objects(["k"])
        backend.close()
    finally:
        relay.close()
    puts = [h for h in relay.heads if h.startswith("PUT")]
    if retries:
        assert result is None and found == [True] and len(puts) == 2
    else:
        assert isinstance(result, Exception) and found == [False] and len(puts) == 1
        assert "dropped" in str(result) or "not reachable" in str(result), result
