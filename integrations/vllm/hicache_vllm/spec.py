"""``HicacheOffloadingSpec``: vLLM's OffloadingConnector with a hicache host tier and L3 behind it.

* Scheduler side (EngineCore process): vLLM's own ``CPUOffloadingManager`` (ref counts, events, metrics),
  whose chunk ids index hicache host pages, with hicache's lease-aware LRU policy
  (:class:`hicache_vllm.retention.HicacheCachePolicy`; vLLM's ARC where ``eviction_policy`` asks). With an
  L3 store, a key the host tier lacks is looked up in the store; a hit is promoted into a host chunk by the
  load job itself and becomes an ordinary host-tier entry once it lands.
* Worker side (Worker process): :class:`hicache_vllm.mover.BlockMover` moves the blocks through
  hicache's dispatcher, and writes stored chunks through to L3, with the request's lease (its
  retention hints ride on the store job).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from .version import check_vllm_version

check_vllm_version()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from hicache_core.retention.hints import RetentionHints  # noqa: E402

from . import weight_updates  # noqa: E402
from .config import HicacheOptions, parse_extra_config  # noqa: E402
from .errors import NotServedError  # noqa: E402
from .mover import BlockMover  # noqa: E402
from .pool_kind import VllmPagePool  # noqa: E402
from .retention import METRICS, HicacheCachePolicy, host_policy_name, request_hints  # noqa: E402

logger = init_logger(__name__)


class HicacheLoadStoreSpec(CPULoadStoreSpec):
    """Host chunks of a job (``block_ids``, as vLLM's CPU spec), each chunk's L3 key, and which to fetch from L3.

    ``lease``: on a store job, the retention hints of the request it stores for; the worker grants the same
    lease on the pages it writes to L3 (``supersede`` only on the request's first store job).
    """

    def __init__(self, chunk_ids: list[int], keys: list[str], fetch: list[bool] | None = None,
                 lease: RetentionHints | None = None) -> None:  # fmt: skip
        super().__init__(chunk_ids)
        self.keys = keys
        self.fetch = fetch or [False] * len(chunk_ids)
        self.lease = lease


def storage_key(key: OffloadKey) -> str:
    """The L3 page hash of a vLLM offload key (block hash and KV group)."""
    return bytes(key).hex()


@dataclass
class _Promotions:
    """Per request: keys its lookup found only in L3, and host hits it will pin (room is checked against both)."""

    from_storage: set = field(default_factory=set)
    host_hits: set = field(default_factory=set)
    promoted: set = field(default_factory=set)


@dataclass
class _StoreLease:
    """Per request: whether a store job has carried its ``supersede`` to L3 already (the first one does)."""

    superseded: bool = False


class StorageProbe:
    """The scheduler's view of L3: does the store hold a key, in the namespace the worker writes.

    It publishes no KV events: it never writes, and a key it finds may be gone before a load reads it. The
    worker's store publishes the L3 tier (``mover._publish_events``); vLLM's manager publishes the host tier,
    an L3 hit promoted into it included (``complete_load`` below ends it with vLLM's ``complete_store``, which
    emits the host tier's ``BlockStored``).
    """

    def __init__(self, options: HicacheOptions, *, num_layers: int, page_bytes: int, block_size: int, model_id: str):
        from hicache_core import make_host_pool
        from hicache_core.storage import make_storage

        # A one-page host pool of the worker's geometry: its namespace is the worker's (device, size and io
        # backend are not part of it), so keys found here are the keys the worker reads.
        pages = [torch.zeros(1, page_bytes, dtype=torch.int8) for _ in range(num_layers)]
        self._device = VllmPagePool(pages, block_size)
        self._host = make_host_pool(self._device, layout=options.layout, io_backend="auto", size=block_size,
                                    pin_memory=False, label="vLLM scheduler's L3 probe")  # fmt: skip
        self.storage = make_storage(options.storage_url, self._host, model_id=model_id, **dict(options.storage_options))
        weight_updates.track(self)

    def set_weight_version(self, version: str) -> bool:
        """Look keys up in the namespace of the weights ``version`` names (``weight_updates``)."""
        return self.storage.set_weight_version(version)

    def exists(self, key: OffloadKey) -> bool:
        return self.storage.batch_exists([storage_key(key)]) == 1

    def close(self) -> None:
        self.storage.close()
        self._host.destroy()


class HicacheOffloadingManager(CPUOffloadingManager):
    """vLLM's CPU manager over hicache host chunks, with L3 hits promoted into the host tier by the load job.

    Reads each request's retention hints once, when it arrives (:func:`hicache_vllm.retention.request_hints`:
    a malformed hint raises ``ValueError`` there, which vLLM 0.32 makes fatal to the engine, see
    :mod:`hicache_vllm.retention`); the host tier's policy leases the request's pages when it finishes, and
    its store jobs carry the lease to L3. With L3, a leased page the host tier evicts counts as demoted when
    L3 holds it. :meth:`get_stats` adds the host tier's lease figures to vLLM's offloading metrics.
    """

    def __init__(self, *, storage: StorageProbe | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._storage = storage
        self._promoting: set = set()
        self._warned_no_leases = False
        if storage is not None and isinstance(self._policy, HicacheCachePolicy):
            self._policy.next_tier = storage.exists

    def retention_stats(self) -> dict[str, Any] | None:
        """The host tier's lease book (``None``: the policy takes no leases, as vLLM's ARC)."""
        return self._policy.stats() if isinstance(self._policy, HicacheCachePolicy) else None

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        hints = request_hints(req_context)  # first: a malformed hint is refused (logged, counted) before anything
        context = super().on_new_request(req_context)
        if hints:
            if isinstance(self._policy, HicacheCachePolicy):
                self._policy.on_new_request(hints)
            elif hints.retain is not None and not self._warned_no_leases:
                self._warned_no_leases = True
                logger.warning("hicache-vllm: the host tier's eviction_policy (%s) takes no leases: requests' "
                               "leases hold in L3 only%s", type(self._policy).__name__,
                               "" if self._storage is not None else " (and there is no L3)")  # fmt: skip
        return context

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, req_context)
        if out is not None and out.keys_to_store and self._storage is not None:
            hints = request_hints(req_context)
            if hints:
                sent = req_context.get_state(_StoreLease)
                if sent is None:
                    sent = _StoreLease()
                    req_context.set_state(sent)
                # The request's first store job supersedes the session's earlier leases in L3; a later one
                # must not supersede the lease its own first job granted.
                out.store_spec.lease = hints if not sent.superseded else dataclasses.replace(hints, supersede=False)
                sent.superseded = True
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats()
        if stats is not None and isinstance(self._policy, HicacheCachePolicy):
            self._policy.report(stats)
        return stats

    def _get_load_store_spec(self, keys, chunks) -> HicacheLoadStoreSpec:
        return HicacheLoadStoreSpec([c.chunk_id for c in chunks], [storage_key(k) for k in keys])

    def _state(self, req_context: ReqContext) -> _Promotions:
        state = req_context.get_state(_Promotions)
        if state is None:
            state = _Promotions()
            req_context.set_state(state)
        return state

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = super().lookup(key, req_context)
        if self._storage is None:
            return result
        state = self._state(req_context)
        if result is not LookupResult.MISS:
            if result is LookupResult.HIT:
                state.host_hits.add(key)
            return result
        if key in state.from_storage:
            return LookupResult.HIT
        # Promise an L3 hit only where its chunk can be had when the load is prepared: free or evictable
        # chunks beyond those this request's host hits and earlier L3 hits will pin.
        room = self._get_num_free_chunks() + self._num_evictable_cache_chunks
        if room < len(state.host_hits) + len(state.from_storage) + 1:
            return LookupResult.MISS
        if not self._storage.exists(key):
            return LookupResult.MISS
        state.from_storage.add(key)
        return LookupResult.HIT

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = req_context.get_state(_Promotions)
        if state is not None and key in state.promoted:
            return CacheHitSource.DISK
        return super().get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        state = self._state(req_context) if self._storage is not None else None
        promote = [k for k in keys if state is not None and k in state.from_storage and self._policy.get(k) is None]
        if not promote:
            if state is not None:
                state.from_storage.clear()
                state.host_hits.clear()
            return super().prepare_load(keys, req_context)
        wanted = set(promote)
        host_keys = [k for k in keys if k not in wanted]
        host_spec = super().prepare_load(host_keys, req_context)
        out = super().prepare_store(promote, req_context)
        if out is None or list(out.keys_to_store) != promote:
            raise RuntimeError(
                f"hicache-vllm: no host chunks for {len(promote)} pages found in L3 although lookup checked for room "
                "(a bug: please report it)"
            )
        chunk_of = dict(zip(host_keys, host_spec.block_ids.tolist()))
        chunk_of.update(zip(promote, out.store_spec.block_ids.tolist()))
        self._promoting.update(promote)
        state.promoted.update(promote)
        state.from_storage.clear()
        state.host_hits.clear()
        return HicacheLoadStoreSpec([chunk_of[k] for k in keys], [storage_key(k) for k in keys],
                                    [k in wanted for k in keys])  # fmt: skip

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        promoted = [k for k in keys if k in self._promoting]
        if promoted:
            # The load job read them from L3 into their host chunks: now they are host-tier entries.
            self._promoting.difference_update(promoted)
            self.complete_store(promoted, req_context, success=True)
        super().complete_load([k for k in keys if k not in set(promoted)], req_context)

    def shutdown(self) -> None:
        if self._storage is not None:
            self._storage.close()
            self._storage = None
        super().shutdown()


class HicacheOffloadingWorker(OffloadingWorker):
    """vLLM's worker interface on :class:`BlockMover`: submit_store / submit_load / get_finished / wait."""

    def __init__(self, mover: BlockMover) -> None:
        self.mover = mover

    @staticmethod
    def _skip(gpu_spec: GPULoadStoreSpec, blocks_per_chunk: int) -> int:
        if len(gpu_spec.group_sizes) != 1:
            raise NotServedError(f"jobs over {len(gpu_spec.group_sizes)} KV cache groups are not served (one group)")
        return int(gpu_spec.block_indices[0]) % blocks_per_chunk

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, HicacheLoadStoreSpec), type(dst_spec)
        skip = self._skip(src_spec, self.mover.blocks_per_chunk)
        self.mover.submit_store(job_id, src_spec.block_ids, dst_spec.block_ids, skip, dst_spec.keys,
                                lease=dst_spec.lease)  # fmt: skip
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HicacheLoadStoreSpec), type(src_spec)
        skip = self._skip(dst_spec, self.mover.blocks_per_chunk)
        fetch = [(i, key) for i, (key, f) in enumerate(zip(src_spec.keys, src_spec.fetch)) if f]
        self.mover.submit_load(job_id, src_spec.block_ids, dst_spec.block_ids, skip, fetch)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs as vLLM's results: a failed job (its copies all finished) once, with ``success=False``,
        after the healthy ones; the mover logs its :class:`~hicache_vllm.mover.TransferFailed`. vLLM 0.32's
        connector asserts success, so a failure stops the engine there, never a request on missing KV."""
        finished = sorted(self.mover.get_finished(), key=lambda f: not f.ok)
        return [TransferResult(f.job_id, f.ok, f.num_bytes, f.seconds) for f in finished]

    def wait(self, job_ids: set[int]) -> None:
        self.mover.wait(job_ids)

    def shutdown(self) -> None:
        self.mover.shutdown()


class HicacheOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec on hicache: ``spec_name: "HicacheOffloadingSpec"`` (registered with vLLM by
    :mod:`hicache_vllm._vllm_plugin`; ``spec_module_path: "hicache_vllm"`` finds it without the plugin).

    Takes vLLM's CPU spec's keys (``cpu_bytes_to_use``, which vLLM's ``--kv-offloading-size`` sets;
    ``eviction_policy``: ``lru``, the default, is hicache's lease-aware LRU, ``arc`` vLLM's ARC;
    ``store_threshold``, ...) and hicache's (``kv_offloading_size`` in GiB, ``hicache_layout``,
    ``hicache_io_backend``, ``hicache_storage_url``, ``hicache_storage_options``); refuses any other key,
    and anything it does not serve, with :class:`NotServedError` when vLLM builds it.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # The manager is vLLM's CPU manager: it emits the CPU spec's metrics, and the host tier's leases.
        return {**CPUOffloadingSpec.build_metric_definitions(extra_config), **METRICS}

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options = parse_extra_config(self.extra_config)
        weight_updates.install()  # in-place weight reloads drop the host tier and move L3 keys
        if len(config.groups) != 1:
            raise NotServedError(
                f"this model has {len(config.groups)} KV cache groups (hybrid or sliding-window layers); "
                "HicacheOffloadingSpec serves models with one group"
            )
        parallel = config.parallel
        if self.options.storage_url and parallel.world_size > 1:
            raise NotServedError("hicache_storage_url is served with one worker (world size 1); this has "
                                 f"{parallel.world_size}")  # fmt: skip
        self.num_layers = len(config.groups[0].layer_names)
        self.block_tokens = config.groups[0].tokens_per_block
        bytes_per_block = config.worker_kv_bytes_per_block
        self.page_bytes = bytes_per_block // self.num_layers if self.num_layers else 0
        self.num_chunks = 0
        if bytes_per_block > 0 and parallel.world_size > 0:
            # As vLLM's CPU spec: the size (cpu_bytes_to_use) covers every worker's copy of a chunk.
            per_chunk = bytes_per_block * parallel.world_size * self.blocks_per_chunk
            self.num_chunks = self.options.host_bytes // per_chunk
        self._manager: OffloadingManager | None = None
        self._worker: HicacheOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            storage = None
            if self.options.storage_url:
                if self.page_bytes * self.num_layers != self.config.worker_kv_bytes_per_block:
                    raise NotServedError("layers of unequal page size are not served with hicache_storage_url")
                storage = StorageProbe(self.options, num_layers=self.num_layers, page_bytes=self.page_bytes,
                                       block_size=self.block_tokens, model_id=self.config.model.name)  # fmt: skip
            self._manager = HicacheOffloadingManager(
                storage=storage,
                num_chunks=self.num_chunks,
                cache_policy=host_policy_name(self.extra_config.get("eviction_policy", "lru")),
                cache_policy_module_path=self.extra_config.get("cache_policy_module_path"),
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    def device_pages(self, kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
        """One ``[num_blocks, page_bytes]`` view per layer tensor, checked against what is served."""
        if len(kv_caches.group_data_refs) != 1:
            raise NotServedError(f"{len(kv_caches.group_data_refs)} KV cache groups; one is served")
        pages = []
        for t in kv_caches.tensors:
            rows = t.tensor.view(torch.int8)
            if rows.dim() != 2 or rows.shape[1] != t.page_size_bytes:
                rows = rows.view(-1, t.page_size_bytes)
            pages.append(rows)
        for ref in kv_caches.group_data_refs[0]:
            padded = kv_caches.tensors[ref.tensor_idx].page_size_bytes
            if ref.page_size_bytes != padded:
                raise NotServedError(
                    f"a layer's page is padded ({ref.page_size_bytes} of {padded} bytes used): padded pages are not "
                    "served"
                )
        total = sum(p.shape[1] for p in pages)
        if total != self.config.worker_kv_bytes_per_block:
            raise NotServedError(
                f"the worker's pages hold {total} bytes per block, vLLM's config says "
                f"{self.config.worker_kv_bytes_per_block}"
            )
        return pages

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            mover = BlockMover(
                self.device_pages(kv_caches),
                block_size=self.block_tokens,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                layout=self.options.layout,
                io_backend=self.options.io_backend,
                storage_url=self.options.storage_url,
                storage_options=self.options.storage_options,
                model_id=self.config.model.name,
                tp_rank=self.config.parallel.rank,
                tp_size=max(1, self.config.parallel.world_size),
                dp_rank=self.config.parallel.data_parallel_index,  # vLLM's own publisher's rank (its scheduler's)
            )
            served = ", ".join(sorted(set(mover.host.implementations.values())))
            logger.info("hicache host tier: %d chunks, layout %s, io backend %s (%s)%s", self.num_chunks,
                        self.options.layout, self.options.io_backend, served,
                        f", L3 {self.options.storage_url}" if self.options.storage_url else "")  # fmt: skip
            self._worker = HicacheOffloadingWorker(mover)
        return self._worker
