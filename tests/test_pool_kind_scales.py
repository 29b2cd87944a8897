"""Scale-carrying KV pool kinds, checked against SGLang 0.5.23's host shapes with the layout oracles.

- ``nvfp4_page_rows``: ``MiniMaxM3Nvfp4MainKVPoolHost`` / ``MiniMaxM3Nvfp4IndexKPoolHost``
  (``pool_host/minimax_m3_nvfp4.py``) keep one ``row_bytes`` row per (layer, page), the NVFP4
  payload and its block scales inside the row: ``layer_first`` ``(layers, pages, row)``,
  ``page_first`` and ``page_first_direct`` both ``(pages, layers, 1, row)``. A flat page is the
  page's rows, layer by layer.
- ``kv_scale_pages``: ``MHATokenToKVPoolMXFP8Host`` (``pool_host/mha_mxfp8.py``) keeps, beside the
  page_first FP8 payload, ``k_scale_host`` and ``v_scale_host`` of ``(pages, layers, sf_page_bytes)``;
  it allows no other layout.
"""

from __future__ import annotations

import os

import pytest
import torch

import hicache_core as hc
from hicache_core.declared.layout_oracles import SGLANG_ORACLES

LAYERS, PAGE, DEVICE_PAGES, HOST_PAGES = 3, 4, 7, 9


class Nvfp4Rows:
    """SGLang's PageRowBufferInfo: ``rows[l]`` is ``slab[l]``, ``(pages, row_bytes)`` uint8."""

    def __init__(self, row_bytes: int = 96) -> None:
        gen = torch.Generator().manual_seed(5)
        self.slab = torch.randint(0, 256, (LAYERS, DEVICE_PAGES, row_bytes), dtype=torch.uint8, generator=gen)
        self.rows = list(self.slab.unbind(0))
        self.page_size, self.size = PAGE, DEVICE_PAGES * PAGE


class Mxfp8Scales:
    """The MXFP8 device scales as SGLang's host pool reads them: per layer ``(pages, sf_page_bytes)`` rows."""

    def __init__(self, k_bytes: int = 64, v_bytes: int = 32) -> None:
        gen = torch.Generator().manual_seed(6)
        self.k_scale_device_rows = [torch.randint(0, 256, (DEVICE_PAGES, k_bytes), dtype=torch.uint8, generator=gen)
                                    for _ in range(LAYERS)]  # fmt: skip
        self.v_scale_device_rows = [torch.randint(0, 256, (DEVICE_PAGES, v_bytes), dtype=torch.uint8, generator=gen)
                                    for _ in range(LAYERS)]  # fmt: skip
        self.page_size, self.size = PAGE, DEVICE_PAGES * PAGE


def backends() -> list[str]:
    out = ["reference", "direct"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("kernel")  # the kernel plugin's Triton kernels, interpreted on CPU pools
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(PAGE) + PAGE * p for p in pages])


HOST, DEV = [1, 4, 8], [0, 2, 6]


#: SGLang's host shapes, written from its constructors (not from the declarations).
NVFP4_SHAPES = {"layer_first": (LAYERS, HOST_PAGES, 96), "page_first": (HOST_PAGES, LAYERS, 1, 96),
                "page_first_direct": (HOST_PAGES, LAYERS, 1, 96)}  # fmt: skip
#: ``_host_layer_pages``: the ``(pages, row)`` rows of one layer.
NVFP4_ROWS = {"layer_first": lambda buf, layer: buf[layer], "page_first": lambda buf, layer: buf[:, layer, 0],
              "page_first_direct": lambda buf, layer: buf[:, layer, 0]}  # fmt: skip


