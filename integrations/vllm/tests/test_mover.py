"""The worker's block mover on tensors shaped as vLLM's, byte for byte (CPU here, CUDA on the GPU machine).

No vLLM needed: the GPU gate runs these with ``HICACHE_TEST_DEVICE=cuda`` where vLLM's CUDA wheel
cannot go. Pages are laid out as vLLM's CPU attention backend lays them out
(:mod:`hicache_vllm.page_oracle`), filled with values that name their (layer, block, part, head,
token, dim), so a misplaced byte shows which item it belonged to.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from conftest import DEVICE
from hicache_vllm.errors import NotServedError
from hicache_vllm.mover import BlockMover, TransferFailed
from hicache_vllm.page_oracle import element_offset, page_bytes

from hicache_core.loads.layer_loads import LayerLoadTimeout, layer_loader

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("HICACHE_TEST_DEVICE=cuda but no CUDA device is visible", allow_module_level=True)

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 3, 12, 2, 32, 32
DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32
IO_BACKENDS = ["auto", "direct"] + (["kernel"] if DEVICE == "cuda" else [])
LAYOUTS = ["page_first", "layer_first"]


def vllm_cache(seed: int = 0) -> list[torch.Tensor]:
    """Per layer vLLM's CPU cache tensor ``[blocks, heads, block, 2*head]``, every element distinct per layer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(LAYERS):
        values = torch.randperm(BLOCKS * HEADS * BLOCK * 2 * HEAD, generator=g).to(torch.float32) + layer
        out.append(values.reshape(BLOCKS, HEADS, BLOCK, 2 * HEAD).to(DTYPE).to(DEVICE))
    return out


