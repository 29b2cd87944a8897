"""The host pool: pinned host buffers in one layout, the slot allocator, and the transfer API.

:func:`make_host_pool` checks its arguments, resolves, once, the implementation of
every operation the pool will run and refuses the pool there if one is missing. The
transfer methods keep SGLang's names and arguments; per call they check arguments
cheaply, map layers, put indices where the implementation declared it wants them
(:mod:`hicache_core.pool.indices`), and call it.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Real
from time import perf_counter
from typing import Any

import torch

from .. import metrics as _metrics
from ..declared.pool_kinds import PoolKind
from ..host_memory import HostMemoryPlan, allocate, check_fits, plan_host_memory
from ..loads.layer_loads import LayerLoad
from ..loads.pool_loads import PoolLoad, submit_loads
from ..plugins.dispatch import UnsupportedCombinationError, failed_plugin_lines, resolve
from ..plugins.implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, OPERATIONS, Implementation, TransferRequest
from ..plugins.registry import Registry, get_registry
from ..settings.variables import VALIDATE
from ..verification.observer import Verification
from ..verification.verify import PageVerifier
from . import geometry as _geometry
from . import slot_events as _slot_events
from .allocator import SlotAllocator
from .drops import HISTORY_MASK, DropReport
from .geometry import PoolGeometry, pages_for
from .host_layout import HostBufferSpec, HostLayoutSpec, host_layout_spec
from .indices import IndexCache, check_bounds, check_whole_pages, reject_indices, whole_pages_mask
from .layer_map import NOT_HERE, LayerMap
from .page_access import PageAccess
from .plan import TransferPlan
from .pool_events import PoolEvents, PoolObserver
from .transfer_errors import TransferError, _note, _refuse_meta
from .validation import positive_int

_log = logging.getLogger("hicache")

ENV_VALIDATE = VALIDATE.name
DEFAULT_HOST_TO_DEVICE_RATIO = 2.0
_POOL_NUMBERS = itertools.count(1)


def make_host_pool(
    device_pool: Any,
    *,
    layout: str,
    io_backend: str,
    page_size: int | None = None,
    size: int | None = None,
    host_to_device_ratio: float | None = None,
    pin_memory: bool = True,
    draft_pools: Sequence[Any] = (),
    operations: Iterable[str] | None = None,
    implementation: str | Mapping[str, str] | None = None,
    validate: bool | None = None,
    verify: bool | None = None,
    registry: Registry | None = None,
    label: str | None = None,
    host_memory_check: Callable[[HostMemoryPlan], None] | None = None,
    layer_map: LayerMap | None = None,
) -> HostPool:
    """Build a host pool mirroring ``device_pool`` and resolve its transfers.

    :param layout: a registered layout name (``layer_first``, ``page_first``, ...).
    :param io_backend: ``"auto"``, or the io backend every transfer must use.
    :param size: host capacity in tokens (rounded up to whole pages); default
        ``host_to_device_ratio`` (2.0) times the device pool's. Like SGLang, a host pool
        smaller than its device pool is refused: the host tier backs the device tier up.
    :param pin_memory: pin the host buffers (where CUDA exists).
    :param draft_pools: MTP draft device pools (one layer each), stored after the target layers.
    :param operations: the operations this pool will run; each is resolved now. Default: load and
        all-layer backup, plus per-layer backup for layer-sharded pools.
    :param implementation: force one implementation by name (or a mapping operation -> name).
    :param validate: check index bounds and page structure on every call (default: ``HICACHE_VALIDATE``).
    :param verify: host-tier verification (:mod:`hicache_core.verification.verify`): checksums taken on the device at
        backup and checked on the device after every load. ``True``: a pool it cannot verify is refused
        here. Default: ``HICACHE_VERIFY``, and where that is unset, on for CUDA pools that can be verified
        and off for CPU pools (``host.verify_reason`` says which and why). ``HICACHE_VALIDATE`` does not imply it.
    :param label: names the pool in logs, errors and the ``hicache_host_pinned_bytes`` metric.
    :param host_memory_check: called with the pool's :class:`~hicache_core.host_memory.HostMemoryPlan`
        before any byte is taken (a server's own budget: the SGLang adapter passes SGLang's); raise to refuse.
    :param layer_map: the caller's layer numbering (:class:`~hicache_core.pool.layer_map.LayerMap`); default: absolute
        model layers, of which this rank keeps ``[start_layer, end_layer)``, then one id per draft pool.
    :raises UnsupportedCombinationError: no installed implementation claims an operation.
    :raises hicache_core.host_memory.HostMemoryError: the host buffers would not fit in this machine's
        available memory or this process's cgroup (checked before anything is allocated).
    :raises ValueError, TypeError: an argument that would otherwise be coerced silently.
    """
    registry = registry or get_registry()
    geometry = _geometry.geometry_of(
        device_pool, page_size=page_size, draft_pools=tuple(draft_pools), pool_kinds=registry.pool_kinds
    )
    layout_decl = _layout(registry, layout, io_backend)
    size = _host_size(device_pool, size, host_to_device_ratio)
    pinned = bool(pin_memory) and geometry.device_type == "cuda" and torch.cuda.is_available()
    resolved, deferred = _resolve(registry, geometry, layout_decl, io_backend, pinned, operations, implementation)
    spec = host_layout_spec(geometry, layout_decl, pages_for(size, geometry.page_size))
    device_layers = _device_layers(device_pool, tuple(draft_pools), geometry)
    label = label or f"host pool {next(_POOL_NUMBERS)} ({geometry.kind}, layout {spec.layout.name})"
    device = next(iter(device_layers.values()))[0].device
    memory = plan_pool_memory(geometry, spec, label=label, pinned=pinned, device=device)
    if host_memory_check is not None:  # the server's own budget first: its refusal is the one its users know
        host_memory_check(memory)
    check_fits(memory)
    buffers = allocate(memory, {b.attr: (b.shape, geometry.dtype) for b in spec.buffers},
                       granules={b.attr: _page_bytes(b, geometry.dtype) for b in spec.buffers})  # fmt: skip
    plan = TransferPlan(geometry, spec, buffers, device_layers, DropReport(pinned, label=label))
    validate = VALIDATE.read() if validate is None else bool(validate)
    pool = HostPool(device_pool, tuple(draft_pools), geometry, spec, plan, resolved, deferred, io_backend, validate,
                    registry, label, layer_map)  # fmt: skip
    pool.verification.decide(verify)
    pool.host_memory = memory
    _log.info("%s; %d tokens, %d bytes per token; %s", memory.summary(), pool.size, pool.get_size_per_token(),
              pool.verify_reason)  # fmt: skip
    return pool


def _layout(registry: Registry, layout: str, io_backend: str) -> Any:
    """The registered declaration of ``layout``; an unknown one is refused, naming those registered."""
    layout_decl = registry.layouts.get(layout) if isinstance(layout, str) else None
    if layout_decl is None:
        known = ", ".join(sorted(registry.layouts))
        failed = "".join("\n" + line for line in failed_plugin_lines(registry))  # a refused plugin's layout: why
        raise UnsupportedCombinationError(
            f"Unknown layout {layout!r}. Registered layouts: {known}. "
            f"(A plugin adds layouts through the hicache_register_layouts hook.){failed}",
            io_backend=io_backend,
            layout=layout,
        )
    return layout_decl


def _host_size(device_pool: Any, size: int | None, ratio: float | None) -> int:
    """The host capacity in tokens: ``size``, or ``ratio`` (default 2.0) times the device pool's; never smaller."""
    if size is not None:
        size = positive_int(size, "size (host capacity in tokens)")
    ratio_ok = not isinstance(ratio, bool) and isinstance(ratio, Real)
    if ratio is not None and not (ratio_ok and ratio > 0):
        raise ValueError(f"host_to_device_ratio must be a number > 0, got {ratio!r}")
    device_size = _device_size(device_pool)
    if size is None:
        if device_size is None:
            raise ValueError("cannot size the host pool: pass size= (tokens), or a device pool with a size")
        size = max(1, int(device_size * (DEFAULT_HOST_TO_DEVICE_RATIO if ratio is None else float(ratio))))
    if device_size is not None and size < device_size:
        raise ValueError(
            f"the host pool ({size} tokens) would be smaller than its device pool ({device_size} tokens). The host "
            "tier backs the device tier up (SGLang refuses this too); pass size >= the device pool's size, or a "
            "host_to_device_ratio >= 1. (size counts tokens, not bytes or GB.) Changed in hicache-core 0.2.0: "
            "0.1 accepted a host pool smaller than its device pool."
        )
    return size


