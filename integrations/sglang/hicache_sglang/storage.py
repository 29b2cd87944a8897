"""hicache's L3 tier (``hicache_core.storage``: file, Redis, Mooncake URLs) as a SGLang storage backend.

SGLang 0.5.23 loads third-party storage backends through its ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "hicache", "module_path": "hicache_sglang.storage", "class_name": "HicacheStorage",
        "interface_v1": 1, "url": "redis://127.0.0.1:6379/0"}'

(:func:`extra_config` builds that JSON). SGLang then calls ``batch_exists`` and the zero-copy
``batch_get_v1`` / ``batch_set_v1`` (``interface_v1``) with its page hashes and host slots; this
class binds hicache's page store of ``url`` to the hicache pool under SGLang's host pool, so pages
move straight between the host pool and the store, with hicache's page header, checksum and
namespace (model, weight version, pool geometry, rank share). Pages SGLang's own backends wrote
are not read here, and the other way round: the formats differ.

The model id is SGLang's model name (``--served-model-name``, by default the model path); a server
that passes none is refused, never given a made-up one under which two models would share pages.
The weight version is SGLang's (``--weight-version``), and follows its in-place weight updates
(:mod:`hicache_sglang.weight_updates`).

With ``HICACHE_KV_EVENTS`` set, the store's pages are announced as SGLang's own ``BlockStored`` /
``BlockRemoved`` events (``medium`` ``DISK`` or ``EXTERNAL``) from the rank SGLang publishes from
(:func:`publish_events`); it is another endpoint than SGLang's ``--kv-events-config``, which keeps
publishing the GPU and host tiers.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from hicache_core import metrics as _metrics

from .errors import NotServedError
from .variables import STORAGE_URL

#: The storage URL when the extra config names none.
URL = STORAGE_URL
ENV_URL = URL.name
logger = logging.getLogger("hicache_sglang")


def extra_config(url: str, **options: Any) -> str:
    """The ``--hicache-storage-backend-extra-config`` JSON that plugs hicache's tier at ``url`` into SGLang."""
    config = {"backend_name": "hicache", "module_path": __name__, "class_name": HicacheStorage.__name__,
              "interface_v1": 1, "url": url}  # fmt: skip
    if options:
        config["options"] = options
    return json.dumps(config)


class HicacheStorage(HiCacheStorage):
    """A SGLang ``HiCacheStorage`` whose pages live in hicache's L3 tier (any installed storage plugin).

    ``extra_config``: ``url`` (or ``$HICACHE_SGLANG_STORAGE_URL``), optional ``options`` (the
    backend's keyword options, e.g. ``{"capacity": "10GiB"}``). Bound to the host pool when SGLang
    registers it; refused with :class:`~hicache_sglang.NotServedError` for a host pool that is not
    hicache's, or a setup (pipeline or context parallelism, DCP) whose pages hicache's namespace
    does not describe yet.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.url = extra.get("url") or URL.read()
        if not self.url:
            raise NotServedError(
                'hicache storage needs a URL: put "url" (file:///dir, redis://host:port/db, mooncake://host:port) '
                f"in --hicache-storage-backend-extra-config, or set {ENV_URL}"
            )
        if not extra.get("interface_v1"):
            raise NotServedError(
                'hicache storage moves pages straight from the host pool: put "interface_v1": 1 in '
                "--hicache-storage-backend-extra-config (SGLang then calls batch_get_v1/batch_set_v1)"
            )
        if not isinstance(storage_config.model_name, str) or not storage_config.model_name:
            raise NotServedError(
                "hicache storage keys every page on the model's name, and SGLang passed "
                f"{storage_config.model_name!r}: start the server with --served-model-name NAME (a name that "
                "identifies the weights; two models under one name would share pages)"
            )
        for what, size in (("pipeline", storage_config.pp_size), ("attention context", storage_config.attn_cp_size),
                           ("decode context", storage_config.dcp_size)):  # fmt: skip
            if size != 1:
                raise NotServedError(f"hicache storage does not serve {what} parallelism (size {size}) yet")
        self.options = dict(extra.get("options") or {})
        self.config = storage_config
        self.store: Any = None  # the hicache PageStore, made when SGLang registers its host pool
        self.events: Any = None  # the store's KV-event feed (hicache_core.events.StoreFeed), where this rank publishes

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        from hicache_core.storage import make_storage

        from .pool import SGLangHostPool

        super().register_mem_pool_host(mem_pool_host)
        if not isinstance(mem_pool_host, SGLangHostPool):
            raise NotServedError(
                f"hicache storage binds to hicache host pools; SGLang registered a {type(mem_pool_host).__name__} "
                "(start the server with python -m hicache_sglang.launch_server)"
            )
        refusal = getattr(mem_pool_host, "l3_refusal", None)
        if refusal:  # the pool's pages carry bytes beside its core pool (scales): storing the core's would drop them
            raise NotServedError(f"hicache storage cannot store the {mem_pool_host.pool_label!r} host pool: {refusal}")
        from . import weight_updates

        cfg = self.config
        self.store = make_storage(self.url, mem_pool_host.core, model_id=cfg.model_name, tp_rank=cfg.tp_rank,
                                  tp_size=cfg.tp_size, replicated=cfg.is_mla_model,
                                  weight_version=weight_updates.current_version(), **self.options)  # fmt: skip
        self.events = publish_events(self.store, cfg)
        weight_updates.track(self)

    def set_weight_version(self, version: str, *, reason: str = "") -> bool:
        """Key pages on the weights ``version`` names from now on (:meth:`PageStore.set_weight_version`)."""
        store = self._bound()
        old = store.weight_version
        if not store.set_weight_version(version):
            return False
        hold = store.weights.hold
        logger.info("hicache storage: %s changed the weights: keys move from weight version %r to %r%s", reason or
                    "an update", old, version, f"; {hold}" if hold else "")  # fmt: skip
        return True

    def _bound(self) -> Any:
        if self.store is None:
            raise RuntimeError("hicache storage is used before SGLang registered its host pool")
        return self.store

    # ---- SGLang's zero-copy interface (interface_v1) ---------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages the store holds; the misses are counted by reason (``hicache_l3_prefetch_pages``)."""
        store = self._bound()
        hits = store.batch_exists(keys)
        if hits < len(keys):
            _count_misses(store, keys, hits)
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        loaded = self._bound().batch_get_into(keys, host_indices)
        _metrics.L3_PREFETCH.labels(result="hit", reason="loaded").inc(sum(loaded))
        return loaded

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        # extra_info.prefix_keys (hicache_storage_pass_prefix_keys) names the first page's parent in the KV events
        return self._bound().batch_set_from(keys, host_indices, extra_info)

    # ---- SGLang's generic interface (flat pages) --------------------------------------------------

    def exists(self, key: str) -> bool:
        return self._bound().exists(key)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self._bound().get(key, target_location)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        return self._bound().batch_get(keys, target_locations)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._bound().set(key, value)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        return self._bound().batch_set(keys, values)

    def clear(self) -> None:
        self._bound().clear()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()  # closes the feed too: a file or shared store's pages outlive this process
            self.store = None
            self.events = None