@pytest.mark.parametrize("io_backend", backends())
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_nvfp4_rows_are_sglangs(layout, io_backend):
    dev = Nvfp4Rows()
    host = hc.make_host_pool(dev, layout=layout, io_backend=io_backend, page_size=PAGE, size=HOST_PAGES * PAGE)
    assert host.geometry.kind == "nvfp4_page_rows"
    assert tuple(host.kv_buffer.shape) == NVFP4_SHAPES[layout]
    host.backup_from_device_all_layer(dev, slots(HOST), slots(DEV), io_backend)
    for layer in range(LAYERS):
        for h, d in zip(HOST, DEV):
            assert torch.equal(NVFP4_ROWS[layout](host.kv_buffer, layer)[h], dev.rows[layer][d])
            assert torch.equal(SGLANG_ORACLES[layout](host, "row", layer, h).reshape(-1), dev.rows[layer][d])
    want = dev.slab.clone()
    dev.slab.zero_()
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, slots(HOST), slots(DEV), layer, io_backend)
    assert torch.equal(dev.slab[:, DEV], want[:, DEV]) and not dev.slab[:, [1, 3, 4, 5]].any()
    # get_data_page: the page's rows layer by layer (kv_buffer[:, page] / kv_buffer[page, :, 0], flattened)
    page = host.get_data_page(4 * PAGE)
    assert torch.equal(page, torch.cat([want[layer, 2] for layer in range(LAYERS)]))


@pytest.mark.parametrize("io_backend", backends())
def test_mxfp8_scale_pages_are_sglangs(io_backend):
    dev = Mxfp8Scales()
    host = hc.make_host_pool(dev, layout="page_first", io_backend=io_backend, page_size=PAGE, size=HOST_PAGES * PAGE)
    assert host.geometry.kind == "kv_scale_pages"
    # _init_scale_buffers: (page_num, layer_num, sf_page_bytes) for K and for V
    assert tuple(host.k_scale_host.shape) == (HOST_PAGES, LAYERS, 64)
    assert tuple(host.v_scale_host.shape) == (HOST_PAGES, LAYERS, 32)
    host.backup_from_device_all_layer(dev, slots(HOST), slots(DEV), io_backend)
    for layer in range(LAYERS):
        for h, d in zip(HOST, DEV):
            assert torch.equal(host.k_scale_host[h, layer], dev.k_scale_device_rows[layer][d])
            assert torch.equal(host.v_scale_host[h, layer], dev.v_scale_device_rows[layer][d])
            for part, rows in (("k_scale", dev.k_scale_device_rows), ("v_scale", dev.v_scale_device_rows)):
                assert torch.equal(SGLANG_ORACLES["page_first"](host, part, layer, h).reshape(-1), rows[layer][d])
    want = [t.clone() for t in dev.k_scale_device_rows + dev.v_scale_device_rows]
    for t in dev.k_scale_device_rows + dev.v_scale_device_rows:
        t.zero_()
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, slots(HOST), slots(DEV), layer, io_backend)
    for t, w in zip(dev.k_scale_device_rows + dev.v_scale_device_rows, want):
        assert torch.equal(t[DEV], w[DEV]) and not t[[1, 3, 4, 5]].any()


def test_mxfp8_scales_allow_only_sglangs_layout():
    with pytest.raises(hc.UnsupportedCombinationError, match="pool kind 'kv_scale_pages' allows only the layouts "
                                                             "page_first"):  # fmt: skip
        hc.make_host_pool(Mxfp8Scales(), layout="page_first_direct", io_backend="direct", page_size=PAGE,
                          size=HOST_PAGES * PAGE)  # fmt: skip


def test_nvfp4_rows_need_whole_pages():
    dev = Nvfp4Rows()
    host = hc.make_host_pool(dev, layout="page_first", io_backend="reference", page_size=PAGE,
                             size=HOST_PAGES * PAGE)  # fmt: skip
    before = host.kv_buffer.clone()
    with pytest.raises(ValueError):
        host.backup_from_device_all_layer(dev, slots([1])[:3], slots([0])[:3], "reference")
    assert torch.equal(host.kv_buffer, before)
