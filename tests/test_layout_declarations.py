"""What a layout can declare: merged axes, stacked or separate components, an oracle; and what it may not."""

from __future__ import annotations

import warnings

import pytest
import torch
from core_helpers import device_pool, device_tensors, fill_random, same_bytes

import hicache_core as hc
from hicache_core import Layout, hookimpl
from hicache_core.plugins.registry import Registry


def _with(*layouts: Layout) -> Registry:
    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):
            for layout in layouts:
                register(layout)

    registry = Registry.from_entry_points({"direct"})
    registry.add_plugin(Plugin(), "extra_layouts")
    return registry


#: LMCache's KV layout: (2, L, T, H*D), tokens and heads x dims each shown as one axis.
LMCACHE = Layout("lmcache_like", ("component", "layer", "page", "token", "head", "dim"),
                 merge=(("page", "token"), ("head", "dim")))  # fmt: skip


def test_a_layout_can_merge_heads_and_dims_as_lmcache_does():
    registry = _with(LMCACHE)
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="lmcache_like", io_backend="direct", size=24, registry=registry)
    assert tuple(host.kv_buffer.shape) == (2, 3, 24, 16)  # (2, L, T, H*D)
    fill_random(device_tensors(dev), seed=2)
    h, d = torch.arange(8, 12), torch.arange(16, 20)
    host.backup_from_device_all_layer(dev, h, d, "direct")
    for layer in range(3):
        assert same_bytes(host.kv_buffer[0, layer, 8:12], dev.k_buffer[layer][16:20])
        assert same_bytes(host.kv_buffer[1, layer, 8:12], dev.v_buffer[layer][16:20])


def test_components_can_be_asked_for_separate_or_stacked():
    separate = Layout("pfd_separate", ("component", "page", "layer", "token", "head", "dim"), components="separate")
    stacked = Layout("pfd_stacked", ("component", "page", "layer", "token", "head", "dim"), components="stacked")
    registry = _with(separate, stacked)
    host = hc.make_host_pool(device_pool("mha", 4), layout="pfd_separate", io_backend="direct", size=24,
                             registry=registry)  # fmt: skip
    assert host.kv_buffer is None and tuple(host.k_buffer.shape) == (6, 3, 4, 2, 8)
    host = hc.make_host_pool(device_pool("mha", 4), layout="pfd_stacked", io_backend="direct", size=24,
                             registry=registry)  # fmt: skip
    assert tuple(host.kv_buffer.shape) == (2, 6, 3, 4, 2, 8)
    with pytest.raises(hc.UnsupportedCombinationError, match="stacks components in one buffer, but pool kind "
                       "'mha_asym': its components differ in shape"):  # fmt: skip
        hc.make_host_pool(device_pool("mha_asym", 4), layout="pfd_stacked", io_backend="direct", size=24,
                          registry=registry)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(merge=(("page", "layer"),)), "must be adjacent axes"),
        (dict(merge=(("token",),)), "must name two or more axes"),
        (dict(components="interleaved"), "components must be one of"),
        (dict(oracle="not callable"), "oracle must be callable"),
    ],
)
def test_malformed_declarations_say_what_is_wrong(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        Layout("bad", ("component", "page", "token", "layer", "head", "dim"), **kwargs)


def test_a_byte_identical_copy_of_an_installed_layout_warns_naming_both():
    twin = Layout("my_page_first", ("component", "page", "token", "layer", "head", "dim"), merge_slots=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = _with(twin)
    messages = [str(w.message) for w in caught]
    assert any(
        "layout 'my_page_first' (plugin extra_layouts) arranges bytes exactly as layout 'page_first' "
        "(plugin hicache_core) does" in m
        for m in messages
    ), messages
    assert "my_page_first" in registry.layouts  # registered all the same: a warning, not a refusal


def test_a_layout_naming_an_unknown_pool_kind_is_refused_and_recorded():
    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):
            register(Layout("odd", ("component", "page", "layer", "token", "head", "dim"),
                            pool_kinds=frozenset({"no_such_kind"})))  # fmt: skip

    registry = Registry()
    record = registry.add_plugin(Plugin(), "odd")
    assert "odd" not in registry.layouts
    assert "unknown pool kinds ['no_such_kind']" in record.errors[0]
