"""The copy lists direct submits, checked on the CPU: addresses, merging, caching, 2-D copies, errors, the ABI.

The CUDA path runs the same lists through ``cudaMemcpyBatchAsync``; here they run
through memmove, so every test is byte-exact against the reference on CPU pools, and
the CUDA copier's dispatch logic is driven through fake runtime functions.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hicache_direct import memcpy
from hicache_direct.descriptors import Batch

import hicache_core as hc
from hicache_core.plugins.reference import reference_copy

PAGE = 4


def _pools(kind: str = "mha", layout: str = "page_first_direct", page_size: int = PAGE, pages: int = 8,
           layers: int = 3, draft: bool = False):  # fmt: skip
    size = pages * page_size
    if kind == "mha":

        def make(n):
            return hc.MHADevicePool(size, page_size, torch.bfloat16, 2, 8, n, "cpu")
    elif kind == "mla":

        def make(n):
            return hc.MLADevicePool(size, page_size, torch.bfloat16, 16, 8, n, "cpu")
    else:

        def make(n):
            return hc.PageRowsDevicePool(pages + 1, page_size, 24, n, "cpu")

    dev = make(layers)
    drafts = (make(1),) if draft else ()
    size = max(size, dev.size)  # a host pool is never smaller than its device pool
    host = hc.make_host_pool(dev, layout=layout, io_backend="direct", size=size, draft_pools=drafts)
    twin = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=size, draft_pools=drafts)
    gen = torch.Generator().manual_seed(7)
    for t in _device_tensors(dev, drafts) + list(host.plan.host_buffers.values()):
        flat = t.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return dev, drafts, host, twin


def _device_tensors(dev, drafts=()):
    attrs = ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer")
    return [t for pool in (dev, *drafts) for a in attrs for t in (getattr(pool, a, None) or [])]


def _bytes(tensors):
    return [t.reshape(-1).view(torch.uint8).clone() for t in tensors]


def _slots(pages: list[int], page_size: int = PAGE) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _check_against_reference(host, dev, drafts, h, d, layers, to_device):
    """Run direct's batch for (h, d, layers) and the reference on copies of the same bytes; compare."""
    impl = host.implementation_for(hc.LOAD)
    dev_before = _bytes(_device_tensors(dev, drafts))
    host_before = _bytes(host.plan.host_buffers.values())
    batch = impl.plan_for(h, d, tuple(layers), to_device)
    impl.copier.submit(batch, impl.builder.describe)
    dev_after = _bytes(_device_tensors(dev, drafts))
    host_after = _bytes(host.plan.host_buffers.values())
    # The reference, on the original bytes.
    for t, b in zip(_device_tensors(dev, drafts), dev_before):
        t.reshape(-1).view(torch.uint8).copy_(b)
    for t, b in zip(host.plan.host_buffers.values(), host_before):
        t.reshape(-1).view(torch.uint8).copy_(b)
    reference_copy(host.plan, h.long(), d.long(), layers, to_device=to_device)
    for got, t in zip(dev_after, _device_tensors(dev, drafts)):
        assert torch.equal(got, t.reshape(-1).view(torch.uint8))
    for got, t in zip(host_after, host.plan.host_buffers.values()):
        assert torch.equal(got, t.reshape(-1).view(torch.uint8))
    return batch


def test_page_first_direct_one_copy_per_page_layer_and_part():
    dev, drafts, host, _ = _pools()
    h, d = _slots([5, 2, 3]), _slots([1, 2, 6])
    batch = _check_against_reference(host, dev, drafts, h, d, [1], True)
    # Pages are apart on the host in page_first_direct: 3 runs x 2 parts (K, V), sorted by host page.
    assert batch.count == 6 and not batch.copies_2d
    part = host.plan.parts[0]
    item = part.item_bytes
    sizes = batch.size[batch.size_at : batch.size_at + batch.count].tolist()
    assert sizes == [PAGE * item] * 6
    # Host page 2 -> device page 2 first: K's host address is the start of (page 2, layer 1) on the host.
    expected = part.host_layer_view(1)[2, 0].data_ptr()
    assert batch.src[batch.src_at] == expected
    assert batch.dst[batch.dst_at] == part.device_layers[1][2 * PAGE].data_ptr()


