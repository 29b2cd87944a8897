"""One failed job among healthy ones: reported failed once, with the TransferFailed that says why, after its
copies finished; every other job is reported as before (the block mover needs no vLLM; the worker's
vLLM-facing results need vLLM's own TransferResult)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import DEVICE
from hicache_vllm.mover import TransferFailed
from test_mover import LAYERS, mover, vllm_cache

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("HICACHE_TEST_DEVICE=cuda but no CUDA device is visible", allow_module_level=True)

FAILING_BLOCK = 9  # a load into this device block fails at layer 1


def _planted(m):
    """The mover's load copies, failing layer 1 of any load into FAILING_BLOCK (a real copy everywhere else)."""
    impl = m.host.implementation_for("load_to_device_per_layer")
    real = impl.load_to_device_per_layer

    def load(h, d, layer):
        if layer == 1 and FAILING_BLOCK in d.tolist():
            raise RuntimeError("planted copy failure")
        real(h, d, layer)

    impl.load_to_device_per_layer = load


def _run_jobs(m, cache):
    """Job 1 stores blocks 5 and 2; jobs 2 (into block 9: fails), 3 and 4 load them back; returns what landed."""
    original = [t.clone() for t in cache]
    m.submit_store(1, np.array([5, 2]), np.array([0, 1]))
    m.wait({1})
    for layer in range(LAYERS):
        cache[layer][[FAILING_BLOCK, 10, 11]] = 0
    m.submit_load(2, np.array([0]), np.array([FAILING_BLOCK]))
    m.submit_load(3, np.array([0]), np.array([10]))
    m.submit_load(4, np.array([1]), np.array([11]))
    return original


def test_a_failed_load_is_reported_once_as_failed_and_the_others_go_on_being_reported():
    cache = vllm_cache(8)
    m = mover(cache, io_backend="direct")
    _planted(m)
    original = _run_jobs(m, cache)
    m.wait({2, 3, 4})  # waits out the failed one too, without raising
    done = {f.job_id: f for f in m.get_finished()}
    assert set(done) == {1, 2, 3, 4}
    assert all(done[j].ok for j in (1, 3, 4)) and not done[2].ok and done[2].is_load
    error = done[2].error
    assert isinstance(error, TransferFailed)
    assert re.fullmatch(r"job 2 failed: LayerLoadError: load of 32 slots into 3 layers: layer 1 failed to load "
                        r"\(TransferError: .* RuntimeError: planted copy failure\); layer 1 and every later layer of "
                        r"this load are missing; the request it serves cannot run on KV that did not arrive",
                        str(error))  # fmt: skip
    assert "planted copy failure" in str(error.__cause__.__cause__)
    assert m.get_finished() == []  # reported once; no call raises for it
    for layer in range(LAYERS):
        assert torch.equal(cache[layer][10], original[layer][5]), layer
        assert torch.equal(cache[layer][11], original[layer][2]), layer
    assert torch.equal(cache[0][FAILING_BLOCK], original[0][5])  # the layer before the failing one landed
    assert not cache[1][FAILING_BLOCK].any() and not cache[2][FAILING_BLOCK].any()
    m.submit_load(5, np.array([1]), np.array([6]))  # the mover goes on
    m.wait({5})
    (later,) = m.get_finished()
    assert later.job_id == 5 and later.ok and torch.equal(cache[2][6], original[2][2])
    m.shutdown()


def test_a_failed_job_never_reported_is_raised_by_shutdown():
    cache = vllm_cache(9)
    m = mover(cache, io_backend="direct")
    _planted(m)
    _run_jobs(m, cache)
    with pytest.raises(TransferFailed, match=r"^job 2 failed: LayerLoadError: .*planted copy failure"):
        m.shutdown()


def test_the_worker_gives_vllm_a_failed_result_after_the_healthy_ones():
    """What vLLM 0.32's offloading connector reads: its own TransferResult, success False for the failed job."""
    pytest.importorskip("vllm", reason="needs vLLM installed (integrations/vllm/dev's environment)")
    from hicache_vllm.spec import HicacheOffloadingWorker
    from vllm.v1.kv_offload.base import TransferResult

    cache = vllm_cache(10)
    worker = HicacheOffloadingWorker(mover(cache, io_backend="direct"))
    _planted(worker.mover)
    _run_jobs(worker.mover, cache)
    worker.wait({2, 3, 4})
    results = worker.get_finished()
    assert all(type(r) is TransferResult for r in results)
    assert [(r.job_id, r.success) for r in results[-1:]] == [(2, False)]
    assert sorted((r.job_id, r.success) for r in results[:-1]) == [(1, True), (3, True), (4, True)]
    assert all(r.transfer_size == 3 * worker.mover.page_bytes * (1 if r.job_id != 1 else 2) for r in results)
    assert worker.get_finished() == []
    worker.shutdown()
