"""Weight versions: pages computed with replaced weights are never loaded (keys, page store, controller, CLI).

After ``set_weight_version`` every key is in the new version's namespace: a page of the old weights
is a miss with the reason ``old_weight_version``; while the host pool still holds pages from before
the change, nothing is written (they would land under the new version's key) until it is cleared.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from hicache_core import metrics
from hicache_core.cli import main
from hicache_core.storage import PageStatus, StorageController, make_storage, page_hashes
from hicache_core.storage.explain import explain_miss
from hicache_core.storage.keys import Namespace, namespace_for
from hicache_core.testing import explain_kit as kit
from hicache_core.testing.storage_kit import StorageCase, make_pool, page_bytes, slots_of

PAGE = 4


def _setup(name: str, version: str = "v1", url: str | None = None):
    host = make_pool(StorageCase("mha", "page_first", "plain", PAGE), pages=32, seed=3)
    storage = make_storage(url or f"memory://wv-{name}-{time.monotonic_ns()}", host, model_id="m",
                           weight_version=version)  # fmt: skip
    return host, storage


def _old_misses() -> float:
    return metrics.L3_PREFETCH.values().get(("miss", "old_weight_version"), 0)


def test_weight_version_is_part_of_the_namespace_and_empty_keeps_the_old_prefix():
    pool = make_pool(StorageCase("mha", "page_first", "plain", PAGE))
    plain = namespace_for(pool, "acme/llama")
    # unversioned: exactly the prefix of namespace version 2, so pages stored before versions keep their keys
    assert plain.prefix == f"acme_llama.{plain.prefix.split('.')[1]}.{plain.fingerprint}.tp0of1"
    v1 = namespace_for(pool, "acme/llama", weight_version="step-100")
    v2 = plain.with_weight_version("step-200")
    assert v1.prefix.startswith("acme_llama.m2-") and ".w-step-100-" in v1.prefix
    assert len({plain.prefix, v1.prefix, v2.prefix}) == 3
    assert v1 == Namespace("acme/llama", plain.fingerprint, "tp0of1", "step-100")
    # versions that read alike are still apart (the exact version is hashed), and the prefix stays path-safe
    a, b = plain.with_weight_version("run/1"), plain.with_weight_version("run_1")
    assert a.prefix != b.prefix and "/" not in a.prefix
    with pytest.raises(TypeError, match="weight_version must be a str"):
        Namespace("m", "0" * 32, "tp0of1", 7)


def test_a_page_of_the_old_weights_is_a_miss_with_its_own_reason():
    host, storage = _setup("miss")
    keys = page_hashes(list(range(12)), PAGE)
    assert all(r.ok for r in storage.write_pages(keys, slots_of([1, 2, 3], PAGE)))
    host.clear()  # the server's cache reset: its host tier holds nothing of v1 any more
    assert storage.set_weight_version("v2") is True and storage.weight_version == "v2"
    assert storage.set_weight_version("v2") is False  # the current one: nothing changes
    assert storage.batch_exists(keys) == 0
    results = storage.read_pages(keys, slots_of([5, 6, 7], PAGE))
    assert [r.status for r in results] == [PageStatus.MISSING] * 3
    assert storage.old_weight_version_of(keys[0]) == "v1"
    report = explain_miss(storage, list(range(12)))
    assert [p.reason for p in report.pages] == ["old_weight_version"] * 3, report.format()
    assert "stored for weight version 'v1'" in report.pages[0].detail and "'v2'" in report.pages[0].detail
    # the new weights' pages go in and come back byte for byte; v1's stay v1's
    slots = host.alloc(3 * PAGE)
    assert all(r.ok for r in storage.write_pages(keys, slots))
    assert storage.batch_exists(keys) == 3
    back = host.alloc(3 * PAGE)
    assert all(r.ok for r in storage.read_pages(keys, back))
    for i in range(3):
        assert torch.equal(
            page_bytes(host, int(slots[i * PAGE]) // PAGE), page_bytes(host, int(back[i * PAGE]) // PAGE)
        )
    with pytest.raises(TypeError, match="a weight version is a str"):
        storage.set_weight_version(None)
    storage.close()


def test_nothing_is_written_while_the_host_pool_holds_pages_of_the_old_weights():
    host, storage = _setup("hold")
    old = host.alloc(2 * PAGE)  # computed with v1, still in the host tier when the weights change
    keys = page_hashes(list(range(100, 108)), PAGE)
    storage.set_weight_version("v2")
    held = storage.write_pages(keys, old)
    assert [r.status for r in held] == [PageStatus.SKIPPED] * 2
    assert "still holds pages of weight version 'v1'" in held[0].detail and "cleared" in held[0].detail
    flat = host.get_dummy_flat_data_page()
    assert storage.set(keys[0], flat) is False and storage.batch_set(keys[:1], [flat]) is False
    assert storage.batch_exists(keys) == 0 and storage.get_stats().write_held_old_weights == 4
    host.free(old)  # freeing is not enough: other slots may still hold old pages; a clear ends the hold
    assert storage.write_pages(keys, slots_of([1, 2], PAGE))[0].status is PageStatus.SKIPPED
    host.clear()
    assert all(r.ok for r in storage.write_pages(keys, slots_of([1, 2], PAGE)))
    # a pool that holds nothing at the change holds nothing old: writes go on
    storage.set_weight_version("v3")
    assert all(r.ok for r in storage.write_pages(keys, slots_of([1, 2], PAGE)))
    storage.close()


class _Gate:
    """A ``ready`` event for a backup that the test opens: the controller's worker waits on it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def query(self) -> bool:
        return self.open.is_set()


