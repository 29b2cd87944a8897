"""What the kernel implementation claims, what it refuses and why, and its SM budget knob."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest
import torch
from hicache_kernel import TritonUVA, triton_uva

import hicache_core as hc
from hicache_core.gpu import device as gpu_device
from hicache_core.plugins.dispatch import reasons_for
from hicache_core.plugins.registry import Registry, allowed_plugins
from hicache_core.testing.guarded import record_grids

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split")


def pool(kind: str, *, layers: int = 3, sharded: bool = False):
    kw = dict(start_layer=1, end_layer=layers) if sharded else {}
    if kind == "mha":
        return hc.MHADevicePool(8, 4, torch.bfloat16, 2, 8, layers, "cpu", **kw)
    if kind == "mha_asym":
        return hc.MHADevicePool(8, 4, torch.bfloat16, 2, 8, layers, "cpu", v_head_dim=4, **kw)
    if kind == "mla":
        return hc.MLADevicePool(8, 4, torch.bfloat16, 16, 8, layers, "cpu", **kw)
    return hc.PageRowsDevicePool(3, 4, 24, layers, "cpu", **kw)


#: The kinds these helpers build pools of (the others are covered by the conformance kit).
FOUR_KINDS = ("mha", "mha_asym", "mla", "page_rows")


def requests(device_type: str = "cpu", pinned: bool = False) -> list[hc.TransferRequest]:
    """Every storable (pool kind, layout, operation, sharded, draft) combination, as a request."""
    layouts = hc.get_registry().layouts
    out = []
    for kind, sharded, draft in itertools.product(FOUR_KINDS, (False, True), (False, True)):
        drafts = (pool(kind, layers=1),) if draft else ()
        geometry = hc.geometry_of(pool(kind, sharded=sharded), draft_pools=drafts)
        geometry = dataclasses.replace(geometry, device_type=device_type)
        for name in LAYOUTS:
            if hc.TransferRequest("reference", hc.LOAD, geometry, layouts[name]).storable:
                out += [hc.TransferRequest("kernel", op, geometry, layouts[name], pinned) for op in hc.OPERATIONS]
    return out


def test_claims_everything_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reqs = requests("cpu")
    assert {r.layout.name for r in reqs} == set(LAYOUTS)
    assert {r.pool_kind for r in reqs} == {"mha", "mha_asym", "mla", "page_rows"}
    assert any(r.sharded for r in reqs) and any(r.draft for r in reqs)
    for request in reqs:
        assert reasons_for(TritonUVA, request) == [], request.describe()
    assert "cpu" in TritonUVA.device_types


def test_claims_everything_on_cuda_with_pinned_memory(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for request in requests("cuda", pinned=True):
        assert reasons_for(TritonUVA, request) == [], request.describe()
    assert TritonUVA.device_types == {"cuda"}


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    request = requests("cpu")[0]
    reasons = TritonUVA.not_supported_reasons(request)
    assert any("TRITON_INTERPRET=1" in r for r in reasons), reasons

    registry = Registry.from_entry_points(allowed_plugins())
    with pytest.raises(hc.UnsupportedCombinationError, match="TRITON_INTERPRET"):
        hc.make_host_pool(pool("mha"), layout="page_first", io_backend="kernel", size=8, registry=registry)


def test_unpinned_host_memory_on_cuda_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    request = requests("cuda", pinned=False)[0]
    reasons = TritonUVA.not_supported_reasons(request)
    assert any("pinned" in r for r in reasons), reasons
    assert TritonUVA.not_supported_reasons(request.with_(host_pinned=True)) == []


def test_cuda_is_claimed_under_the_interpreter_too(monkeypatch):
    """Claims are reasoning about pools (``hicache explain --device cuda``); a real CUDA pool under the
    interpreter is refused when the host pool is built."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonUVA.not_supported_reasons(requests("cuda", pinned=True)[0]) == []
    assert TritonUVA.device_types == {"cuda", "cpu"}


