"""The host pool: pinned host buffers in one layout, the slot allocator, and the transfer API.

:func:`make_host_pool` resolves, once, the implementation of every operation the
pool will run and refuses the pool there if one is missing. The transfer methods
keep SGLang's names and arguments; per call they check arguments cheaply, map
layers, move indices where the implementation declared it wants them, and call it.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .allocator import SlotAllocator
from .dispatch import UnsupportedCombinationError, resolve
from .drops import DropReport
from .geometry import HostLayoutSpec, PoolGeometry, geometry_of, host_layout_spec, pages_for
from .implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, OPERATIONS, Implementation, TransferRequest
from .plan import TransferPlan
from .registry import Registry, get_registry

ENV_VALIDATE = "HICACHE_VALIDATE"
DEFAULT_HOST_TO_DEVICE_RATIO = 2.0
_INDEX_DTYPES = (torch.int32, torch.int64)


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
    registry: Registry | None = None,
) -> HostPool:
    """Build a host pool mirroring ``device_pool`` and resolve its transfers.

    :param layout: a registered layout name (``layer_first``, ``page_first``, ...).
    :param io_backend: ``"auto"``, or the io backend every transfer must use.
    :param size: host capacity in tokens; default ``host_to_device_ratio`` (2.0) times the device pool's.
    :param pin_memory: pin the host buffers (where CUDA exists).
    :param draft_pools: MTP draft device pools (one layer each), stored after the target layers.
    :param operations: the operations this pool will run; each is resolved now. Default: load and
        all-layer backup, plus per-layer backup for layer-sharded pools.
    :param implementation: force one implementation by name (or a mapping operation -> name).
    :param validate: check index bounds and page structure on every call (default: ``HICACHE_VALIDATE``).
    :raises UnsupportedCombinationError: no installed implementation claims an operation.
    """
    registry = registry or get_registry()
    geometry = geometry_of(device_pool, page_size=page_size, draft_pools=tuple(draft_pools))
    layout_decl = registry.layouts.get(layout) if isinstance(layout, str) else None
    if layout_decl is None:
        known = ", ".join(sorted(registry.layouts))
        raise UnsupportedCombinationError(
            f"Unknown layout {layout!r}. Registered layouts: {known}. "
            "(A plugin adds layouts through the hicache_register_layouts hook.)",
            io_backend=io_backend,
            layout=layout,
        )
    pinned = bool(pin_memory) and geometry.device_type == "cuda" and torch.cuda.is_available()
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

    device_size = int(getattr(device_pool, "size", 0) or 0)
    if size is None:
        ratio = DEFAULT_HOST_TO_DEVICE_RATIO if host_to_device_ratio is None else float(host_to_device_ratio)
        size = int(device_size * ratio)
        if size <= 0:
            raise ValueError("cannot size the host pool: pass size= (tokens), or a device pool with a size")
    spec = host_layout_spec(geometry, layout_decl, pages_for(int(size), geometry.page_size))
    buffers = {
        b.attr: torch.empty(b.shape, dtype=geometry.dtype, device="cpu", pin_memory=pinned) for b in spec.buffers
    }
    device_layers = _device_layers(device_pool, tuple(draft_pools), geometry)
    plan = TransferPlan(geometry, spec, buffers, device_layers, DropReport(pinned))
    if validate is None:
        validate = os.environ.get(ENV_VALIDATE, "") not in ("", "0")
    return HostPool(
        device_pool, tuple(draft_pools), geometry, spec, plan, resolved, deferred, io_backend, validate, registry
    )


def default_operations(geometry: PoolGeometry) -> list[str]:
    """What a server runs: load and all-layer backup; per-layer backup too when layer-sharded."""
    return [LOAD, BACKUP_ALL, BACKUP_LAYER] if geometry.sharded else [LOAD, BACKUP_ALL]


def _device_layers(device_pool, draft_pools, geometry: PoolGeometry) -> dict[str, list[torch.Tensor]]:
    """Per component attribute, the device tensor of each host layer (owned layers, then drafts)."""
    return {
        comp.attr: list(getattr(device_pool, comp.attr)) + [getattr(d, comp.attr)[0] for d in draft_pools]
        for comp in geometry.components
    }


class HostPool:
    """Pinned host memory mirroring a device pool in one layout (SGLang's ``HostKVCache`` API).

    Attributes follow SGLang: ``kv_buffer`` (and ``k_buffer``/``v_buffer`` where a pool
    kind splits them), ``layout``, ``page_size``, ``page_num``, ``size`` (tokens),
    ``layer_num`` (host layers: owned plus draft), ``dtype``, ``pin_memory``.
    ``implementations`` maps each resolved operation to the implementation serving it.
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
    ) -> None:
        self.device_pool = device_pool
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
        for alias, target in spec.aliases:
            setattr(self, alias, getattr(self, target))
        if self.k_buffer is None and self.kv_buffer is not None and len(spec.parts) == 2:
            self.k_buffer, self.v_buffer = self.kv_buffer[0], self.kv_buffer[1]
        self.allocator = SlotAllocator(self.size, self.page_size)

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
            entry = (impl, target.type == "cuda", cls.index_dtypes, target)
            for name in {io_backend, cls.io_backend}:
                self._impls[(op, name)] = entry
            self.implementations[op] = cls.name
        self._deferred = deferred
        self._model_layers = geometry.layer_num
        self._owned = geometry.owned_layers
        self._items_are_pages = geometry.items_are_pages
        self._num_items = plan.num_items
        self._rows = plan.device_rows_per_layer
        self._drops = plan.drop_report

    def _plugin_of(self, impl: Implementation) -> str:
        return self.registry.plugin_of(impl.name)

    def implementation_for(self, operation: str, io_backend: str | None = None) -> Implementation:
        """The implementation instance serving ``operation`` (to inspect it, or tune it, e.g. ``max_ctas``)."""
        return self._impl(operation, self.io_backend if io_backend is None else io_backend)[0]

    def check_dropped(self, synchronize: bool = True) -> None:
        """Raise :class:`~hicache_core.drops.DroppedIndicesError` if a kernel masked indices of an earlier call.

        Every transfer call checks this itself, without waiting for the GPU; this waits for the
        device first (``synchronize=True``), so that transfers already launched are covered too.
        """
        if synchronize and self.plan.device.type == "cuda":
            torch.cuda.synchronize(self.plan.device)
        self._drops.raise_if_dropped()

    # ---- allocator ---------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free host slots (whole pages), or ``None`` when the pool is full."""
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Give slots back; a slot freed twice raises."""
        return self.allocator.free(indices)

    def available_size(self) -> int:
        """Free host slots, in tokens (always whole pages)."""
        return self.allocator.available_size()

    def clear(self) -> None:
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

        A layer this rank does not own is a no-op; ``is_draft`` addresses MTP draft layer
        ``layer_id - layer_num`` (device layer 0 of the draft pool passed).
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
        impl, want_cuda, dtypes, target = self._impl(BACKUP_ALL, io_backend)
        if device_pool is not self.device_pool:
            raise ValueError("device_pool is not the device pool this host pool was made for")
        h, d = self._indices(host_indices, device_indices, want_cuda, dtypes, target)
        if h is not None:
            drops = self._drops
            if drops._value.value:
                drops.raise_if_dropped()
            drops.begin(BACKUP_ALL, None, h.shape[0])
            self._call(impl, BACKUP_ALL, h, d)

    def _per_layer(self, op, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft) -> None:
        impl, want_cuda, dtypes, target = self._impl(op, io_backend)
        layer = self._host_layer(device_pool, layer_id, is_draft)
        if layer is None:
            return
        h, d = self._indices(host_indices, device_indices, want_cuda, dtypes, target, layer)
        if h is None:
            return
        drops = self._drops
        if drops._value.value:
            drops.raise_if_dropped()
        drops.begin(op, layer_id, h.shape[0])
        try:  # inline rather than through _call: this is the per-layer hot path
            getattr(impl, op)(h, d, layer)
        except (ValueError, IndexError, TypeError) as exc:
            _note(impl, op, exc)
            raise
        except Exception as exc:
            raise TransferError(impl, self._plugin_of(impl), op, exc) from exc

    def _call(self, impl: Implementation, op: str, *args) -> None:
        """Run the implementation; whatever it raises names it (input errors keep their type)."""
        try:
            getattr(impl, op)(*args)
        except (ValueError, IndexError, TypeError) as exc:
            _note(impl, op, exc)
            raise
        except Exception as exc:
            raise TransferError(impl, self._plugin_of(impl), op, exc) from exc

    def _impl(self, op: str, io_backend: str):
        entry = self._impls.get((op, io_backend))
        if entry is not None:
            return entry
        if op in self._deferred:
            raise ValueError(
                f"this host pool was not made to run {op} (pass operations=... to make_host_pool to resolve it "
                f"at construction):\n{self._deferred[op]}"
            )
        made = sorted({name for (o, name) in self._impls if o == op})
        raise ValueError(f"io_backend {io_backend!r} was not resolved for this host pool; it was made with {made}")

    def _host_layer(self, device_pool: Any, layer_id: int, is_draft: bool) -> int | None:
        try:
            layer_id = operator.index(layer_id)
        except TypeError:
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}") from None
        if is_draft:
            draft = layer_id - self._model_layers
            if not 0 <= draft < len(self.draft_pools):
                raise IndexError(
                    f"draft layer_id {layer_id} is out of range: this pool's draft layers are "
                    f"[{self._model_layers}, {self._model_layers + len(self.draft_pools)})"
                )
            if device_pool is not self.draft_pools[draft]:
                raise ValueError(f"device_pool is not draft pool {draft} this host pool was made with")
            return self._owned + draft
        if not 0 <= layer_id < self._model_layers:
            raise IndexError(f"layer_id {layer_id} is out of range [0, {self._model_layers})")
        if device_pool is not self.device_pool:
            raise ValueError("device_pool is not the device pool this host pool was made for")
        layer = layer_id - self.start_layer
        return layer if 0 <= layer < self._owned else None

    def _indices(self, host_indices, device_indices, want_cuda: bool, dtypes: frozenset, target: torch.device,
                 layer: int | None = None):  # fmt: skip
        # The hot path: a handful of attribute reads, no allocation unless indices must move.
        try:
            hd, dd, n = host_indices.dtype, device_indices.dtype, host_indices.numel()
            ok = (
                (hd is torch.int64 or hd is torch.int32)
                and (dd is torch.int64 or dd is torch.int32)
                and device_indices.numel() == n
                and host_indices.dim() == 1
                and device_indices.dim() == 1
            )
        except (AttributeError, TypeError):
            ok = False
        if not ok:
            _reject_indices(host_indices, device_indices)
        if n == 0:
            return None, None
        if self._items_are_pages:
            if n % self.page_size:
                raise ValueError(
                    f"indices must come in whole pages: got {n} slots with page_size {self.page_size} "
                    "(page-row pools move whole pages)"
                )
            if self.validate:
                check_whole_pages(host_indices, self.page_size, "host_indices")
                check_whole_pages(device_indices, self.page_size, "device_indices")
            else:  # the cheap part, always: each run of page_size slots starts at a page start
                for what, idx in (("host_indices", host_indices), ("device_indices", device_indices)):
                    if not idx.is_cuda and bool((idx[:: self.page_size] % self.page_size).any()):
                        raise ValueError(f"{what} must come in whole pages: a run of {self.page_size} slots "
                                         "starts off a page start (page-row pools move whole pages)")  # fmt: skip
            host_indices = host_indices[:: self.page_size] // self.page_size
            device_indices = device_indices[:: self.page_size] // self.page_size
        if self.validate:
            check_bounds(host_indices, self._num_items, "host_indices")
            rows = self._rows[layer] if layer is not None else min(self._rows)  # all layers: the fewest rows
            check_bounds(device_indices, rows, "device_indices")
        if host_indices.is_cuda is not want_cuda or hd not in dtypes or (want_cuda and host_indices.device != target):
            host_indices = _move(host_indices, dtypes, target)
        if (
            device_indices.is_cuda is not want_cuda
            or dd not in dtypes
            or (want_cuda and device_indices.device != target)
        ):
            device_indices = _move(device_indices, dtypes, target)
        return host_indices, device_indices

    # ---- pages, for L3 storage backends ------------------------------------------------------

    def _page_views(self, index: int) -> list[torch.Tensor]:
        page = operator.index(index) // self.page_size
        if not 0 <= page < self.page_num:
            raise IndexError(f"page of slot {index} is outside the pool ({self.page_num} pages)")
        views = []
        for b in self.spec.buffers:
            full = getattr(self, b.attr).view(b.full_shape)
            views.append(full.select(b.axes.index("page"), page))
        return views

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The page holding slot ``index``, all layers and parts (flat: one 1-D copy)."""
        views = self._page_views(index)
        if flat:
            return torch.cat([v.flatten() for v in views])
        return views[0] if len(views) == 1 else tuple(views)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(sum(v.numel() for v in self._page_views(0)), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (as :meth:`get_data_page` returns it) into the page holding slot ``index``."""
        views = self._page_views(index)
        total = sum(v.numel() for v in views)
        if data_page.numel() != total or data_page.dtype != self.dtype:
            raise ValueError(
                f"a flat page here is {total} elements of {self.dtype}, got {data_page.numel()} of {data_page.dtype}"
            )
        offset = 0
        for v in views:
            v.copy_(data_page.reshape(-1)[offset : offset + v.numel()].view(v.shape))
            offset += v.numel()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of the contiguous host runs of each page (zero-copy L3 I/O).

        ``indices`` are token slots in whole pages; one entry per contiguous run of each page,
        in buffer order then outer-axis order, K and V of a layer together (``layer_first``:
        K0 V0 K1 V1 ...).
        """
        slots = indices.to("cpu", torch.int64).reshape(-1)
        if slots.numel() % self.page_size:
            raise ValueError(
                f"get_page_buffer_meta takes whole pages: {slots.numel()} slots, page_size {self.page_size}"
            )
        ptrs: list[int] = []
        sizes: list[int] = []
        for start in slots[:: self.page_size].tolist():
            for view, spec in zip(self._page_views(start), self.spec.buffers):
                runs = _contiguous_runs(view)
                axes = [a for a in spec.axes if a != "page"]
                if "component" in axes and "layer" in axes and axes.index("component") < axes.index("layer"):
                    # Runs come component-major (K0 K1 .. V0 V1 ..); SGLang lists K and V of a layer
                    # together (K0 V0 K1 V1 ..), and L3 objects must stay compatible with its.
                    k = view.shape[axes.index("component")]
                    per = len(runs) // k
                    if per > 1 and per * k == len(runs):
                        runs = [runs[c * per + i] for i in range(per) for c in range(k)]
                for ptr, nbytes in runs:
                    ptrs.append(ptr)
                    sizes.append(nbytes)
        return ptrs, sizes

    def get_ksize_per_token(self) -> int:
        """Host bytes per token slot of the first part (K, or the MLA latent part), all host layers."""
        part = self.plan.parts[0]
        per_item = part.item_bytes * self.layer_num
        return per_item // self.page_size if self.geometry.items_are_pages else per_item

    def is_stride_page_aligned(self, alignment: int = 4096) -> bool:
        """Whether every page of every host buffer starts on an ``alignment``-byte boundary (O_DIRECT I/O)."""
        for buf, spec in zip(self.plan.host_buffers.values(), self.spec.buffers):
            page_axis = spec.axes.index("page")
            stride = buf.view(spec.full_shape).stride(page_axis) * buf.element_size()
            if buf.data_ptr() % alignment or stride % alignment:
                return False
        return True

    def destroy(self) -> None:
        """Release the host buffers (SGLang unregisters its pinned memory here); the pool is unusable after."""
        for attr in list(self.plan.host_buffers):
            self.plan.host_buffers[attr] = torch.empty(0, dtype=self.dtype)
        self.kv_buffer = self.k_buffer = self.v_buffer = None
        self._impls.clear()

    def get_size_per_token(self) -> int:
        """Host bytes per token slot, all host layers and parts."""
        return sum(t.numel() * t.element_size() for t in self.plan.host_buffers.values()) // self.size

    def __repr__(self) -> str:
        shapes = ", ".join(f"{b.attr}{tuple(b.shape)}" for b in self.spec.buffers)
        return f"<HostPool {self.geometry.kind} layout={self.layout} {shapes} implementations={self.implementations}>"


class TransferError(RuntimeError):
    """An implementation raised while moving bytes (or while binding to a pool); names it and its plugin."""

    def __init__(self, impl: type[Implementation] | Implementation, plugin: str, operation: str,
                 cause: BaseException) -> None:  # fmt: skip
        self.implementation = impl.name
        self.plugin = plugin
        self.operation = operation
        super().__init__(
            f"{impl.name} (plugin {plugin}, io backend {impl.io_backend!r}) raised during {operation}: "
            f"{type(cause).__name__}: {cause}"
        )


def _note(impl: type[Implementation] | Implementation, operation: str, exc: Exception) -> None:
    """Input errors raised inside a transfer keep their type (callers catch them as bad input) and gain a note."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised by {impl.name}, io backend {impl.io_backend!r}, during {operation})")


def _contiguous_runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """Split a strided view into maximal contiguous runs (pointer, bytes)."""
    sizes, strides = list(view.shape), list(view.stride())
    inner, expected, cut = 1, 1, len(sizes)
    for axis in range(len(sizes) - 1, -1, -1):
        if strides[axis] != expected and sizes[axis] != 1:
            break
        expected *= sizes[axis]
        inner *= sizes[axis]
        cut = axis
    if cut == 0:
        return [(view.data_ptr(), inner * view.element_size())]
    runs = []
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in sizes[:cut]]).reshape(-1, cut).tolist():
        offset = sum(i * s for i, s in zip(idx, strides[:cut]))
        runs.append((view.data_ptr() + offset * view.element_size(), inner * view.element_size()))
    return runs


def _move(indices: torch.Tensor, dtypes: frozenset, target: torch.device) -> torch.Tensor:
    """Indices where and as the implementation declared it wants them (what SGLang's controller did)."""
    dtype = indices.dtype if indices.dtype in dtypes else torch.int64
    # Host-to-device may run ahead on the stream; device-to-host must land before the CPU reads it.
    return indices.to(target, dtype, non_blocking=target.type == "cuda")


def _reject_indices(host_indices, device_indices) -> None:
    """Raise the precise error for indices the hot path's combined check refused."""
    for what, idx in (("host_indices", host_indices), ("device_indices", device_indices)):
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{what} must be a torch tensor of int32/int64 slots, got {type(idx).__name__}")
    if host_indices.dtype not in _INDEX_DTYPES or device_indices.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"indices must be int32 or int64, got host {host_indices.dtype} and device {device_indices.dtype}"
        )
    raise ValueError(
        "host_indices and device_indices must be 1-D and of equal length, got "
        f"{tuple(host_indices.shape)} and {tuple(device_indices.shape)}"
    )


def check_bounds(indices: torch.Tensor, limit: int, what: str) -> None:
    """Raise unless every index lies in ``[0, limit)`` (syncs when the indices live on a GPU)."""
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= limit:
        raise IndexError(f"{what} out of range: min {lo}, max {hi}, valid [0, {limit})")


def check_whole_pages(indices: torch.Tensor, page_size: int, what: str) -> None:
    """Raise unless the slots form whole pages: runs of ``page_size`` consecutive slots from a page start."""
    if indices.numel() % page_size:
        raise ValueError(f"{what} must come in whole pages: {indices.numel()} slots with page_size {page_size}")
    if page_size == 1:
        return
    pages = indices.reshape(-1, page_size).to(torch.int64)
    offsets = torch.arange(page_size, device=pages.device)
    if bool((pages[:, 0] % page_size).any()) or not bool((pages - pages[:, :1] == offsets).all()):
        raise ValueError(f"{what} must come in whole pages of {page_size} consecutive slots starting at a page start")
