"""Indices outside the pool never reach memory outside it: the kernels mask them, and report them.

The implementation is called directly (the host pool checks bounds only in its validating
mode). Every host buffer and device layer is cut out of a larger random-filled allocation
with guard bytes on both sides (:mod:`hicache_core.testing.guarded`), so a stray write
anywhere near the pool shows; the plan's drop word must name the call that masked.
"""

from __future__ import annotations

import pytest
import torch
from hicache_jit import VARIANTS, JitOneLayer
from jit_helpers import small_pool

import hicache_core as hc
from hicache_core.testing.guarded import bad_pairs, check_masked_call, guarded_plan


def jit_plan(kind: str, layout: str, device: str, *, draft_pages: int | None = None):
    """A guarded plan: 3 layers (+1 draft layer), host of 3 pages of 4 tokens."""
    drafts = (small_pool(kind, "cpu", pages=draft_pages, layers=1),) if draft_pages is not None else ()
    return guarded_plan(small_pool(kind, "cpu", pages=3), layout, device, drafts=drafts, seed=11)


def run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, hv, dv, layer: int, *, dropped: bool = True) -> None:
    """``op`` on ``h``/``d`` moves exactly the valid pairs, touches nothing else, and reports a drop if any."""
    def call():
        getattr(impl, op)(h.to(plan.device), d.to(plan.device), layer)

    seq, flagged = check_masked_call(plan, host_mem, dev_mem, call, hv, dv, [layer], op == hc.LOAD, op)
    assert flagged == (seq if dropped else 0), f"{op}: drop word {flagged}, call {seq}, dropped={dropped}"


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
def test_out_of_range_indices_are_masked_and_reported(kind, layout, dtype, jit_device):
    plan, host_mem, dev_mem = jit_plan(kind, layout, jit_device)
    impl = JitOneLayer(plan)
    impl.max_ctas = 2
    h, d, hv, dv = bad_pairs(plan, dtype)
    for op, layer in ((hc.LOAD, 1), (hc.BACKUP_LAYER, 2)):
        run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, hv, dv, layer)
        run_and_compare(impl, op, plan, host_mem, dev_mem, hv.to(dtype), dv.to(dtype), hv, dv, layer, dropped=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_masks_and_reports(variant, jit_device):
    plan, host_mem, dev_mem = jit_plan("mha", "page_first_direct", jit_device)
    impl = JitOneLayer(plan)
    impl.variant = variant
    impl.tile_bytes = 64  # two items per tile: several tiles per CTA, so the loop and its prefetch run
    impl.max_ctas = 2
    h, d, hv, dv = bad_pairs(plan, torch.int64)
    for op in (hc.LOAD, hc.BACKUP_LAYER):
        run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, hv, dv, 0)


def test_a_smaller_draft_layer_masks_by_its_own_rows(jit_device):
    """Rows that exist in the target layers but not in the (smaller) draft layer are skipped there."""
    plan, host_mem, dev_mem = jit_plan("mha", "page_first", jit_device, draft_pages=1)
    impl = JitOneLayer(plan)
    draft = plan.num_layers - 1
    draft_rows = plan.parts[0].device_layers[draft].shape[0]
    h = torch.tensor([1, 2, 3, 4])
    d = torch.tensor([0, draft_rows - 1, draft_rows, draft_rows + 3])  # the last two exist in the target only
    for op in (hc.LOAD, hc.BACKUP_LAYER):
        run_and_compare(impl, op, plan, host_mem, dev_mem, h, d, h[:2], d[:2], draft)


def test_a_layer_out_of_range_is_refused_before_any_launch(jit_device):
    plan, _, _ = jit_plan("mla", "page_first", jit_device)
    impl = JitOneLayer(plan)
    idx = torch.arange(2, device=jit_device)
    for layer in (-1, plan.num_layers):
        with pytest.raises(IndexError, match="layer"):
            impl.load_to_device_per_layer(idx, idx, layer)
    with pytest.raises(ValueError, match="length"):
        impl.backup_from_device_per_layer(idx, idx[:1], 0)