def test_missing_triton_is_a_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gpu_device, "_triton_found", False)
    reasons = TritonUVA.not_supported_reasons(requests("cpu")[0])
    assert any("triton is not installed" in r for r in reasons), reasons


def test_declaration_and_registration():
    assert TritonUVA.declaration_problems() == []
    registry = Registry.from_entry_points(allowed_plugins())
    assert registry.implementations.get("kernel.triton_uva") is TritonUVA
    assert registry.plugin_of("kernel.triton_uva") == "kernel"
    assert TritonUVA.index_device == "device"
    assert TritonUVA.index_dtypes == {torch.int32, torch.int64}
    assert TritonUVA.priority == 50 and TritonUVA.io_backend == "kernel"


def test_importing_the_plugin_is_cheap():
    code = (
        "import sys; import hicache_core as hc; r = hc.Registry.from_entry_points(); "
        "assert 'kernel.triton_uva' in r.implementations; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "import torch; assert not torch.cuda.is_initialized(), 'CUDA initialised'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resolved_by_io_backend_kernel_and_auto(kernel_device):
    dev = hc.MLADevicePool(8, 4, torch.bfloat16, 16, 8, 2, kernel_device)
    registry = Registry.from_entry_points(allowed_plugins())
    for backend in ("kernel", "auto"):
        host = hc.make_host_pool(dev, layout="page_first_kv_split", io_backend=backend, size=8, registry=registry)
        assert set(host.implementations.values()) == {"kernel.triton_uva"}


# ---- the SM budget ------------------------------------------------------------------------------


def _host(device: str, **kw):
    dev = hc.MHADevicePool(60, 4, torch.bfloat16, 2, 8, 3, device)
    kw.setdefault("registry", Registry.from_entry_points(allowed_plugins()))
    return hc.make_host_pool(dev, layout="page_first", io_backend="kernel", size=64, **kw), dev


def test_max_ctas_default_env_and_setter(kernel_device, monkeypatch):
    monkeypatch.delenv(triton_uva.ENV_MAX_CTAS, raising=False)
    host, _ = _host(kernel_device)
    impl = host.implementation_for(hc.LOAD)
    assert impl.max_ctas == 8
    monkeypatch.setenv(triton_uva.ENV_MAX_CTAS, "3")
    assert _host(kernel_device)[0].implementation_for(hc.LOAD).max_ctas == 3
    monkeypatch.setenv(triton_uva.ENV_MAX_CTAS, "0")
    assert _host(kernel_device)[0].implementation_for(hc.LOAD).max_ctas == 0
    monkeypatch.setenv(triton_uva.ENV_MAX_CTAS, "many")
    with pytest.raises(ValueError, match=triton_uva.ENV_MAX_CTAS):
        _host(kernel_device)
    for bad in (-1, 2.5, "4"):
        with pytest.raises(ValueError, match="max_ctas"):
            impl.max_ctas = bad


def test_grid_is_tiles_capped_by_the_budget(kernel_device, monkeypatch):
    host, dev = _host(kernel_device)
    impl = host.implementation_for(hc.BACKUP_ALL)
    impl.tile_words = 8  # 32 items x 2 words (32 B items, 16-byte words) = 8 tiles per part and layer
    seen = record_grids(impl, monkeypatch)
    idx = torch.arange(32, dtype=torch.int64)
    impl.max_ctas = 5
    host.backup_from_device_all_layer(dev, idx, idx, "kernel")
    impl.max_ctas = 0
    host.backup_from_device_all_layer(dev, idx, idx, "kernel")
    impl.max_ctas = None
    host.backup_from_device_all_layer(dev, idx[:1], idx[:1], "kernel")
    impl.max_ctas = 1000
    host.backup_from_device_all_layer(dev, idx, idx, "kernel")
    sms = impl._sm_count
    # one launch covers all 3 layers and both parts: 3 x 2 x 8 tiles
    assert seen == [5, min(48, sms), min(6, sms), 48]
