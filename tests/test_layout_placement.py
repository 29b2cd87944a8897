"""After a backup, each token sits where SGLang's layout puts it (shapes from the reference, section 3).

These tests index the host buffers with SGLang's shapes directly, independently of the
strides the core derives, so a wrong layout declaration cannot hide behind a round trip.
"""

from __future__ import annotations

import pytest
import torch
from core_helpers import device_pool, device_tensors, fill_random, random_page_slots, same_bytes

import hicache_core as hc

P_SIZE = 4
HOST_PAGES = 6
L = 3


def _backed_up(kind: str, layout: str, io_backend: str, registry, sharded: bool = False):
    dev = device_pool(kind, P_SIZE, pages=6, sharded=sharded)
    host = hc.make_host_pool(dev, layout=layout, io_backend=io_backend, size=HOST_PAGES * P_SIZE, registry=registry)
    fill_random(device_tensors(dev), seed=11)
    for t in host.plan.host_buffers.values():
        t.zero_()
    h = random_page_slots(HOST_PAGES, 3, P_SIZE, seed=12)
    d = random_page_slots(6, 3, P_SIZE, seed=13, first=1)
    host.backup_from_device_all_layer(dev, h, d, io_backend)
    return dev, host, h.tolist(), d.tolist()


def _backends(registry, kind, layout):
    """The reference always; direct where it claims the layout."""
    out = ["reference"]
    if layout in ("layer_first", "page_first_direct") or (kind, layout) in {("mla", "page_first_kv_split")}:
        out.append("direct")
    if kind == "page_rows" and layout == "page_first":
        out.append("direct")
    return out


