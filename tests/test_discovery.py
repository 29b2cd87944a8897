"""Plugins are found through entry points, filtered by HICACHE_PLUGINS, and can add layouts and io backends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from core_helpers import device_pool, device_tensors, fill_random, random_page_slots, same_bytes

import hicache_core as hc
from hicache_core import hookimpl
from hicache_core.plugins.registry import Registry, allowed_plugins


def test_direct_is_discovered_through_its_entry_point(registry):
    record = registry.plugins["direct"]
    assert record.distribution == "hicache-direct"
    assert record.status == "loaded" and not record.errors
    assert "direct.copy_engine" in record.implementations
    assert registry.implementations["direct.copy_engine"].io_backend == "direct"
    assert "hicache_register_backends" in record.hooks


def test_builtin_layouts_come_from_the_core_plugin(registry):
    assert {"layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split"} <= set(
        registry.plugins["hicache_core"].layouts
    )


@pytest.mark.parametrize(
    "value, expected", [(None, None), ("", set()), ("direct", {"direct"}), (" a , b,", {"a", "b"})]
)
def test_allow_list_parsing(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv("HICACHE_PLUGINS", raising=False)
        assert allowed_plugins() is None
    else:
        assert allowed_plugins(value) == expected


def test_empty_allow_list_loads_no_plugin():
    registry = Registry.from_entry_points(set())
    assert registry.plugins["direct"].status == "filtered"
    assert "direct.copy_engine" not in registry.implementations
    dev = device_pool("mha", 4)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(dev, layout="layer_first", io_backend="direct", registry=registry)
    assert "hicache-direct is installed but HICACHE_PLUGINS leaves it out" in str(err.value)


def test_allow_list_by_distribution_name():
    registry = Registry.from_entry_points({"hicache-direct"})
    assert registry.plugins["direct"].status == "loaded"


def test_env_var_reaches_a_fresh_process():
    code = "import json, hicache_core as hc; r = hc.get_registry(); print(json.dumps(r.plugins['direct'].status))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"HICACHE_PLUGINS": "", "PATH": ""}, capture_output=True, text=True
    )
    assert json.loads(out.stdout) == "filtered", out.stderr


class _ByteFlipLayout:
    """A test plugin: a new layout (page-major with layers innermost) and a new io backend serving it."""

    layout = hc.Layout(
        "page_layer_inner",
        ("page", "component", "token", "head", "layer", "dim"),
        pool_kinds=frozenset({"mha", "mla"}),
    )

    class Loop(hc.Implementation):
        name = "testplugin.loop"
        io_backend = "loopcopy"
        priority = 5
        device_types = frozenset({"cpu", "cuda"})
        index_dtypes = frozenset({torch.int64, torch.int32})
        calls: list = []

        def load_to_device_per_layer(self, h, d, layer):
            self.calls.append(("load", layer))
            hc.reference_copy(self.plan, h, d, [layer], to_device=True)

        def backup_from_device_per_layer(self, h, d, layer):
            self.calls.append(("backup", layer))
            hc.reference_copy(self.plan, h, d, [layer], to_device=False)

        def backup_from_device_all_layer(self, h, d):
            self.calls.append(("backup_all", None))
            hc.reference_copy(self.plan, h, d, range(self.plan.num_layers), to_device=False)

    @hookimpl
    def hicache_register_layouts(self, register):
        register(self.layout)

    @hookimpl
    def hicache_register_backends(self, register):
        register(self.Loop)


def test_a_plugin_adds_a_layout_and_an_io_backend_and_is_dispatched_to():
    registry = Registry.from_entry_points({"direct"})
    plugin = _ByteFlipLayout()
    registry.add_plugin(plugin, "testplugin")
    assert registry.plugins["testplugin"].layouts == ["page_layer_inner"]
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="page_layer_inner", io_backend="loopcopy", size=24, registry=registry)
    assert host.implementations["load_to_device_per_layer"] == "testplugin.loop"
    # shape follows the declaration with no core change: (P, 2, p, H, L, D)
    assert tuple(host.kv_buffer.shape) == (6, 2, 4, 2, 3, 8)
    fill_random(device_tensors(dev), seed=3)
    h, d = random_page_slots(4, 2, 4, seed=1), random_page_slots(6, 2, 4, seed=2, first=1)
    plugin.Loop.calls.clear()
    host.backup_from_device_all_layer(dev, h, d, "loopcopy")
    assert plugin.Loop.calls == [("backup_all", None)]
    for layer in range(3):
        for s, slot in zip(h.tolist(), d.tolist()):
            assert same_bytes(host.kv_buffer[s // 4, 0, s % 4, :, layer], dev.k_buffer[layer][slot])
    # direct judges the new layout by its structure (layers inside heads split items), not by name
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(dev, layout="page_layer_inner", io_backend="direct", registry=registry)
    assert "layout 'page_layer_inner' splits each item across heads" in str(err.value)
    assert "io backends for layout 'page_layer_inner': 'loopcopy'" in str(err.value)


def test_a_new_layout_that_direct_can_serve():
    registry = Registry.from_entry_points({"direct"})

    class Blob:
        @hookimpl
        def hicache_register_layouts(self, register):
            register(hc.Layout("page_blob_direct", ("page", "component", "layer", "token", "head", "dim")))

    registry.add_plugin(Blob(), "blob")
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="direct", size=24, registry=registry)
    assert tuple(host.kv_buffer.shape) == (6, 2, 3, 4, 2, 8)
    fill_random(device_tensors(dev), seed=3)
    h, d = random_page_slots(4, 2, 4, seed=1), random_page_slots(6, 2, 4, seed=2, first=1)
    host.backup_from_device_all_layer(dev, h, d, "direct")
    for layer in range(3):
        for s, slot in zip(h.tolist(), d.tolist()):
            assert same_bytes(host.kv_buffer[s // 4, 1, layer, s % 4], dev.v_buffer[layer][slot])
