"""The L3 core: key chain, namespaces, page headers, the storage hook, make_storage, the controller (memory://)."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

import pytest
import torch

from hicache_core.plugins.registry import Registry
from hicache_core.storage import (
    Capabilities,
    PageStatus,
    PrefetchTimeout,
    StorageBackend,
    StorageController,
    UnknownStorageScheme,
    hash_page,
    make_storage,
    page_hashes,
)
from hicache_core.storage.keys import namespace_for
from hicache_core.storage.page_format import (
    HEADER_SIZE,
    HeaderError,
    checksum_bytes,
    checksum_runs,
    pack_header,
    unpack_header,
)
from hicache_core.testing.storage_kit import StorageCase, make_pool, page_bytes, slots_of

# SHA-256 of the bytes 01000000 02000000 (tokens 1, 2 as uint32 LE), from `printf ... | sha256sum`,
# and of that digest's 32 bytes followed by tokens 3, 4: SGLang's chain for [1, 2, 3, 4] in pages of 2.
H12 = "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f"
H1234 = "c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c"


def test_key_chain_matches_sglang_test_vector():
    assert page_hashes([1, 2, 3, 4], 2) == [H12, H1234]
    assert page_hashes([1, 2, 3, 4, 5], 2) == [H12, H1234]  # a partial page has no key
    assert page_hashes([3, 4], 2, prior_hash=H12) == [H1234]
    assert page_hashes(torch.tensor([1, 2, 3, 4]), 2) == [H12, H1234]
    # tuple tokens (EAGLE bigrams) hash each element
    assert hash_page([(1, 2)]) == H12
    expected = hashlib.sha256(struct.pack("<4I", 7, 8, 9, 10)).hexdigest()
    assert page_hashes([7, 8, 9, 10], 4) == [expected]


def test_key_chain_rejects_bad_input():
    with pytest.raises(ValueError, match="4 unsigned bytes"):
        page_hashes([2**32], 1)
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0)


def test_namespace_separates_model_geometry_and_share():
    a = make_pool(StorageCase("mha", "page_first", "plain", 4))
    b = make_pool(StorageCase("mha", "page_first_direct", "plain", 4))
    s = make_pool(StorageCase("mha", "page_first", "sharded", 4))
    mla = make_pool(StorageCase("mla", "page_first", "plain", 4))
    base = namespace_for(a, "llama")
    assert namespace_for(a, "llama") == base
    assert namespace_for(a, "other").prefix != base.prefix
    assert namespace_for(b, "llama").fingerprint != base.fingerprint
    assert namespace_for(a, "llama", tp_rank=1, tp_size=2).share == "tp1of2"
    assert namespace_for(s, "llama").share == "tp0of1-L1-3of4"
    assert namespace_for(mla, "m", tp_rank=1, tp_size=4).share == "replicated"
    assert namespace_for(a, "org/model name").prefix.startswith("org_model_name.")
    with pytest.raises(ValueError, match="tp_rank"):
        namespace_for(a, "llama", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="model_id"):
        namespace_for(a, "")


def test_page_header_round_trip_and_damage():
    fp, kd = bytes(range(16)), bytes(range(32))
    raw = pack_header(payload_bytes=1234, checksum=0xDEADBEEF, fingerprint=fp, key_digest=kd)
    assert len(raw) == HEADER_SIZE and raw[:4] == b"HICP"
    h = unpack_header(raw)
    assert (h.payload_bytes, h.checksum, h.fingerprint, h.key_digest, h.version) == (1234, 0xDEADBEEF, fp, kd, 2)
    for offset, words in ((0, "magic"), (20, "CRC"), (78, "CRC")):
        bad = bytearray(raw)
        bad[offset] ^= 1
        with pytest.raises(HeaderError, match=words):
            unpack_header(bad)
    with pytest.raises(HeaderError, match="shorter"):
        unpack_header(raw[:10])


def test_checksum_is_xxh3_64_over_the_concatenation():
    xxhash = pytest.importorskip("xxhash")
    data = bytes(range(256)) * 100
    assert checksum_bytes(b"") == 0x2D06800538D394C2  # XXH3-64 of nothing, seed 0
    assert checksum_bytes(data) == xxhash.xxh3_64_intdigest(data)
    buf = bytearray(data)
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert checksum_runs([(base, 1000), (base + 1000, len(data) - 1000)]) == xxhash.xxh3_64_intdigest(data)


def test_unknown_scheme_names_installed_backends_and_install_hint():
    with pytest.raises(UnknownStorageScheme) as info:
        make_storage("nosuch://x/y", registry=Registry())
    text = str(info.value)
    assert "No storage backend serves nosuch://" in text and "memory://" in text
    with pytest.raises(UnknownStorageScheme) as info:
        make_storage("redis://127.0.0.1:1/0", registry=Registry())
    text = str(info.value)
    assert "hicache-storage-redis serves redis:// and is not installed" in text
    assert text.rstrip().splitlines()[-2].endswith("pip install -e " + str(Path(__file__).resolve().parents[1]
                                                                         / "plugins" / "storage-redis"))
    with pytest.raises(ValueError, match="storage URL looks like"):
        make_storage("/just/a/path")


def test_make_storage_checks_arguments_before_opening():
    host = make_pool(StorageCase("mha", "page_first", "plain", 4))
    with pytest.raises(ValueError, match="model_id"):
        make_storage("memory://args", host)
    with pytest.raises(ValueError, match="does not take option"):
        make_storage("memory://args?bogus=1", host, model_id="m")


class _Good(StorageBackend):
    scheme = "good"
    capabilities = Capabilities(shared=True)
    description = "test"

    def exists_objects(self, keys):
        return [False] * len(keys)

    def put_objects(self, keys, values):
        return [None] * len(keys)

    def get_objects(self, keys):
        return [None] * len(keys)


class _NoReader(StorageBackend):
    scheme = "noreader"
    capabilities = Capabilities(zero_copy=True)

    def exists_objects(self, keys):
        return []

    def put_objects(self, keys, values):
        return []


class _StoragePlugin:
    from hicache_core import hookimpl

    @hookimpl
    def hicache_register_storage_backends(self, register):
        register(_Good)
        register(_NoReader)
        register(_Good)  # a second claim on a scheme
        register(object)


def test_storage_hook_registers_and_refuses_with_reasons():
    registry = Registry()
    record = registry.add_plugin(_StoragePlugin(), "teststorage")
    assert registry.storage_backends["good"] is _Good and record.storage_backends == ["good"]
    assert registry.plugin_of_storage("good") == "teststorage"
    errors = " | ".join(record.errors)
    assert "does not implement get_objects_into" in errors
    assert "scheme 'good' is already registered by teststorage" in errors
    assert "not a subclass of hicache_core.storage.StorageBackend" in errors
    assert "hicache_register_storage_backends" in record.hooks
    assert registry.storage_backends["memory"].__name__ == "MemoryStorage"


# ---- the controller, on memory:// ---------------------------------------------------------------


def _setup(name, **kw):
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=32, seed=3)
    storage = make_storage(f"memory://{name}-{time.monotonic_ns()}", host, model_id="m", **kw)
    return host, storage


def _wait(future, timeout=10):
    deadline = time.monotonic() + timeout
    while not future.done():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_write_policies():
    host, storage = _setup("policy")
    toks = list(range(16))
    slots = host.alloc(16)
    with StorageController(storage, write_policy="write_back") as ctl:
        r = ctl.backup(toks, slots).result(10)
        assert r.written == 0 and all("eviction" in x.detail for x in r.results)
        assert ctl.backup(toks, slots, evicting=True).result(10).written == 4
    with StorageController(storage, write_policy="write_through_selective") as ctl:
        more = list(range(100, 116))
        assert ctl.backup(more, slots, hit_count=1).result(10).written == 0
        assert ctl.backup(more, slots, hit_count=2).result(10).written == 4
        again = ctl.backup(more, slots, hit_count=3).result(10)
        assert again.written == 0 and again.stored_prefix == 4  # already stored: not written twice
        assert ctl.stats()["backup_skipped_by_policy"] == 1


def test_replicated_pool_backs_up_on_rank_zero_only():
    host = make_pool(StorageCase("mla", "page_first", "plain", 4), pages=8)
    storage = make_storage(f"memory://rep-{time.monotonic_ns()}", host, model_id="m", tp_rank=1, tp_size=2)
    with StorageController(storage, tp_rank=1) as ctl:
        r = ctl.backup(list(range(8)), host.alloc(8)).result(10)
        assert r.written == 0 and "rank 0" in r.results[0].detail


def test_prefetch_policies_and_cancel():
    host, storage = _setup("pf")
    toks = list(range(40))
    src = host.alloc(40)
    with StorageController(storage, prefetch_policy="wait_complete", batch_pages=3) as ctl:
        ctl.backup(toks, src).result(10)
        res = ctl.prefetch(toks + [1] * 8).result(10)
        assert (res.local_hits, res.agreed_hits, res.completed, res.tokens) == (10, 10, 10, 40)
        for i in range(10):
            src_page, got_page = int(src[4 * i]) // 4, int(res.host_indices[4 * i]) // 4
            assert torch.equal(page_bytes(host, src_page), page_bytes(host, got_page))
        host.free(res.host_indices)
        free = host.available_size()
        fut = ctl.prefetch(toks)
        fut.cancel()
        res = fut.result(10)
        assert res.completed == 0 and host.available_size() == free
    with StorageController(storage, prefetch_policy="best_effort") as ctl:
        fut = ctl.prefetch(toks)
        _wait(fut)
        assert fut.result().completed == 10
        host.free(fut.result().host_indices)


class _SlowMemory:
    """Makes a memory:// backend take ``delay`` seconds per read batch (a slow store)."""

    def __init__(self, storage, delay):
        self.real = storage.backend.get_objects_into
        self.delay = delay
        storage.backend.get_objects_into = self

    def __call__(self, keys, targets):
        time.sleep(self.delay)
        return self.real(keys, targets)


