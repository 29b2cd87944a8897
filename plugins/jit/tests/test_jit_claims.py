"""What jit.one_layer claims, what it refuses and why (no kernel runs here)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hicache_jit import JitOneLayer
from jit_helpers import small_pool

import hicache_core as hc
from hicache_core.gpu import device as gpu_device
from hicache_core.plugins.dispatch import reasons_for
from hicache_core.plugins.registry import Registry

ROW_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")
ONE_LAYER = (hc.LOAD, hc.BACKUP_LAYER)


#: The kinds these helpers build pools of (the others are covered by the conformance kit).
FOUR_KINDS = ("mha", "mha_asym", "mla", "page_rows")


def requests(device_type: str = "cpu", pinned: bool = False, ops=hc.OPERATIONS) -> list[hc.TransferRequest]:
    """Every storable (pool kind, layout, operation, sharded, draft) combination, as a request."""
    layouts = hc.get_registry().layouts
    out = []
    for kind, sharded, draft in itertools.product(FOUR_KINDS, (False, True), (False, True)):
        drafts = (small_pool(kind, "cpu", layers=1),) if draft else ()
        kw = dict(start_layer=1, end_layer=3) if sharded else {}
        geometry = hc.geometry_of(small_pool(kind, "cpu", **kw), draft_pools=drafts)
        geometry = dataclasses.replace(geometry, device_type=device_type)
        for layout in layouts.values():
            if hc.TransferRequest("reference", hc.LOAD, geometry, layout).storable:
                out += [hc.TransferRequest("kernel", op, geometry, layout, pinned) for op in ops]
    return out


def test_declaration():
    assert JitOneLayer.declaration_problems() == []
    assert JitOneLayer.name == "jit.one_layer" and JitOneLayer.io_backend == "kernel"
    assert JitOneLayer.priority == 60
    assert JitOneLayer.operations == {hc.LOAD, hc.BACKUP_LAYER}
    assert JitOneLayer.index_device == "device"
    assert JitOneLayer.index_dtypes == {torch.int32, torch.int64}
    registry = Registry.from_entry_points()
    assert registry.implementations.get("jit.one_layer") is JitOneLayer
    assert registry.plugin_of("jit.one_layer") == "jit"
    kernel = registry.implementations.get("kernel.triton_uva")
    if kernel is not None:
        assert JitOneLayer.priority > kernel.priority


def test_claims_every_row_layout_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    claimed = set()
    for request in requests("cpu", ops=ONE_LAYER):
        reasons = reasons_for(JitOneLayer, request)
        if request.layout.name == "page_head":
            assert reasons, request.describe()
        else:
            assert reasons == [], (request.describe(), reasons)
            claimed.add((request.pool_kind, request.layout.name, request.sharded, request.draft))
    assert {layout for _, layout, _, _ in claimed} == set(ROW_LAYOUTS)
    assert {kind for kind, _, _, _ in claimed} == set(FOUR_KINDS)
    assert any(s for _, _, s, _ in claimed) and any(d for _, _, _, d in claimed)
    assert JitOneLayer.device_types == {"cuda", "cpu"}


def test_claims_on_cuda_with_pinned_memory(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for request in requests("cuda", pinned=True, ops=ONE_LAYER):
        if request.layout.name != "page_head":
            assert reasons_for(JitOneLayer, request) == [], request.describe()
    assert JitOneLayer.device_types == {"cuda"}


def test_page_first_direct_is_claimed():
    """Same per-(page, layer) structure as page_first_kv_split: rows of a page are contiguous, pages strided."""
    for request in requests("cuda", pinned=True, ops=ONE_LAYER):
        if request.layout.name == "page_first_direct":
            assert JitOneLayer.not_supported_reasons(request) == []


def test_page_head_is_refused_with_a_reason():
    refused = [r for r in requests("cuda", pinned=True, ops=ONE_LAYER) if r.layout.name == "page_head"]
    assert refused
    for request in refused:
        reasons = JitOneLayer.not_supported_reasons(request)
        assert any("splits each item across heads" in r and "kernel.triton_uva" in r for r in reasons), reasons


def test_all_layer_backup_is_refused_naming_hicache_kernel():
    for request in requests("cuda", pinned=True, ops=(hc.BACKUP_ALL,)):
        reasons = JitOneLayer.not_supported_reasons(request)
        assert any("not claimed" in r for r in reasons), reasons
        assert any("hicache-kernel" in r for r in reasons), reasons


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    request = requests("cpu", ops=(hc.LOAD,))[0]
    reasons = JitOneLayer.not_supported_reasons(request)
    assert any("TRITON_INTERPRET=1" in r for r in reasons), reasons
    assert JitOneLayer.device_types == {"cuda"}


def test_unpinned_host_memory_on_cuda_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    request = next(r for r in requests("cuda", pinned=False, ops=(hc.LOAD,)) if r.layout.name == "page_first")
    reasons = JitOneLayer.not_supported_reasons(request)
    assert any("pinned" in r for r in reasons), reasons
    assert JitOneLayer.not_supported_reasons(request.with_(host_pinned=True)) == []


def test_missing_triton_is_a_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gpu_device, "_triton_found", False)
    request = next(r for r in requests("cpu", ops=(hc.LOAD,)) if r.layout.name == "page_first")
    reasons = JitOneLayer.not_supported_reasons(request)
    assert any("triton is not installed" in r for r in reasons), reasons


def test_forcing_it_on_page_head_fails_at_construction(jit_device):
    dev = small_pool("mha", jit_device)
    with pytest.raises(hc.UnsupportedCombinationError, match="splits each item across heads"):
        hc.make_host_pool(
            dev, layout="page_head", io_backend="kernel", operations=[hc.LOAD], implementation="jit.one_layer", size=32
        )
