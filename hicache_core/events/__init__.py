"""KV events: what hicache's tiers hold, told to the cluster's router in the server's own format.

vLLM and SGLang publish ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` as msgpack over a ZMQ
PUB socket for the tiers they place; routers (Dynamo's KV router, llm-d's KV-cache manager) index them
and send each request where its prefix is held. hicache publishes, the same way and in the same format,
for the tiers it owns: every L3 store and the peer tier, so a prefix in a shared store or in another
instance's host pool is visible to the router too.

* :class:`KVEventPublisher`: one per process; the sockets, the sequence numbers, replay, snapshot and
  tier statistics.
* :meth:`hicache_core.storage.PageStore.publish_events`: attaches a store (a :class:`StoreFeed`).
* :class:`EventSubscriber` / :class:`EventIndex`: the router's side, for tests, benchmarks and routers.
* :data:`VLLM`, :data:`SGLANG`: the formats (``formats.py``).

The guide: ``docs/kv-events.md``. Needs ``pyzmq`` and ``msgspec`` (``hicache-core[events]``).
"""

from .configured import configured_publisher, publish_store_events
from .feed import StoreFeed
from .formats import SGLANG, VLLM, EventFormat, format_named, sglang_block_hash, vllm_block_hash
from .publisher import KVEventPublisher
from .subscriber import EventIndex, EventSubscriber
from .tiers import Tier, tier_of

__all__ = [
    "EventFormat", "EventIndex", "EventSubscriber", "KVEventPublisher", "SGLANG", "StoreFeed", "Tier", "VLLM",
    "configured_publisher", "format_named", "publish_store_events", "sglang_block_hash", "tier_of",
    "vllm_block_hash",
]  # fmt: skip