def _resolve(registry: Registry, geometry: PoolGeometry, layout_decl: Any, io_backend: str, pinned: bool,
             operations: Iterable[str] | None, implementation: str | Mapping[str, str] | None,
             ) -> tuple[dict[str, type[Implementation]], dict[str, UnsupportedCombinationError]]:  # fmt: skip
    """Every operation's implementation: those ``operations`` needs, or the pool is refused; the others when
    one claims them (else the reason, raised at their first call)."""
    required = list(operations) if operations is not None else default_operations(geometry)
    named = list(implementation) if isinstance(implementation, Mapping) else []
    for op in required + named:
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; operations: {', '.join(OPERATIONS)}")
    resolved: dict[str, type[Implementation]] = {}
    deferred: dict[str, UnsupportedCombinationError] = {}
    for op in OPERATIONS:
        request = TransferRequest(io_backend, op, geometry, layout_decl, pinned)
        force = implementation.get(op) if isinstance(implementation, Mapping) else implementation
        try:
            resolved[op] = resolve(registry, request, force=force)
        except UnsupportedCombinationError as exc:
            if op in required:
                raise
            deferred[op] = exc
    if io_backend == "auto" and implementation is None:
        # Per operation, auto may hold several implementations and choose per call by token count
        # (a measured profile, else the static rule: hicache_core.plugins.autoselect).
        from ..plugins.autoselect import auto_class

        resolved = {
            op: auto_class(registry, TransferRequest(io_backend, op, geometry, layout_decl, pinned), cls)
            for op, cls in resolved.items()
        }
    return resolved, deferred