MHA_SHAPES = {
    "layer_first": lambda S, P: (2, L, S, 2, 8),
    "page_first": lambda S, P: (2, S, L, 2, 8),
    "page_first_direct": lambda S, P: (2, P, L, P_SIZE, 2, 8),
    "page_head": lambda S, P: (2, P, 2, P_SIZE, L, 8),
}
MHA_TOKEN = {
    "layer_first": lambda buf, c, layer, s: buf[c, layer, s],
    "page_first": lambda buf, c, layer, s: buf[c, s, layer],
    "page_first_direct": lambda buf, c, layer, s: buf[c, s // P_SIZE, layer, s % P_SIZE],
    "page_head": lambda buf, c, layer, s: buf[c, s // P_SIZE, :, s % P_SIZE, layer],
}


@pytest.mark.parametrize("layout", list(MHA_SHAPES))
def test_mha(layout, direct_only):
    for backend in _backends(direct_only, "mha", layout):
        dev, host, hs, ds = _backed_up("mha", layout, backend, direct_only)
        S = HOST_PAGES * P_SIZE
        assert tuple(host.kv_buffer.shape) == MHA_SHAPES[layout](S, HOST_PAGES)
        assert host.k_buffer.data_ptr() == host.kv_buffer[0].data_ptr()
        for layer in range(L):
            for s, d in zip(hs, ds):
                assert same_bytes(MHA_TOKEN[layout](host.kv_buffer, 0, layer, s), dev.k_buffer[layer][d]), backend
                assert same_bytes(MHA_TOKEN[layout](host.kv_buffer, 1, layer, s), dev.v_buffer[layer][d]), backend


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first", "page_head"])
def test_mha_asym(layout, direct_only):
    shapes = {
        "page_first": lambda D: (HOST_PAGES * P_SIZE, L, 2, D),
        "page_first_direct": lambda D: (HOST_PAGES, L, P_SIZE, 2, D),
        "layer_first": lambda D: (L, HOST_PAGES * P_SIZE, 2, D),
        "page_head": lambda D: (HOST_PAGES, 2, P_SIZE, L, D),
    }
    for backend in _backends(direct_only, "mha_asym", layout):
        dev, host, hs, ds = _backed_up("mha_asym", layout, backend, direct_only)
        assert host.kv_buffer is None
        assert tuple(host.k_buffer.shape) == shapes[layout](8)
        assert tuple(host.v_buffer.shape) == shapes[layout](4)
        for layer in range(L):
            for s, d in zip(hs, ds):
                for buf, dbuf in ((host.k_buffer, dev.k_buffer), (host.v_buffer, dev.v_buffer)):
                    got = MHA_TOKEN[layout](buf.unsqueeze(0), 0, layer, s)
                    assert same_bytes(got, dbuf[layer][d]), (backend, layout)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split"])
def test_mla(layout, direct_only):
    S = HOST_PAGES * P_SIZE
    for backend in _backends(direct_only, "mla", layout):
        dev, host, hs, ds = _backed_up("mla", layout, backend, direct_only)
        for layer in range(L):
            for s, d in zip(hs, ds):
                row = dev.kv_buffer[layer][d]  # (1, 24)
                if layout == "layer_first":
                    assert tuple(host.kv_buffer.shape) == (L, S, 1, 24)
                    assert same_bytes(host.kv_buffer[layer, s], row)
                elif layout == "page_first":
                    assert tuple(host.kv_buffer.shape) == (S, L, 1, 24)
                    assert same_bytes(host.kv_buffer[s, layer], row)
                elif layout == "page_first_direct":
                    assert tuple(host.kv_buffer.shape) == (HOST_PAGES, L, P_SIZE, 1, 24)
                    assert same_bytes(host.kv_buffer[s // P_SIZE, layer, s % P_SIZE], row)
                else:
                    assert tuple(host.k_buffer.shape) == (HOST_PAGES, L, P_SIZE, 1, 16)
                    assert tuple(host.v_buffer.shape) == (HOST_PAGES, L, P_SIZE, 1, 8)
                    assert host.kv_buffer is host.k_buffer
                    assert same_bytes(host.k_buffer[s // P_SIZE, layer, s % P_SIZE], row[:, :16].contiguous())
                    assert same_bytes(host.v_buffer[s // P_SIZE, layer, s % P_SIZE], row[:, 16:].contiguous())


#: SGLang's page-item host pools: DSAIndexerPoolHost keeps one 4-D shape for page_first and page_first_direct;
#: DeepSeekV4PagedHostPool / DeepSeekV4StateHostPool keep page_first 3-D. (pool kind, host attribute, shapes)
PAGE_ITEM_SHAPES = {
    "page_rows": ("index_k_with_scale_buffer", {
        "layer_first": (L, HOST_PAGES, 24), "page_first": (HOST_PAGES, L, 1, 24),
        "page_first_direct": (HOST_PAGES, L, 1, 24)}),
    "dsv4_paged": ("kv_buffer", {
        "layer_first": (L, HOST_PAGES, 40), "page_first": (HOST_PAGES, L, 40),
        "page_first_direct": (HOST_PAGES, L, 1, 40)}),
    "dsv4_state": ("kv_buffer", {
        "layer_first": (L, HOST_PAGES, 48), "page_first": (HOST_PAGES, L, 48),
        "page_first_direct": (HOST_PAGES, L, 1, 48)}),
}  # fmt: skip
PAGE_ITEM_ROW = {
    "layer_first": lambda buf, layer, page: buf[layer, page],
    "page_first": lambda buf, layer, page: buf[page, layer],
    "page_first_direct": lambda buf, layer, page: buf[page, layer, 0],
}


@pytest.mark.parametrize("kind", list(PAGE_ITEM_SHAPES))
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_page_items(kind, layout, direct_only):
    attr, shapes = PAGE_ITEM_SHAPES[kind]
    device_attr = {"page_rows": "index_k_with_scale_buffer", "dsv4_paged": "device_buffers",
                   "dsv4_state": "device_page_views"}[kind]  # fmt: skip
    for backend in ("reference", "direct") if layout != "page_first" else ("reference",):
        dev, host, hs, ds = _backed_up(kind, layout, backend, direct_only)
        assert tuple(getattr(host, attr).shape) == shapes[layout]
        for layer in range(L):
            for s, d in zip(hs[::P_SIZE], ds[::P_SIZE]):
                row = getattr(dev, device_attr)[layer][d // P_SIZE]
                assert same_bytes(PAGE_ITEM_ROW[layout](getattr(host, attr), layer, s // P_SIZE), row), (backend, kind)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mha_k_only(layout, direct_only):
    """MiniMax's index-K pool: one k_buffer, SGLang's MHATokenToKOnlyPoolHost shapes."""
    shapes = {"layer_first": (L, HOST_PAGES * P_SIZE, 2, 8), "page_first": (HOST_PAGES * P_SIZE, L, 2, 8),
              "page_first_direct": (HOST_PAGES, L, P_SIZE, 2, 8)}  # fmt: skip
    for backend in _backends(direct_only, "mha", layout):
        dev, host, hs, ds = _backed_up("mha_k_only", layout, backend, direct_only)
        assert host.kv_buffer is None and host.v_buffer is None
        assert tuple(host.k_buffer.shape) == shapes[layout]
        for layer in range(L):
            for s, d in zip(hs, ds):
                assert same_bytes(MHA_TOKEN[layout](host.k_buffer.unsqueeze(0), 0, layer, s), dev.k_buffer[layer][d])


def test_sharded_host_holds_only_owned_layers(direct_only):
    dev, host, hs, ds = _backed_up("mla", "layer_first", "direct", direct_only, sharded=True)
    assert host.layer_num == 2 and tuple(host.kv_buffer.shape)[0] == 2
    for host_layer, device_layer in ((0, 0), (1, 1)):  # model layers 1 and 2
        for s, d in zip(hs, ds):
            assert same_bytes(host.kv_buffer[host_layer, s], dev.kv_buffer[device_layer][d])


def test_unknown_pages_untouched(direct_only):
    dev, host, hs, ds = _backed_up("mha", "page_first_direct", "direct", direct_only)
    touched = {s // P_SIZE for s in hs}
    for page in set(range(HOST_PAGES)) - touched:
        assert not host.kv_buffer[:, page].view(torch.uint8).any()


#: Kinds of one part with nothing to split, and SGLang's page_first shape of each (for page_rows: the DSA
#: indexer's ``(pages, L, 1, stride)``; mha_k_only: MHATokenToKOnlyPoolHost's ``(S, L, H, D)``).
ONE_PART = {
    "page_rows": ("index_k_with_scale_buffer", (HOST_PAGES, L, 1, 24)),
    "dsv4_paged": ("kv_buffer", (HOST_PAGES, L, 40)),
    "dsv4_state": ("kv_buffer", (HOST_PAGES, L, 48)),
    "mha_k_only": ("k_buffer", (HOST_PAGES * P_SIZE, L, 2, 8)),
}


@pytest.mark.parametrize("kind", list(ONE_PART))
def test_a_one_part_kind_in_page_first_kv_split_is_stored_as_page_first(kind, direct_only):
    """Seed 001 beside the DSA indexer: a pool with one part has nothing to split (SGLang raises mid-construction)."""
    attr, shape = ONE_PART[kind]
    dev, host, hs, ds = _backed_up(kind, "page_first_kv_split", "reference", direct_only)
    assert host.layout == "page_first" and not host.spec.layout.split
    buf = getattr(host, attr)
    assert tuple(buf.shape) == shape
    for layer in range(L):
        if kind == "mha_k_only":
            for s, d in zip(hs, ds):
                assert same_bytes(buf[s, layer], dev.k_buffer[layer][d])
            continue
        device_attr = {"page_rows": "index_k_with_scale_buffer", "dsv4_paged": "device_buffers",
                       "dsv4_state": "device_page_views"}[kind]  # fmt: skip
        for s, d in zip(hs[::P_SIZE], ds[::P_SIZE]):
            assert same_bytes(buf[s // P_SIZE, layer], getattr(dev, device_attr)[layer][d // P_SIZE])


def test_page_first_kv_split_still_splits_mla_and_refuses_mha(direct_only):
    mla = hc.make_host_pool(device_pool("mla"), layout="page_first_kv_split", io_backend="reference",
                            registry=direct_only)  # fmt: skip
    assert mla.layout == "page_first_kv_split" and mla.kv_buffer is mla.k_buffer
    with pytest.raises(hc.UnsupportedCombinationError, match="pool kind 'mha' declares no attribute to split"):
        hc.make_host_pool(device_pool("mha"), layout="page_first_kv_split", io_backend="reference",
                          registry=direct_only)  # fmt: skip


def test_unsplit_as_is_only_for_a_split_layout():
    page_first = hc.get_registry().layouts["page_first"]
    with pytest.raises(ValueError, match="unsplit_as must be a layout that does not split"):
        hc.Layout("mine", page_first.axes, unsplit_as=page_first)
