"""Addressing a transfer plan from a GPU kernel through UVA: word size, word strides, offset tables.

Pinned host memory is addressable from CUDA kernels at its host virtual address
(unified virtual addressing), and the Triton interpreter addresses plain process
memory. So a kernel can take ONE pointer argument, the *anchor* (any small tensor on
the pool's device), and reach every byte of both sides of a plan as
``anchor + offset``, where ``offset`` is an ``int64`` count of elements from the
anchor's address. This module holds the pieces of that scheme that do not depend on
a kernel language (pure torch): the widest word every address and size allows, the
per-part strides in elements, and the per-host-layer offset table, built once when a
host pool is made so that the hot path allocates nothing.

Vocabulary: a *piece* is the contiguous run one (item, head) moves, as
:class:`~hicache_core.pool.plan.BoundPart` describes it; where an item is contiguous on both
sides, its heads merge into one piece. A *word* is the unit a kernel moves per lane
(16, 8, 4, 2 or 1 bytes); an *element* is the pointer's scalar type, at most 8 bytes,
so a 16-byte word is two ``int64`` elements.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..pool.plan import BoundPart, TransferPlan

#: Word sizes a kernel may move, widest first.
WORD_SIZES: tuple[int, ...] = (16, 8, 4, 2, 1)

_ELEMENT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}

#: Columns of :func:`layer_offset_table`.
TABLE_HOST, TABLE_DEVICE, TABLE_DEVICE_ROWS, TABLE_HOST_ITEMS = 0, 1, 2, 3
TABLE_COLUMNS = 4


def widest_word(values: Iterable[int], limit: int = 16) -> int:
    """The largest word size in :data:`WORD_SIZES` (at most ``limit``) dividing every value."""
    values = [int(v) for v in values]
    for word in WORD_SIZES:
        if word <= limit and all(v % word == 0 for v in values):
            return word
    return 1


def word_element(word_bytes: int) -> tuple[torch.dtype, int]:
    """The pointer element dtype for a word size, and how many elements make one word."""
    if word_bytes not in WORD_SIZES:
        raise ValueError(f"word size must be one of {WORD_SIZES}, got {word_bytes}")
    elem = min(word_bytes, 8)
    return _ELEMENT_DTYPES[elem], word_bytes // elem


@dataclass(frozen=True)
class Pieces:
    """How one part of an item is moved: ``heads`` pieces of ``piece_bytes`` each (bytes throughout)."""

    heads: int
    piece_bytes: int
    host_head_stride: int
    device_head_stride: int


def pieces_of(part: BoundPart, *, merge_heads: bool = True) -> Pieces:
    """The pieces of ``part``; with ``merge_heads``, an item contiguous on both sides is one piece."""
    if merge_heads and part.host_item_contiguous and part.device_item_contiguous:
        return Pieces(1, part.item_bytes, part.item_bytes, part.item_bytes)
    return Pieces(part.heads, part.piece_bytes, part.head_stride, part.device_head_stride)


def part_alignment_values(part: BoundPart, *, merge_heads: bool = True) -> list[int]:
    """Every size, stride, offset and base address of ``part`` a word must divide."""
    p = pieces_of(part, merge_heads=merge_heads)
    values = [
        p.piece_bytes,
        part.host.data_ptr(),
        part.host_offset,
        part.page_stride,
        part.token_stride,
        part.layer_stride,
        part.device_offset,
        part.device_row_bytes,
    ]
    if p.heads > 1:
        values += [p.host_head_stride, p.device_head_stride]
    values += [t.data_ptr() for t in part.device_layers]
    return values


def plan_word_bytes(
    plan: TransferPlan,
    *,
    merge_heads: bool = True,
    anchor: torch.Tensor | None = None,
    parts: Sequence[int] | None = None,
    limit: int = 16,
) -> int:
    """The widest word (16/8/4/2/1 bytes) that divides every piece, stride, offset and base address.

    :param anchor: include the anchor's address (offsets from it must be whole elements).
    :param parts: only these part indices (default: all), for a kernel that moves parts separately.
    """
    chosen = range(len(plan.parts)) if parts is None else parts
    values: list[int] = []
    for i in chosen:
        values += part_alignment_values(plan.parts[i], merge_heads=merge_heads)
    if anchor is not None:
        values.append(anchor.data_ptr())
    return widest_word(values, limit)


@dataclass(frozen=True)
class UVAPart:
    """One part in the units a UVA kernel addresses: words per piece, strides in elements.

    Host element offset of (item ``t``, head ``h``) of a layer, from the layer's table entry:
    ``(t // tokens_per_page) * host_page_stride + (t % tokens_per_page) * host_token_stride
    + h * host_head_stride``. Device: ``row * device_row_stride + h * device_head_stride``.
    """

    heads: int
    piece_words: int
    elems_per_word: int
    tokens_per_page: int
    host_page_stride: int
    host_token_stride: int
    host_layer_stride: int
    host_head_stride: int
    device_row_stride: int
    device_head_stride: int

    @property
    def words_per_item(self) -> int:
        return self.heads * self.piece_words


def uva_part(part: BoundPart, word_bytes: int, *, merge_heads: bool = True) -> UVAPart:
    """Convert one bound part's byte strides into element strides for ``word_bytes`` words."""
    _, per_word = word_element(word_bytes)
    elem = word_bytes // per_word
    p = pieces_of(part, merge_heads=merge_heads)
    strides = {
        "piece bytes": p.piece_bytes,
        "host page stride": part.page_stride,
        "host token stride": part.token_stride,
        "host layer stride": part.layer_stride,
        "host head stride": p.host_head_stride if p.heads > 1 else 0,
        "device row bytes": part.device_row_bytes,
        "device head stride": p.device_head_stride if p.heads > 1 else 0,
    }
    for what, value in strides.items():
        if value % word_bytes:
            raise ValueError(f"{what} {value} is not a multiple of the {word_bytes}-byte word (see plan_word_bytes)")
    return UVAPart(
        heads=p.heads,
        piece_words=p.piece_bytes // word_bytes,
        elems_per_word=per_word,
        tokens_per_page=part.tokens_per_page,
        host_page_stride=part.page_stride // elem,
        host_token_stride=part.token_stride // elem,
        host_layer_stride=part.layer_stride // elem,
        host_head_stride=strides["host head stride"] // elem,
        device_row_stride=part.device_row_bytes // elem,
        device_head_stride=strides["device head stride"] // elem,
    )


def make_anchor(device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small tensor on ``device`` whose address every offset is taken from (keep it alive)."""
    # Two 16-byte words: allocators align far beyond that, so any word size divides its address.
    return torch.zeros(32 // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)


def _elements_from(anchor_ptr: int, address: int, elem: int, what: str) -> int:
    delta = address - anchor_ptr
    if delta % elem:
        raise ValueError(f"{what} at {address:#x} is not {elem}-byte aligned relative to the anchor")
    return delta // elem


def layer_offset_table(
    plan: TransferPlan,
    anchor: torch.Tensor,
    elem_bytes: int,
    *,
    parts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Per host layer and part, where the layer starts on each side, as offsets from the anchor.

    Returns an ``int64`` tensor of shape ``(plan.num_layers, len(parts), TABLE_COLUMNS)`` on
    ``device`` (default: the anchor's). Columns: :data:`TABLE_HOST` (elements from the anchor to
    item 0, head 0 of that layer in the host buffer), :data:`TABLE_DEVICE` (elements to row 0 of
    that layer's device tensor, plus the part's offset in the row), :data:`TABLE_DEVICE_ROWS` (rows
    of that device layer: draft pools may differ from the target), :data:`TABLE_HOST_ITEMS`.
    Built once per host pool; a kernel reads one row per tile, so per-layer addresses never cross
    the host/device boundary per call.
    """
    chosen = list(range(len(plan.parts)) if parts is None else parts)
    base = anchor.data_ptr()
    rows: list[list[list[int]]] = []
    for layer in range(plan.num_layers):
        entries = []
        for i in chosen:
            part = plan.parts[i]
            host = part.host.data_ptr() + part.host_offset + layer * part.layer_stride
            dev_tensor = part.device_layers[layer]
            dev = dev_tensor.data_ptr() + part.device_offset
            entries.append(
                [
                    _elements_from(base, host, elem_bytes, f"host layer {layer} of part {part.spec.name}"),
                    _elements_from(base, dev, elem_bytes, f"device layer {layer} of part {part.spec.name}"),
                    int(dev_tensor.shape[0]),
                    int(plan.num_items),
                ]
            )
        rows.append(entries)
    return (
        torch.tensor(rows, dtype=torch.int64)
        .reshape(plan.num_layers, len(chosen), TABLE_COLUMNS)
        .to(anchor.device if device is None else device)
    )