def kv_event_rank(config: Any) -> int | None:
    """The rank this scheduler's L3 KV events name, or ``None`` where this scheduler does not publish them.

    SGLang's own rule, so hicache's L3 stream and SGLang's GPU/host stream come from the same schedulers
    under the same rank (``sglang.srt.disaggregation.kv_events``): one publisher per independent KV cache,
    on pp rank 0, attention-TP rank 0 and attention-CP rank 0; its rank is the attention-DP rank, or the
    DP replica's under plain data parallelism. With TP > 1 every rank writes its own share of each page
    (an MLA pool: rank 0 alone writes), in lockstep, as SGLang's controller backs up the same node on
    every rank; rank 0's share stands for the page, as rank 0's radix tree stands for the GPU tier.
    """
    from sglang.srt.disaggregation.kv_events import is_kv_publisher_rank, select_kv_publisher_dp_rank
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        # is_kv_publisher_rank reads only whether events are configured, then the ranks: hicache's are.
        if not is_kv_publisher_rank("hicache"):
            return None
        return select_kv_publisher_dp_rank(parallel.attn_dp_size, parallel.attn_dp_rank, parallel.dp_rank)
    except RuntimeError:  # no rank published in this process (a store made outside SGLang's scheduler)
        if config.tp_rank or config.pp_rank or config.attn_cp_rank:
            return None
        return int(config.dp_rank or 0)


def publish_events(store: Any, config: Any) -> Any:
    """Attach ``store`` to the process's KV-event publisher (``HICACHE_KV_EVENTS``), in SGLang's format.

    Returns the feed, or ``None`` where events are off or this rank does not publish (:func:`kv_event_rank`).
    ``chained``: SGLang backs up a radix node's pages in chain order (``write_backup_storage`` passes
    ``node.hash_value``; the controller's ``_page_backup`` writes it in order, 128 pages a call), so each
    page's parent is the one before it. The keys SGLang gives are its own page hashes, passed to the store
    unchanged, so an event's hash is ``hash_str_to_int64`` of them: the hash SGLang's radix cache
    publishes for the GPU and host tiers of the same page. Not for a request with a ``cache_salt`` or a
    LoRA adapter: SGLang's events hash those pages on another chain than its storage keys
    (``compute_node_event_hash_values``), which the store, given only the storage key, cannot follow.
    """
    from hicache_core.events import publish_store_events
    from hicache_core.settings.variables import KV_EVENTS

    if not KV_EVENTS.read():
        return None
    rank = kv_event_rank(config)
    if rank is None:
        return None
    return publish_store_events(store, "sglang", rank=rank, chained=True)


def _count_misses(store: Any, keys: list[str], hits: int) -> None:
    """The first missing page's reason (``old_weight_version`` or ``not_in_store``); the pages after it follow it."""
    from hicache_core.storage.weights import OLD_WEIGHT_VERSION

    old = None
    if store.weights.previous:
        try:
            old = store.old_weight_version_of(keys[hits])
        except Exception:  # noqa: BLE001 - cannot tell: counted not_in_store
            old = None
    misses = _metrics.L3_PREFETCH
    misses.labels(result="miss", reason=OLD_WEIGHT_VERSION if old is not None else "not_in_store").inc()
    if len(keys) > hits + 1:
        misses.labels(result="miss", reason="earlier_page_missing").inc(len(keys) - hits - 1)
