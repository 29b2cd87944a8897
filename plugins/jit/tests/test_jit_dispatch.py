"""Dispatch with and without hicache-kernel: jit takes the one-layer operations, never the all-layer backup."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from jit_helpers import check_against_reference, fill_random, pages, small_pool, snapshot

import hicache_core as hc
import hicache_core.plugins.registry as registry_module
from hicache_core.plugins.registry import Registry

ONE_LAYER = [hc.LOAD, hc.BACKUP_LAYER]
kernel_installed = importlib.util.find_spec("hicache_kernel") is not None


@pytest.fixture
def jit_without_kernel_installed(monkeypatch) -> Registry:
    """A registry as if hicache-kernel were not installed at all (jit and direct are)."""
    real = registry_module._entry_points
    monkeypatch.setattr(registry_module, "_entry_points", lambda: [ep for ep in real() if ep.name != "kernel"])
    return Registry.from_entry_points()


@pytest.fixture
def jit_with_kernel_filtered() -> Registry:
    """HICACHE_PLUGINS=jit,direct: hicache-kernel, if installed, is left out."""
    return Registry.from_entry_points({"jit", "direct"})


@pytest.mark.parametrize("which", ["filtered", "not_installed"])
def test_one_layer_operations_resolve_to_jit_without_hicache_kernel(which, jit_device, request):
    registry = request.getfixturevalue(
        "jit_with_kernel_filtered" if which == "filtered" else "jit_without_kernel_installed"
    )
    assert "kernel.triton_uva" not in registry.implementations
    for kind, layout in [("mla", "page_first"), ("mha", "layer_first"), ("mla", "page_first_kv_split")]:
        dev = small_pool(kind, jit_device)
        host = hc.make_host_pool(dev, layout=layout, io_backend="kernel", operations=ONE_LAYER, size=32,
                                 registry=registry)  # fmt: skip
        assert host.implementations == {hc.LOAD: "jit.one_layer", hc.BACKUP_LAYER: "jit.one_layer"}
        impl = host.implementation_for(hc.LOAD)
        check_against_reference(host, impl, hc.LOAD, pages([1, 3], 4), pages([5, 2], 4), layer=2)


def test_scenario_5_per_layer_backup_of_a_layer_sharded_dsa_indexer(jit_device, jit_with_kernel_filtered):
    """DSA indexer, layer-sharded, page_first, io_backend="kernel", backup per layer: layer-first -> page-first."""
    dev = small_pool("page_rows", jit_device, layers=4, start_layer=2, end_layer=4)
    host = hc.make_host_pool(dev, layout="page_first", io_backend="kernel", operations=[hc.BACKUP_LAYER],
                             size=36, registry=jit_with_kernel_filtered)  # fmt: skip
    assert host.implementations[hc.BACKUP_LAYER] == "jit.one_layer"
    impl = host.implementation_for(hc.BACKUP_LAYER)
    rows = torch.tensor([6, 0, 3])
    for layer in range(host.plan.num_layers):
        check_against_reference(host, impl, hc.BACKUP_LAYER, rows, torch.tensor([1, 7, 4]), layer=layer)


def test_all_layer_backup_names_hicache_kernel_when_filtered_out(jit_device, jit_with_kernel_filtered):
    dev = small_pool("mla", jit_device)
    with pytest.raises(hc.UnsupportedCombinationError) as err:  # default operations include the all-layer backup
        hc.make_host_pool(dev, layout="page_first", io_backend="kernel", size=32, registry=jit_with_kernel_filtered)
    message = str(err.value)
    assert err.value.operation == hc.BACKUP_ALL
    assert "jit.one_layer" in message and "hicache-kernel" in message
    if kernel_installed:
        assert "hicache-kernel is installed but HICACHE_PLUGINS leaves it out" in message


def test_all_layer_backup_names_hicache_kernel_when_not_installed(jit_device, jit_without_kernel_installed):
    dev = small_pool("mla", jit_device)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(dev, layout="page_first", io_backend="kernel", operations=[hc.LOAD, hc.BACKUP_ALL],
                          size=32, registry=jit_without_kernel_installed)  # fmt: skip
    message = str(err.value)
    assert err.value.operation == hc.BACKUP_ALL
    assert "hicache-kernel (io backend 'kernel') is not installed" in message
    tree = Path(hc.__file__).resolve().parents[1]
    assert message.rstrip().endswith(f"pip install -e {tree / 'plugins' / 'kernel'}")


@pytest.mark.skipif(not kernel_installed, reason="needs hicache-kernel installed beside hicache-jit")
@pytest.mark.parametrize("backend", ["kernel", "auto"])
def test_with_both_installed_one_layer_goes_to_jit_and_all_layers_to_kernel(backend, jit_device):
    registry = Registry.from_entry_points({"jit", "kernel", "direct"})
    dev = small_pool("mla", jit_device, layers=3, start_layer=1, end_layer=3)
    host = hc.make_host_pool(dev, layout="page_first", io_backend=backend, size=32, registry=registry,
                             operations=[hc.LOAD, hc.BACKUP_LAYER, hc.BACKUP_ALL])  # fmt: skip
    assert host.implementations == {
        hc.LOAD: "jit.one_layer",
        hc.BACKUP_LAYER: "jit.one_layer",
        hc.BACKUP_ALL: "kernel.triton_uva",
    }
    # And the bytes: back two pages up through kernel (all layers), reload them into one layer through jit.
    ref = hc.make_host_pool(dev, layout="page_first", io_backend="reference", size=32, registry=registry,
                            operations=[hc.LOAD, hc.BACKUP_ALL])  # fmt: skip
    h, d, d2 = pages([3, 0], 4), pages([2, 6], 4), pages([1, 5], 4)
    dev_tensors = [t for p in host.plan.parts for t in p.device_layers]
    hosts, refs = list(host.plan.host_buffers.values()), list(ref.plan.host_buffers.values())
    for t in hosts + refs:
        t.zero_()
    fill_random(dev_tensors, 1)
    host.backup_from_device_all_layer(dev, h.to(jit_device), d.to(jit_device), backend)
    ref.backup_from_device_all_layer(dev, h, d, "reference")
    assert all(torch.equal(a, b) for a, b in zip(snapshot(hosts), snapshot(refs)))
    fill_random(dev_tensors, 2)
    host.load_to_device_per_layer(dev, h.to(jit_device), d2.to(jit_device), 2, backend)
    got = snapshot(dev_tensors)
    fill_random(dev_tensors, 2)
    ref.load_to_device_per_layer(dev, h, d2, 2, "reference")
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(dev_tensors)))


def test_importing_is_cheap_and_transfers_never_import_hicache_kernel(jit_device):
    """Registering and building a pool import neither triton nor CUDA; transferring never imports hicache_kernel."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import hicache_core as hc
        r = hc.Registry.from_entry_points({"jit"})
        assert "jit.one_layer" in r.implementations, r.plugins
        dev = hc.MLADevicePool(8, 4, torch.bfloat16, 16, 8, 2, sys.argv[1])
        host = hc.make_host_pool(dev, layout="page_first", io_backend="kernel", operations=[hc.LOAD], size=32,
                                 registry=r)
        assert "triton" not in sys.modules, "triton imported before the first transfer"
        if sys.argv[1] == "cpu":
            assert not torch.cuda.is_initialized(), "CUDA initialised"
        idx = torch.arange(4, device=sys.argv[1])
        host.load_to_device_per_layer(dev, idx, idx + 4, 1, "kernel")
        assert "triton" in sys.modules
        assert not any(m.startswith("hicache_kernel") for m in sys.modules), "hicache_kernel was imported"
        """
    )
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", code, jit_device], check=True, env=env, timeout=300)
