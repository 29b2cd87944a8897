"""Out-of-range indices never touch memory outside the pool: the kernel masks them, and reports them.

The implementation is called directly (the host pool would refuse bad indices only in
validating mode). Every host buffer and device layer sits inside a larger tensor with
random guard bytes on both sides (:mod:`hicache_core.testing.guarded`), so a stray write
anywhere near the pool is seen; the plan's drop word must name the call that masked.
"""

from __future__ import annotations

import pytest
import torch
from hicache_kernel import TritonUVA

import hicache_core as hc
from hicache_core.testing.guarded import bad_pairs, check_masked_call, guarded_plan, tiny_pool


def small_pool(kind: str, *, layers: int = 2, rows: int = 16):
    return tiny_pool(kind, "cpu", pages=rows // 4 - 1, layers=layers)


def kernel_plan(kind: str, layout: str, device: str, *, draft_rows: int | None = None):
    """A guarded plan: 2 owned layers (+1 draft layer of ``draft_rows`` rows), 3 host pages of 4."""
    drafts = (small_pool(kind, layers=1, rows=draft_rows),) if draft_rows is not None else ()
    return guarded_plan(small_pool(kind), layout, device, drafts=drafts)


@pytest.mark.parametrize("stages", [0, 3], ids=["loop", "stages3"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "kind, layout",
    [("mha", "layer_first"), ("mha", "page_head"), ("mla", "page_first"), ("page_rows", "page_first_direct")],
)
def test_out_of_range_indices_are_skipped_and_reported(kind, layout, dtype, stages, kernel_device):
    plan, host_mem, dev_mem = kernel_plan(kind, layout, kernel_device)
    impl = TritonUVA(plan)
    impl.max_ctas = 2
    impl.stages = stages
    h, d, hv, dv = bad_pairs(plan, dtype)
    h, d = h.to(kernel_device), d.to(kernel_device)
    every_layer = range(plan.num_layers)
    operations = {
        hc.LOAD: (lambda: impl.load_to_device_per_layer(h, d, 1), [1], True),
        hc.BACKUP_LAYER: (lambda: impl.backup_from_device_per_layer(h, d, 0), [0], False),
        hc.BACKUP_ALL: (lambda: impl.backup_from_device_all_layer(h, d), every_layer, False),
    }
    for op, (call, layers, to_device) in operations.items():
        seq, flagged = check_masked_call(plan, host_mem, dev_mem, call, hv, dv, layers, to_device, op)
        assert flagged == seq, f"{op}: the drop word holds {flagged}, not the call's number {seq}"
    # The valid pairs alone: nothing is reported.
    hv_, dv_ = hv.to(h.dtype).to(kernel_device), dv.to(d.dtype).to(kernel_device)
    _, flagged = check_masked_call(plan, host_mem, dev_mem, lambda: impl.load_to_device_per_layer(hv_, dv_, 1), hv, dv,
                                   [1], True, "valid pairs")  # fmt: skip
    assert flagged == 0


def test_smaller_draft_layer_masks_by_its_own_rows(kernel_device):
    """A draft pool with fewer rows than the target: rows valid for the target are skipped on the draft layer."""
    plan, host_mem, dev_mem = kernel_plan("mha", "page_first", kernel_device, draft_rows=8)
    impl = TritonUVA(plan)
    h = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    d = torch.tensor([2, 7, 8, 15], dtype=torch.int64)  # 8 and 15 exist in the target only
    start = host_mem.snapshot(), dev_mem.snapshot()
    seq = plan.drop_report.begin(hc.BACKUP_ALL, None, 4)
    impl.backup_from_device_all_layer(h.to(kernel_device), d.to(kernel_device))
    got = host_mem.snapshot()
    host_mem.restore(start[0])
    hc.reference_copy(plan, h, d, range(plan.num_layers - 1), to_device=False)
    hc.reference_copy(plan, h[:2], d[:2], [plan.num_layers - 1], to_device=False)
    assert host_mem.equals(got)
    assert dev_mem.equals(start[1])
    assert plan.drop_report.dropped() == seq, "rows past the draft layer's end were dropped: the call is reported"


def test_empty_and_strided_indices(kernel_device):
    plan, host_mem, dev_mem = kernel_plan("mla", "page_first_kv_split", kernel_device)
    impl = TritonUVA(plan)
    start = host_mem.snapshot(), dev_mem.snapshot()
    empty = torch.empty(0, dtype=torch.int64, device=kernel_device)
    impl.load_to_device_per_layer(empty, empty, 0)
    impl.backup_from_device_all_layer(empty, empty)
    assert host_mem.equals(start[0]) and dev_mem.equals(start[1])

    # Non-contiguous index tensors (every other element of a longer one) are read with their stride.
    h_full = torch.tensor([4, 99, 9, 99, 0, 99], dtype=torch.int32)
    d_full = torch.tensor([7, 99, 1, 99, 10, 99, 99, 99, 99], dtype=torch.int32)
    h, d = h_full[::2], d_full[:6][::2]
    impl.load_to_device_per_layer(h.to(kernel_device), d.to(kernel_device), 1)
    got = dev_mem.snapshot()
    dev_mem.restore(start[1])
    hc.reference_copy(plan, h.contiguous(), d.contiguous(), [1], to_device=True)
    assert dev_mem.equals(got)


def test_too_many_items_for_one_call_is_refused(kernel_device):
    plan, _, _ = kernel_plan("mha", "layer_first", kernel_device)
    impl = TritonUVA(plan)
    impl._max_items = 3
    idx = torch.zeros(4, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="split it"):
        impl.load_to_device_per_layer(idx, idx, 0)


def test_warmup_moves_nothing(kernel_device):
    plan, host_mem, dev_mem = kernel_plan("mha", "page_head", kernel_device)
    impl = TritonUVA(plan)
    start = host_mem.snapshot(), dev_mem.snapshot()
    impl.warmup((torch.int32, torch.int64))
    assert host_mem.equals(start[0]) and dev_mem.equals(start[1])


def test_index_length_mismatch_is_refused(kernel_device):
    plan, _, _ = kernel_plan("mha", "layer_first", kernel_device)
    impl = TritonUVA(plan)
    with pytest.raises(ValueError, match="device_indices has 3"):
        impl.backup_from_device_all_layer(torch.arange(4, device=kernel_device), torch.arange(3, device=kernel_device))


def test_cached_launcher_gets_the_kernel_arguments_in_order(kernel_device, monkeypatch):
    """The CUDA fast path passes the same arguments, in kernel order, as Triton's launch (pointers as ints).

    Checked without a GPU: a recording launcher captures the call; the captured arguments, with the
    pointers turned back into their tensors, then drive the kernel through Triton and must move the
    same bytes as the reference.
    """
    from hicache_kernel import triton_uva

    plan, host_mem, dev_mem = kernel_plan("mla", "page_first_kv_split", kernel_device)
    impl = TritonUVA(plan)
    calls = []
    (group,) = impl._groups
    head = ("function", "metadata", None, None, None)
    for key in [(to_dev, dt, dt) for to_dev in (True, False) for dt in (torch.int32, torch.int64)]:
        group.fast[key] = (lambda *a: calls.append(a), head)
    monkeypatch.setattr(impl, "_get_device", lambda: impl._dev_index)
    monkeypatch.setattr(impl, "_get_stream", lambda index: 1234)
    monkeypatch.setattr(impl, "_fast_launch", 2)  # what CUDA sets; the interpreter launches through Triton
    h = torch.tensor([5, 0, 9], dtype=torch.int32, device=kernel_device)
    d = torch.tensor([2, 11, 7], dtype=torch.int32, device=kernel_device)
    seq = plan.drop_report.begin(hc.LOAD, 1, 3)
    impl.load_to_device_per_layer(h, d, 1)
    (call,) = calls
    assert call[1:4] == (1, 1, 1234) and call[4:9] == head
    grid = call[0]
    args = dict(zip(triton_uva.KERNEL_PARAMS, call[9:], strict=True))
    pointers = {"anchor": impl._anchor, "hidx": h, "didx": d}
    for name, tensor in pointers.items():
        assert args[name] == tensor.data_ptr(), name
    assert (args["n"], args["seq"], args["layer0"], args["num_layers"], args["TO_DEVICE"]) == (3, seq, 1, 1, True)
    assert impl._anchor_ptr + args["drop"] * impl._elem_bytes == plan.drop_report.address
    assert impl._anchor_ptr + args["table"] * impl._elem_bytes == group.table.data_ptr()

    start = dev_mem.snapshot()
    kernel = triton_uva._load_kernel()
    kernel[(grid,)](*[pointers.get(name, value) for name, value in args.items()])
    got = dev_mem.snapshot()
    dev_mem.restore(start)
    hc.reference_copy(plan, h.long(), d.long(), [1], to_device=True)
    assert dev_mem.equals(got) and not dev_mem.equals(start)


def test_launch_hooks_force_tritons_own_launch(kernel_device, monkeypatch):
    """With a profiler's launch hook installed, launches go through Triton so the hook sees them."""
    from hicache_kernel import triton_uva

    from hicache_core.gpu import triton_base

    triton_uva._load_kernel()
    knobs = triton_base._runtime_knobs
    if knobs is None or not hasattr(knobs.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch hook chain")
    assert triton_base.hooks_idle()

    def hook(metadata):
        pass

    knobs.launch_enter_hook.add(hook)
    try:
        assert not triton_base.hooks_idle()
    finally:
        knobs.launch_enter_hook.remove(hook)
    assert triton_base.hooks_idle()
