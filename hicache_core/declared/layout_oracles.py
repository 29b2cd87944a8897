"""Where SGLang's host layouts put each item, written from SGLang's shapes, not from the declarations.

An oracle takes a host pool, a part name (``"k"``, ``"v"``, ``"kv"``, ``"row"``, ...),
a host layer and an item (a token slot; a page for page-item kinds) and returns the
view of the host buffer that holds that item, by indexing the buffer the way SGLang's
host pools index theirs (``reference/sglang-hicache.md`` section 3):

==================== =====================================================
layout               item ``i`` of layer ``l`` (``p`` tokens per page)
==================== =====================================================
layer_first          ``buf[l, i]``
page_first           ``buf[i, l]``
page_first_direct    ``buf[i // p, l, i % p]``
page_head            ``buf[i // p, :, i % p, l]``
page_first_kv_split  ``k_buffer[i // p, l, i % p]`` / ``v_buffer[...]``;
                     a kind of one part with nothing to split: as page_first
==================== =====================================================

``buf`` is the part's own buffer, or its slice ``kv_buffer[0]`` / ``kv_buffer[1]`` of a
stacked buffer (SGLang keeps K/V first). The conformance kit compares these views with
the device rows after a transfer, so a layout declaration whose axes say something else
fails, whatever the kit's reference (which reads the declaration) thinks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def part_tensor(host: Any, part: str) -> torch.Tensor:
    """The host tensor of one part, as SGLang names it: its own buffer, or its slice of a stacked one."""
    kind = host.geometry.decl
    for name, attr in kind.split_parts:
        if host.spec.layout.split and name == part:
            return getattr(host, attr)
    for index, comp in enumerate(kind.components):
        if comp.name != part:
            continue
        stacked = kind.stacked_attr
        if stacked is not None and getattr(host, stacked, None) is not None and len(kind.components) > 1:
            return getattr(host, stacked)[index]
        return getattr(host, comp.host_attr)
    raise KeyError(f"pool kind {kind.name!r} has no part {part!r}")


def _tokens(host: Any) -> int:
    return 1 if host.geometry.items_are_pages else host.page_size


def _layer_first(host: Any, part: str, layer: int, item: int) -> torch.Tensor:
    return part_tensor(host, part)[layer, item]


def _page_first(host: Any, part: str, layer: int, item: int) -> torch.Tensor:
    return part_tensor(host, part)[item, layer]


def _page_first_direct(host: Any, part: str, layer: int, item: int) -> torch.Tensor:
    p = _tokens(host)
    return part_tensor(host, part)[item // p, layer, item % p]


def _page_head(host: Any, part: str, layer: int, item: int) -> torch.Tensor:
    p = _tokens(host)
    return part_tensor(host, part)[item // p, :, item % p, layer]


def _page_first_kv_split(host: Any, part: str, layer: int, item: int) -> torch.Tensor:
    kind = host.geometry.decl
    if kind.split_by is None and len(kind.components) == 1:
        # Nothing to split (the DSA indexer's page rows): SGLang's page_first buffer of that pool.
        return _page_first(host, part, layer, item)
    return _page_first_direct(host, part, layer, item)


SGLANG_ORACLES: dict[str, Callable[[Any, str, int, int], torch.Tensor]] = {
    "layer_first": _layer_first,
    "page_first": _page_first,
    "page_first_direct": _page_first_direct,
    "page_head": _page_head,
    "page_first_kv_split": _page_first_kv_split,
}