def test_timeout_policy_returns_what_arrived_from_a_slow_store():
    host, storage = _setup("slow")
    toks = list(range(40))
    src = host.alloc(40)
    limit = PrefetchTimeout(base_s=0.5, per_ki_token_s=0.0, max_s=0.5)
    with StorageController(storage, prefetch_policy="timeout", prefetch_timeout=limit, batch_pages=2) as ctl:
        ctl.backup(toks, src).result(10)
        _SlowMemory(storage, 0.2)
        t0 = time.monotonic()
        res = ctl.prefetch(toks).result(10)
        waited = time.monotonic() - t0
        assert res.terminated and 0 < res.completed < 10, res
        assert res.completed % 2 == 0 and res.tokens == res.completed * 4
        assert waited < 0.5 + 2 * 0.2 + 1.0  # the limit, the batch in flight, slack
        assert ctl.stats()["prefetch_terminated"] == 1
        for i in range(res.completed):
            src_page, got_page = int(src[4 * i]) // 4, int(res.host_indices[4 * i]) // 4
            assert torch.equal(page_bytes(host, src_page), page_bytes(host, got_page))


def test_full_store_refusals_are_counted():
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=16)
    storage = make_storage(f"memory://full-{time.monotonic_ns()}", host, model_id="m", capacity=3 * 600)
    with StorageController(storage) as ctl:
        r = ctl.backup(list(range(24)), host.alloc(24)).result(10)
    statuses = [x.status for x in r.results]
    assert statuses[0] is PageStatus.OK and PageStatus.FULL in statuses
    assert storage.get_stats().write_refused_full >= 1
    assert storage.get_stats().backend["refused_full"] >= 1


