"""The base of hicache's Triton implementations over UVA (this module does not import triton).

``kernel.triton_uva`` (hicache-kernel) and ``jit.one_layer`` (hicache-jit) launch Triton
kernels that read and write the pinned host pool in place through UVA. What they share
lives here, once: the claims and refusal reasons, binding a plan (the word, the anchor,
the parts in elements, the drop word), the knobs every such kernel has (``max_ctas``,
``num_warps``, ``stages``, ``fast_launch``, each also read from ``<env_prefix>_...``), and
the launch path: a process-wide table of compiled kernels, a direct launch through the
compiled kernel's launcher after the first call, and Triton's own launch whenever a
profiler hook wants to see launches.

**Kernel parameters.** Every kernel starts with :data:`CALL_PARAMS`: the anchor pointer,
the two index tensors, their strides, the item count, the call's number ``seq`` and
``drop``, the drop word's offset from the anchor in anchor elements (see
:mod:`hicache_core.pool.drops`). A kernel that masks an out-of-range index stores ``seq`` as an
``int64`` at ``anchor + drop`` (a masked store: nothing moves when every index is good),
and the host pool raises :class:`~hicache_core.pool.drops.DroppedIndicesError` at its next call.
The rest of a kernel's arguments are one tuple the subclass builds once per pool, layer
and direction (``args``), so a call packs nothing.

**Subclasses** set ``name``, ``priority``, ``operations``, ``env_prefix`` and implement
:meth:`TritonImplementation._kernel_for` (the ``@triton.jit`` function of a group),
:meth:`TritonImplementation._compile_key` and :meth:`TritonImplementation._configure`
(rebuild the argument tuples after a knob changes), and their operations, which end in
:meth:`TritonImplementation._launch`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..plugins.implementation import Implementation, TransferRequest
from ..pool.plan import TransferPlan
from . import uva
from .device import (
    CudaOrInterpreter,
    bind_uva_device,
    cuda_current_functions,
    interpreting,
    triton_available,
)
from .knobs import Knob, SMBudget, checked, read_knobs

#: The parameters every kernel starts with, in this order (checked when a kernel is loaded).
CALL_PARAMS = ("anchor", "hidx", "didx", "h_stride", "d_stride", "n", "seq", "drop")
#: Integer parameters that differ from call to call or pool to pool: kernels must never specialise on them
#: (``do_not_specialize``), so one compiled kernel serves every call of a shape, and must annotate their type
#: (``tl.int64``/``tl.int32``), so a large value never changes the signature under the cached launcher.
VARYING_PARAMS = ("h_stride", "d_stride", "n", "seq", "drop")
#: Index pointers are not specialised on alignment either (an index tensor may be a strided view).
INDEX_PARAMS = ("hidx", "didx")

#: Largest ``num_warps``: 32 warps are 1024 threads, the most a CUDA block may have.
MAX_NUM_WARPS = 32
#: ``fast_launch`` modes: Triton's ``kernel[grid](...)``, the compiled kernel's launcher, its C launch function.
FAST_LAUNCH_MODES = (0, 1, 2)
_INT32_MAX = 2**31 - 1


# ---- Triton's runtime, once a kernel module is loaded -------------------------------------------

_runtime_knobs: Any = None
_allocation: Any = None


def load_triton_runtime() -> None:
    """Look up Triton's launch hooks and allocator (call when a kernel module is first imported)."""
    global _runtime_knobs, _allocation
    try:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    except ImportError:  # older Triton: no launch hooks to honour
        _runtime_knobs = None
    try:
        from triton.runtime import _allocation as allocation

        _allocation = allocation
    except ImportError:
        _allocation = None


def hooks_idle() -> bool:
    """Whether no profiler hook wants to see launches (a direct launch would hide them from it)."""
    knobs = _runtime_knobs
    if knobs is None:
        return True
    # Triton 3.4+ has hook chains with a list of calls (empty when idle); earlier ones, a callable or None.
    # No loop and no tuple: this runs on every call.
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    busy_in = enter is not None and getattr(enter, "calls", True)
    return not (busy_in or (leave is not None and getattr(leave, "calls", True)))


def check_kernel_params(kernel: Any, expected: tuple[str, ...]) -> None:
    """Refuse a kernel whose parameters differ from the argument order the launch path builds."""
    names = tuple(getattr(kernel, "arg_names", expected))
    if names != expected:
        raise RuntimeError(f"kernel parameters {names} differ from the argument order {expected}")


# ---- compiled kernels, process-wide ---------------------------------------------------------------