def plan_pool_memory(geometry: PoolGeometry, spec: HostLayoutSpec, *, label: str, pinned: bool,
                     device: torch.device | None) -> HostMemoryPlan:  # fmt: skip
    """The host memory a pool of ``spec`` will take: its buffers (what :func:`make_host_pool` allocates)."""
    size = torch.empty((), dtype=geometry.dtype).element_size()
    return plan_host_memory({b.attr: math.prod(b.shape) * size for b in spec.buffers}, label=label, pinned=pinned,
                            device=device)  # fmt: skip


def _page_bytes(buffer: HostBufferSpec, dtype: torch.dtype) -> int:
    """Bytes from one host page of ``buffer`` to the next: no copy of one page crosses such a boundary."""
    inner = buffer.full_shape[buffer.axes.index("page") + 1 :] if "page" in buffer.axes else ()
    return math.prod(inner) * torch.empty((), dtype=dtype).element_size()


def geometry_of(
    device_pool: Any,
    *,
    page_size: int | None = None,
    draft_pools: tuple = (),
    pool_kinds: Mapping[str, PoolKind] | None = None,
) -> PoolGeometry:
    """Read the geometry of any object shaped like SGLang's device pools (duck typing).

    A door: ``pool_kinds`` defaults to the process registry's (:func:`hicache_core.get_registry`).
    """
    kinds = get_registry().pool_kinds if pool_kinds is None else pool_kinds
    return _geometry.geometry_of(device_pool, page_size=page_size, draft_pools=draft_pools, pool_kinds=kinds)


def pool_kind_of(device_pool: Any, pool_kinds: Mapping[str, PoolKind] | None = None) -> PoolKind:
    """The pool kind of ``device_pool``, among ``pool_kinds`` (default: the process registry's)."""
    return _geometry.pool_kind_of(device_pool, get_registry().pool_kinds if pool_kinds is None else pool_kinds)


def _device_size(device_pool: Any) -> int | None:
    """The device pool's capacity in tokens, where it says (SGLang's pools have ``size``)."""
    size = getattr(device_pool, "size", None)
    try:
        size = operator.index(size)
    except TypeError:
        return None
    return size if size > 0 else None


def default_operations(geometry: PoolGeometry) -> list[str]:
    """What a server runs: load and all-layer backup; per-layer backup too when layer-sharded."""
    return [LOAD, BACKUP_ALL, BACKUP_LAYER] if geometry.sharded else [LOAD, BACKUP_ALL]


def _device_layers(device_pool, draft_pools, geometry: PoolGeometry) -> dict[str, list[torch.Tensor]]:
    """Per component attribute, the device tensor of each host layer (owned layers, then drafts)."""
    return {
        comp.attr: list(getattr(device_pool, comp.attr)) + [getattr(d, comp.attr)[0] for d in draft_pools]
        for comp in geometry.components
    }


_INT64, _INT32 = torch.int64, torch.int32