def pages_of(cache: list[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's canonical view: ``[num_blocks, page_bytes]`` int8 per layer."""
    return [t.view(torch.int8).view(BLOCKS, -1) for t in cache]


def mover(cache, **kw) -> BlockMover:
    kw.setdefault("num_chunks", 10)
    return BlockMover(pages_of(cache), block_size=BLOCK, **kw)


def finish(m: BlockMover, jobs: set[int]) -> dict[int, object]:
    m.wait(jobs)
    done = {f.job_id: f for f in m.get_finished()}
    assert set(done) == jobs
    return done


def test_page_oracle_matches_the_cpu_backend_view():
    """The oracle against vLLM's own split: K half first ([head, 2*block, head] view), V rows after it."""
    cache = torch.arange(HEADS * BLOCK * 2 * HEAD, dtype=torch.float32).reshape(1, HEADS, BLOCK, 2 * HEAD)
    four = cache.view(1, HEADS, 2 * BLOCK, HEAD)
    key_cache, value_cache = four.chunk(2, dim=2)
    flat = cache.reshape(-1)
    for head, token, dim in [(0, 0, 0), (1, 5, 7), (1, 31, 31), (0, 17, 3)]:
        v_at = element_offset(part="v", head=head, token=token, dim=dim, block_size=BLOCK, head_size=HEAD)
        assert flat[v_at] == value_cache[0, head, token, dim]
        # K is written transposed: element (dim, token) of the K half's [head_size x block_size] matrix.
        k_at = element_offset(part="k", head=head, token=token, dim=dim, block_size=BLOCK, head_size=HEAD)
        assert flat[k_at] == key_cache[0, head].reshape(-1)[dim * BLOCK + token]
    assert page_bytes(num_kv_heads=HEADS, block_size=BLOCK, head_size=HEAD, element_size=4) == cache.numel() * 4


@pytest.mark.parametrize("io_backend", IO_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_evict_load_byte_for_byte(layout, io_backend):
    cache = vllm_cache()
    original = [t.clone() for t in cache]
    m = mover(cache, layout=layout, io_backend=io_backend)
    m.submit_store(1, np.array([5, 2, 9], dtype=np.int32), np.array([3, 0, 7], dtype=np.int32))
    done = finish(m, {1})
    assert done[1].num_bytes == 3 * LAYERS * BLOCK * HEADS * 2 * HEAD * cache[0].element_size()
    for t in cache:
        t.zero_()  # vLLM reuses the blocks
    m.submit_load(2, np.array([7, 3], dtype=np.int32), np.array([1, 4], dtype=np.int32))
    finish(m, {2})
    for layer in range(LAYERS):
        assert torch.equal(cache[layer][1], original[layer][9]), f"layer {layer}: block 1 is not chunk 7's page"
        assert torch.equal(cache[layer][4], original[layer][5]), f"layer {layer}: block 4 is not chunk 3's page"
        others = [b for b in range(BLOCKS) if b not in (1, 4)]
        assert not cache[layer][others].any(), f"layer {layer}: a block outside the load was written"
    # Read through the oracle: K of token 17, head 1, dim 3 of layer 2 arrived where vLLM reads it.
    at = element_offset(part="k", head=1, token=17, dim=3, block_size=BLOCK, head_size=HEAD)
    assert cache[2][1].reshape(-1)[at] == original[2][9].reshape(-1)[at]
    m.shutdown()


def test_chunks_of_two_blocks_with_a_partial_first_chunk():
    cache = vllm_cache(1)
    original = [t.clone() for t in cache]
    m = mover(cache, num_chunks=4, blocks_per_chunk=2)
    # Blocks 6, 7, 8 stored from the second half of chunk 1 on (vLLM's block_indices % blocks_per_chunk = 1).
    m.submit_store(1, np.array([6, 7, 8]), np.array([1, 2]), skip=1)
    finish(m, {1})
    for t in cache:
        t.zero_()
    m.submit_load(2, np.array([1, 2]), np.array([0, 10, 11]), skip=1)
    finish(m, {2})
    for layer in range(LAYERS):
        for dst, src in ((0, 6), (10, 7), (11, 8)):
            assert torch.equal(cache[layer][dst], original[layer][src])
    m.shutdown()


def test_bad_indices_are_refused_before_any_byte_moves():
    cache = vllm_cache(2)
    m = mover(cache, num_chunks=4)
    with pytest.raises(IndexError, match="host chunk 4 is outside the host tier"):
        m.submit_store(1, np.array([0, 1]), np.array([0, 4]))
    with pytest.raises(IndexError, match="device block 12 is outside"):
        m.submit_store(1, np.array([0, 12]), np.array([0, 1]))
    with pytest.raises(ValueError, match="cannot hold"):
        m.submit_load(1, np.array([0]), np.array([0, 1]))
    assert m.get_finished() == []
    with pytest.raises(NotServedError, match="raise its size"):
        mover(cache, num_chunks=0)
    m.shutdown()


@pytest.mark.skipif(DEVICE != "cuda", reason="streams and events exist on CUDA only")
def test_store_waits_for_the_callers_stream_and_reports_only_landed_bytes():
    cache = vllm_cache(3)
    m = mover(cache)
    torch.cuda._sleep(200_000_000)  # the model still running on the caller's stream ...
    cache[0][5].fill_(7.0)  # ... and writing the block the store reads
    m.submit_store(1, np.array([5]), np.array([2]))
    early = m.get_finished()
    assert early == [], "a store was reported finished before its bytes landed"
    finish(m, {1})
    cache[0][5].zero_()
    m.submit_load(2, np.array([2]), np.array([6]))
    finish(m, {2})
    torch.cuda.synchronize()
    assert bool((cache[0][6] == 7.0).all()), "the store read the block before the caller's stream wrote it"
    m.shutdown()


@pytest.mark.skipif(DEVICE != "cuda", reason="streams exist on CUDA only")
def test_load_runs_off_the_callers_stream():
    cache = vllm_cache(4)
    original = cache[1][3].clone()
    m = mover(cache)
    m.submit_store(1, np.array([3]), np.array([0]))
    finish(m, {1})
    cache[1][8].zero_()
    m.submit_load(2, np.array([0]), np.array([8]))
    assert torch.cuda.current_stream() != m._stream(True)
    finish(m, {2})
    assert torch.equal(cache[1][8], original)
    m.shutdown()


@pytest.fixture(params=["file", "redis", "s3"])
def l3_url(request, tmp_path, monkeypatch):
    """A store of each scheme: a directory, a real redis-server or a real SeaweedFS on 127.0.0.1 (skipped, saying
    why, without one)."""
    if request.param == "file":
        yield f"file://{tmp_path / 'l3'}"
        return
    if request.param == "s3":
        s3 = request.getfixturevalue("s3_store")
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(name, s3.env[name])
        yield s3.url_for(f"mover-{tmp_path.name}")
        return
    pytest.importorskip("hicache_storage_redis", reason="hicache-storage-redis is not installed")
    from hicache_core.testing.servers import start_redis

    server = start_redis(tmp_path)
    try:
        yield f"redis://127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def test_l3_write_through_then_a_new_worker_reads_it_back(l3_url):
    url = l3_url
    cache = vllm_cache(5)
    original = [t.clone() for t in cache]
    keys = ["aa01", "aa02"]
    m1 = mover(cache, storage_url=url, model_id="tiny")
    m1.submit_store(1, np.array([4, 11]), np.array([1, 2]), storage_keys=keys)
    finish(m1, {1})
    assert m1.storage.get_stats().pages_written == 2
    m1.shutdown()
    for t in cache:
        t.zero_()
    m2 = mover(cache, storage_url=url, model_id="tiny")  # a restarted worker: empty host tier
    m2.submit_load(2, np.array([5, 6]), np.array([0, 7]), fetch=[(0, keys[0]), (1, keys[1])])
    finish(m2, {2})
    for layer in range(LAYERS):
        assert torch.equal(cache[layer][0], original[layer][4])
        assert torch.equal(cache[layer][7], original[layer][11])
    m2.shutdown()


def test_l3_page_that_fails_its_checksum_is_never_reported_loaded(tmp_path):
    root = tmp_path / "l3"
    url = f"file://{root}"
    cache = vllm_cache(6)
    m1 = mover(cache, storage_url=url, model_id="tiny")
    m1.submit_store(1, np.array([4]), np.array([1]), storage_keys=["bb01"])
    finish(m1, {1})
    m1.shutdown()
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    m2 = mover(cache, storage_url=url, model_id="tiny")
    before = [t[0].clone() for t in cache]
    m2.submit_load(2, np.array([3]), np.array([0]), fetch=[(0, "bb01")])
    m2.wait({2})
    (failed,) = m2.get_finished()  # reported failed, once; the device block untouched
    assert failed.job_id == 2 and not failed.ok and isinstance(failed.error, TransferFailed)
    assert "1 of 1 pages could not be read back" in str(failed.error)
    assert all(torch.equal(t[0], b) for t, b in zip(cache, before)) and m2.get_finished() == []
    with pytest.raises(ValueError, match="no store"):
        mover(cache).submit_load(3, np.array([0]), np.array([0]), fetch=[(0, "x")])
    m2.shutdown()


def test_a_weight_reload_finishes_old_writes_under_old_keys_then_reads_nothing_old(tmp_path):
    from hicache_vllm import weight_updates

    cache = vllm_cache(7)
    m = mover(cache, storage_url=f"file://{tmp_path / 'l3'}", model_id="tiny")
    assert m in set(weight_updates._followers)  # vLLM's reload reaches it (weight_updates.follow)
    m.submit_store(1, np.array([4]), np.array([1]), storage_keys=["cc01"])
    assert weight_updates.follow("reload-1") >= 1  # waits for job 1: written before the keys move
    assert m.storage.old_weight_version_of("cc01") == "" and m.storage.batch_exists(["cc01"]) == 0
    before = [t[0].clone() for t in cache]
    m.submit_load(2, np.array([3]), np.array([0]), fetch=[(0, "cc01")])
    m.wait({1, 2})
    done = {f.job_id: f for f in m.get_finished()}
    assert done[1].ok and not done[2].ok  # the old weights' page is not in the new version's namespace
    assert all(torch.equal(t[0], b) for t, b in zip(cache, before))
    m.shutdown()


@pytest.fixture
def stuck_copies(monkeypatch):
    """The process's layer loader made afresh under ``HICACHE_LOAD_TIMEOUT_S=0.2``, its thread held by a copy that
    does not finish until the returned event is set: a load submitted now cannot finish in time."""
    monkeypatch.setenv("HICACHE_LOAD_TIMEOUT_S", "0.2")
    layer_loader(DEVICE).close()  # the loader reads the bound when it is made
    loader = layer_loader(DEVICE)
    assert loader.timeout_s == 0.2
    release = threading.Event()
    loader.submit(1, lambda layer: release.wait(60), what="a copy that does not finish")
    yield release
    release.set()
    loader.close()  # the next test's loader is made under the default bound


def _stored(root, namespace, page_hash):
    """Whether the file store under ``root`` holds an object of ``page_hash`` in ``namespace`` (its directory)."""
    return any(f.is_file() for f in (root / namespace.prefix).rglob(f"{page_hash}*"))


def test_a_reload_whose_wait_times_out_moves_the_keys_and_writes_no_old_page_under_the_new_ones(tmp_path, stuck_copies):
    """The wait for the transfers in flight fails (a load past HICACHE_LOAD_TIMEOUT_S): every store moves all
    the same (else the worker writes the new weights' pages under the old keys), the error is raised, and a
    store still writing an old page when the keys moved writes it under no key."""
    from hicache_vllm import weight_updates

    root = tmp_path / "l3"
    cache = vllm_cache(11)
    original = [t.clone() for t in cache]
    m = mover(cache, storage_url=f"file://{root}", model_id="tiny")
    other = mover(cache, storage_url=f"file://{root}", model_id="tiny")  # another worker's store, stuck as well
    old = m.storage.namespace
    for i, each in enumerate((m, other)):
        each.submit_store(0, np.array([9]), np.array([0]))
        finish(each, {0})
        each.submit_load(1, np.array([0]), np.array([3 + i]))  # behind the copy that does not finish
    slow_store = threading.Event()
    m._pool().submit(slow_store.wait, 60)  # the L3 thread busy: job 2's write-through is queued at the reload
    m.submit_store(2, np.array([4]), np.array([1]), storage_keys=["dd01"])
    with pytest.raises(LayerLoadTimeout):
        weight_updates.follow("reload-1")
    assert m.storage.weight_version == other.storage.weight_version == "reload-1"
    new = m.storage.namespace
    slow_store.set()
    m.wait({2})
    # Job 2's page is of the old weights: not under the new keys (held: under none).
    assert not _stored(root, new, "dd01") and m.storage.batch_exists(["dd01"]) == 0
    assert not _stored(root, old, "dd01")
    assert m.storage.get_stats().write_held_old_weights == 1 and m.storage_write_failures == 1
    stuck_copies.set()
    m.wait({1})
    other.wait({1})
    assert all(f.ok for f in m.get_finished() + other.get_finished())
    # The old stores are through: a page of the new weights goes under the new keys, never the old ones.
    m.submit_store(3, np.array([7]), np.array([2]), storage_keys=["dd02"])
    finish(m, {3})
    assert _stored(root, new, "dd02") and not _stored(root, old, "dd02")
    assert m.storage.get_stats().pages_written == 1
    for t in cache:
        t.zero_()
    m.submit_load(4, np.array([5]), np.array([0]), fetch=[(0, "dd02")])
    finish(m, {4})
    assert all(torch.equal(t[0], o[7]) for t, o in zip(cache, original))
    m.shutdown()
    other.shutdown()


def test_no_vllm_needed():
    """The CUDA path's code imports without vLLM (the GPU machine has none)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None; import hicache_vllm.mover, hicache_vllm.pool_kind; "
            "import hicache_vllm; print(hicache_vllm.SERVED_VLLM_VERSIONS)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "0.32.0" in out.stdout
