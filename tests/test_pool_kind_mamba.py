"""The ``mamba`` pool kind: SGLang's MambaPoolHost shapes, checked with an oracle written from them.

SGLang 0.5.23 (``pool_host/mamba.py``) keeps, per request slot (page size 1), a temporal (SSM)
state and a conv state per mamba layer, host buffers ``(slots, layers, 1, *state)`` for both
``page_first`` and ``page_first_direct``; no other layout. A flat page is the slot's temporal
bytes (all layers), then its conv bytes.
"""

from __future__ import annotations

import pytest
import torch

import hicache_core as hc
from hicache_core.declared.layout_oracles import SGLANG_ORACLES

LAYERS, SLOTS, HOST_SLOTS = 3, 9, 20


class MambaDevice:
    """Per layer: temporal (slots, 4, 8) float32 and conv (slots, 6, 3) bfloat16 states, as bytes rows."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.temporal_layers = [torch.randint(0, 256, (SLOTS, 128), dtype=torch.uint8, generator=gen)
                                for _ in range(LAYERS)]  # fmt: skip
        self.conv_layers = [torch.randint(0, 256, (SLOTS, 36), dtype=torch.uint8, generator=gen)
                            for _ in range(LAYERS)]  # fmt: skip
        self.page_size, self.size = 1, SLOTS


def backends() -> list[str]:
    return ["reference", "direct"]


@pytest.mark.parametrize("io_backend", backends())
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_host_shapes_and_bytes_are_sglangs(layout, io_backend):
    dev = MambaDevice()
    host = hc.make_host_pool(dev, layout=layout, io_backend=io_backend, size=HOST_SLOTS)
    assert host.geometry.kind == "mamba" and host.page_size == 1
    # MambaPoolHost: (size, num_mamba_layers, 1, *state) for both page-first layouts
    assert tuple(host.temporal_buffer.shape) == (HOST_SLOTS, LAYERS, 1, 128)
    assert tuple(host.conv_buffer.shape) == (HOST_SLOTS, LAYERS, 1, 36)
    hs, ds = torch.tensor([3, 7, 11, 19]), torch.tensor([1, 2, 5, 8])
    host.backup_from_device_all_layer(dev, hs, ds, io_backend)
    for layer in range(LAYERS):
        for h, d in zip(hs.tolist(), ds.tolist()):
            assert torch.equal(host.temporal_buffer[h, layer, 0], dev.temporal_layers[layer][d])
            assert torch.equal(host.conv_buffer[h, layer, 0], dev.conv_layers[layer][d])
            assert torch.equal(SGLANG_ORACLES[layout](host, "temporal", layer, h).reshape(-1),
                               dev.temporal_layers[layer][d])  # fmt: skip
    for t in dev.temporal_layers + dev.conv_layers:
        t.zero_()
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, hs, ds, layer, io_backend)
        for h, d in zip(hs.tolist(), ds.tolist()):
            assert torch.equal(dev.temporal_layers[layer][d], host.temporal_buffer[h, layer, 0])
            assert torch.equal(dev.conv_layers[layer][d], host.conv_buffer[h, layer, 0])
    # _iter_page_tensors: temporal_buffer[slot] then conv_buffer[slot]
    page = host.get_data_page(7)
    assert torch.equal(page, torch.cat([host.temporal_buffer[7].flatten(), host.conv_buffer[7].flatten()]))
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor([3, 7]))
    assert sizes == [LAYERS * 128, LAYERS * 36] * 2
    assert ptrs[0] == host.temporal_buffer[3].data_ptr() and ptrs[3] == host.conv_buffer[7].data_ptr()


def test_only_sglangs_layouts():
    with pytest.raises(hc.UnsupportedCombinationError, match="pool kind 'mamba' allows only the layouts "
                                                             "page_first, page_first_direct"):  # fmt: skip
        hc.make_host_pool(MambaDevice(), layout="layer_first", io_backend="direct", size=HOST_SLOTS)
