"""A weight update under a running server: no page computed with the old weights is loaded after it.

Two checkpoints of the same architecture with different random weights. ``wv-updated`` serves the
first with hicache's ``file://`` L3 tier (write_through): a prompt's pages reach the store, and load
from it after a flush (so this server does load that prefix from L3 when nothing stops it). Then
``POST /update_weights_from_disk`` switches it to the second checkpoint. The same prompt must give,
token for token, what a server started on the second checkpoint gives, and neither the host tier
nor L3 may load a page of the first: SGLang's accounting shows no cached token, hicache's metrics
no L3 read and no host-to-device load, and the miss is counted under its reason,
``old_weight_version``.

The second checkpoint is the fleet's own model, so the server started on it is the fleet's server
without HiCache of the same page size (``base-p16``): this module starts one server of its own
(each start costs ~25 CPU-seconds), not two.
"""

from __future__ import annotations

import os
import time

import pytest
import workload
from conftest import Case, need, selected
from server import Server, start_all, stop_all
from tiny_model import make_llama

CASE = Case("wv-lf-direct-p16-wt-hfile", "layer_first", "direct", 16, "write_through", storage="hicache-file")
NAMES = ("wv-updated",)
#: hicache's figures reach /metrics every second here (default 5); a wait covers a few syncs.
METRICS_INTERVAL = 1.0


@pytest.fixture(scope="module")
def servers(fleet, tmp_path_factory):
    if selected(list(NAMES)) != list(NAMES):
        pytest.skip(f"HICACHE_E2E_ONLY leaves out server(s) {', '.join(NAMES)}")
    need(fleet, f"base-p{CASE.page_size}")
    root = tmp_path_factory.mktemp("weight-update")
    # the fleet's model is make_llama's seed 0: the first checkpoint is the same architecture, other weights
    first = make_llama(str(root / "checkpoint-1"), seed=1)
    second = fleet.model
    fresh = fleet.servers[f"base-p{CASE.page_size}"]  # started on the second checkpoint, without HiCache
    store = root / "l3"
    store.mkdir()
    log_dir = os.environ.get("HICACHE_E2E_LOG_DIR") or str(root)
    env = {"HICACHE_METRICS_INTERVAL": str(METRICS_INTERVAL)}
    updated = Server(NAMES[0], first, CASE.args(f"file://{store}"), log_dir, env=env)
    try:
        start_all([updated], 1)
        yield updated, fresh, second, store
    finally:
        stop_all([updated])


def _namespaces(store) -> dict[str, int]:
    """Each namespace folder of the file store, with the pages under it."""
    return {d.name: sum(len(files) for _, _, files in os.walk(d)) for d in store.iterdir() if d.is_dir()}


def _wait_for(what, condition, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if condition(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def _host_loads(server) -> float:
    """Pages hicache's host pools loaded to the device (every load operation, every implementation)."""
    total = 0.0
    for key, value in server.metrics().items():
        if key.startswith("sglang:hicache_transfer_pages_total{") and 'op="load' in key:
            total += value
    return total


def _settled_metrics(server) -> None:
    time.sleep(3 * METRICS_INTERVAL + 1)  # every scheduler synced its figures at least twice


def test_after_a_weight_update_no_page_of_the_old_weights_is_loaded(servers):
    updated, fresh, second, store = servers
    updated.check_up()
    fresh.check_up()
    prompt = workload.Prompts.make(seed=43).first
    pages = len(prompt) // CASE.page_size
    reads = ("sglang:hicache_l3_pages_total", {"op": "read", "outcome": "ok"})

    # the first weights: the prompt's pages reach L3 ...
    before = updated.generate(prompt, workload.NEW_TOKENS)
    assert before["meta_info"]["cached_tokens"] == 0, before["meta_info"]
    stored = _wait_for(lambda: _namespaces(store), lambda ns: sum(ns.values()) >= pages)
    assert len(stored) == 1 and sum(stored.values()) >= pages, stored
    (old_namespace,) = stored
    assert ".w-default-" in old_namespace, old_namespace  # SGLang's --weight-version, default "default"
    # ... and, with the device and host tiers flushed, load from it: this server does read that prefix from L3
    updated.flush_cache()
    again = updated.generate(prompt, workload.NEW_TOKENS)
    details = again["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= pages * CASE.page_size, details
    assert again["output_ids"] == before["output_ids"]
    assert _wait_for(lambda: updated.counter(reads[0], **reads[1]), lambda n: n >= pages) >= pages

    old_pages = _namespaces(store)[old_namespace]

    # the update: SGLang loads the second checkpoint in place and flushes its radix tree (device and host)
    answer = updated._post("/update_weights_from_disk", {"model_path": second})
    assert answer.get("success") is True, answer
    log = updated.log()
    assert "update_weights_from_disk changed the weights: keys move from weight version 'default' to " \
        "'default~unnamed-" in log, log[-3000:]  # fmt: skip
    _settled_metrics(updated)
    read_before = updated.counter(reads[0], **reads[1])
    loads_before = _host_loads(updated)
    old_misses = updated.counter("sglang:hicache_l3_prefetch_pages_total", result="miss", reason="old_weight_version")

    after = updated.generate(prompt, workload.NEW_TOKENS)
    reference = fresh.generate(prompt, workload.NEW_TOKENS)
    assert reference["output_ids"] != before["output_ids"], "the two checkpoints give the same tokens: no test"
    assert after["output_ids"] == reference["output_ids"], (
        "after the update the server did not answer as the second checkpoint"
    )
    assert after["meta_info"]["cached_tokens"] == 0, after["meta_info"]  # nothing from device, host or L3
    details = after["meta_info"].get("cached_tokens_details") or {}
    assert not any(details.get(tier, 0) for tier in ("device", "host", "storage")), details

    _settled_metrics(updated)
    assert updated.counter(reads[0], **reads[1]) == read_before, "an L3 page was read after the update"
    assert _host_loads(updated) == loads_before, "a host page was loaded to the device after the update"
    assert updated.counter("sglang:hicache_l3_prefetch_pages_total", result="miss",
                           reason="old_weight_version") >= old_misses + 1  # fmt: skip
    # the second weights' pages go under a namespace of their own; the first's stay where they were
    now = _wait_for(lambda: _namespaces(store), lambda ns: len(ns) == 2 and min(ns.values()) >= pages)
    assert set(now) - {old_namespace} and now[old_namespace] == old_pages, now
    (new_namespace,) = set(now) - {old_namespace}
    assert ".w-default_unnamed-" in new_namespace and now[new_namespace] >= pages, now
