"""The msgpack structs of both formats (imported only where events are on: it needs msgspec).

Written without ``from __future__ import annotations``: msgspec reads these annotations as types.
The field order and which fields have defaults are the servers' own (vLLM 0.32's and SGLang 0.5.23's
``kv_events`` modules), so their decoders read these events unchanged; the names on our side are ours.
"""

from typing import Any

import msgspec

BlockHash = Any  # vLLM: an int (its default) or bytes; SGLang: a signed 64-bit int


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class VllmBlockStored(_Event, tag="BlockStored"):
    """vLLM's ``BlockStored``: every field it requires, then the optional ones hicache sets."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VllmBlockRemoved(_Event, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class SglangBlockStored(_Event, tag="BlockStored"):
    """SGLang's ``BlockStored``; ``store`` is hicache's (which store holds the page), ignored by SGLang's decoder."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    session_id: str | None = None
    store: str | None = None


class SglangBlockRemoved(_Event, tag="BlockRemoved"):
    """SGLang's ``BlockRemoved``, with hicache's ``store``."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    store: str | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    """Both servers' ``AllBlocksCleared``."""


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | AllBlocksCleared]
    rank: int | None = None


class SglangBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, attn_dp_rank]``."""

    ts: float
    events: list[SglangBlockStored | SglangBlockRemoved | AllBlocksCleared]
    rank: int | None = None


STRUCTS = {
    "vllm": (VllmBlockStored, VllmBlockRemoved, AllBlocksCleared, VllmBatch),
    "sglang": (SglangBlockStored, SglangBlockRemoved, AllBlocksCleared, SglangBatch),
}
