"""Pool kinds are declarations: a plugin adds one, and kernel and direct serve it with no edit anywhere.

The third-party kind here is what hybrid linear-attention models need: a per-page state
blob beside each KV page. It is registered through ``hicache_register_pool_kinds`` from
a plugin object, exactly as an installed plugin would, and nothing in the core or in
the transfer plugins knows its name.
"""

from __future__ import annotations

import pytest
import torch
from core_helpers import same_bytes

import hicache_core as hc
from hicache_core import ComponentDecl, PoolKind, hookimpl
from hicache_core.declared.pool_kinds import has_layers
from hicache_core.plugins.registry import Registry
from hicache_core.testing import ConformanceTests

#: Each item is one page: a KV page row of 2 x 4 tokens x 16 bf16, and a 48-byte state blob.
KV_WITH_STATE = PoolKind(
    "kv_with_state",
    (
        ComponentDecl("kv", "kv_page_buffer", "kv_buffer", (256,)),
        ComponentDecl("state", "state_buffer", "state_buffer", (48,)),
    ),
    item="page",
    detect=has_layers("kv_page_buffer", "state_buffer"),
    description="hybrid linear attention: a state blob beside each KV page",
)


class HybridPlugin:
    @hookimpl
    def hicache_register_pool_kinds(self, register):
        register(KV_WITH_STATE)


class HybridDevicePool:
    """What a hybrid model's server would hand over: per-layer page rows under its own attribute names."""

    def __init__(self, pages: int, page_size: int, layers: int, device: str):
        self.page_size, self.size, self.layer_num = page_size, pages * page_size, layers
        self.kv_page_buffer = [torch.zeros(pages, 256, dtype=torch.uint8, device=device) for _ in range(layers)]
        self.state_buffer = [torch.zeros(pages, 48, dtype=torch.uint8, device=device) for _ in range(layers)]


def _registry(*names: str) -> Registry:
    registry = Registry.from_entry_points(set(names))
    registry.add_plugin(HybridPlugin(), "hybrid")
    return registry


def test_the_kind_is_registered_through_the_hook_and_detected_by_its_attributes():
    registry = _registry("direct")
    assert registry.pool_kinds["kv_with_state"] is KV_WITH_STATE
    assert registry.plugins["hybrid"].pool_kinds == ["kv_with_state"]
    geometry = hc.geometry_of(HybridDevicePool(6, 4, 3, "cpu"), pool_kinds=registry.pool_kinds)
    assert geometry.kind == "kv_with_state" and geometry.items_are_pages
    assert geometry.item_bytes == (256, 48)


@pytest.mark.parametrize("layout, shapes", [
    ("layer_first", {"kv_buffer": (3, 8, 256), "state_buffer": (3, 8, 48)}),
    ("page_first", {"kv_buffer": (8, 3, 256), "state_buffer": (8, 3, 48)}),
    ("page_first_direct", {"kv_buffer": (8, 3, 1, 256), "state_buffer": (8, 3, 1, 48)}),
])  # fmt: skip
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_kernel_and_direct_serve_it_byte_exact(layout, shapes, io_backend):
    registry = _registry("direct", "kernel")
    if io_backend == "kernel" and "kernel.triton_uva" not in registry.implementations:
        pytest.skip("hicache-kernel is not installed")
    dev = HybridDevicePool(6, 4, 3, "cpu")
    if io_backend == "kernel" and not hc.TransferRequest(
        "kernel", hc.LOAD, hc.geometry_of(dev, pool_kinds=registry.pool_kinds), registry.layouts[layout]
    ).storable:
        pytest.skip("layout not storable")
    try:
        host = hc.make_host_pool(dev, layout=layout, io_backend=io_backend, size=32, registry=registry,
                                 operations=hc.OPERATIONS)  # fmt: skip
    except hc.UnsupportedCombinationError as exc:
        if io_backend == "kernel" and "TRITON_INTERPRET" in str(exc):
            pytest.skip("the kernel serves CPU pools only under TRITON_INTERPRET=1")
        raise
    assert {b.attr: tuple(b.shape) for b in host.spec.buffers} == shapes
    gen = torch.Generator().manual_seed(9)
    for t in dev.kv_page_buffer + dev.state_buffer:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    slots = torch.tensor([5, 2, 7]) * 4
    h = (slots[:, None] + torch.arange(4)).reshape(-1)
    d = (torch.tensor([1, 4, 0])[:, None] * 4 + torch.arange(4)).reshape(-1)
    host.backup_from_device_all_layer(dev, h, d, io_backend)
    for layer in range(3):
        for hp, dp in ((5, 1), (2, 4), (7, 0)):
            where = {"layer_first": (layer, hp), "page_first": (hp, layer), "page_first_direct": (hp, layer, 0)}[layout]
            assert same_bytes(host.kv_buffer[where], dev.kv_page_buffer[layer][dp])
            assert same_bytes(host.state_buffer[where], dev.state_buffer[layer][dp])
    for t in dev.kv_page_buffer + dev.state_buffer:
        t.zero_()
    for layer in range(3):
        host.load_to_device_per_layer(dev, h, d, layer, io_backend)
    for layer in range(3):
        for hp, dp in ((5, 1), (2, 4), (7, 0)):
            where = {"layer_first": (layer, hp), "page_first": (hp, layer), "page_first_direct": (hp, layer, 0)}[layout]
            assert same_bytes(dev.state_buffer[layer][dp], host.state_buffer[where])