class HostPool(PageAccess):
    """Pinned host memory mirroring a device pool in one layout (SGLang's ``HostKVCache`` API).

    Attributes follow SGLang: the buffers the pool kind and layout declare (``kv_buffer``,
    ``k_buffer``/``v_buffer``, ``index_k_with_scale_buffer``, ...), ``layout``,
    ``page_size``, ``page_num``, ``size`` (tokens), ``layer_num`` (host layers: owned
    plus draft), ``dtype``, ``pin_memory``. ``implementations`` maps each resolved
    operation to the implementation serving it.

    Indices: token slots (whole pages for page-item kinds), int32 or int64, on the CPU or
    the pool's device; each implementation gets them where it declared it wants them
    (``index_device``), converted once per index tensor (see :mod:`hicache_core.pool.indices`).
    Out-of-range indices raise in the call (``validate``, or implementations that check on
    the host) or, where a kernel masks them, at the next call (:mod:`hicache_core.pool.drops`).
    """

    def __init__(
        self,
        device_pool: Any,
        draft_pools: tuple,
        geometry: PoolGeometry,
        spec: HostLayoutSpec,
        plan: TransferPlan,
        resolved: dict[str, type[Implementation]],
        deferred: dict[str, UnsupportedCombinationError],
        io_backend: str,
        validate: bool,
        registry: Registry,
        label: str = "host pool",
        layer_map: LayerMap | None = None,
    ) -> None:
        self.device_pool = device_pool
        #: Names the pool in logs, errors and the ``hicache_host_pinned_bytes`` metric.
        self.label = label
        #: What the host buffers took (:class:`~hicache_core.host_memory.HostMemoryPlan`), set by make_host_pool.
        self.host_memory: HostMemoryPlan | None = None
        self.registry = registry
        self.draft_pools = draft_pools
        self.geometry = geometry
        self.spec = spec
        self.plan = plan
        self.layout = spec.layout.name
        self.page_size = geometry.page_size
        self.page_num = spec.num_pages
        self.size = spec.num_pages * geometry.page_size
        self.layer_num = geometry.host_layers
        self.start_layer, self.end_layer = geometry.start_layer, geometry.end_layer
        self.dtype = geometry.dtype
        self.device = "cpu"
        self.pin_memory = any(t.is_pinned() for t in plan.host_buffers.values()) if torch.cuda.is_available() else False
        self.io_backend = io_backend
        self.validate = validate
        self.kv_buffer = self.k_buffer = self.v_buffer = None
        for attr, tensor in plan.host_buffers.items():
            setattr(self, attr, tensor)
        for alias in spec.aliases:
            setattr(self, alias.attr, self._alias_view(alias))
        self.allocator = SlotAllocator(self.size, self.page_size)
        self._destroyed = False

        instances: dict[type[Implementation], Implementation] = {}
        self._impls: dict[tuple[str, str], tuple[Implementation, bool, frozenset, torch.device]] = {}
        self.implementations: dict[str, str] = {}
        for op, cls in resolved.items():
            impl = instances.get(cls)
            if impl is None:
                try:
                    impl = instances[cls] = cls(plan)
                except (ValueError, IndexError, TypeError) as exc:
                    _note(cls, "binding to the host pool", exc)
                    raise
                except Exception as exc:
                    raise TransferError(cls, registry.plugin_of(cls.name), "binding to the host pool", exc) from exc
            target = plan.device if cls.index_device == "device" else torch.device("cpu")
            cuda = target.type == "cuda"
            if cuda and target.index is None:
                target = torch.device("cuda", torch.cuda.current_device())
            # (implementation, wants CUDA indices, index dtypes, where, that device's index as get_device() says it)
            entry = (impl, cuda, cls.index_dtypes, target, target.index if cuda else -1)
            for name in {io_backend, cls.io_backend}:
                self._impls[(op, name)] = entry
            self.implementations[op] = cls.name
        self._deferred = deferred
        self._owned = geometry.owned_layers
        #: The callers' layer numbering: which host layer a layer id names (:mod:`hicache_core.pool.layer_map`).
        self.layer_map = layer_map or LayerMap.owned_range(
            geometry.layer_num, self.start_layer, self.end_layer, device_pool=device_pool, draft_pools=draft_pools,
            skipped=f"is not owned by this rank (it owns layers [{self.start_layer}, {self.end_layer}) of "
                    f"{geometry.layer_num}; hicache's layer ids are absolute)",
        )  # fmt: skip
        if self.layer_map.host_layers != self.layer_num:
            raise ValueError(f"the layer map addresses {self.layer_map.host_layers} host layers; the {label} keeps "
                             f"{self.layer_num}")  # fmt: skip
        self._host_of, self._map_pool = self.layer_map.host_of, self.layer_map.device_pool
        self._items_are_pages = geometry.items_are_pages
        self._num_items = plan.num_items
        self._rows = plan.device_rows_per_layer
        self._drops = plan.drop_report
        self._drop_word, self._drop_calls = plan.drop_report._value, plan.drop_report._calls
        self._drop_numbers, self._call_now = plan.drop_report.numbers, plan.drop_report.current
        self._cache = IndexCache()
        self._malformed_on_device: torch.Tensor | None = None
        self._index_stream: Any = None  # where a layer-wise load's indices are converted (CUDA)
        host_bytes = sum(t.numel() * t.element_size() for t in plan.host_buffers.values())
        self._layer_page_bytes = host_bytes // max(1, spec.num_pages) // max(1, self.layer_num)
        _metrics.track_host_pool(self)
        self._on = PoolEvents()
        self.observe(_metrics.TRANSFER_METRICS)
        _slot_events.attach_deprecated(self)
        #: Host-tier verification (:mod:`hicache_core.verification.observer`): on or off, why, and its observer.
        self.verification = Verification(self)

    # ---- observers (hicache_core.pool.pool_events) ---------------------------------------------------

    def observe(self, observer: PoolObserver) -> None:
        """Tell ``observer`` of this pool's events from now on (:class:`~hicache_core.pool.pool_events.PoolObserver`).
        """
        self._on.add(observer)

    def unobserve(self, observer: PoolObserver) -> None:
        """Stop telling ``observer`` (one that does not observe this pool raises ``ValueError``)."""
        self._on.remove(observer)

    @property
    def observers(self) -> tuple[PoolObserver, ...]:
        """The observers of this pool, in the order they are told."""
        return self._on.observers

    @property
    def verifier(self) -> PageVerifier | None:
        """Host-tier verification's checksum table and words (:mod:`hicache_core.verification.verify`); ``None``: not
        verifying."""
        return self.verification.verifier

    @verifier.setter
    def verifier(self, verifier: PageVerifier | None) -> None:
        self.verification.use(verifier)

    @property
    def verify(self) -> bool:
        """Whether this pool verifies its pages now."""
        return self.verification.verifier is not None

    @property
    def verify_reason(self) -> str:
        """Whether the pool verifies, and why (``"on: ..."``, ``"off: ..."``)."""
        return self.verification.reason

    def _alias_view(self, alias) -> torch.Tensor:
        buffer = getattr(self, alias.buffer)
        if alias.component is None:
            return buffer
        spec = next(b for b in self.spec.buffers if b.attr == alias.buffer)
        dim = spec.dim_of("component")
        if dim is not None:
            return buffer.select(dim, alias.component)
        # The component axis is merged with another: name the component in the unmerged shape.
        return buffer.view(spec.full_shape).select(spec.axes.index("component"), alias.component)

    def _plugin_of(self, impl: Implementation) -> str:
        return self.registry.plugin_of(impl.name)

    def implementation_for(self, operation: str, io_backend: str | None = None) -> Implementation:
        """The implementation instance serving ``operation`` (to inspect it, or tune it, e.g. ``max_ctas``)."""
        return self._impl(operation, self.io_backend if io_backend is None else io_backend)[0]

    def check_dropped(self, synchronize: bool = True) -> None:
        """Raise :class:`~hicache_core.pool.drops.DroppedIndicesError` if a kernel masked indices of an earlier call.

        Every transfer call checks this itself, without waiting for the GPU; this waits for the
        device first (``synchronize=True``), so that transfers already launched are covered too.
        """
        self._alive()
        if synchronize and self.plan.device.type == "cuda":
            torch.cuda.synchronize(self.plan.device)
        self._drops.raise_if_dropped()

    def check_verified(self, synchronize: bool = True) -> None:
        """Raise :class:`~hicache_core.verification.verify.PageVerificationError` if a load's pages failed their
        checksums.

        Every transfer call checks this itself, without waiting for the GPU; this waits for the
        device first (``synchronize=True``). A pool made without ``verify`` has nothing to report.
        """
        self._alive()
        self.verification.check(synchronize)

    def take_failed_pages(self) -> torch.Tensor:
        """Token slots (whole pages, int64) of host pages that failed verification and were not taken yet.

        For the server's radix tree: evict the nodes holding them and free the slots (freeing lifts their
        quarantine; until then the storage controller never writes them to L3). Reads what the device
        reported so far without waiting for it; empty for a pool that does not verify.
        """
        self._alive()
        return self.verification.take_failed()

    def verify_stats(self) -> dict[str, int]:
        """Host-tier verification counters (for metrics): pages and calls that failed, pages quarantined now."""
        self._alive()
        return self.verification.stats()

    def quarantined_pages(self) -> set[int]:
        """Host pages that failed verification and whose slots were not freed yet (a copy)."""
        self._alive()
        return self.verification.quarantined()

    # ---- allocator ---------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free host slots (whole pages), or ``None`` when the pool is full."""
        self._alive()
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Give slots back (whole pages); a slot never allocated, or freed twice, raises."""
        self._alive()
        heard = self._on.slots_freed
        if heard:  # before the slots can be handed out again (a peer may be reading them)
            slots = self.allocator.checked(indices)
            for tell in heard:
                tell(slots)
        return self.allocator.free(indices)

    def available_size(self) -> int:
        """Free host slots, in tokens (always whole pages)."""
        self._alive()
        return self.allocator.available_size()

    def clear(self) -> None:
        self._alive()
        for tell in self._on.slots_freed:
            tell(None)
        self.allocator.clear()

    # ---- transfers ---------------------------------------------------------------------------

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        """Copy one layer of the given slots host -> device, on the current stream.

        A layer this rank does not own is a no-op (reported under ``validate``); ``is_draft``
        addresses MTP draft layer ``layer_id - layer_num`` (device layer 0 of the draft pool passed).
        """
        self._per_layer(LOAD, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft)

    def backup_from_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        """Copy one layer of the given slots device -> host (what a layer-sharded pool runs per owned layer)."""
        self._per_layer(BACKUP_LAYER, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft)

    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        """Copy every owned layer and every draft layer of the given slots device -> host."""
        entry = self._impl(BACKUP_ALL, io_backend)
        self.layer_map.check_pool(device_pool, self.label)
        h, d = self._indices(BACKUP_ALL, None, host_indices, device_indices, entry, None)
        if h is not None:
            self._per_layer(BACKUP_ALL, device_pool, h, d, None, io_backend, False, (entry[0], h, d, None, None, 0))

    def submit_load(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
        *,
        layer_ids: Sequence[int] | None = None,
        start_event: Any = None,
        timing: bool = False,
    ) -> LayerLoad:
        """Load the given slots host -> device for every owned layer (or ``layer_ids``, in order), off
        the caller's thread; returns at once (:mod:`hicache_core.loads.layer_loads`).

        The copies follow what the caller's current stream holds now (or ``start_event``, already
        recorded). ``load.wait(i)`` orders the current stream after the ``i``-th layer of the list;
        a layer's error is raised there. Arguments are checked here, before anything is queued.
        ``timing``: the load's start and finish events time it (``load.start_event.elapsed_time``).
        """
        ids = list(self.layer_map.kept_ids) if layer_ids is None else list(layer_ids)
        part = self.prepare_load(device_pool, host_indices, device_indices, io_backend, ids, after=start_event)
        return submit_loads([part], len(ids), start_event=start_event, timing=timing,
                            what=f"load of {host_indices.shape[0]} slots into {len(ids)} layers")  # fmt: skip

    def prepare_load(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                     io_backend: str, layer_ids: Sequence[int | None], *, is_draft: bool = False,
                     after: Any = None) -> PoolLoad:  # fmt: skip
        """This pool's part of a layer-wise load (:func:`hicache_core.loads.pool_loads.submit_loads`): step ``i`` loads
        layer ``layer_ids[i]`` (``None``: nothing). Every layer id is mapped here and the indices are checked and
        converted here, once (a bad argument raises before anything is queued); on CUDA on a stream of the
        pool's, after ``after`` (an event already recorded; default: what the current stream holds now)."""
        entry = self._impl(LOAD, io_backend)
        layers = [None if i is None else (i, self._host_layer(device_pool, i, is_draft)) for i in layer_ids]
        layers = [None if m is None or m[1] == NOT_HERE else m for m in layers]
        ready = None
        if self.plan.device.type != "cuda":
            h, d = self._indices(LOAD, None, host_indices, device_indices, entry, None, number=False)
        else:  # the load's copies follow `ready`, and nothing more of the caller's stream than before
            side = self._index_stream = self._index_stream or torch.cuda.Stream(self.plan.device)
            if after is None:
                side.wait_stream(torch.cuda.current_stream(self.plan.device))
            else:
                side.wait_event(after)
            with torch.cuda.stream(side):
                h, d = self._indices(LOAD, None, host_indices, device_indices, entry, None, number=False)
                ready = torch.cuda.Event()
                ready.record(side)
        count = sum(m is not None for m in layers)
        started_by = self._on.load_started if entry[0].load_check is None else ()  # loads that check in the copy
        watches = [w for started in started_by if (w := started(count, entry[0].engine)) is not None]
        return PoolLoad(self, entry[0], device_pool, io_backend, (host_indices, device_indices), h, d, layers,
                        watches, ready)  # fmt: skip

    def _per_layer(self, op, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft,
                   prepared: tuple | None = None) -> None:  # fmt: skip
        """One transfer call: map, check, copy, tell the observers. ``prepared``: a call whose indices were checked
        and converted already, ``(impl, h, d, host layer or None, the load's watches or None, items to number the
        call by or 0)``."""
        try:
            if prepared is None:
                entry = self._impls.get((op, io_backend)) or self._impl(op, io_backend)
                # The common call (a kept target layer, an int layer id) is mapped inline; the rest, and every
                # error, goes through the layer map.
                host_of, pool = self._host_of, self._map_pool
                if (
                    is_draft
                    or type(layer_id) is not int
                    or not 0 <= layer_id < len(host_of)
                    or (layer := host_of[layer_id]) is None
                    or (pool is not None and device_pool is not pool)
                ):
                    layer = self._host_layer(device_pool, layer_id, is_draft)
                h, d = self._indices(op, layer_id, host_indices, device_indices, entry, layer)
                if h is None:
                    return
                impl, heard = entry[0], None
            else:
                impl, h, d, layer, heard, n = prepared
                if n:
                    self._alive()
                    self._begin(op, layer_id, n)
            on = self._on
            if op != LOAD:
                for tell in on.before_backup:
                    tell()
            timed = on.transferred
            t0 = perf_counter() if timed else 0.0
            try:  # inline rather than through a helper: this is the per-layer hot path
                if layer is None:
                    getattr(impl, op)(h, d)
                else:
                    getattr(impl, op)(h, d, layer)
            except (ValueError, IndexError, TypeError) as exc:
                _refuse_meta(h, d)
                _note(impl, op, exc)
                raise
            except Exception as exc:
                _refuse_meta(h, d)
                raise TransferError(impl, self._plugin_of(impl), op, exc) from exc
            if timed:
                items = h.numel()
                pages = items if self._items_are_pages else items // self.page_size
                seconds = perf_counter() - t0
                nbytes = pages * self._layer_page_bytes * (1 if layer is not None else self.layer_num)
                for tell in timed:
                    tell(op, impl.name, pages, nbytes, seconds)
            if heard is None:  # a load whose copy checked its pages is nobody's news
                heard = (on.after_load if impl.load_check is None else ()) if op == LOAD else on.after_backup
            if heard:
                seq = self._call_now.seq
                for tell in heard:
                    tell(h, d, layer, seq)
        except BaseException:
            for tell in self._on.call_failed:
                tell()
            raise

    def _impl(self, op: str, io_backend: str):
        entry = self._impls.get((op, io_backend))
        if entry is not None:
            return entry
        self._alive()
        if op in self._deferred:
            raise ValueError(
                f"this host pool was not made to run {op} (pass operations=... to make_host_pool to resolve it "
                f"at construction):\n{self._deferred[op]}"
            )
        made = sorted({name for (o, name) in self._impls if o == op})
        raise ValueError(f"io_backend {io_backend!r} was not resolved for this host pool; it was made with {made}")

    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(
                "this host pool was destroyed (destroy() released its memory): make a new one with make_host_pool"
            )

    def _host_layer(self, device_pool: Any, layer_id: int, is_draft: bool) -> int:
        return self.layer_map.host_layer(device_pool, layer_id, is_draft, self.label, self.validate)

    def _indices(self, op: str, layer_id, host_indices, device_indices, entry, layer: int | None,
                 number: bool = True):  # fmt: skip
        """Checked indices, where and as the implementation wants them; ``(None, None)`` when nothing moves.
        ``number``: the call moves bytes now (else a layer-wise load's one check: its layers are numbered)."""
        # The hot path: a handful of attribute reads, the cheapest ones (a small load's cost is host time),
        # no allocation unless indices must move.
        try:
            hd, dd, shape = host_indices.dtype, device_indices.dtype, host_indices.shape
            ok = (
                (hd is _INT64 or hd is _INT32)
                and (dd is _INT64 or dd is _INT32)
                and len(shape) == 1
                and device_indices.shape == shape
            )
        except (AttributeError, TypeError):
            ok = False
        if not ok:
            reject_indices(host_indices, device_indices)
        n = shape[0]
        if n % self.page_size:
            if self._items_are_pages:
                raise ValueError(
                    f"indices must come in whole pages: got {n} slots with page_size {self.page_size} "
                    "(page-item pools move whole pages)"
                )
            # A checksum covers a whole page: verification stops, or (asked for) refuses, before any byte moves.
            for tell in self._on.handed_out:
                tell(None, f"a call moved {n} slots, part of a page (page_size {self.page_size}), and a checksum "
                           "covers whole pages")  # fmt: skip
        if n == 0 or layer == NOT_HERE:
            if layer == NOT_HERE and self.validate and n:
                check_bounds(host_indices, self.size, "host_indices")
            return None, None
        if number:
            drops = self._drops  # _begin, inline
            if self._drop_word.value or (self._malformed_on_device is not None and drops._malformed.value):
                drops.raise_if_dropped()
            for tell in self._on.before_call:
                tell()
            seq = self._call_now.seq = next(self._drop_numbers)
            self._drop_calls[seq & HISTORY_MASK] = (op, layer_id, n, seq)
        elif self._items_are_pages and not self.validate and (host_indices.is_cuda or device_indices.is_cuda):
            self._drops.begin(op, None, n)  # pages are checked on the device: a bad one names the load
        if self._items_are_pages:
            host_indices = self._page_items(host_indices, "host_indices")
            device_indices = self._page_items(device_indices, "device_indices")
        if self.validate:
            check_bounds(host_indices, self._num_items, "host_indices")
            rows = self._rows[layer] if layer is not None else min(self._rows)  # all layers: the fewest rows
            check_bounds(device_indices, rows, "device_indices")
        _, want_cuda, dtypes, target, where = entry
        # get_device() (-1 on the CPU) rather than .device, which builds an object on every call.
        if host_indices.is_cuda is not want_cuda or host_indices.get_device() != where or hd not in dtypes:
            host_indices = self._cache.move(host_indices, hd if hd in dtypes else torch.int64, target)
        if device_indices.is_cuda is not want_cuda or device_indices.get_device() != where or dd not in dtypes:
            device_indices = self._cache.move(device_indices, dd if dd in dtypes else torch.int64, target)
        return host_indices, device_indices

    def _begin(self, op: str, layer_id, n: int) -> None:
        """A call that moves bytes: earlier calls' failures are raised first, then it takes its number."""
        drops = self._drops
        if self._drop_word.value or (self._malformed_on_device is not None and drops._malformed.value):
            drops.raise_if_dropped()
        for tell in self._on.before_call:
            tell()
        seq = self._call_now.seq = next(self._drop_numbers)  # DropReport.begin, inline
        self._drop_calls[seq & HISTORY_MASK] = (op, layer_id, n, seq)

    def _page_items(self, slots: torch.Tensor, what: str) -> torch.Tensor:
        """Page-item pools: whole pages of token slots -> page numbers (checked; converted once per tensor)."""
        key = ("pages", self.page_size)
        hit = self._cache.lookup(slots, key)
        if hit is not None:
            return hit
        p = self.page_size
        if slots.is_meta:
            raise ValueError(f"{what} is on the meta device, which holds no values: pass real indices")
        if p > 1:
            if self.validate or not slots.is_cuda:
                check_whole_pages(slots, p, what)
            else:
                self._check_pages_on_device(slots)
        return self._cache.store(slots, key, slots[::p] // p)

    def _check_pages_on_device(self, slots: torch.Tensor) -> None:
        """Check GPU slots for whole pages without a sync: a bad call's number reaches the drop word."""
        flag = self._malformed_on_device
        if flag is None or flag.device != slots.device:
            flag = self._malformed_on_device = torch.zeros(1, dtype=torch.int64, device=slots.device)
        bad = whole_pages_mask(slots, self.page_size).to(torch.int64) * self._call_now.seq
        # A running maximum, so that a later good call can never overwrite an earlier bad one.
        torch.maximum(flag, bad.reshape(1), out=flag)
        self._drops.word[1:2].copy_(flag, non_blocking=True)

    def destroy(self) -> None:
        """Release the host buffers and everything bound to them; every later call raises "destroyed".

        Implementations, the transfer plan, the page views and cached indices all hold views of
        the buffers, so all of them are dropped; the host memory (:mod:`hicache_core.host_memory`) is
        unpinned and unmapped when its last view goes. Views of the buffers that the caller kept stay
        valid and keep their memory alive (and pinned) until they go.
        """
        if self._destroyed:
            return
        self._destroyed = True
        self._impls.clear()
        self._cache.clear()
        self._malformed_on_device = None
        # The drop word's memory goes with the pool: nothing may read its address after this.
        self._drops = None  # type: ignore[assignment]
        self._drop_word = ctypes.c_int64(0)
        self.verification.use(None)  # its events hold the verifier's methods: they go with it
        self._on = PoolEvents()
        self.implementations = {}
        for attr in [b.attr for b in self.spec.buffers] + [a.attr for a in self.spec.aliases]:
            setattr(self, attr, None)
        self.kv_buffer = self.k_buffer = self.v_buffer = None
        self.plan = None  # type: ignore[assignment]
        self.allocator = None  # type: ignore[assignment]
        gc.collect()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if self.pin_memory and empty_host_cache is not None:
            empty_host_cache()

    def get_size_per_token(self) -> int:
        """Host bytes per token slot, all host layers and parts."""
        self._alive()
        return sum(t.numel() * t.element_size() for t in self.plan.host_buffers.values()) // self.size

    def __repr__(self) -> str:
        if self._destroyed:
            return f"<HostPool {self.geometry.kind} layout={self.layout} destroyed>"
        shapes = ", ".join(f"{b.attr}{tuple(b.shape)}" for b in self.spec.buffers)
        return f"<HostPool {self.geometry.kind} layout={self.layout} {shapes} implementations={self.implementations}>"
