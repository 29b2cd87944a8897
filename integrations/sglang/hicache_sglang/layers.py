"""SGLang's layer numberings, declared for the core (:class:`hicache_core.pool.layer_map.LayerMap`).

SGLang's host pools take layer ids local to the device pool, with packed MTP drafts numbered after them; its
page-row, Mamba and MiniMax pools take their own host layer. The core reads every id through these maps, so a
pool of the adapter refuses a bad id, or skips another rank's layer, exactly as the core's own pools do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache_core.pool.layer_map import LayerMap


def device_layers(device_pool: Any, *, device_layer_num: int, kept: Sequence[int],
                  draft_pools: Sequence[Any] = ()) -> LayerMap:  # fmt: skip
    """SGLang's local ids ``0..device_layer_num-1``, of which the host keeps ``kept`` (in that order); packed draft
    ``d`` is id ``device_layer_num + d``. Ids kept elsewhere (another context-parallel rank's, a DSA layer sharing
    another's top-k) are no-ops: SGLang loads every id. An id outside the device pool is one too, as in SGLang's
    own pools; ``HICACHE_VALIDATE`` reports it."""
    host_of: list[int | None] = [None] * device_layer_num
    for host, layer in enumerate(kept):
        host_of[layer] = host
    return LayerMap(tuple(host_of), device_pool, tuple(draft_pools), draft_base=device_layer_num,
                    numbering="SGLang's layer ids, local to the device pool",
                    skipped="keeps no host layer on this rank (another rank's, or one that shares another's rows)",
                    skips_are_calls=True, outside_is_noop=True)  # fmt: skip


def own_layers(layers: int, *, what: str, drafts_refused: str | None = None) -> LayerMap:
    """A pool addressed by its own host layer ``0..layers-1`` whatever device pool is passed (SGLang's page-row,
    Mamba and MiniMax pools; packed drafts are plain layers after the target's, or refused)."""
    return LayerMap(tuple(range(layers)), None, numbering=f"the {what} pool's host layers",
                    drafts_refused=drafts_refused, drafts_are_layers=drafts_refused is None)  # fmt: skip
