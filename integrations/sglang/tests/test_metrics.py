"""hicache's metrics on SGLang's own ``/metrics``, across processes as SGLang runs them.

A scheduler process (a subprocess with ``PROMETHEUS_MULTIPROC_DIR`` set before anything
imports prometheus_client, as SGLang's launcher does) builds SGLang's host pool and lets
SGLang's ``HiCacheController`` write 4 pages to the host tier and load them back layer by
layer. This process plays SGLang's HTTP process: SGLang's own ``add_prometheus_middleware``
mounts ``/metrics`` (a fresh registry with prometheus_client's ``MultiProcessCollector``)
and the test scrapes it. The expected figures come from SGLang's device pool shapes (pages,
bytes per token and layer) and from what the controller was asked to move.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
PAGE, PAGES, LAYERS_MOVED = 16, 4, 3
BACKUP, LOAD = "backup_from_device_all_layer", "load_to_device_per_layer"  # hicache's operation names

SCHEDULER = f"""
import json, sys
sys.path.insert(0, {str(HERE)!r})
import sglang_platform
sglang_platform.apply()  # what the suite's conftest shows SGLang of the machine, in this process too
import hicache_sglang
hicache_sglang.install()
from hicache_core import metrics as hm
from sglang_setup import LAYERS, device_layers, fill_random
from test_controller import build
import sglang.srt.mem_cache.pool_host.base as host_base
# The pool asks for a few KiB; SGLang's 10 GiB reserve would refuse it on a shared 24 GiB test machine.
host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0

dev, allocator, host, controller = build("mha", "page_first", "kernel", {PAGE}, 0)
assert LAYERS == {LAYERS_MOVED}
fill_random(device_layers(dev), seed=1)
device_indices = allocator.alloc({PAGES * PAGE})
host_indices = controller.write(device_indices, node_id=1)
controller.ack_write_queue.pop().finish_event.synchronize()
controller.load(host_indices, node_id=2)
controller.start_loading()
controller.ack_load_queue.pop().finish_event.synchronize()
from hicache_sglang import metrics
metrics.sync()
metrics.sync()  # a second sync adds nothing: only increases since the last one are added
row_bytes = sum(t[0].numel() * t.element_size() for t in (dev.k_buffer[0], dev.v_buffer[0]))
print(json.dumps({{"snapshot": hm.snapshot(), "row_bytes": row_bytes, "host_pages": host.page_num,
                  "impls": host.implementations}}), flush=True)
sys.stdin.readline()  # alive while the HTTP side scrapes
"""


def _scrape(folder: Path, monkeypatch) -> dict:
    """GET /metrics from SGLang's own metrics route; {sample name: {labels tuple: value}} and the type lines."""
    from prometheus_client.parser import text_string_to_metric_families
    from sglang.srt.utils import add_prometheus_middleware
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    app = Starlette()
    add_prometheus_middleware(app)
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    samples: dict = {"types": {}}
    for family in text_string_to_metric_families(response.text):
        samples["types"][family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_hicache_metrics_on_sglang_metrics_route(tmp_path, monkeypatch):
    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder), HICACHE_METRICS_INTERVAL="3600")
    if DEVICE == "cpu":  # Triton's interpreter runs the kernels on CPU pools only; CUDA pools compile them
        env["TRITON_INTERPRET"] = "1"
    stderr = tmp_path / "scheduler.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SCHEDULER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line, f"the scheduler process exited ({proc.wait(60)}):\n{stderr.read_text()[-4000:]}"
        scheduler = json.loads(line)
        scraped = _scrape(folder, monkeypatch)
    finally:
        proc.stdin.close()
        proc.wait(60)
    assert proc.returncode == 0

    row_bytes = scheduler["row_bytes"]  # K and V bytes of one token in one layer, from SGLang's device pool
    pages = scraped["sglang:hicache_transfer_pages_total"]
    by_op = {dict(k)["op"]: (dict(k)["impl"], v) for k, v in pages.items()}
    assert set(by_op) == {BACKUP, LOAD}
    assert by_op[BACKUP][1] == PAGES  # one write of 4 pages
    assert by_op[LOAD][1] == PAGES * LAYERS_MOVED  # one load call per layer, 4 pages each
    nbytes = {dict(k)["op"]: v for k, v in scraped["sglang:hicache_transfer_bytes_total"].items()}
    assert nbytes == {BACKUP: PAGES * PAGE * row_bytes * LAYERS_MOVED, LOAD: PAGES * PAGE * row_bytes * LAYERS_MOVED}
    counts = {dict(k)["op"]: v for k, v in scraped["sglang:hicache_transfer_submit_seconds_count"].items()}
    assert counts == {BACKUP: 1, LOAD: LAYERS_MOVED}
    inf = {dict(k)["op"]: v for k, v in scraped["sglang:hicache_transfer_submit_seconds_bucket"].items()
           if dict(k)["le"] == "+Inf"}  # fmt: skip
    assert inf == counts
    occupancy = {dict(k)["state"]: v for k, v in scraped["sglang:hicache_host_pool_pages"].items()}
    assert occupancy == {"used": PAGES, "capacity": scheduler["host_pages"]}
    assert scraped["types"]["sglang:hicache_transfer_pages"] == "counter"
    assert scraped["types"]["sglang:hicache_transfer_submit_seconds"] == "histogram"
    assert scraped["types"]["sglang:hicache_host_pool_pages"] == "gauge"

    # The same numbers as the scheduler's own hicache_core.metrics, bucket by bucket, sums included.
    snap = scheduler["snapshot"]
    for row in snap["hicache_transfer_submit_seconds"]["values"]:
        labels = tuple(sorted(row["labels"].items()))
        assert scraped["sglang:hicache_transfer_submit_seconds_sum"][labels] == pytest.approx(row["value"]["sum"])
        for bound, n in row["value"]["buckets"]:
            le = "+Inf" if bound == "inf" or bound == float("inf") else repr(float(bound))
            assert scraped["sglang:hicache_transfer_submit_seconds_bucket"][tuple(sorted((*labels, ("le", le))))] == n
    for row in snap["hicache_transfer_pages_total"]["values"]:
        assert pages[tuple(sorted(row["labels"].items()))] == row["value"]
    assert {impl for impl, _ in by_op.values()} <= set(scheduler["impls"].values())


def test_nothing_starts_without_sglang_metrics(monkeypatch):
    from hicache_sglang import metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert metrics.start() is None
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    monkeypatch.setenv(metrics.ENV_INTERVAL, "0")
    with pytest.raises(ValueError, match=r"^HICACHE_METRICS_INTERVAL='0' is not a number of seconds > 0$"):
        metrics.INTERVAL.read()