def test_controller_writes_no_backup_queued_before_the_change_and_hands_over_no_page_read_before_it():
    host, storage = _setup("ctl")
    toks = list(range(200, 216))
    with StorageController(storage, prefetch_policy="wait_complete") as ctl:
        gate = _Gate()
        src = host.alloc(16)
        first = ctl.backup(toks[:8], src[:8], ready=gate)  # the worker waits on it
        queued = ctl.backup(toks, src)  # behind it in the queue, of the old weights
        time.sleep(0.05)
        assert ctl.set_weight_version("v2") is True
        gate.open.set()
        # it was running: its pages would land under v2's keys, and the host pool still holds v1's pages
        ran = first.result(10)
        assert ran.written == 0 and "still holds pages of weight version 'v1'" in ran.results[0].detail
        res = queued.result(10)
        assert res.written == 0 and all(r.status is PageStatus.SKIPPED for r in res.results)
        assert "weight version changed after this backup was queued" in res.results[0].detail
        assert ctl.stats()["backup_skipped_old_weights"] == 1
        host.free(src)
        host.clear()

        # v2's prefix stored; a prefetch read under v2, handed over after a change to v3: no page, slots freed
        src = host.alloc(16)
        assert ctl.backup(toks, src).result(10).written == 4
        host.free(src)
        free = host.available_size()
        fut = ctl.prefetch(toks)
        while not fut.done():
            time.sleep(0.005)
        ctl.set_weight_version("v3")
        got = fut.result(10)
        assert got.completed == 0 and got.tokens == 0 and "weight version changed" in got.error
        assert host.available_size() == free
        assert ctl.outcomes.last(page_hashes(toks, PAGE)[0])[0] == "old_weight_version"

        # under v3 the v2 pages are misses counted by reason, and explained
        before = _old_misses()
        res = ctl.prefetch(toks).result(10)
        assert res.completed == 0 and res.local_hits == 0
        assert _old_misses() == before + 1  # the first missing page; the rest follow it
        report = ctl.explain_miss(toks)
        assert [p.reason for p in report.pages] == ["old_weight_version"] * 4
        assert ctl.stats()["prefetch_pages_old_weights"] == 4
    storage.close()


def test_cli_explain_miss_names_pages_of_an_old_weight_version(tmp_path, capsys):
    url = f"file://{tmp_path}"
    host = kit.host_pool()
    storage = make_storage(url, host, model_id="acme/llama", weight_version="step-1")
    toks = list(range(3000, 3000 + 3 * kit.PAGE))
    slots = host.alloc(len(toks))
    assert all(r.ok for r in storage.write_pages(page_hashes(toks, kit.PAGE), slots))
    storage.close()
    base = ["explain-miss", url, "--model-id", "acme/llama", *kit.CLI_GEOMETRY, "--token-ids", ",".join(map(str, toks))]
    assert main([*base, "--weight-version", "step-1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reasons"] == {"in_store": 3}
    assert main([*base, "--weight-version", "step-2", "--old-weight-version", "step-1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["reason"] for p in report["pages"]] == ["old_weight_version"] * 3
    assert ".w-step-2-" in report["namespace"]
    assert main([*base, "--weight-version", "step-2", "--json"]) == 1  # without the history: just not there
    assert json.loads(capsys.readouterr().out)["reasons"] == {"not_in_store": 3}
