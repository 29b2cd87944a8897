"""The servers' KV-event wire formats: vLLM 0.32's and SGLang 0.5.23's, as their routers decode them.

Both servers send msgpack over ZMQ: a batch is the array ``[ts, events, rank]``, each event a map tagged
``type`` with its class name (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), optional fields
left out when unset. They differ in which fields are required, in the ``medium`` names, and in what a
block hash is. The structs here are hicache's own, shaped so that the servers' decoders
(``vllm.distributed.kv_events.KVEventBatch``, ``sglang.srt.disaggregation.kv_events.KVEventBatch``) read
every event unchanged: the integration suites decode hicache's stream with those classes.

A block hash is the server's own, computed from the page hash the server gave the store, so a router's
index of the GPU tier and of hicache's tiers name a block the same way:

* SGLang's page hash is the SHA-256 hex chain of its radix cache; its events carry the first 64 bits as
  a signed integer (``hash_str_to_int64``).
* vLLM's L3 key is ``bytes(OffloadKey).hex()``: the block hash then 4 bytes of KV-cache group. Its events
  carry the block hash's low 64 bits as an unsigned integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on
  by default in 0.32), or the bytes themselves with that variable at 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from .tiers import Tier

__all__ = ["EventFormat", "SGLANG", "VLLM", "format_named", "sglang_block_hash", "vllm_block_hash"]


def sglang_block_hash(page_hash: str) -> int:
    """SGLang's event hash of one page hash: its first 16 hex digits as a signed 64-bit integer."""
    value = int(page_hash[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def vllm_group(page_hash: str) -> int:
    """The KV-cache group of a vLLM L3 key: its last 4 bytes (``get_offload_group_idx``)."""
    return int.from_bytes(bytes.fromhex(page_hash[-8:]), "big")


def vllm_block_hash(page_hash: str, as_int: bool | None = None) -> int | bytes:
    """vLLM's event hash of one L3 key (an ``OffloadKey`` in hex): the block hash, as vLLM publishes it.

    ``as_int`` follows ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default on) when ``None``.
    """
    raw = bytes.fromhex(page_hash)
    if len(raw) <= 4:
        raise ValueError(f"{page_hash!r} is not a vLLM offload key (block hash, then 4 bytes of KV-cache group)")
    block = raw[:-4]
    if as_int is None:
        as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
    return int.from_bytes(block, "big") & ((1 << 64) - 1) if as_int else block


@dataclass(frozen=True)
class EventFormat:
    """One server's wire format: its media names, its block hashes and its structs.

    :param name: ``"vllm"`` or ``"sglang"``.
    :param media: the ``medium`` string of each tier kind (``host``, ``disk``, ``shared``, ``object``, ``peer``).
    :param block_hash: the server's event hash of a page hash the server gave the store.
    :param group_of: the server's KV-cache group of a page hash, where its events name one (vLLM's ``group_idx``).
    """

    name: str
    media: dict[str, str]
    block_hash: Callable[[str], int | bytes]
    group_of: Callable[[str], int] | None = None

    def medium(self, tier: Tier) -> str:
        """The ``medium`` this server names ``tier``'s kind by."""
        return self.media[tier.kind]

    def stored(self, tier: Tier, hashes: list[Any], block_size: int, parent: Any = None, group: int | None = None,
               session: str | None = None) -> Any:  # fmt: skip
        """A ``BlockStored`` of ``hashes`` (event hashes, in chain order) held by ``tier``, of KV-cache ``group``;
        ``session``: the session whose lease holds them (both servers' ``session_id``)."""
        s = _structs(self.name)
        if self.name == "vllm":
            return s.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=block_size,
                                 lora_id=None, medium=self.medium(tier), lora_name=None, group_idx=group,
                                 locality=tier.locality, ownership=tier.store, session_id=session)  # fmt: skip
        return s.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=block_size,
                             lora_id=None, medium=self.medium(tier), session_id=session,
                             store=tier.store)  # fmt: skip

    def removed(self, tier: Tier, hashes: list[Any], group: int | None = None) -> Any:
        """A ``BlockRemoved`` of ``hashes`` (of KV-cache ``group``) that ``tier`` no longer holds."""
        s = _structs(self.name)
        if self.name == "vllm":
            return s.BlockRemoved(block_hashes=hashes, medium=self.medium(tier), group_idx=group,
                                  locality=tier.locality, ownership=tier.store)  # fmt: skip
        return s.BlockRemoved(block_hashes=hashes, medium=self.medium(tier), store=tier.store)

    def cleared(self) -> Any:
        """An ``AllBlocksCleared``: everything this publisher announced is void."""
        return _structs(self.name).AllBlocksCleared()

    def batch(self, ts: float, events: list[Any], rank: int) -> Any:
        """The batch a publisher sends: ``[ts, events, rank]``."""
        return _structs(self.name).KVEventBatch(ts=ts, events=events, rank=rank)

    def encode(self, value: Any) -> bytes:
        """msgpack of a batch (or of tier statistics)."""
        import msgspec

        return msgspec.msgpack.encode(value)

    def decode(self, payload: bytes) -> Any:
        """A batch decoded with this format's own structs (what hicache's subscriber reads)."""
        import msgspec

        return msgspec.msgpack.decode(payload, type=_structs(self.name).KVEventBatch)


VLLM = EventFormat(
    "vllm",
    {"host": "CPU", "disk": "STORAGE", "shared": "STORAGE", "object": "STORAGE", "peer": "STORAGE"},
    vllm_block_hash,
    vllm_group,
)
SGLANG = EventFormat(
    "sglang",
    {"host": "CPU_PINNED", "disk": "DISK", "shared": "EXTERNAL", "object": "EXTERNAL", "peer": "EXTERNAL"},
    sglang_block_hash,
)
_FORMATS = {f.name: f for f in (VLLM, SGLANG)}


def format_named(name: str) -> EventFormat:
    """The format a server is named by (``vllm`` or ``sglang``)."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"KV events come in the format of {' or '.join(sorted(_FORMATS))}, not {name!r}") from None


@cache
def _structs(name: str) -> Any:
    """The msgspec structs of one format (``wire.py``), imported on first use: msgspec is needed only there."""
    try:
        from . import wire
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise ImportError("KV events need msgspec and pyzmq: pip install 'hicache-core[events]'") from exc
    stored, removed, cleared, batch = wire.STRUCTS[name]

    class Structs:
        BlockStored = stored
        BlockRemoved = removed
        AllBlocksCleared = cleared
        KVEventBatch = batch

    return Structs
