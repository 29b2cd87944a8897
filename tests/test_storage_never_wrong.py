"""The L3 defects that were silently wrong, each pinned: namespaces, token ids, batch checks, format versions, abandoned
prefetches, explain_miss's reasons and the metrics (memory:// and file://, the real backends in the plugins)."""

from __future__ import annotations

import json
import struct
import threading
import time
import zlib

import pytest
import torch

from hicache_core import metrics
from hicache_core.storage import PageStatus, PrefetchTimeout, StorageController, make_storage, page_hashes
from hicache_core.storage.keys import Namespace, namespace_for
from hicache_core.storage.make import UnknownStorageScheme
from hicache_core.storage.page_format import HEADER_SIZE
from hicache_core.storage.url import StorageURL, redact_url
from hicache_core.testing.storage_kit import StorageCase, make_pool

CASE = StorageCase("mha", "page_first", "plain", 4)


def _setup(name, pages=32, model="m", case=CASE, **kw):
    host = make_pool(case, pages=pages, seed=3)
    storage = make_storage(f"memory://{name}", host, model_id=model, **kw)
    return host, storage


@pytest.mark.parametrize("a, b", [
    ("/mnt/models/team-research/experiments/llama-3-8b-sft/run-2026-01-15-lr3e-5-bs512/checkpoint-1000",
     "/mnt/models/team-research/experiments/llama-3-8b-sft/run-2026-01-15-lr3e-5-bs512/checkpoint-2000"),
    ("acme/llama-3-8b", "acme_llama-3-8b"),
    ("team-a/model", "team-a:model"),
    ("x" * 80 + "-a", "x" * 80 + "-b"),
])  # fmt: skip
def test_models_never_share_pages(a, b):
    host = make_pool(CASE, pages=16, seed=1)
    assert namespace_for(host, a).prefix != namespace_for(host, b).prefix
    name = f"ns-{time.monotonic_ns()}"
    first = make_storage(f"memory://{name}", host, model_id=a)
    second = make_storage(f"memory://{name}", host, model_id=b)
    toks = list(range(16))
    assert all(r.ok for r in first.write_pages(page_hashes(toks, 4), host.alloc(16)))
    assert first.batch_exists(page_hashes(toks, 4)) == 4
    assert second.batch_exists(page_hashes(toks, 4)) == 0


def test_prefix_keeps_a_readable_part_and_the_exact_model_digest():
    import hashlib

    ns = Namespace("meta-llama/Llama-3-8B", "0" * 32, "tp0of1")
    digest = hashlib.sha256(b"meta-llama/Llama-3-8B").hexdigest()[:24]
    assert ns.prefix == f"meta-llama_Llama-3-8B.m2-{digest}.{'0' * 32}.tp0of1"


def test_a_page_of_the_old_namespace_version_reads_as_mismatch():
    from hicache_core.storage import keys as K

    host, storage = _setup(f"old-{time.monotonic_ns()}")
    hashes = page_hashes(list(range(8)), 4)
    storage.write_pages(hashes, host.alloc(8))
    # the header a version-1 writer would put under this key: the fingerprint of the v1 description
    old = dict(K.geometry_description(host), version=1)
    key = storage.namespace.key(hashes[0])
    blob = bytearray(storage.backend._store.objects[key]) if hasattr(storage.backend, "_store") else None
    assert blob is not None
    body = bytearray(blob[: HEADER_SIZE - 4])
    body[28:44] = bytes.fromhex(K.fingerprint(old))
    blob[: HEADER_SIZE] = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
    storage.backend._store.objects[key] = blob
    res = storage.read_pages(hashes, host.alloc(8))
    assert res[0].status is PageStatus.MISMATCH and res[1].ok


def test_another_page_format_version_is_a_mismatch_not_corrupt():
    host, storage = _setup(f"fmt-{time.monotonic_ns()}")
    hashes = page_hashes(list(range(4)), 4)
    storage.write_pages(hashes, host.alloc(4))
    key = storage.namespace.key(hashes[0])
    blob = bytearray(storage.backend._store.objects[key])
    body = bytearray(blob[: HEADER_SIZE - 4])
    body[4:6] = struct.pack("<H", 99)
    blob[:HEADER_SIZE] = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
    storage.backend._store.objects[key] = blob
    (res,) = storage.read_pages(hashes, host.alloc(4))
    assert res.status is PageStatus.MISMATCH and "version 99" in res.detail


