"""Indices outside the pool never reach memory outside it: the kernels mask them.

The implementation is called directly (the host pool checks bounds only in its validating
mode). Every host buffer and device layer is cut out of a larger random-filled allocation
with guard bytes on both sides, so a stray write anywhere near the pool shows.
"""

from __future__ import annotations

import pytest
import torch
from hicache_jit import VARIANTS, JitOneLayer
from jit_helpers import small_pool

import hicache_core as hc
from hicache_core.geometry import host_layout_spec
from hicache_core.plan import TransferPlan

GUARD = 128


class GuardedMemory:
    """Tensors carved out of random-filled allocations, each with ``GUARD`` bytes on either side."""

    def __init__(self, device: str, seed: int, *, pinned: bool = False) -> None:
        self.device, self.pinned = device, pinned
        self.gen = torch.Generator().manual_seed(seed)
        self.allocations: list[torch.Tensor] = []

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, generator=self.gen)
        raw = raw.pin_memory() if self.pinned else raw.to(self.device)
        self.allocations.append(raw)
        if raw.device.type == "cpu":
            # Storage offset 0 over the middle: host views (BoundPart.host_layer_view) count from the storage start.
            middle = torch.frombuffer(raw.numpy()[GUARD : GUARD + nbytes], dtype=torch.uint8)
        else:
            middle = raw[GUARD : GUARD + nbytes]
        return middle.view(dtype).view(shape)

    def scramble(self) -> None:
        for raw in self.allocations:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=self.gen))

    def snapshot(self) -> list[torch.Tensor]:
        return [raw.cpu().clone() for raw in self.allocations]

    def restore(self, images: list[torch.Tensor]) -> None:
        for raw, image in zip(self.allocations, images):
            raw.copy_(image)

    def equals(self, images: list[torch.Tensor]) -> bool:
        return all(torch.equal(raw.cpu(), image) for raw, image in zip(self.allocations, images))


def guarded_plan(kind: str, layout: str, device: str, *, draft_pages: int | None = None):
    """A plan over guarded memory: 3 layers (+1 draft layer), host of 3 pages of 4 tokens."""
    pool = small_pool(kind, "cpu", pages=3)
    drafts = (small_pool(kind, "cpu", pages=draft_pages, layers=1),) if draft_pages is not None else ()
    geometry = hc.geometry_of(pool, draft_pools=drafts)
    spec = host_layout_spec(geometry, hc.get_registry().layouts[layout], num_pages=3)
    host_mem = GuardedMemory("cpu", seed=11, pinned=device == "cuda")
    dev_mem = GuardedMemory(device, seed=12)
    host_buffers = {b.attr: host_mem.tensor(b.shape, geometry.dtype) for b in spec.buffers}
    device_layers = {}
    for comp in geometry.components:
        layers = list(getattr(pool, comp.attr)) + [getattr(d, comp.attr)[0] for d in drafts]
        device_layers[comp.attr] = [dev_mem.tensor(t.shape, t.dtype) for t in layers]
    return TransferPlan(geometry, spec, host_buffers, device_layers), host_mem, dev_mem


def bad_pairs(plan: TransferPlan, dtype: torch.dtype):
    """Valid pairs mixed with every kind of bad index; and the valid pairs alone."""
    huge = 2**31 - 1 if dtype == torch.int32 else 2**42
    items, rows = plan.num_items, plan.device_rows
    h = [1, items - 1, -1, items, items + 2, huge, 4, 0, -huge, 6]
    d = [rows - 1, 2, 3, 5, 1, 0, -1, rows, 4, -huge]
    valid = [(a, b) for a, b in zip(h, d) if 0 <= a < items and 0 <= b < rows]
    hv = torch.tensor([a for a, _ in valid])
    dv = torch.tensor([b for _, b in valid])
    return torch.tensor(h, dtype=dtype), torch.tensor(d, dtype=dtype), hv, dv


def run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, hv, dv, layer: int) -> None:
    host_mem.scramble()
    dev_mem.scramble()
    start = host_mem.snapshot(), dev_mem.snapshot()
    getattr(impl, op)(h.to(plan.device), d.to(plan.device), layer)
    if plan.device.type == "cuda":
        torch.cuda.synchronize()
    got = host_mem.snapshot(), dev_mem.snapshot()
    host_mem.restore(start[0])
    dev_mem.restore(start[1])
    hc.reference_copy(plan, hv, dv, [layer], to_device=op == hc.LOAD)
    assert host_mem.equals(got[0]), f"{op}: host bytes (pool or guards) differ from moving the valid pairs only"
    assert dev_mem.equals(got[1]), f"{op}: device bytes (pool or guards) differ from moving the valid pairs only"
    assert not (host_mem.equals(start[0]) and dev_mem.equals(start[1])), f"{op} moved nothing"


CASES = [
    ("mha", "page_first"),
    ("mha_asym", "layer_first"),
    ("mla", "page_first_kv_split"),
    ("mla_odd", "page_first_direct"),
    ("page_rows", "page_first"),
    ("wide_rows", "page_first_direct"),
]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("kind, layout", CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_out_of_range_indices_are_masked(kind, layout, dtype, jit_device):
    plan, host_mem, dev_mem = guarded_plan(kind, layout, jit_device)
    impl = JitOneLayer(plan)
    impl.max_ctas = 2
    h, d, hv, dv = bad_pairs(plan, dtype)
    for op, layer in ((hc.LOAD, 1), (hc.BACKUP_LAYER, 2)):
        run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, hv, dv, layer)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_masks(variant, jit_device):
    plan, host_mem, dev_mem = guarded_plan("mha", "page_first_direct", jit_device)
    impl = JitOneLayer(plan)
    impl.variant = variant
    impl.tile_bytes = 64  # two items per tile: several tiles per CTA, so the loop and its prefetch run
    impl.max_ctas = 2
    h, d, hv, dv = bad_pairs(plan, torch.int64)
    for op in (hc.LOAD, hc.BACKUP_LAYER):
        run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, hv, dv, 0)


def test_a_smaller_draft_layer_masks_by_its_own_rows(jit_device):
    """Rows that exist in the target layers but not in the (smaller) draft layer are skipped there."""
    plan, host_mem, dev_mem = guarded_plan("mha", "page_first", jit_device, draft_pages=1)
    impl = JitOneLayer(plan)
    draft = plan.num_layers - 1
    draft_rows = plan.parts[0].device_layers[draft].shape[0]
    h = torch.tensor([1, 2, 3, 4])
    d = torch.tensor([0, draft_rows - 1, draft_rows, draft_rows + 3])  # the last two exist in the target only
    for op in (hc.LOAD, hc.BACKUP_LAYER):
        run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, h[:2], d[:2], draft)


def test_a_layer_out_of_range_is_refused_before_any_launch(jit_device):
    plan, _, _ = guarded_plan("mla", "page_first", jit_device)
    impl = JitOneLayer(plan)
    idx = torch.arange(2, device=jit_device)
    for layer in (-1, plan.num_layers):
        with pytest.raises(IndexError, match="layer"):
            impl.load_to_device_per_layer(idx, idx, layer)
    with pytest.raises(ValueError, match="length"):
        impl.backup_from_device_per_layer(idx, idx[:1], 0)