class TestDirectServesAThirdPartyKind(ConformanceTests):
    """The conformance kit generates its cases for the kind from its declaration alone."""

    implementation = "direct.copy_engine"
    device = "cpu"
    only_pool_kinds = ("kv_with_state",)

    @classmethod
    def make_registry(cls) -> Registry:
        return _registry("direct")


def test_the_kit_generated_cases_for_the_third_party_kind():
    from hicache_core.testing.conformance import _CASES

    cases = [case for case, _ in _CASES["round_trip"](TestDirectServesAThirdPartyKind)]
    assert {c.pool_kind for c in cases} == {"kv_with_state"}
    assert {c.layout for c in cases} == {"layer_first", "page_first", "page_first_direct"}


def test_a_malformed_or_duplicate_kind_is_refused_and_recorded():
    class Bad:
        @hookimpl
        def hicache_register_pool_kinds(self, register):
            register(KV_WITH_STATE)  # a second time
            register("not a kind")

    registry = _registry("direct")
    record = registry.add_plugin(Bad(), "bad")
    assert "pool kind 'kv_with_state' refused: pool kind 'kv_with_state' is already registered by hybrid" in (
        record.errors[0]
    )
    assert "registered 'not a kind', which is not a hicache_core.PoolKind" in record.errors[1]
    with pytest.raises(ValueError, match="components must be a non-empty tuple of ComponentDecl"):
        PoolKind("empty", ())


def test_an_ambiguous_device_pool_must_name_its_kind():
    twin = PoolKind("twin", KV_WITH_STATE.components, item="page", detect=KV_WITH_STATE.detect)

    class TwinPlugin:
        @hookimpl
        def hicache_register_pool_kinds(self, register):
            register(twin)

    registry = _registry("direct")
    registry.add_plugin(TwinPlugin(), "twin")
    dev = HybridDevicePool(6, 4, 3, "cpu")
    with pytest.raises(ValueError, match=r"looks like several pool kinds \(kv_with_state, twin\); set its pool_kind"):
        hc.geometry_of(dev, pool_kinds=registry.pool_kinds)
    dev.pool_kind = "twin"
    assert hc.geometry_of(dev, pool_kinds=registry.pool_kinds).kind == "twin"


def test_matrix_and_explain_list_the_new_built_in_kinds(capsys):
    from hicache_core.cli import main

    assert main(["matrix", "--pool", "dsv4_state", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "dsv4_state  layer_first" in out and "dsv4_state  page_head" not in out
    assert main(["explain", "--pool", "mha_k_only", "--layout", "page_first_direct", "--op",
                 "load_to_device_per_layer", "--io-backend", "direct", "--device", "cpu"]) == 0  # fmt: skip
    assert "Resolved to direct.copy_engine" in capsys.readouterr().out


# ---- SGLang's page-access methods, for every layout that has them ----------------------------------------------


def test_split_heads_page_meta_gives_each_head_group_of_each_page(direct_only):
    dev = hc.MHADevicePool(24, 4, torch.bfloat16, 4, 8, 3, "cpu")
    host = hc.make_host_pool(dev, layout="page_head", io_backend="reference", size=24, registry=direct_only)
    ptrs, sizes = host.get_split_heads_page_buffer_meta(torch.arange(8, 16), 2)
    it = 2
    group = 2 * 4 * 3 * 8 * it  # 2 heads x 4 tokens x 3 layers x 8 dims
    want = []
    for page in (2, 3):
        for g in range(2):
            want += [(host.kv_buffer[c, page, 2 * g].data_ptr(), group) for c in (0, 1)]
    assert list(zip(ptrs, sizes)) == want
    with pytest.raises(ValueError, match="head_num 4 is not divisible by split_factor 3"):
        host.get_split_heads_page_buffer_meta(torch.arange(8, 16), 3)
    other = hc.make_host_pool(dev, layout="page_first", io_backend="reference", size=24, registry=direct_only)
    with pytest.raises(ValueError, match="keeps token, layer outside the head axis"):
        other.get_split_heads_page_buffer_meta(torch.arange(8, 16), 2)


def test_contiguous_buf_infos_give_whole_page_regions(direct_only):
    dev = hc.MHADevicePool(24, 4, torch.bfloat16, 2, 8, 3, "cpu")
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="reference", size=24, registry=direct_only)
    ptrs, lens, items = host.get_contiguous_buf_infos()
    page = 4 * 2 * 8 * 2
    assert ptrs == [host.kv_buffer[c, layer].data_ptr() for c in range(2) for layer in range(3)]  # K layers, then V
    assert lens == [6 * page] * 6 and items == [page] * 6
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="reference", size=24, registry=direct_only)
    ptrs, lens, items = host.get_contiguous_buf_infos()
    assert ptrs == [host.kv_buffer[0].data_ptr(), host.kv_buffer[1].data_ptr()] and items == [3 * page] * 2


