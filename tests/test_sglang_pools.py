"""A server passes its own device pools: objects with SGLang's attribute names are read as they are."""

from __future__ import annotations

import torch
from core_helpers import fill_random, random_page_slots, same_bytes

import hicache_core as hc


class SGLangStyleMHAPool:
    """What SGLang's MHATokenToKVPool exposes: local layer_num, end_layer inclusive, per-layer buffers."""

    def __init__(self, size, page_size, heads, dim, layer_num, start_layer=None, end_layer=None):
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.start_layer = start_layer or 0
        self.end_layer = end_layer or layer_num - 1
        self.dtype = torch.bfloat16
        self.k_buffer = [torch.zeros(size + page_size, heads, dim, dtype=self.dtype) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size + page_size, heads, dim, dtype=self.dtype) for _ in range(layer_num)]


def test_single_rank_pool(direct_only):
    dev = SGLangStyleMHAPool(32, 4, 2, 8, layer_num=4)
    geometry = hc.geometry_of(dev)
    assert (geometry.start_layer, geometry.end_layer, geometry.layer_num, geometry.sharded) == (0, 4, 4, False)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=32, registry=direct_only)
    fill_random(dev.k_buffer + dev.v_buffer, seed=1)
    h, d = random_page_slots(4, 2, 4, seed=2), random_page_slots(8, 2, 4, seed=3, first=1)
    host.backup_from_device_all_layer(dev, h, d, "direct")
    assert same_bytes(host.kv_buffer[1, 3, h], dev.v_buffer[3][d])


def test_pipeline_rank_owning_layers_20_to_23(direct_only):
    dev = SGLangStyleMHAPool(32, 4, 2, 8, layer_num=4, start_layer=20, end_layer=23)
    geometry = hc.geometry_of(dev)
    assert (geometry.start_layer, geometry.end_layer, geometry.owned_layers) == (20, 24, 4)
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="direct", size=32, registry=direct_only)
    fill_random(dev.k_buffer, seed=1)
    h, d = random_page_slots(4, 2, 4, seed=2), random_page_slots(8, 2, 4, seed=3, first=1)
    host.backup_from_device_per_layer(dev, h, d, 22, "direct")  # global layer id 22 is local layer 2
    for s, slot in zip(h.tolist(), d.tolist()):
        assert same_bytes(host.kv_buffer[0, s // 4, 2, s % 4], dev.k_buffer[2][slot])