@pytest.mark.parametrize("bad", [[1.5] * 4, ["1"] * 4, [True] * 4, torch.ones(4) * 1.5])
def test_token_ids_are_never_coerced(bad):
    with pytest.raises(TypeError, match="not an integer|is a bool"):
        page_hashes(bad, 4)
    assert page_hashes(torch.ones(4, dtype=torch.int64), 4) == page_hashes([1] * 4, 4)


@pytest.mark.parametrize("bad", ["../etc", "a/b", "a.b", "", "x" * 201])
def test_one_bad_key_moves_nothing(bad):
    host, storage = _setup(f"bad-{time.monotonic_ns()}")
    keys = page_hashes(list(range(12)), 4)
    keys[2] = bad
    with pytest.raises((ValueError, TypeError), match="nothing was moved|non-empty"):
        storage.write_pages(keys, host.alloc(12))
    assert storage.batch_exists(keys[:2]) == 0
    with pytest.raises(ValueError, match="twice"):
        storage.write_pages([keys[0], keys[0]], host.alloc(8))


def test_one_bad_key_moves_nothing_on_files(tmp_path):
    host = make_pool(CASE, pages=16, seed=1)
    storage = make_storage(f"file://{tmp_path}", host, model_id="m")
    keys = page_hashes(list(range(12)), 4)
    keys[2] = "bad.key"
    with pytest.raises(ValueError, match="nothing was moved"):
        storage.write_pages(keys, host.alloc(12))
    assert not list(tmp_path.rglob("*.page*")) and storage.batch_exists(keys[:2]) == 0


def test_batch_set_and_get_check_everything_first():
    host, storage = _setup(f"bs-{time.monotonic_ns()}")
    keys = page_hashes(list(range(8)), 4)
    with pytest.raises(TypeError, match="one flat page tensor per key, got NoneType"):
        storage.batch_set(keys, None)
    pages = [host.get_data_page(0, flat=True).clone(), torch.zeros(3, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="flat page here is"):
        storage.batch_set(keys, pages)
    assert storage.batch_exists(keys) == 0  # the good first page was not written either
    good = [host.get_data_page(0, flat=True).clone(), host.get_data_page(4, flat=True).clone()]
    assert storage.batch_set(keys, good)
    got = storage.batch_get(keys, [torch.zeros_like(g) for g in good])
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, good))


def test_secrets_never_printed():
    url = "redis://alice:s3cr3t@127.0.0.1:6379/0?password=hunter2&prefix=a"
    parsed = StorageURL.parse(url)
    assert (parsed.username, parsed.password) == ("alice", "s3cr3t")
    for text in (repr(parsed), parsed.redacted, redact_url(url)):
        assert "s3cr3t" not in text and "hunter2" not in text and "alice" in text
    with pytest.raises(UnknownStorageScheme) as exc:
        make_storage("nope://:s3cr3t@host/")
    assert "s3cr3t" not in str(exc.value)
    with pytest.raises(ValueError) as exc:
        StorageURL.parse("redis://:s3cr3t@host:99999/0")
    assert "s3cr3t" not in str(exc.value) and "port" in str(exc.value)


class _Slow:
    def __init__(self, storage, delay):
        self.real, self.delay = storage.backend.get_objects_into, delay
        storage.backend.get_objects_into = self

    def __call__(self, keys, targets):
        time.sleep(self.delay)
        return self.real(keys, targets)


def test_an_abandoned_prefetch_frees_its_slots():
    host, storage = _setup(f"ab-{time.monotonic_ns()}")
    toks = list(range(40))
    src = host.alloc(40)
    with StorageController(storage, prefetch_policy="wait_complete", batch_pages=2) as ctl:
        ctl.backup(toks, src).result(10)
        free = host.available_size()
        _Slow(storage, 0.15)
        fut = ctl.prefetch(toks)
        with pytest.raises(TimeoutError, match="abandoned"):
            fut.result(timeout=0.2)
        deadline = time.monotonic() + 10
        while ctl.stats()["prefetch_abandoned"] == 0:
            assert time.monotonic() < deadline, ctl.stats()
            time.sleep(0.02)
        assert host.available_size() == free  # nothing stays reserved
        assert ctl.stats()["prefetch_abandoned_pages_freed"] == 10
        with pytest.raises(TimeoutError, match="abandoned"):
            fut.result(timeout=0.1)
        report = ctl.explain_miss(toks)
        assert report.pages[0].last_outcome == "timed_out" and report.pages[0].reason == "timed_out"


