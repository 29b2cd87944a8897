"""Out-of-range indices never touch memory outside the pool: the kernel masks them.

The implementation is called directly (the host pool would refuse bad indices only in
validating mode). Every host buffer and device layer sits inside a larger tensor with
random guard bytes on both sides, so a stray write anywhere near the pool is seen.
"""

from __future__ import annotations

import pytest
import torch
from hicache_kernel import TritonUVA

import hicache_core as hc
from hicache_core.geometry import host_layout_spec
from hicache_core.plan import TransferPlan

GUARD = 256  # bytes on each side of every tensor


class Guarded:
    """Tensors carved out of random-filled backings with guard bytes around each."""

    def __init__(self, device: str, seed: int, *, pin: bool = False) -> None:
        self.device = device
        self.pin = pin
        self.gen = torch.Generator().manual_seed(seed)
        self.backings: list[torch.Tensor] = []

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        backing = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, generator=self.gen)
        backing = backing.pin_memory() if self.pin else backing.to(self.device)
        self.backings.append(backing)
        if backing.device.type == "cpu":
            # A tensor of its own (storage offset 0) over the middle bytes: the core's host views
            # (BoundPart.host_layer_view) take offsets from the start of the storage.
            middle = torch.frombuffer(backing.numpy()[GUARD : GUARD + nbytes], dtype=torch.uint8)
        else:
            middle = backing[GUARD : GUARD + nbytes]
        return middle.view(dtype).view(shape)

    def scramble(self) -> None:
        for b in self.backings:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=self.gen))

    def snapshot(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.backings]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for b, s in zip(self.backings, snap):
            b.copy_(s)

    def same(self, snap: list[torch.Tensor]) -> bool:
        return all(torch.equal(b.cpu(), s.cpu()) for b, s in zip(self.backings, snap))


