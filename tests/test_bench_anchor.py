"""``hicache bench``'s SGLang anchor: found or skipped with a reason, called with SGLang's arguments, checked.

sgl-kernel runs only on CUDA, so on the CPU the anchor's calls go to a byte-level model of its
``transfer_kv_*`` functions written from SGLang's index math (``transfer.cu``: an item's address
is ``base + layer * layer_dim + slot * item_size`` for layer_first, ``base + slot * layout_dim +
layer * item_size`` for page_first, ``table[layer] + slot * item_size`` through pointer tables).
It checks that hicache passes SGLang's tensors, sizes and strides, and that the byte check before
any timing refuses a wrong call. The H200 run calls the real kernels (benchmarks/sgl_anchor).
"""

from __future__ import annotations

import ctypes
import sys
import types

import pytest
import torch

import hicache_core as hc
from hicache_core.plugins.implementation import BACKUP_ALL, LOAD
from hicache_core.tools.bench.sglang_kernels import FUNCTIONS, AnchorCalls, find_anchor
from hicache_core.tools.shapes import SHAPES


def _copy(src_base: int, dst_base: int, src_idx, dst_idx, item: int, src_at, dst_at) -> None:
    for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
        ctypes.memmove(dst_base + dst_at(d), src_base + src_at(s), item)


def _model(layer_shift: int = 0) -> types.ModuleType:
    """sgl-kernel's functions as byte moves (``layer_shift`` != 0: a wrong kernel, for the refusal test)."""
    m = types.ModuleType("sglang_transfer_model")

    def per_layer(src, dst, si, di, item, *_):
        _copy(src.data_ptr(), dst.data_ptr(), si, di, item, lambda s: s * item, lambda d: d * item)

    def per_layer_pf(src, dst, si, di, layer, item, layout_dim, *_):
        layer += layer_shift
        _copy(src.data_ptr(), dst.data_ptr(), si, di, item, lambda s: s * layout_dim + layer * item, lambda d: d * item)

    def all_tables(src_tbl, dst_tbl, si, di, item, layers):
        for lay in range(layers):
            s, d = int(src_tbl[lay]), int(dst_tbl[lay])
            _copy(s, d, si, di, item, lambda x: x * item, lambda x: x * item)

    def all_lf_pf(src_tbl, dst, si, di, item, layout_dim, layers):
        for lay in range(layers):
            _copy(int(src_tbl[lay]), dst.data_ptr(), si, di, item, lambda x: x * item,
                  lambda x, lay=lay: x * layout_dim + (lay + layer_shift) * item)  # fmt: skip

    m.transfer_kv_per_layer_mla = lambda src, dst, si, di, item, bq, w: per_layer(src, dst, si, di, item)
    m.transfer_kv_per_layer = lambda sk, dk, sv, dv, si, di, item, bq, w: (
        per_layer(sk, dk, si, di, item), per_layer(sv, dv, si, di, item))
    m.transfer_kv_per_layer_mla_pf_lf = lambda src, dst, si, di, layer, item, dim, bq, w: per_layer_pf(
        src, dst, si, di, layer, item, dim)
    m.transfer_kv_per_layer_pf_lf = lambda sk, dk, sv, dv, si, di, layer, item, dim, bq, w: (
        per_layer_pf(sk, dk, si, di, layer, item, dim), per_layer_pf(sv, dv, si, di, layer, item, dim))
    m.transfer_kv_all_layer_mla = lambda st, dt, si, di, item, n, bq, w: all_tables(st, dt, si, di, item, n)
    m.transfer_kv_all_layer = lambda skt, dkt, svt, dvt, si, di, item, n, bq, w: (
        all_tables(skt, dkt, si, di, item, n), all_tables(svt, dvt, si, di, item, n))
    m.transfer_kv_all_layer_mla_lf_pf = lambda st, dst, si, di, item, dim, n, bq, w: all_lf_pf(
        st, dst, si, di, item, dim, n)
    m.transfer_kv_all_layer_lf_pf = lambda skt, dk, svt, dv, si, di, item, dim, n, bq, w: (
        all_lf_pf(skt, dk, si, di, item, dim, n), all_lf_pf(svt, dv, si, di, item, dim, n))
    return m


@pytest.fixture
def model_module(monkeypatch):
    def install(layer_shift: int = 0) -> str:
        monkeypatch.setitem(sys.modules, "sglang_transfer_model", _model(layer_shift))
        return "sglang_transfer_model"

    return install


def _pools(shape: str, layout: str):
    dev = SHAPES[shape].device_pool(256, page_size=16, device="cpu", layers=3)
    host = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=256, operations=())
    return host, dev


def test_missing_module_is_skipped_with_the_import_error():
    anchor = find_anchor("hicache_no_such_anchor_module")
    assert not anchor.available
    assert "hicache_no_such_anchor_module does not import here (ModuleNotFoundError" in anchor.why_not
    assert anchor.describe() == {"module": "hicache_no_such_anchor_module", "status": "skipped",
                                 "why": anchor.why_not}  # fmt: skip


def test_a_module_without_the_functions_is_skipped_naming_them(monkeypatch):
    partial = types.ModuleType("half_anchor")
    partial.transfer_kv_per_layer = lambda *a: None
    monkeypatch.setitem(sys.modules, "half_anchor", partial)
    anchor = find_anchor("half_anchor")
    assert not anchor.available
    assert anchor.why_not.startswith("half_anchor imports but lacks transfer_kv_all_layer, ")
    assert "transfer_kv_per_layer_mla_pf_lf" in anchor.why_not


def test_the_environment_names_the_module(monkeypatch, model_module):
    monkeypatch.setenv("HICACHE_BENCH_ANCHOR", model_module())
    anchor = find_anchor()
    assert anchor.available and anchor.module == "sglang_transfer_model"
    assert anchor.describe()["functions"] == sorted(set(FUNCTIONS.values()))


@pytest.mark.parametrize("shape", ["deepseek-mla", "llama-8b"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("op", [LOAD, BACKUP_ALL])
def test_calls_move_what_sglang_semantics_say(shape, layout, op, model_module):
    host, dev = _pools(shape, layout)
    assert AnchorCalls.supports(host)
    calls = AnchorCalls(find_anchor(model_module()), host, dev)
    h = torch.tensor([48, 5, 200, 17, 100])
    d = torch.tensor([3, 250, 64, 9, 31])
    assert calls.moved_right(op, h, d, layer=1) is None
    assert calls.item_size() == (1152 if shape == "deepseek-mla" else 2048)


@pytest.mark.parametrize("shape", ["deepseek-mla", "llama-8b"])
@pytest.mark.parametrize("op", [LOAD, BACKUP_ALL])
def test_a_wrong_call_is_refused_before_any_timing(shape, op, model_module):
    host, dev = _pools(shape, "page_first")
    calls = AnchorCalls(find_anchor(model_module(layer_shift=1)), host, dev)
    h, d = torch.tensor([48, 5, 200]), torch.tensor([3, 250, 64])
    why = calls.moved_right(op, h, d, layer=1)
    fn = FUNCTIONS[(SHAPES[shape].kind, "page_first", op)]
    assert why is not None and why.startswith(f"{fn}: part 0, layer ")
    assert "differ from the source" in why


def test_pools_sglang_has_no_kernel_for_are_not_anchored():
    dev = SHAPES["llama-8b"].device_pool(256, page_size=16, device="cpu", layers=2)
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="reference", size=256, operations=())
    assert not AnchorCalls.supports(host)