def test_explain_miss_every_local_reason(tmp_path):
    name = f"ex-{time.monotonic_ns()}"
    host, storage = _setup(name, pages=12)
    toks = list(range(24))
    keys = page_hashes(toks, 4)
    with StorageController(storage, prefetch_policy="wait_complete") as ctl:
        with pytest.raises(ValueError, match="host_pages"):
            ctl.explain_miss(toks, host_pages=7)
        report = ctl.explain_miss(toks)
        assert [p.reason for p in report.pages] == ["not_in_store"] * 6 and report.hit_pages == 0
        src = host.alloc(16)
        ctl.backup(toks[:16], src).result(10)
        storage.backend.corrupt(storage.namespace.key(keys[2]), HEADER_SIZE + 5)
        report = ctl.explain_miss(toks, host_pages=1)
        assert [p.reason for p in report.pages] == [
            "in_host", "in_store", "checksum_failed", "earlier_page_missing", "not_in_store", "not_in_store"]
        assert report.hit_pages == 2 and report.pages[3].in_store is True
        # the host pool full: the agreed pages find no room, and the controller remembers it
        hold = host.alloc(host.available_size())
        res = ctl.prefetch(toks).result(10)
        assert res.completed == 0 and "no room" in res.error
        report = ctl.explain_miss(toks)
        assert [p.reason for p in report.pages[:2]] == ["host_pool_full"] * 2
        assert "hit" not in json.dumps(report.as_dict()["reasons"])
        host.free(hold)
        # a prefetch that loads: loaded pages, then the checksum failure it met
        res = ctl.prefetch(toks).result(10)
        assert res.completed == 2
        assert [ctl.outcomes.last(k)[0] for k in keys] == [
            "loaded", "loaded", "checksum_failed", "earlier_page_failed", "not_in_store", "earlier_page_missing"]
        host.free(res.host_indices)
    # another layout's pages of the same model: layout_mismatch, not just "not in the store"
    other = make_pool(StorageCase("mha", "layer_first", "plain", 4), pages=12, seed=3)
    writer = make_storage(f"memory://{name}", other, model_id="m")
    writer.write_pages(keys[4:6], other.alloc(8))
    with StorageController(storage) as ctl:
        report = ctl.explain_miss(toks)
    assert [p.reason for p in report.pages[4:]] == ["layout_mismatch"] * 2
    assert "layer_first" in report.pages[4].detail
    assert "page    4" in report.format()


def test_explain_miss_timed_out():
    host, storage = _setup(f"to-{time.monotonic_ns()}")
    toks = list(range(40))
    limit = PrefetchTimeout(base_s=0.3, per_ki_token_s=0.0, max_s=0.3)
    with StorageController(storage, prefetch_policy="timeout", prefetch_timeout=limit, batch_pages=2) as ctl:
        ctl.backup(toks, host.alloc(40)).result(10)
        _Slow(storage, 0.2)
        res = ctl.prefetch(toks).result(10)
        assert res.terminated and res.completed < 10
        storage.backend.get_objects_into = storage.backend.get_objects_into.real
        report = ctl.explain_miss(toks, host_pages=res.completed)
        reasons = [p.reason for p in report.pages]
        assert reasons[: res.completed] == ["in_host"] * res.completed
        assert set(reasons[res.completed :]) == {"timed_out"}, reasons
        host.free(res.host_indices)


def test_metrics_count_transfers_l3_and_reasons():
    metrics.reset()
    host, storage = _setup(f"m-{time.monotonic_ns()}", pages=16)
    toks = list(range(16))
    with StorageController(storage, prefetch_policy="wait_complete") as ctl:
        ctl.backup(toks[:8], host.alloc(8)).result(10)
        res = ctl.prefetch(toks).result(10)
    snap = metrics.snapshot()

    def value(name, **labels):
        rows = [r["value"] for r in snap[name]["values"] if r["labels"] == {k: str(v) for k, v in labels.items()}]
        return rows[0] if rows else 0

    assert value("hicache_l3_pages_total", op="write", outcome="ok") == 2
    assert value("hicache_l3_pages_total", op="read", outcome="ok") == 2
    assert value("hicache_l3_prefetch_pages_total", result="hit", reason="loaded") == 2
    assert value("hicache_l3_prefetch_pages_total", result="miss", reason="not_in_store") == 1
    assert value("hicache_l3_prefetch_pages_total", result="miss", reason="earlier_page_missing") == 1
    page_bytes_ = storage.page_bytes + HEADER_SIZE
    assert value("hicache_l3_bytes_total", op="read") == 2 * page_bytes_
    assert value("hicache_host_pool_pages", state="used") >= 2
    host.free(res.host_indices)


