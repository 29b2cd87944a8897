"""Every launch variant is byte-exact; the knobs (variant, max_ctas, tile, warps, hints) behave as documented.

The conformance kit runs the default variant on tiny pools, where one tile holds a whole call.
Here tiles are shrunk so every CTA loops over several tiles (and the pipelined variants
prefetch past the end), on shapes that exercise each kernel path: two parts per launch, a
tail block, non-uniform page strides, narrow words, items too wide for the row kernel.
"""

from __future__ import annotations

import pytest
import torch
from hicache_jit import DEFAULT_VARIANT, VARIANTS, one_layer
from jit_helpers import check_against_reference, pages, small_pool

import hicache_core as hc
from hicache_core.testing.guarded import record_grids

SHAPES = [
    ("mha", "page_first"),  # two parts, uniform token stride
    ("mha_asym", "page_first_direct"),  # two parts of different sizes, page + token strides
    ("mla", "page_first_kv_split"),  # two halves of one device row
    ("mla_odd", "layer_first"),  # 36-byte items: 4-byte words, a tail block
    ("page_rows", "page_first"),  # page rows (items are pages)
    ("wide_rows", "layer_first"),  # 16400-byte rows: the flat kernel
]


def _host(kind: str, layout: str, device: str, **pool_kw):
    dev = small_pool(kind, device, **pool_kw)
    host = hc.make_host_pool(dev, layout=layout, io_backend="kernel", operations=[hc.LOAD, hc.BACKUP_LAYER],
                             implementation="jit.one_layer", size=36)  # fmt: skip
    return host, host.implementation_for(hc.LOAD)


def _indices(host, dtype=torch.int64):
    if host.geometry.items_are_pages:
        return torch.tensor([7, 0, 3, 5, 1], dtype=dtype), torch.tensor([2, 8, 4, 0, 6], dtype=dtype)
    p = host.page_size
    return pages([7, 0, 3, 5, 1], p).to(dtype), pages([2, 8, 4, 0, 6], p).to(dtype)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kind, layout", SHAPES, ids=[f"{k}-{lay}" for k, lay in SHAPES])
def test_variants_are_byte_exact_over_many_tiles(variant, kind, layout, jit_device):
    host, impl = _host(kind, layout, jit_device)
    impl.variant = variant
    impl.tile_bytes = 1  # one item per tile
    impl.max_ctas = 3
    h, d = _indices(host)
    check_against_reference(host, impl, hc.LOAD, h, d, layer=1)
    check_against_reference(host, impl, hc.BACKUP_LAYER, h, d, layer=2)


def test_int32_and_strided_indices(jit_device):
    host, impl = _host("mha_asym", "page_first_direct", jit_device)
    impl.tile_bytes = 256
    h, d = _indices(host, torch.int32)
    check_against_reference(host, impl, hc.LOAD, h, d, layer=0)
    wide_h = torch.stack([h, h]).t().reshape(-1)[::2]  # a view with stride 2
    wide_d = torch.stack([d, -d]).t().reshape(-1)[::2]
    assert wide_h.stride(0) == 2 and torch.equal(wide_h, h)
    check_against_reference(host, impl, hc.BACKUP_LAYER, wide_h, wide_d, layer=1)


def test_hints_and_warps_keep_the_bytes(jit_device):
    host, impl = _host("mla", "page_first", jit_device)
    h, d = _indices(host)
    for hints in one_layer.HINTS.values():
        impl.hints = hints
        impl.num_warps = 2
        check_against_reference(host, impl, hc.LOAD, h, d, layer=2)


def test_launch_config_names_the_kernel_and_tile(jit_device):
    _, impl = _host("mla", "page_first", jit_device)
    impl.variant = "rows"
    (cfg,) = impl.launch_config()
    assert cfg["kernel"] == "rows" and cfg["word_bytes"] == 16
    assert cfg["constexprs"]["A_MAIN"] + cfg["constexprs"]["A_TAIL"] == 3  # 48-byte rows: 2 + 1 words
    assert cfg["rows_per_tile"] & (cfg["rows_per_tile"] - 1) == 0
    impl.variant = "flat"
    assert impl.launch_config()[0]["kernel"] == "flat"
    _, wide = _host("wide_rows", "layer_first", jit_device)
    assert wide.launch_config()[0]["kernel"] == "flat"  # rows of 1025 words: too wide for the row kernel