@dataclass
class CompiledEntry:
    """One specialisation built in this process: how long its first call took, and its compiled launcher."""

    seconds: float
    run: Any = None  # the compiled kernel's launcher (``compiled.run``), on CUDA
    function: Any = None
    metadata: Any = None


_compiled: dict[tuple[str, Hashable], CompiledEntry] = {}
_compiled_lock = threading.Lock()


def compiled_entries(implementation: str) -> dict[Hashable, CompiledEntry]:
    """The specialisations ``implementation`` (a name) built in this process, in the order first used."""
    return {key: entry for (name, key), entry in _compiled.items() if name == implementation}


def direct_launch(entry: CompiledEntry, mode: int, scratch: torch.Tensor | None) -> tuple[Any, tuple] | None:
    """``(callable, arguments between the stream and the kernel's)`` for a launch mode, or None.

    Mode 1 calls the compiled kernel's launcher (it allocates scratch through Triton's allocator,
    so kernels that need scratch use mode 2); mode 2 calls the C launch function beneath it, with
    ``scratch`` (at least grid x the kernel's scratch size) as the global scratch. None where this
    Triton's compiled kernel does not look as expected: every call then goes through Triton.
    """
    run = entry.run
    if run is None or entry.function is None:
        return None
    needs_scratch = getattr(run, "global_scratch_size", 0) > 0
    if getattr(run, "profile_scratch_size", 0):
        return None
    raw = getattr(run, "launch", None)
    if (mode == 2 or needs_scratch) and raw is not None and hasattr(run, "launch_cooperative_grid"):
        if needs_scratch and scratch is None:
            return None
        pointer = scratch.data_ptr() if needs_scratch else None
        return raw, (entry.function, run.launch_cooperative_grid, getattr(run, "launch_pdl", 0), pointer, None,
                     entry.metadata, None, None, None)  # fmt: skip
    if needs_scratch:
        return None
    return run, (entry.function, entry.metadata, None, None, None)


def compiled_launch(compiled: Any) -> tuple[Any, tuple] | None:
    """:func:`direct_launch`'s C launch of a kernel Triton just compiled and launched (``kernel[grid](...)``'s
    answer), for a kernel that needs no scratch; None where this Triton's answer does not look as expected."""
    entry = CompiledEntry(0.0)
    if compiled is not None:
        _remember(compiled, entry)
    return direct_launch(entry, 2, None)


def _remember(compiled: Any, entry: CompiledEntry) -> None:
    try:
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        entry.run, entry.function, entry.metadata = compiled.run, compiled.function, compiled.packed_metadata
    except Exception:  # noqa: BLE001 - another Triton version: the normal launch path still works
        entry.run = None


# ---- the base class -------------------------------------------------------------------------------


@dataclass(eq=False)
class LaunchGroup:
    """Up to two parts of a plan moved by one launch, with what its calls need precomputed.

    Subclasses add their own fields; :meth:`TritonImplementation._configure` fills ``args``.
    """

    parts: tuple[int, ...]
    #: Per direction (True: to the device), per host layer: the kernel's arguments after ``seq``.
    args: dict[bool, list[tuple]] = field(default_factory=dict)
    #: (to_device, host index dtype, device index dtype) -> (launch callable, arguments before the kernel's).
    fast: dict[tuple, tuple] = field(default_factory=dict)
    #: Per direction: global scratch for kernels that need it (Triton allocates some, e.g. for device-made
    #: tensor descriptors), grid x size bytes.
    scratch: dict[bool, torch.Tensor] = field(default_factory=dict)