def small_pool(kind: str, *, layers: int = 2, rows: int = 16):
    page_size = 4
    if kind == "mha":
        return hc.MHADevicePool(rows - page_size, page_size, torch.bfloat16, 2, 8, layers, "cpu")
    if kind == "mla":
        return hc.MLADevicePool(rows - page_size, page_size, torch.bfloat16, 16, 8, layers, "cpu")
    return hc.PageRowsDevicePool(rows // page_size, page_size, 24, layers, "cpu")


def guarded_plan(kind: str, layout: str, device: str, *, draft_rows: int | None = None):
    """A plan over guarded tensors: 2 owned layers (+1 draft layer of ``draft_rows`` rows), 3 host pages of 4."""
    pool = small_pool(kind)
    drafts = (small_pool(kind, layers=1, rows=draft_rows),) if draft_rows is not None else ()
    geometry = hc.geometry_of(pool, draft_pools=drafts)
    spec = host_layout_spec(geometry, hc.get_registry().layouts[layout], num_pages=3)
    host_mem = Guarded("cpu", seed=5, pin=device == "cuda")
    host_buffers = {b.attr: host_mem.tensor(b.shape, geometry.dtype) for b in spec.buffers}
    dev_mem = Guarded(device, seed=6)
    device_layers = {}
    for comp in geometry.components:
        tensors = list(getattr(pool, comp.attr)) + [getattr(d, comp.attr)[0] for d in drafts]
        device_layers[comp.attr] = [dev_mem.tensor(t.shape, t.dtype) for t in tensors]
    return TransferPlan(geometry, spec, host_buffers, device_layers), host_mem, dev_mem


def _pairs(plan: TransferPlan, dtype: torch.dtype):
    """Valid pairs mixed with every kind of bad index, and the valid pairs alone."""
    big = 2**31 - 1 if dtype == torch.int32 else 2**40
    items, rows = plan.num_items, plan.device_rows
    h = [0, 5, items - 1, -1, items, items + 3, big, 2, 7, -big]
    d = [3, rows - 1, 1, 2, 4, 5, 6, -1, rows, 0]
    valid = [(a, b) for a, b in zip(h, d) if 0 <= a < items and 0 <= b < rows]
    hv = torch.tensor([a for a, _ in valid], dtype=torch.int64)
    dv = torch.tensor([b for _, b in valid], dtype=torch.int64)
    return torch.tensor(h, dtype=dtype), torch.tensor(d, dtype=dtype), hv, dv


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "kind, layout",
    [("mha", "layer_first"), ("mha", "page_head"), ("mla", "page_first"), ("page_rows", "page_first_direct")],
)
def test_out_of_range_indices_are_skipped(kind, layout, dtype, kernel_device):
    plan, host_mem, dev_mem = guarded_plan(kind, layout, kernel_device)
    impl = TritonUVA(plan)
    impl.max_ctas = 2
    h, d, hv, dv = _pairs(plan, dtype)
    h, d = h.to(kernel_device), d.to(kernel_device)
    every_layer = range(plan.num_layers)
    operations = {
        hc.LOAD: (
            lambda: impl.load_to_device_per_layer(h, d, 1),
            lambda: hc.reference_copy(plan, hv, dv, [1], to_device=True),
        ),
        hc.BACKUP_LAYER: (
            lambda: impl.backup_from_device_per_layer(h, d, 0),
            lambda: hc.reference_copy(plan, hv, dv, [0], to_device=False),
        ),
        hc.BACKUP_ALL: (
            lambda: impl.backup_from_device_all_layer(h, d),
            lambda: hc.reference_copy(plan, hv, dv, every_layer, to_device=False),
        ),
    }
    for op, (kernel_call, reference_call) in operations.items():
        host_mem.scramble()
        dev_mem.scramble()
        start = host_mem.snapshot(), dev_mem.snapshot()
        kernel_call()
        got = host_mem.snapshot(), dev_mem.snapshot()
        # The same start, with the reference moving only the valid pairs.
        host_mem.restore(start[0])
        dev_mem.restore(start[1])
        reference_call()
        assert host_mem.same(got[0]), f"{op}: host bytes (pool or guards) differ from moving the valid pairs only"
        assert dev_mem.same(got[1]), f"{op}: device bytes (pool or guards) differ from moving the valid pairs only"
        assert not (host_mem.same(start[0]) and dev_mem.same(start[1])), f"{op} moved nothing"


def test_smaller_draft_layer_masks_by_its_own_rows(kernel_device):
    """A draft pool with fewer rows than the target: rows valid for the target are skipped on the draft layer."""
    plan, host_mem, dev_mem = guarded_plan("mha", "page_first", kernel_device, draft_rows=8)
    impl = TritonUVA(plan)
    h = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    d = torch.tensor([2, 7, 8, 15], dtype=torch.int64)  # 8 and 15 exist in the target only
    start = host_mem.snapshot(), dev_mem.snapshot()
    impl.backup_from_device_all_layer(h.to(kernel_device), d.to(kernel_device))
    got = host_mem.snapshot()
    host_mem.restore(start[0])
    hc.reference_copy(plan, h, d, range(plan.num_layers - 1), to_device=False)
    hc.reference_copy(plan, h[:2], d[:2], [plan.num_layers - 1], to_device=False)
    assert host_mem.same(got)
    assert dev_mem.same(start[1])


def test_empty_and_strided_indices(kernel_device):
    plan, host_mem, dev_mem = guarded_plan("mla", "page_first_kv_split", kernel_device)
    impl = TritonUVA(plan)
    start = host_mem.snapshot(), dev_mem.snapshot()
    empty = torch.empty(0, dtype=torch.int64, device=kernel_device)
    impl.load_to_device_per_layer(empty, empty, 0)
    impl.backup_from_device_all_layer(empty, empty)
    assert host_mem.same(start[0]) and dev_mem.same(start[1])

    # Non-contiguous index tensors (every other element of a longer one) are read with their stride.
    h_full = torch.tensor([4, 99, 9, 99, 0, 99], dtype=torch.int32)
    d_full = torch.tensor([7, 99, 1, 99, 10, 99, 99, 99, 99], dtype=torch.int32)
    h, d = h_full[::2], d_full[:6][::2]
    impl.load_to_device_per_layer(h.to(kernel_device), d.to(kernel_device), 1)
    got = dev_mem.snapshot()
    dev_mem.restore(start[1])
    hc.reference_copy(plan, h.contiguous(), d.contiguous(), [1], to_device=True)
    assert dev_mem.same(got)