# ---- a kind's shape_as is resolved in the registry that holds it ---------------------------------

#: Page rows presented, for page_first, with the shape of a layout only this test's registry has.
BLOB_ROWS = PoolKind(
    "blob_rows",
    (ComponentDecl("row", "blob_buffer", "blob_buffer", (24,)),),
    item="page",
    detect=has_layers("blob_buffer"),
    layouts=frozenset({"page_first", "blob_shape"}),
    shape_as=(("page_first", "blob_shape"),),
)
BLOB_SHAPE = hc.Layout(
    "blob_shape", ("component", "page", "layer", "token", "head", "dim"), merge=(("page", "layer"),)
)


class BlobPlugin:
    def __init__(self, layouts=(BLOB_SHAPE,)):
        self.extra_layouts = layouts

    @hookimpl
    def hicache_register_pool_kinds(self, register):
        register(BLOB_ROWS)

    @hookimpl
    def hicache_register_layouts(self, register):
        for layout in self.extra_layouts:
            register(layout)


class BlobDevicePool:
    def __init__(self, pages: int, page_size: int, layers: int):
        self.page_size, self.size, self.layer_num = page_size, pages * page_size, layers
        self.blob_buffer = [torch.zeros(pages, 24, dtype=torch.uint8) for _ in range(layers)]


def test_shape_as_uses_the_callers_registry_not_the_process_one():
    registry = Registry()  # the core's plugin only: nothing from the process registry
    registry.add_plugin(BlobPlugin(), "blob")
    assert registry.pool_kinds["blob_rows"].presented_as(registry.layouts["page_first"]) is BLOB_SHAPE
    dev = BlobDevicePool(6, 4, 3)
    host = hc.make_host_pool(
        dev, layout="page_first", io_backend="reference", size=32, registry=registry, pin_memory=False
    )  # fmt: skip
    # blob_shape merges page and layer: 8 pages x 3 layers in one dimension, the unit token axis, the row.
    assert tuple(host.blob_buffer.shape) == (24, 1, 24)
    dev.blob_buffer[1][2] = torch.arange(24, dtype=torch.uint8)
    host.backup_from_device_all_layer(dev, torch.arange(4, 8), torch.arange(8, 12), io_backend="reference")
    assert torch.equal(host.blob_buffer.view(8, 3, 24)[1, 1], torch.arange(24, dtype=torch.uint8))


def test_shape_as_naming_a_layout_nobody_registers_is_an_error_not_a_fallback():
    registry = Registry()
    registry.add_plugin(BlobPlugin(layouts=()), "blob")
    assert any("'blob_shape'" in e and "no plugin registers" in e for e in registry.plugins["blob"].errors)
    with pytest.raises(ValueError, match="presents layout 'page_first' with layout 'blob_shape'"):
        hc.make_host_pool(
            BlobDevicePool(6, 4, 3), layout="page_first", io_backend="reference", size=32, registry=registry,
            pin_memory=False,
        )  # fmt: skip


def test_storage_keys_follow_the_kinds_rank_replicated_declaration():
    """A plugin kind that declares rank_replicated shares one copy of each page across TP ranks, as MLA does."""
    from dataclasses import replace

    from hicache_core.storage.keys import namespace_for

    replicated = replace(BLOB_ROWS, name="blob_replicated", rank_replicated=True, detect=None)

    class Both:
        @hookimpl
        def hicache_register_pool_kinds(self, register):
            register(BLOB_ROWS)
            register(replicated)

        @hookimpl
        def hicache_register_layouts(self, register):
            register(BLOB_SHAPE)

    registry = Registry()
    registry.add_plugin(Both(), "both")
    for kind, shared in (("blob_rows", False), ("blob_replicated", True)):
        dev = BlobDevicePool(6, 4, 3)
        dev.pool_kind = kind
        host = hc.make_host_pool(dev, layout="page_first", io_backend="reference", size=32, registry=registry,
                                 pin_memory=False)  # fmt: skip
        ranks = [namespace_for(host, "m", tp_rank=r, tp_size=2) for r in (0, 1)]
        assert (ranks[0] == ranks[1]) is shared, kind
