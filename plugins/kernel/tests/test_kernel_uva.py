"""hicache_core.gpu.uva: word size, pieces, element strides and the per-layer offset table (pure torch)."""

from __future__ import annotations

import pytest
import torch

import hicache_core as hc
from hicache_core.gpu import uva


def test_widest_word():
    assert uva.widest_word([16, 32, 1152, 0]) == 16
    assert uva.widest_word([16, 8]) == 8
    assert uva.widest_word([656, 64]) == 16
    assert uva.widest_word([6, 12]) == 2
    assert uva.widest_word([13]) == 1
    assert uva.widest_word([]) == 16
    assert uva.widest_word([64], limit=4) == 4


def test_word_element():
    assert uva.word_element(16) == (torch.int64, 2)
    assert uva.word_element(8) == (torch.int64, 1)
    assert uva.word_element(4) == (torch.int32, 1)
    assert uva.word_element(2) == (torch.int16, 1)
    assert uva.word_element(1) == (torch.int8, 1)
    with pytest.raises(ValueError):
        uva.word_element(32)


def _plan(layout: str, *, drafts=(), dtype=torch.bfloat16, head_dim=8):
    dev = hc.MHADevicePool(12, 4, dtype, 2, head_dim, 3, "cpu", start_layer=1)
    host = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=16, draft_pools=list(drafts))
    return host.plan


def test_pieces_merge_heads_only_where_contiguous_on_both_sides():
    part = _plan("layer_first").parts[0]
    assert uva.pieces_of(part) == uva.Pieces(1, 32, 32, 32)
    assert uva.pieces_of(part, merge_heads=False) == uva.Pieces(2, 16, 16, 16)
    part = _plan("page_head").parts[0]
    assert uva.pieces_of(part).heads == 2 and uva.pieces_of(part).piece_bytes == 16


def test_plan_word_bytes_sees_sizes_and_addresses():
    assert uva.plan_word_bytes(_plan("page_first")) == 16
    # 2 heads x 3 fp16: 12-byte items merge their heads; page_head keeps 6-byte pieces apart
    assert uva.plan_word_bytes(_plan("page_first", dtype=torch.float16, head_dim=3)) == 4
    assert uva.plan_word_bytes(_plan("page_head", dtype=torch.float16, head_dim=3)) == 2
    assert uva.plan_word_bytes(_plan("page_first", dtype=torch.float16, head_dim=3), merge_heads=False) == 2
    odd_anchor = torch.zeros(16, dtype=torch.uint8)[1:]
    assert uva.plan_word_bytes(_plan("page_first"), anchor=odd_anchor) == 1


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_uva_part_strides_are_byte_strides_in_elements(layout):
    plan = _plan(layout)
    word = uva.plan_word_bytes(plan)
    for part in plan.parts:
        p = uva.uva_part(part, word)
        elem = word // p.elems_per_word
        pieces = uva.pieces_of(part)
        assert p.piece_words * word == pieces.piece_bytes
        assert p.heads == pieces.heads
        assert p.host_page_stride * elem == part.page_stride
        assert p.host_token_stride * elem == part.token_stride
        assert p.host_layer_stride * elem == part.layer_stride
        assert p.device_row_stride * elem == part.device_row_bytes
        if p.heads > 1:
            assert p.host_head_stride * elem == part.head_stride
            assert p.device_head_stride * elem == part.device_head_stride
    with pytest.raises(ValueError, match="word"):
        uva.uva_part(_plan("page_first", dtype=torch.float16, head_dim=3).parts[0], 16)


def test_layer_offset_table_points_at_each_layer():
    draft = hc.MHADevicePool(4, 4, torch.bfloat16, 2, 8, 1, "cpu")  # 8 rows, fewer than the target's 16
    plan = _plan("page_first", drafts=[draft])
    anchor = uva.make_anchor("cpu", torch.int64)
    table = uva.layer_offset_table(plan, anchor, 8)
    assert table.shape == (plan.num_layers, len(plan.parts), uva.TABLE_COLUMNS)
    assert table.dtype == torch.int64
    base = anchor.data_ptr()
    for layer in range(plan.num_layers):
        for i, part in enumerate(plan.parts):
            host, dev, rows, items = table[layer, i].tolist()
            assert base + 8 * host == part.host.data_ptr() + part.host_offset + layer * part.layer_stride
            assert base + 8 * dev == part.device_layers[layer].data_ptr() + part.device_offset
            assert rows == part.device_layers[layer].shape[0]
            assert items == plan.num_items
    assert table[-1, 0, uva.TABLE_DEVICE_ROWS] == 8 and table[0, 0, uva.TABLE_DEVICE_ROWS] == 16
    only_v = uva.layer_offset_table(plan, anchor, 8, parts=[1])
    assert torch.equal(only_v[:, 0], table[:, 1])