def test_uniform_strides_fold(jit_device):
    """page_first and layer_first address rows with one stride; page_first_direct keeps page and token strides."""
    for layout, folded in (("page_first", True), ("layer_first", True), ("page_first_direct", False)):
        _, impl = _host("mha", layout, jit_device)
        tpp = impl.launch_config()[0]["constexprs"]["TPP"]
        assert (tpp == 1) is folded, (layout, tpp)


def test_grid_is_tiles_capped_by_max_ctas(jit_device, monkeypatch):
    host, impl = _host("mha", "page_first", jit_device)
    impl.variant = "rows"
    impl.tile_bytes = 4 * 64  # 4 items of 64 bytes (K + V) per tile
    seen = record_grids(impl, monkeypatch)
    idx = torch.arange(32, device=jit_device)  # the implementation is called directly: indices where it wants them
    for budget in (5, 0, None, 1000):
        impl.max_ctas = budget
        impl.load_to_device_per_layer(idx, idx, 0)
    impl.max_ctas = 2
    impl.load_to_device_per_layer(idx[:3], idx[:3], 0)
    sms = impl._sm_count  # "unlimited" is the SM count (4 programs on the CPU)
    assert seen == [5, min(8, sms), min(8, sms), 8, 1]  # 8 tiles


def test_knob_defaults_environment_and_validation(jit_device, monkeypatch):
    for name in (one_layer.ENV_MAX_CTAS, one_layer.ENV_VARIANT, one_layer.ENV_NUM_WARPS, one_layer.ENV_TILE_BYTES,
                 one_layer.ENV_HINTS, one_layer.ENV_PREFETCH, one_layer.ENV_STAGES):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    _, impl = _host("mla", "page_first", jit_device)
    preset = VARIANTS[DEFAULT_VARIANT]
    assert impl.max_ctas == 8 and impl.variant == DEFAULT_VARIANT
    assert (impl.tile_bytes, impl.num_warps, impl.hints, impl.prefetch, impl.stages) == (
        preset.tile_bytes, preset.num_warps, preset.hints, preset.prefetch, preset.stages,
    )  # fmt: skip

    monkeypatch.setenv(one_layer.ENV_MAX_CTAS, "3")
    monkeypatch.setenv(one_layer.ENV_VARIANT, "flat")
    monkeypatch.setenv(one_layer.ENV_NUM_WARPS, "4")
    monkeypatch.setenv(one_layer.ENV_HINTS, "evict_first")
    monkeypatch.setenv(one_layer.ENV_PREFETCH, "indices")
    monkeypatch.setenv(one_layer.ENV_STAGES, "3")
    _, impl = _host("mla", "page_first", jit_device)
    knobs = (impl.max_ctas, impl.variant, impl.num_warps, impl.hints, impl.prefetch, impl.stages)
    assert knobs == (3, "flat", 4, 2, 1, 3)
    for name in (one_layer.ENV_PREFETCH, one_layer.ENV_STAGES):
        monkeypatch.delenv(name)
    monkeypatch.setenv(one_layer.ENV_MAX_CTAS, "0")
    assert _host("mla", "page_first", jit_device)[1].max_ctas == 0

    monkeypatch.setenv(one_layer.ENV_MAX_CTAS, "few")
    with pytest.raises(ValueError, match=one_layer.ENV_MAX_CTAS):
        _host("mla", "page_first", jit_device)
    monkeypatch.delenv(one_layer.ENV_MAX_CTAS)
    monkeypatch.setenv(one_layer.ENV_VARIANT, "nope")
    with pytest.raises(ValueError, match="unknown variant"):
        _host("mla", "page_first", jit_device)
    monkeypatch.delenv(one_layer.ENV_VARIANT)

    for bad in (-1, 2.5, "4", True):
        with pytest.raises(ValueError, match="max_ctas"):
            impl.max_ctas = bad
    for bad in (3, 64, 0, True):  # 64 warps would be 2048 threads: more than a CUDA block may have
        with pytest.raises(ValueError, match="num_warps"):
            impl.num_warps = bad
    for bad in (1, -1, 17, 2.0):
        with pytest.raises(ValueError, match="stages"):
            impl.stages = bad
    with pytest.raises(ValueError, match="prefetch"):
        impl.prefetch = 3
    with pytest.raises(ValueError, match="fast_launch"):
        impl.fast_launch = 3
    with pytest.raises(ValueError, match="hints"):
        impl.hints = 7
    with pytest.raises(ValueError, match="tile_bytes"):
        impl.tile_bytes = 0
    with pytest.raises(ValueError, match="unknown variant"):
        impl.variant = "fastest"
    assert "jit.one_layer" in repr(impl)