def test_backup_queue_full_is_reported():
    host, storage = _setup("queue")
    gate = _SlowPut(storage, 0.3)
    with StorageController(storage, queue_depth=1) as ctl:
        futures = [ctl.backup(list(range(i * 100, i * 100 + 4)), host.alloc(4)) for i in range(4)]
        results = [f.result(10) for f in futures]
    refused = [r for r in results if r.results[0].status is PageStatus.ERROR and "queue full" in r.results[0].detail]
    assert refused and ctl.stats()["backup_refused_queue_full"] == len(refused)
    del gate


class _SlowPut:
    def __init__(self, storage, delay):
        self.real, self.delay = storage.backend.put_objects, delay
        storage.backend.put_objects = self

    def __call__(self, keys, values):
        time.sleep(self.delay)
        return self.real(keys, values)


def test_controller_refuses_bad_arguments():
    host, storage = _setup("args")
    with pytest.raises(ValueError, match="write_policy"):
        StorageController(storage, write_policy="sometimes")
    with pytest.raises(ValueError, match="prefetch_policy"):
        StorageController(storage, prefetch_policy="maybe")
    with pytest.raises(ValueError, match="init_process_group"):
        StorageController(storage, group=object())
    with StorageController(storage) as ctl:
        with pytest.raises(ValueError, match="host slots"):
            ctl.backup(list(range(16)), slots_of([1], 4))


def test_cli_storage_check_stats_and_two_process_demo(tmp_path, capsys):
    from hicache_core.cli import main

    url = f"memory://cli-{time.monotonic_ns()}"
    assert main(["storage", "check", url]) == 0
    assert "all checks passed" in capsys.readouterr().out
    assert main(["storage", "stats", url]) == 0
    assert '"backend_class": "MemoryStorage"' in capsys.readouterr().out
    # process 1 backs up and exits, process 2 (fresh pools) finds, prefetches, loads and compares
    assert main(["demo", "--storage", f"file://{tmp_path}/l3", "--tokens", "64", "--device", "cpu"]) == 0