def test_metrics_transfers_from_the_host_pool():
    from hicache_core.pool.host_pool import make_host_pool
    from hicache_core.tools.shapes import SHAPES

    metrics.reset()
    dev = SHAPES["llama-8b"].device_pool(64, page_size=16, device="cpu", layers=2)
    host = make_host_pool(dev, layout="layer_first", io_backend="auto", size=64)
    h, d = host.alloc(32), torch.arange(16, 48)
    host.backup_from_device_all_layer(dev, h, d, "auto")
    host.load_to_device_per_layer(dev, h, d, 1, "auto")
    snap = metrics.snapshot()
    rows = {(r["labels"]["op"]): r["value"] for r in snap["hicache_transfer_pages_total"]["values"]}
    assert rows == {"backup_from_device_all_layer": 2, "load_to_device_per_layer": 2}
    nbytes = {(r["labels"]["op"]): r["value"] for r in snap["hicache_transfer_bytes_total"]["values"]}
    backed, loaded = nbytes["backup_from_device_all_layer"], nbytes["load_to_device_per_layer"]
    assert backed == 32 * host.get_size_per_token() == 2 * loaded
    hist = snap["hicache_transfer_submit_seconds"]["values"][0]["value"]
    assert hist["count"] == 1 and hist["sum"] > 0


def test_metrics_are_exact_across_threads_and_refuse_bad_labels():
    c = metrics.Counter("t_total", "test", ("k",))
    child = c.labels(k="a")

    def work():
        for _ in range(20000):
            child.inc()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.values() == {("a",): 80000}
    with pytest.raises(ValueError, match="no label"):
        c.labels(k="a", j="b")
    with pytest.raises(ValueError, match="needs label"):
        c.labels()
    with pytest.raises(ValueError, match="only goes up"):
        child.inc(-1)
    with pytest.raises(ValueError, match="tier"):
        metrics.record_checksum_failure("disk")
    metrics.record_checksum_failure("host", 3)
    assert metrics.CHECKSUM_FAILURES.values()[("host",)] >= 3


def test_hicache_stats_text_and_json(tmp_path, capsys):
    from hicache_core.cli import main

    metrics.reset()
    metrics.record_checksum_failure("l3", 2)
    metrics.write_snapshot(tmp_path / "hicache-1.json")
    metrics.write_snapshot(tmp_path / "hicache-2.json")
    assert main(["stats", str(tmp_path)]) == 0
    assert "hicache_checksum_failures_total{tier=l3} 4" in capsys.readouterr().out
    assert main(["stats", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hicache_checksum_failures_total"]["values"] == [{"labels": {"tier": "l3"}, "value": 4}]
    assert main(["stats", str(tmp_path / "missing")]) == 2


def test_prometheus_export_names():
    import prometheus_client as prom  # scripts/dev installs it (pinned): this test never skips in CI

    metrics.reset()
    metrics.record_checksum_failure("l3")
    registry = prom.CollectorRegistry()
    metrics.register_prometheus(registry, prefix="sglang:")
    text = prom.generate_latest(registry).decode()
    assert 'sglang:hicache_checksum_failures_total{tier="l3"} 1.0' in text
    assert "# TYPE sglang:hicache_transfer_submit_seconds histogram" in text


_NO_PROMETHEUS = """
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError(f"blocked: {name}")

sys.meta_path.insert(0, _Block())
import hicache_core, hicache_core.cli, hicache_core.storage
from hicache_core import metrics
metrics.record_checksum_failure("l3", 2)
assert metrics.snapshot()["hicache_checksum_failures_total"]["values"] == [{"labels": {"tier": "l3"}, "value": 2}]
try:
    metrics.register_prometheus(None, prefix="sglang:")
except ImportError as exc:
    print("refused:", exc)
assert "prometheus_client" not in sys.modules
"""


def test_core_without_prometheus_client():
    """prometheus_client is optional: the core imports and records without it, and the export says how to get it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NO_PROMETHEUS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: hicache's Prometheus export needs prometheus_client" in done.stdout
    assert "pip install 'hicache-core[metrics]'" in done.stdout