class TritonImplementation(SMBudget, Implementation):
    """Base of the Triton implementations over UVA-mapped pinned host memory (see the module doc).

    Knobs, per instance (``host.implementation_for(op)``), each defaulting to
    ``<env_prefix>_<NAME>`` or the class default: ``max_ctas`` (the SM budget),
    ``num_warps`` (a power of two up to 32), ``stages`` (0: a plain persistent loop; 2 or
    more: Triton's software pipelining of the host accesses over that many stages, through
    asynchronous copies), and ``fast_launch`` (:data:`FAST_LAUNCH_MODES`).
    """

    io_backend = "kernel"
    device_types = CudaOrInterpreter()  # type: ignore[assignment]
    sharded = True
    draft = True
    item_alignment = 1  # any byte size: the word narrows (16/8/4/2/1 bytes) to what sizes and strides allow
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "device"
    needs_pinned_host = False  # only on CUDA; see not_supported_reasons

    #: Prefix of the environment knobs (``<prefix>_MAX_CTAS``, ``_NUM_WARPS``, ``_STAGES``, ``_FAST_LAUNCH``).
    env_prefix: ClassVar[str] = "HICACHE_TRITON"
    default_max_ctas: ClassVar[int | None] = 8
    default_num_warps: ClassVar[int] = 8
    default_stages: ClassVar[int] = 0
    #: Whether an item's heads merge into one piece where the item is contiguous on both sides.
    merge_heads: ClassVar[bool] = True
    #: Programs standing in for "one per SM" under the interpreter (it runs them in turn).
    cpu_programs: ClassVar[int] = 4
    checks_loads = True

    @classmethod
    def not_supported_reasons(cls, request: TransferRequest) -> list[str]:
        reasons = super().not_supported_reasons(request)
        if not triton_available():
            reasons.append("triton is not installed (pip install triton): these are Triton kernels")
        if request.device_type == "cpu" and not interpreting():
            reasons.append(
                "the CPU is served only by the Triton interpreter, for tests: set TRITON_INTERPRET=1 "
                "before triton is imported"
            )
        if request.device_type == "cuda" and not request.host_pinned:
            reasons.append(
                "needs pinned host memory on CUDA: GPU threads read and write the host pool in place through UVA "
                "(pin_memory=True)"
            )
        return reasons

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        self._cuda, self._dev_index, self._sm_count = bind_uva_device(self.name, plan, self.cpu_programs)
        self._device_name = f"cuda:{self._dev_index}" if self._cuda else "cpu"
        self._interpreting = not self._cuda
        self.word_bytes = uva.plan_word_bytes(plan, merge_heads=self.merge_heads)
        elem_dtype, self._vec = uva.word_element(self.word_bytes)
        self._elem_dtype = str(elem_dtype).removeprefix("torch.")
        self._elem_bytes = self.word_bytes // self._vec
        self._anchor = uva.make_anchor(plan.device, elem_dtype)
        self._anchor_ptr = self._anchor.data_ptr()
        if self._anchor_ptr % self.word_bytes:
            raise RuntimeError(f"the anchor tensor is not {self.word_bytes}-byte aligned")
        self.uva_parts = tuple(uva.uva_part(p, self.word_bytes, merge_heads=self.merge_heads) for p in plan.parts)
        self._drops = plan.drop_report
        self._call_now = plan.drop_report.current  # the calling thread's call number (DropReport.seq)
        self._drop = self._offset(self._drops.address, "the drop word")
        self._get_device = self._get_stream = None
        if self._cuda:
            self._get_device, self._get_stream = cuda_current_functions()
        self._groups: list[LaunchGroup] = []
        self._max_items = 1
        self._cap = self._sm_count
        self._num_warps = self.default_num_warps
        self._stages = self.default_stages
        self._fast_launch = 0
        self._configuring = True  # knobs set during __init__ configure once, at the end

    def _offset(self, address: int, what: str) -> int:
        """``address`` as an offset from the anchor, in anchor elements (how kernels reach words beside the pools)."""
        delta = address - self._anchor_ptr
        if delta % self._elem_bytes:
            raise RuntimeError(f"{what} at {address:#x} is not {self._elem_bytes}-byte aligned")
        return delta // self._elem_bytes

    def _read_knobs(self) -> None:
        """Set the shared knobs from the environment (through the setters, so values are checked alike)."""
        self.max_ctas = self.default_max_ctas
        self.fast_launch = 2
        read_knobs(self, self.env_prefix)

    def _finish_init(self) -> None:
        """Configure once every knob is set (subclasses call this at the end of ``__init__``)."""
        self._configuring = False
        self._reconfigure()

    # ---- knobs ----------------------------------------------------------------------------------

    def _budget_changed(self) -> None:
        super()._budget_changed()
        if self.load_check is not None:
            self.load_check.programs = self._cap
        for group in self._groups:  # scratch is sized by the budget
            group.fast.clear()
            group.scratch.clear()

    num_warps = Knob(
        checked(lambda v: _is_int(v) and 1 <= v <= MAX_NUM_WARPS and not v & (v - 1),
                f"a power of two in [1, {MAX_NUM_WARPS}]"),
        env="NUM_WARPS", minimum=1,
        doc="Warps per CTA: a power of two from 1 to 32 (1024 threads, CUDA's limit per block).",
    )  # fmt: skip
    stages = Knob(
        checked(lambda v: _is_int(v) and (v == 0 or 2 <= v <= 16), "0 or an int in [2, 16]"),
        env="STAGES",
        doc="0: a plain persistent loop; ``s >= 2``: Triton pipelines the host accesses over ``s`` stages.",
    )
    fast_launch = Knob(
        checked(lambda v: v in FAST_LAUNCH_MODES and _is_int(v), f"one of {FAST_LAUNCH_MODES}"),
        env="FAST_LAUNCH", changed="_launch_path_changed",
        doc="How calls after the first launch: 0 Triton's ``kernel[grid]``, 1 the compiled launcher, 2 its C function.",
    )  # fmt: skip

    def _launch_path_changed(self) -> None:
        if not self._cuda:
            self._fast_launch = 0  # the interpreter has no compiled launcher
        for group in self._groups:
            group.fast.clear()

    def _reconfigure(self) -> None:
        if self._configuring:
            return
        for group in self._groups:
            group.fast.clear()
        self._configure()

    def _loop_stages(self) -> int:
        """The STAGES constexpr: 0 under the interpreter (it cannot run ``tl.range`` with run-time bounds)."""
        return 0 if self._interpreting else self._stages

    # ---- loads that check what they move -------------------------------------------------------

    def bind_load_check(self, verifier: Any) -> list[str]:
        """Per-layer loads copy and check in one launch (:mod:`hicache_core.gpu.checked_load`), for a verifier that
        checks with its kernel and a plan whose components are whole device rows; else the reasons."""
        from .checked_load import CheckedLoads, refusals

        self.__dict__.pop("load_to_device_per_layer", None)  # the plain copy again
        self.load_check = None
        if verifier is None:
            return []
        if not verifier.kernel:
            return ["the verifier checks in torch (a CPU pool), not with the checksum kernel"]
        reasons = refusals(self.plan, len(verifier.components))
        if reasons:
            return reasons
        checked = CheckedLoads(self.plan, verifier, self._call_now, self._cap, self._interpreting,
                               (hooks_idle, compiled_launch))  # fmt: skip
        if self._cuda:
            try:
                checked.warmup()
            except Exception as exc:  # noqa: BLE001 - a kernel this Triton cannot build: loads are checked apart
                return [f"the checked-load kernel could not be built here ({type(exc).__name__}: {exc})"]
        # An attribute of the instance: the pool calls what `load_to_device_per_layer` holds, with no test per call.
        self.load_to_device_per_layer = checked.load  # type: ignore[method-assign]
        self.load_check = checked
        return []

    # ---- for subclasses -------------------------------------------------------------------------

    def _configure(self) -> None:
        """Rebuild every group's ``args`` (and ``self._max_items``) from the knobs."""
        raise NotImplementedError

    def _kernel_for(self, group: LaunchGroup) -> Any:
        """The ``@triton.jit`` function that serves ``group`` now (import the kernels on first use)."""
        raise NotImplementedError

    def _compile_key(self, group: LaunchGroup, to_device: bool, h: torch.Tensor, d: torch.Tensor) -> Hashable:
        """What selects a compiled kernel: kernel, direction, index dtypes, constexprs, warps, device."""
        raise NotImplementedError

    # ---- the launch path ------------------------------------------------------------------------

    def _count(self, h: torch.Tensor, d: torch.Tensor) -> int:
        """The item count of a call, checked (the kernel reads ``device_indices[i]`` for every host index)."""
        n = h.shape[0]
        if d.shape[0] != n:  # shape[0], not len(): a quarter of the host time
            raise ValueError(f"host_indices has {n} entries but device_indices has {d.shape[0]} (length mismatch)")
        if n > self._max_items:
            raise ValueError(f"{n} items in one call is more than {self.name} addresses ({self._max_items}); split it")
        return n

    def _ready(self, h: torch.Tensor, d: torch.Tensor, n: int) -> tuple[int, tuple] | None:
        """``(stream, call arguments)`` shared by every cached launch of one call; None where none may be used.

        The hot path of a small load is host time, so this reads each fact once per call, the cheapest
        way (``stride()[0]`` costs a quarter of ``stride(0)``, which goes through an overload parser).
        """
        if not self._fast_launch or self._get_device() != self._dev_index or not hooks_idle():
            return None
        return self._get_stream(self._dev_index), (self._anchor_ptr, h.data_ptr(), d.data_ptr(), h.stride()[0],
                                                   d.stride()[0], n, self._call_now.seq)  # fmt: skip

    def _launch(self, group: LaunchGroup, grid: int, h: torch.Tensor, d: torch.Tensor, n: int, to_device: bool,
                args: tuple, ready: tuple[int, tuple] | None = None) -> None:  # fmt: skip
        """Launch ``group``'s kernel: through its cached compiled launcher where there is one, else through Triton.

        ``ready`` is :meth:`_ready`'s answer for this call (computed once when a call launches several groups).
        """
        fast = group.fast.get((to_device, h.dtype, d.dtype)) if ready is not None else None
        if fast is not None:
            fast[0](grid, 1, 1, ready[0], *fast[1], *ready[1], *args)
            return
        self._launch_slow(group, grid, h, d, n, to_device, args)

    def _launch_slow(self, group: LaunchGroup, grid: int, h, d, n: int, to_device: bool, args: tuple) -> None:
        """First use of a key (build it), a key another pool built (reuse it), or Triton's own launch path."""
        if h.dtype not in self.index_dtypes or d.dtype not in self.index_dtypes:
            raise TypeError(f"indices must be int32 or int64, got {h.dtype} and {d.dtype}")
        kernel = self._kernel_for(group)
        key = (self.name, self._compile_key(group, to_device, h, d))
        entry = _compiled.get(key)
        fast_key = (to_device, h.dtype, d.dtype)
        if entry is not None and self._cache_launch(group, fast_key, entry, to_device):
            ready = self._ready(h, d, n)
            if ready is not None:
                # The cached launch itself, not through _launch: this call is one launch, counted once.
                call, head = group.fast[fast_key]
                call(grid, 1, 1, ready[0], *head, *ready[1], *args)
                return
        call = (self._anchor, h, d, h.stride()[0], d.stride()[0], n, self._call_now.seq, *args)
        start = time.perf_counter()
        if self._cuda:
            with torch.cuda.device(self._dev_index), _ScratchAllocator(self._dev_index):
                compiled = kernel[(grid,)](*call, num_warps=self._num_warps)
        else:
            compiled = kernel[(grid,)](*call, num_warps=self._num_warps)
        seconds = time.perf_counter() - start
        if entry is None:
            with _compiled_lock:
                entry = _compiled.setdefault(key, CompiledEntry(seconds))
        if self._cuda and entry.run is None and compiled is not None:
            _remember(compiled, entry)
        self._cache_launch(group, fast_key, entry, to_device)

    def _cache_launch(self, group: LaunchGroup, fast_key: tuple, entry: CompiledEntry, to_device: bool) -> bool:
        """Cache the direct launch of ``entry`` for ``group`` (with this instance's scratch); whether it could."""
        if not self._fast_launch or entry.run is None:
            return False
        size = getattr(entry.run, "global_scratch_size", 0)
        scratch = group.scratch.get(to_device)
        if size and (scratch is None or scratch.numel() < self._cap * size):
            # Kernel scratch lives here, one slot per CTA. Launches of one direction of a pool
            # run in stream order, so they may share it (one buffer per direction: loads and backups of a
            # pool may overlap on two streams).
            scratch = group.scratch[to_device] = torch.empty(self._cap * size, dtype=torch.uint8,
                                                             device=self.plan.device)  # fmt: skip
        launch = direct_launch(entry, self._fast_launch, scratch)
        if launch is None:
            return False
        group.fast[fast_key] = launch
        return True

    def warmup(self, index_dtypes: tuple[torch.dtype, ...] = (torch.int64,)) -> None:
        """Build (or fetch) the kernels of every direction now instead of at the first call.

        Launches kernels that move nothing (zero items), on the current stream.
        """
        for dtype in index_dtypes:
            empty = torch.empty(0, dtype=dtype, device=self.plan.device)
            for to_device in self._directions():
                for group in self._groups:
                    self._launch_slow(group, 1, empty, empty, 0, to_device, group.args[to_device][0])

    def _directions(self) -> tuple[bool, ...]:
        return (True, False)

    def _knob_repr(self) -> str:
        return (
            f"word={self.word_bytes}B max_ctas={self._max_ctas} num_warps={self._num_warps} stages={self._stages} "
            f"fast_launch={self._fast_launch}"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self._knob_repr()}>"


class _ScratchAllocator:
    """Triton's allocator, for the duration of a launch through Triton, where a kernel needs global scratch.

    Allocations come from torch's caching allocator on the current stream, so freeing them after the
    launch is stream-ordered (later work on that stream cannot be handed the memory early).
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self.token = None

    def __call__(self, size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=f"cuda:{self.device}")

    def __enter__(self) -> _ScratchAllocator:
        if _allocation is not None:
            self.token = _allocation._allocator.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _allocation._allocator.reset(self.token)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_items_for(words_per_item: int, block: int) -> int:
    """Most items one call may address when word indices inside a (layer, part) are ``int32``."""
    return max(1, (_INT32_MAX - block) // max(1, words_per_item))