def test_layer_first_merges_adjacent_pages_into_one_run():
    dev, drafts, host, _ = _pools(layout="layer_first")
    # Host pages 1, 2, 3 (adjacent in layer_first) to device pages 4, 5, 6: one run of 12 tokens.
    h, d = _slots([3, 1, 2]), _slots([6, 4, 5])
    batch = _check_against_reference(host, dev, drafts, h, d, [0], True)
    assert len(batch.runs) == 1 and batch.count == 2
    assert batch.size[batch.size_at] == 3 * PAGE * host.plan.parts[0].item_bytes


def test_runs_break_where_either_side_stops_advancing():
    dev, drafts, host, _ = _pools(layout="layer_first", page_size=1, pages=32)
    h = torch.tensor([3, 4, 5, 9, 10, 11, 12, 20])
    d = torch.tensor([7, 8, 2, 3, 4, 5, 6, 1])
    batch = _check_against_reference(host, dev, drafts, h, d, [2], False)
    runs = batch.runs
    assert runs.host.tolist() == [3, 5, 9, 20]
    assert runs.device.tolist() == [7, 2, 3, 1]
    assert runs.length.tolist() == [2, 1, 4, 1]


@pytest.mark.parametrize("kind,layout", [
    ("mha", "page_first_direct"), ("mha", "layer_first"), ("mla", "page_first_direct"), ("mla", "layer_first"),
    ("mla", "page_first_kv_split"), ("page_rows", "page_first_direct"), ("page_rows", "layer_first"),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_every_layout_byte_exact_all_layers_and_one(kind, layout, dtype):
    dev, drafts, host, _ = _pools(kind, layout, draft=True)
    gen = torch.Generator().manual_seed(3)
    pages = torch.randperm(7, generator=gen)[:5] + 1
    if kind == "page_rows":  # items are pages: one row per page
        h, d = pages.to(dtype), (torch.randperm(8, generator=gen)[:5]).to(dtype)
    else:
        h, d = _slots(pages.tolist()).to(dtype), _slots((torch.randperm(7, generator=gen)[:5] + 1).tolist()).to(dtype)
    layers = list(range(host.plan.num_layers))
    _check_against_reference(host, dev, drafts, h, d, layers, False)
    _check_against_reference(host, dev, drafts, h, d, [layers[-1]], True)  # the draft layer
    _check_against_reference(host, dev, drafts, h, d, [0, 2], True)  # a subset: built per call


def test_kv_split_halves_are_2d_copies_and_single_rows_join_the_batch():
    dev, drafts, host, _ = _pools("mla", "page_first_kv_split")
    # Runs of 3 (tokens 0-2 of page 1) and of 1 (page 5): a 2-D copy per half, then two linear copies.
    h = torch.tensor([4, 5, 6, 20])
    d = torch.tensor([10, 11, 12, 3])
    batch = _check_against_reference(host, dev, drafts, h, d, [1], True)
    assert batch.count == 2 and len(batch.copies_2d) == 2
    k, v = host.plan.parts
    dst, dpitch, src, spitch, width, height, origin = batch.copies_2d[0]
    assert (dpitch, spitch, width, height) == (k.device_row_bytes, k.item_bytes, k.item_bytes, 3)
    assert dst == k.device_layers[1][10].data_ptr() and origin == (1, 0, 0)
    assert batch.size[batch.size_at : batch.size_at + 2].tolist() == [k.item_bytes, v.item_bytes]


def test_same_tensors_reuse_their_runs_until_modified():
    dev, drafts, host, _ = _pools()
    impl = host.implementation_for(hc.LOAD)
    h, d = _slots([1, 2]), _slots([3, 4])
    first = impl.builder.runs(h, d, 100)
    assert impl.builder.runs(h, d, 100) is first
    d.add_(PAGE)  # in place: the version counter moves, the runs are found again
    again = impl.builder.runs(h, d, 100)
    assert again is not first and again.device.tolist() == [4 * PAGE, 5 * PAGE]
    _check_against_reference(host, dev, drafts, h, d, [0], True)
    # A cached decomposition is still checked against a smaller bound (a draft layer's rows).
    with pytest.raises(IndexError, match="out of range"):
        impl.builder.runs(h, d, 5 * PAGE)


def test_out_of_range_moves_nothing_and_says_so():
    dev, drafts, host, _ = _pools()
    before = _bytes(_device_tensors(dev)) + _bytes(host.plan.host_buffers.values())
    impl = host.implementation_for(hc.LOAD)
    for h, d in [(_slots([1, 99]), _slots([1, 2])), (_slots([1, 2]), _slots([1, -1])),
                 (torch.tensor([0, 1, 2, 400]), torch.tensor([0, 1, 2, 3]))]:  # fmt: skip
        with pytest.raises(IndexError, match="nothing was copied"):
            impl.load_to_device_per_layer(h, d, 0)
    after = _bytes(_device_tensors(dev)) + _bytes(host.plan.host_buffers.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_through_the_host_pool_per_layer_then_all_layers():
    dev, drafts, host, twin = _pools(layout="page_first_direct")
    h, d = _slots([6, 1, 3]), _slots([2, 7, 5])
    for layer in range(3):
        host.load_to_device_per_layer(dev, h, d, layer, "direct")
    host.backup_from_device_all_layer(dev, h.int(), d.int(), "direct")
    expect = _bytes(host.plan.host_buffers.values())
    host.backup_from_device_all_layer(dev, h, d, "direct")
    assert all(torch.equal(a, b) for a, b in zip(expect, _bytes(host.plan.host_buffers.values())))


# ---- the CUDA copier's logic, through fake runtime functions ---------------------------------------


class _FakeLib:
    def __init__(self, version: int, has_batch: bool = True):
        self.version = version
        if has_batch:
            self.cudaMemcpyBatchAsync = lambda *a: 0

    def cudaRuntimeGetVersion(self, out):
        out._obj.value = self.version
        return 0


@pytest.mark.parametrize("version,abi,nargs", [(12080, "12.8", 9), (12090, "12.8", 9), (13000, "13.0", 8),
                                               (13020, "13.0", 8)])  # fmt: skip
def test_batch_abi_follows_the_runtime_version(version, abi, nargs):
    fn, got, why = memcpy._batch_function(_FakeLib(version), version)
    assert got == abi and why is None and len(fn.argtypes) == nargs
    assert fn.argtypes[-1] is ctypes.c_void_p  # the stream is last in both


def test_no_batch_call_before_12_8():
    fn, abi, why = memcpy._batch_function(_FakeLib(12060), 12060)
    assert fn is None and "12.8" in why
    fn, abi, why = memcpy._batch_function(_FakeLib(12080, has_batch=False), 12080)
    assert fn is None and "not exported" in why


def test_attributes_are_the_24_bytes_of_cudaMemcpyAttributes():
    assert ctypes.sizeof(memcpy.MemcpyAttributes) == 24
    assert memcpy.MemcpyAttributes.flags.offset == 20


def _fake_copier(abi: str, batch_result, memcpy_fail_at=None):
    """A CudaCopier whose runtime calls are Python fakes that record what they were given."""
    c = memcpy.CudaCopier.__new__(memcpy.CudaCopier)
    c.calls = []
    c.index = 0
    c.runtime_version = 13000 if abi == "13.0" else 12080
    c._local = __import__("threading").local()
    c._attrs_h2d, c._attrs_d2h = memcpy.MemcpyAttributes(), memcpy.MemcpyAttributes()
    c._attr_idx = (ctypes.c_size_t * 1)(0)
    c.prefer_overlap = True
    c.batch, c.max_batch, c.streams, c.unavailable = True, 0, 1, None
    c.first_batch = 0
    c._batch_abi = abi

    def batch_fn(*args):
        c.calls.append(("batch", args[3], args[-1]))
        c.attrs_seen = args[4]._obj
        if abi == "12.8" and isinstance(batch_result, tuple):
            ctypes.cast(args[7], ctypes.POINTER(ctypes.c_size_t))[0] = batch_result[1]
            return batch_result[0]
        return batch_result

    def memcpy_fn(dst, src, size, kind, stream):
        c.calls.append(("memcpy", size, stream))
        n = sum(1 for x in c.calls if x[0] == "memcpy")
        return 1 if memcpy_fail_at is not None and n - 1 == memcpy_fail_at else 0

    c._batch_fn = batch_fn
    c._batch3d_fn, c.batch_2d, c.unavailable_2d = None, False, None
    c._memcpy = memcpy_fn
    c._memcpy2d = lambda *a: c.calls.append(("2d", a[5], a[7])) or 0
    c._is_capturing = lambda stream, ref: 0
    c._error_name = lambda err: b"cudaErrorInvalidValue"
    c._get_stream = lambda index: 0  # the legacy default stream
    c._get_device = lambda: 0
    return c


def _a_batch():
    dev, drafts, host, _ = _pools()
    impl = host.implementation_for(hc.LOAD)
    batch = impl.plan_for(_slots([5, 2, 3]), _slots([1, 2, 6]), (1,), True)
    return impl, batch


def test_one_batch_call_on_the_per_thread_stream_not_the_legacy_one():
    impl, batch = _a_batch()
    c = _fake_copier("13.0", 0)
    c.submit(batch, impl.builder.describe)
    assert c.calls == [("batch", 6, memcpy._STREAM_PER_THREAD)]


def test_attributes_follow_the_direction():
    impl, batch = _a_batch()
    c = _fake_copier("13.0", 0)
    c._attrs_h2d = memcpy.MemcpyAttributes(1, memcpy._MemLocation(2, 0), memcpy._MemLocation(1, 0), 1)
    c._attrs_d2h = memcpy.MemcpyAttributes(1, memcpy._MemLocation(1, 0), memcpy._MemLocation(2, 0), 1)
    c.submit(batch, impl.builder.describe)  # a load: host -> device
    assert (c.attrs_seen.srcAccessOrder, c.attrs_seen.srcLocHint.type, c.attrs_seen.dstLocHint.type) == (1, 2, 1)
    c.prefer_overlap = False
    backup = impl.plan_for(_slots([5]), _slots([1]), (0,), False)
    c.submit(backup, impl.builder.describe)
    assert (c.attrs_seen.srcLocHint.type, c.attrs_seen.dstLocHint.type, c.attrs_seen.flags) == (1, 2, 0)


def test_max_batch_splits_the_submission():
    impl, batch = _a_batch()
    c = _fake_copier("13.0", 0)
    c.max_batch = 4
    c.submit(batch, impl.builder.describe)
    assert [x[1] for x in c.calls] == [4, 2]


def test_first_batch_then_the_rest_in_one_call():
    impl, batch = _a_batch()
    c = _fake_copier("13.0", 0)
    c.first_batch, c.max_batch = 2, 0
    c.submit(batch, impl.builder.describe)
    assert [x[1] for x in c.calls] == [2, 4]
    c.calls.clear()
    c.first_batch, c.max_batch = 2, 3
    c.submit(batch, impl.builder.describe)
    assert [x[1] for x in c.calls] == [2, 3, 1]


def test_the_retired_worker_switch_is_refused_not_ignored(monkeypatch):
    """HICACHE_DIRECT_THREAD=1 asked for the worker retired in 0.3.0: refused at pool construction, naming
    what replaced it; 0 (what every call now does) is accepted."""
    monkeypatch.setenv("HICACHE_DIRECT_THREAD", "1")
    refused = r"^HICACHE_DIRECT_THREAD='1' is not 0 or unset: the direct plugin's worker thread was retired in "
    with pytest.raises(ValueError, match=refused + r"hicache-direct 0\.3\.0 .*HostPool\.submit_load"):
        _pools()
    monkeypatch.setenv("HICACHE_DIRECT_THREAD", "0")
    _pools()


def test_failidx_names_the_run_on_12_8():
    impl, batch = _a_batch()
    c = _fake_copier("12.8", (1, 3))  # copy 3: part V (1) of run 0 (host page 2)
    with pytest.raises(memcpy.CopyError, match=r"copy 3 of 6: run 0 of 3 \(host items \[8, 12\).*part 'v'"):
        c.submit(batch, impl.builder.describe)


def test_on_13_the_copies_go_one_by_one_to_find_the_culprit():
    impl, batch = _a_batch()
    c = _fake_copier("13.0", 1, memcpy_fail_at=4)
    with pytest.raises(memcpy.CopyError, match=r"cudaMemcpyAsync failed .* copy 4 of 6: run 1 of 3"):
        c.submit(batch, impl.builder.describe)


def test_a_refused_batch_whose_copies_succeed_alone_falls_back_for_good():
    impl, batch = _a_batch()
    c = _fake_copier("13.0", 801)
    with pytest.warns(UserWarning, match="one by one"):
        c.submit(batch, impl.builder.describe)
    assert [x[0] for x in c.calls] == ["batch"] + ["memcpy"] * 6
    assert c._batch_fn is None and "one cudaMemcpyAsync per run" in c.path
    c.calls.clear()
    c.submit(batch, impl.builder.describe)
    assert [x[0] for x in c.calls] == ["memcpy"] * 6


def test_batch_pointers_address_the_descriptor_arrays():
    impl, batch = _a_batch()
    assert isinstance(batch, Batch)
    arr = np.ctypeslib.as_array(ctypes.cast(batch.src_ptr, ctypes.POINTER(ctypes.c_int64)), (batch.count,))
    assert arr.tolist() == batch.linear()[1]


def test_a_huge_refused_batch_is_split_before_it_is_given_up():
    dev, drafts, host, _ = _pools(layout="layer_first", page_size=1, pages=2600)
    impl = host.implementation_for(hc.LOAD)
    h = torch.arange(0, 2400, 2)  # 1200 runs of one token: 2400 copies (K and V)
    batch = impl.plan_for(h, h + 1, (0,), True)
    assert batch.count == 2400
    c = _fake_copier("13.0", 1)
    with pytest.warns(UserWarning, match="batches of at most 1024"):
        c.submit(batch, impl.builder.describe)
    assert c.max_batch == 1024 and c._batch_fn is not None
    c.calls.clear()
    c._batch_fn = lambda *a: c.calls.append(("batch", a[3], a[-1])) or 0
    c.submit(batch, impl.builder.describe)
    assert [x[1] for x in c.calls] == [1024, 1024, 352]


def test_3d_batch_records_have_the_runtime_layout():
    # Offsets of cudaMemcpy3DBatchOp as cuda-bindings 13.5 compiles it (read back through getPtr()).
    fields = memcpy.BATCH_OP_3D.fields
    assert memcpy.BATCH_OP_3D.itemsize == 112
    expect = {"src_type": 0, "src_ptr": 8, "src_row": 16, "src_layer": 24, "src_loc": 32, "src_loc_id": 36,
              "dst_type": 40, "dst_ptr": 48, "dst_row": 56, "dst_layer": 64, "dst_loc": 72, "dst_loc_id": 76,
              "width": 80, "height": 88, "depth": 96, "order": 104, "flags": 108}  # fmt: skip
    assert {name: fields[name][1] for name in expect} == expect


@pytest.mark.parametrize("abi", ["12.8", "13.0"])
def test_2d_copies_as_one_3d_batch(abi):
    dev, drafts, host, _ = _pools("mla", "page_first_kv_split")
    impl = host.implementation_for(hc.LOAD)
    batch = impl.plan_for(_slots([1, 3]), _slots([2, 5]), (1,), True)  # 2 pages x 2 halves: four 2-D copies
    assert batch.count == 0 and len(batch.copies_2d) == 4
    c = _fake_copier(abi, 0)
    seen = {}

    def batch3d(n, ptr, *rest):
        raw = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), (n * 112,))
        seen["ops"], seen["rest"] = raw.view(memcpy.BATCH_OP_3D).copy(), rest
        return 0

    c._batch3d_fn, c.batch_2d = batch3d, True
    c._attrs_h2d = memcpy.MemcpyAttributes(1, memcpy._MemLocation(2, 0), memcpy._MemLocation(1, 0), 1)
    c.submit(batch, impl.builder.describe)
    ops = seen["ops"]
    assert len(seen["rest"]) == (3 if abi == "12.8" else 2) and seen["rest"][-1] == memcpy._STREAM_PER_THREAD
    k = host.plan.parts[0]
    first = batch.copies_2d[0]
    assert (ops["src_type"] == 1).all() and (ops["dst_type"] == 1).all() and (ops["depth"] == 1).all()
    assert ops["dst_ptr"][0] == first[0] and ops["dst_row"][0] == k.device_row_bytes
    assert ops["src_ptr"][0] == first[2] and ops["src_row"][0] == k.item_bytes
    assert ops["width"][0] == k.item_bytes and ops["height"][0] == PAGE and ops["src_layer"][0] == PAGE
    assert (ops["order"] == 1).all() and (ops["src_loc"] == 2).all() and (ops["dst_loc"] == 1).all()
    assert not any(x[0] == "2d" for x in c.calls)


def test_a_refused_3d_batch_falls_back_to_2d_copies():
    dev, drafts, host, _ = _pools("mla", "page_first_kv_split")
    impl = host.implementation_for(hc.LOAD)
    batch = impl.plan_for(_slots([1, 3]), _slots([2, 5]), (1,), True)
    c = _fake_copier("13.0", 0)
    c._batch3d_fn, c.batch_2d = (lambda *a: 1), True
    with pytest.warns(UserWarning, match="2-D copies one by one"):
        c.submit(batch, impl.builder.describe)
    assert [x[0] for x in c.calls] == ["2d"] * 4 and c._batch3d_fn is None


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_vectorised_descriptors_are_the_per_item_copies_of_a_scattered_prefix(layout):
    """A prefix in miniature (64 scattered pages, every layer in turn): each layer's copy list, whether
    built per call or served from the per-runs tables (second use on), expands item by item to exactly
    the (device address, host address, bytes) of every item, written out one item at a time here."""
    dev, _, host, _ = _pools("mha", layout, pages=80, layers=3)
    impl = host.implementation_for(hc.LOAD)
    gen = torch.Generator().manual_seed(11)
    pages = (torch.randperm(79, generator=gen)[:64] + 1).tolist()
    rows = (torch.randperm(79, generator=gen)[:64] + 1).tolist()
    h, d = _slots(pages), _slots(rows)
    parts = impl.builder.parts
    for rep in range(2):
        for layer in range(3):
            batch = impl.plan_for(h, d, (layer,), True)
            got = []
            dst, src, size = batch.linear()
            for a, b, n in zip(dst, src, size):
                for p in parts:
                    if n % p.item_bytes == 0:
                        item = p.item_bytes
                        break
                got += [(a + k * item, b + k * item, item) for k in range(n // item)]
            want = []
            for p in parts:
                for slot, row in zip(h.tolist(), d.tolist()):
                    page, token = divmod(slot, PAGE)
                    src_addr = p.host_base + layer * p.layer_stride + page * p.page_stride + token * p.token_stride
                    want.append((p.device_bases[layer] + row * p.row_bytes, src_addr, p.item_bytes))
            assert sorted(got) == sorted(want), (layout, rep, layer)
            assert batch.copies_2d == []


def test_copier_knobs_are_declared_once_with_their_checks_and_variables(monkeypatch):
    from hicache_core.gpu.knobs import knobs_of, read_knobs

    knobs = {k.name: k for k in knobs_of(memcpy.CudaCopier)}
    assert list(knobs) == ["batch", "max_batch", "first_batch", "streams", "prefer_overlap", "batch_2d"]
    assert {name: k.env for name, k in knobs.items()} == {name: name.upper() for name in knobs}
    c = _fake_copier("13.0", 0)
    # Declared defaults (the copier's starting values where no variable is set):
    fresh = memcpy.CudaCopier.__new__(memcpy.CudaCopier)
    assert [getattr(fresh, name) for name in knobs] == [True, 32, 0, 1, True, False]
    with pytest.raises(ValueError, match=r"^streams must be an int >= 1, got 0$"):
        c.streams = 0
    with pytest.raises(ValueError, match=r"^max_batch must be an int >= 0, got -1$"):
        c.max_batch = -1
    with pytest.raises(ValueError, match=r"^batch must be True or False \(1 or 0\), got 2$"):
        c.batch = 2
    c.batch = 0
    assert c.batch is False
    c.prefer_overlap = 0
    assert c.prefer_overlap is False and c._attrs_h2d.flags == c._attrs_d2h.flags == 0
    # The environment goes through the same checks, and an error names the variable:
    monkeypatch.setenv("HICACHE_DIRECT_MAX_BATCH", "8")
    monkeypatch.setenv("HICACHE_DIRECT_PREFER_OVERLAP", "1")
    read_knobs(c, c.env_prefix)
    assert c.max_batch == 8 and c.prefer_overlap is True and c._attrs_h2d.flags == memcpy._PREFER_OVERLAP
    monkeypatch.setenv("HICACHE_DIRECT_STREAMS", "0")
    with pytest.raises(ValueError, match=r"^HICACHE_DIRECT_STREAMS='0' is not an integer >= 1$"):
        read_knobs(c, c.env_prefix)
    monkeypatch.setenv("HICACHE_DIRECT_STREAMS", "two")
    with pytest.raises(ValueError, match=r"^HICACHE_DIRECT_STREAMS='two' is not an integer >= 1$"):
        read_knobs(c, c.env_prefix)
    monkeypatch.delenv("HICACHE_DIRECT_STREAMS")
    monkeypatch.setenv("HICACHE_DIRECT_BATCH", "2")
    with pytest.raises(ValueError, match=r"^HICACHE_DIRECT_BATCH='2': batch must be True or False"):
        read_knobs(c, c.env_prefix)


def test_tuned_takes_every_declared_knob_and_restores_it():
    impl, _ = _a_batch()
    impl.copier = _fake_copier("13.0", 0)
    with impl.tuned({"first_batch": 4, "max_batch": 1}):
        assert (impl.copier.first_batch, impl.copier.max_batch) == (4, 1)
    assert (impl.copier.first_batch, impl.copier.max_batch) == (0, 0)
    with pytest.raises(ValueError, match=r"streams must be an int >= 1"):
        with impl.tuned({"streams": 0}):
            pass
    assert impl.copier.streams == 1
    variants = impl.tuning_variants()
    assert "worker" not in variants and variants["streams2"] == {"streams": 2}
