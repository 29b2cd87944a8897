"""benchmarks/verify_cost.py's matrix: every registered pool kind has a geometry, and its sizes are what it says.

The benchmark runs on the GPU machine only, where a case that cannot be built costs device time; these
checks run its setup on the ``meta`` device (shapes without memory) so a kind added without a geometry,
or a geometry that does not fit its kind, fails here first.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from hicache_core.plugins.registry import get_registry

_PATH = Path(__file__).parents[1] / "benchmarks" / "verify_cost.py"


@pytest.fixture(scope="module")
def vc():
    spec = importlib.util.spec_from_file_location("verify_cost", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["verify_cost"] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["verify_cost"]


def test_all_is_every_registered_kind_in_every_layout_it_allows(vc):
    reg = get_registry()
    cases = vc.matrix_cases("all")
    assert {k for k, _ in cases} == set(reg.pool_kinds)
    assert ("mamba", "page_first") in cases and ("mamba", "layer_first") not in cases  # Mamba: page-first only
    assert ("kv_scale_pages", "page_first") in cases and ("kv_scale_pages", "page_first_direct") not in cases
    assert {lay for k, lay in cases if k == "mha"} == set(reg.layouts)
    assert vc.matrix_cases("mla:page_first,mha:layer_first") == [("mla", "page_first"), ("mha", "layer_first")]


@pytest.mark.parametrize("kind", sorted(get_registry().pool_kinds))
def test_each_kinds_pool_has_the_geometrys_rows_and_moves_the_bytes_listed(vc, kind):
    decl = get_registry().pool_kinds[kind]
    g = vc.geometry(kind)
    assert set(g.rows) == {c.name for c in decl.components}
    for tokens in (4096, 32768):
        items, page = vc.items_and_page(kind, tokens, 64)
        assert items * g.tokens_per_item == tokens and items % page == 0
        dp = vc.DeclaredDevicePool(decl, items + 4 * page, page, g.layers, "meta", dtype=g.dtype, rows=g.rows,
                                   extras=g.extras)  # fmt: skip
        moved = 0
        for comp in decl.components:
            layers = getattr(dp, comp.device_attr)
            assert len(layers) == g.layers
            # A load moves `items` token rows, or items / page page rows, of every layer.
            rows = items // page if decl.items_are_pages else items
            assert layers[0].shape[1:] == g.rows[comp.name]
            assert layers[0].shape[0] >= rows + 1  # room for the rows the load writes, past the padding row
            moved += rows * math.prod(layers[0].shape[1:]) * layers[0].element_size() * g.layers
        assert vc.load_bytes(kind, tokens, 64) == moved
    for name, value in g.extras.items():
        assert getattr(dp, name) == value


def test_mamba_stands_one_item_for_a_request_and_refuses_tokens_short_of_one(vc):
    assert vc.items_and_page("mamba", 4096, 64) == (8, 1)
    with pytest.raises(SystemExit, match="mamba: 256 tokens make 0 items"):
        vc.items_and_page("mamba", 256, 64)
    with pytest.raises(SystemExit, match="no geometry for pool kind 'nope'"):
        vc.geometry("nope")


def test_list_needs_no_gpu(vc, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["verify_cost.py", "--list", "--cases", "all", "--tokens", "4096"])
    vc.main()
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"{2 * len(vc.matrix_cases('all'))} cases")
    assert any(line.split()[:4] == ["4096", "mla", "page_first", "kernel"] for line in out)