def test_too_many_items_for_one_call_is_refused(kernel_device):
    plan, _, _ = guarded_plan("mha", "layer_first", kernel_device)
    impl = TritonUVA(plan)
    impl._max_items = 3
    idx = torch.zeros(4, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="split it"):
        impl.load_to_device_per_layer(idx, idx, 0)


def test_warmup_moves_nothing(kernel_device):
    plan, host_mem, dev_mem = guarded_plan("mha", "page_head", kernel_device)
    impl = TritonUVA(plan)
    start = host_mem.snapshot(), dev_mem.snapshot()
    impl.warmup((torch.int32, torch.int64))
    assert host_mem.same(start[0]) and dev_mem.same(start[1])


def test_index_length_mismatch_is_refused(kernel_device):
    plan, _, _ = guarded_plan("mha", "layer_first", kernel_device)
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

    plan, host_mem, dev_mem = guarded_plan("mla", "page_first_kv_split", kernel_device)
    impl = TritonUVA(plan)
    calls = []
    (group,) = impl._groups
    for key in [(to_dev, dt, dt) for to_dev in (True, False) for dt in (torch.int32, torch.int64)]:
        group.fast[key] = (lambda *a: calls.append(a), "function", "metadata")
    monkeypatch.setattr(impl, "_get_device", lambda: impl._dev_index)
    monkeypatch.setattr(impl, "_get_stream", lambda index: 1234)
    h = torch.tensor([5, 0, 9], dtype=torch.int32, device=kernel_device)
    d = torch.tensor([2, 11, 7], dtype=torch.int32, device=kernel_device)
    impl.load_to_device_per_layer(h, d, 1)
    (call,) = calls
    grid, one, one_, stream, function, metadata, launch_metadata, enter, leave = call[:9]
    assert (one, one_, stream, function, metadata, launch_metadata, enter, leave) == (
        1, 1, 1234, "function", "metadata", None, None, None,
    )  # fmt: skip
    args = dict(zip(triton_uva.KERNEL_PARAMS, call[9:], strict=True))
    pointers = {"anchor": impl._anchor, "table": group.table, "hidx": h, "didx": d}
    for name, tensor in pointers.items():
        assert args[name] == tensor.data_ptr(), name
    assert (args["n"], args["layer0"], args["num_layers"], args["TO_DEVICE"]) == (3, 1, 1, True)

    start = dev_mem.snapshot()
    kernel = triton_uva._load_kernel()
    kernel[(grid,)](*[pointers.get(name, value) for name, value in args.items()])
    got = dev_mem.snapshot()
    dev_mem.restore(start)
    hc.reference_copy(plan, h.long(), d.long(), [1], to_device=True)
    assert dev_mem.same(got) and not dev_mem.same(start)


def test_launch_hooks_force_tritons_own_launch(kernel_device, monkeypatch):
    """With a profiler's launch hook installed, launches go through Triton so the hook sees them."""
    from hicache_kernel import triton_uva

    triton_uva._load_kernel()
    knobs = triton_uva._runtime_knobs
    if knobs is None or not hasattr(knobs.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch hook chain")
    assert triton_uva._no_launch_hooks()

    def hook(metadata):
        pass

    knobs.launch_enter_hook.add(hook)
    try:
        assert not triton_uva._no_launch_hooks()
    finally:
        knobs.launch_enter_hook.remove(hook)
    assert triton_uva._no_launch_hooks()
