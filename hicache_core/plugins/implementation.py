"""The implementation base class: what a plugin's transfer code declares and does.

An implementation serves one io backend. It declares, as class attributes, the
combinations it claims; :meth:`Implementation.not_supported_reasons` turns those
declarations into reasons, and subclasses add their own with ``super()``. The
dispatcher picks the highest-priority implementation with no reasons.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..declared.layouts import Layout
from ..pool.geometry import PoolGeometry
from ..pool.host_layout import HostLayoutSpec, host_layout_spec

if TYPE_CHECKING:
    from ..pool.plan import TransferPlan

LOAD = "load_to_device_per_layer"
BACKUP_ALL = "backup_from_device_all_layer"
BACKUP_LAYER = "backup_from_device_per_layer"
OPERATIONS: tuple[str, ...] = (LOAD, BACKUP_ALL, BACKUP_LAYER)
INDEX_DEVICES = ("cpu", "device")
#: What can move an implementation's bytes (:attr:`Implementation.engine`).
ENGINES = ("copy_engine", "sm", "cpu")


@dataclass(frozen=True)
class TransferRequest:
    """The dispatch key: one operation of one pool with one io backend."""

    io_backend: str
    operation: str
    geometry: PoolGeometry
    layout: Layout
    host_pinned: bool = True

    @property
    def pool_kind(self) -> str:
        return self.geometry.kind

    @property
    def device_type(self) -> str:
        return self.geometry.device_type

    @property
    def sharded(self) -> bool:
        return self.geometry.sharded

    @property
    def draft(self) -> bool:
        return self.geometry.draft_layers > 0

    @functools.cached_property
    def host_spec(self) -> HostLayoutSpec:
        """Host parts and strides of one page (enough to reason about; no memory).

        Raises ``ValueError`` where the layout cannot store this pool (:attr:`layout_problem` says why).
        """
        return host_layout_spec(self.geometry, self.layout, num_pages=1)

    @functools.cached_property
    def layout_problem(self) -> str | None:
        """Why the layout cannot store this pool (its pool kinds, the kind's layouts, a split it lacks), or None."""
        try:
            _ = self.host_spec
        except ValueError as exc:
            return str(exc)
        return None

    @property
    def storable(self) -> bool:
        """Whether the layout can store this pool (implementations may skip structural checks otherwise)."""
        return self.layout_problem is None

    @property
    def part_bytes(self) -> tuple[int, ...]:
        """Bytes of each contiguous piece an item is moved as (one head of one part where heads are split)."""
        it = self.geometry.itemsize
        return tuple(p.dim * it for p in self.host_spec.parts)

    def with_(self, **changes) -> TransferRequest:
        return replace(self, **changes)

    def describe(self) -> list[tuple[str, str]]:
        g = self.geometry
        return [
            ("pool kind", f"{g.kind} (item bytes {', '.join(map(str, g.item_bytes))}, dtype {str(g.dtype)[6:]})"),
            ("layout", self.layout.name),
            ("operation", self.operation),
            ("io backend", repr(self.io_backend)),
            ("device", g.device_type),
            ("sharded", f"yes (layers [{g.start_layer}, {g.end_layer}) of {g.layer_num})" if g.sharded else "no"),
            ("draft", f"yes ({g.draft_layers} draft layers)" if g.draft_layers else "no"),
            ("page size", str(g.page_size)),
            ("host memory", "pinned" if self.host_pinned else "not pinned"),
        ]


def _names(values) -> str:
    return ", ".join(sorted(str(v) for v in values))


class Implementation:
    """Base class of every transfer implementation a plugin registers.

    Subclasses set the class attributes to declare what they claim, override
    :meth:`not_supported_reasons` to add reasons the attributes cannot express
    (always extending ``super()``'s list), and implement the operations they
    claim. An instance is made once per host pool with its :class:`TransferPlan`
    (host buffers, strides and device layer tensors, all bound); precompute
    there what the hot path needs, and allocate nothing per call.

    Indices reach the operations as *item* indices (token slots, or page rows
    for page-row pools), of a dtype in :attr:`index_dtypes`, on the device named
    by :attr:`index_device`; layers are host layers (``0 .. plan.num_layers-1``).
    """

    #: Unique name, conventionally ``"<plugin>.<what>"``; callers may force it.
    name: ClassVar[str] = ""
    #: The io backend it serves (what a server passes as ``io_backend``).
    io_backend: ClassVar[str] = ""
    #: Higher wins among implementations that claim the same request.
    priority: ClassVar[int] = 0
    #: Pool kinds claimed; ``None`` means any.
    pool_kinds: ClassVar[frozenset[str] | None] = None
    #: Layout names claimed; ``None`` means any registered layout (structural checks go in reasons).
    layouts: ClassVar[frozenset[str] | None] = None
    operations: ClassVar[frozenset[str]] = frozenset(OPERATIONS)
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    #: Whether it serves layer-sharded pools and pools with MTP draft layers.
    sharded: ClassVar[bool] = True
    draft: ClassVar[bool] = True
    #: Every contiguous piece it moves must be a multiple of this many bytes.
    item_alignment: ClassVar[int] = 1
    index_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.int64})
    #: ``"cpu"``: indices on the CPU; ``"device"``: on the pool's device.
    index_device: ClassVar[str] = "cpu"
    needs_pinned_host: ClassVar[bool] = False
    #: Whether ``io_backend="auto"`` may pick it.
    auto_selectable: ClassVar[bool] = True
    #: What moves the bytes (:data:`ENGINES`): ``"copy_engine"`` (DMA), ``"sm"`` (GPU threads) or ``"cpu"``.
    #: Selection policy (``auto``'s rule) and the bench read this, never an implementation's name.
    engine: ClassVar[str] = "sm"
    description: ClassVar[str] = ""
    #: Whether its per-layer loads can check the pages they move against a verifying pool's checksums in the
    #: copy itself (:meth:`bind_load_check`), so that the pool runs no separate check for them.
    checks_loads: ClassVar[bool] = False
    #: What its loads check against now (set by :meth:`bind_load_check`); ``None``: they are checked apart.
    load_check: Any = None

    @property
    def path(self) -> str | None:
        """How this instance submits its operations, in words, as it is set now (the bench records it beside
        its timings); ``None``: nothing beyond :attr:`description`."""
        return None

    @classmethod
    def not_supported_reasons(cls, request: TransferRequest) -> list[str]:
        """Why this implementation cannot serve ``request`` (empty: it can)."""
        reasons = []
        if cls.pool_kinds is not None and request.pool_kind not in cls.pool_kinds:
            reasons.append(f"pool kind {request.pool_kind!r} is not claimed (claims: {_names(cls.pool_kinds)})")
        if cls.layouts is not None and request.layout.name not in cls.layouts:
            reasons.append(f"layout {request.layout.name!r} is not claimed (claims: {_names(cls.layouts)})")
        if request.operation not in cls.operations:
            reasons.append(f"operation {request.operation} is not claimed (claims: {_names(cls.operations)})")
        if request.device_type not in cls.device_types:
            reasons.append(f"device type {request.device_type!r} is not claimed (claims: {_names(cls.device_types)})")
        if request.sharded and not cls.sharded:
            reasons.append("layer-sharded pools are not claimed")
        if request.draft and not cls.draft:
            reasons.append("pools with MTP draft layers are not claimed")
        if cls.item_alignment > 1:
            bad = [b for b in request.part_bytes if b % cls.item_alignment]
            if bad:
                reasons.append(f"pieces of {_names(set(bad))} bytes are not multiples of {cls.item_alignment} bytes")
        if cls.needs_pinned_host and not request.host_pinned:
            reasons.append("needs pinned host memory, but the host pool is not pinned (pin_memory=False, or no CUDA)")
        return reasons

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """What is malformed in the class declaration (checked when a plugin registers it)."""
        problems = []
        if not isinstance(cls.name, str) or not cls.name:
            problems.append("'name' must be a non-empty string")
        if not isinstance(cls.io_backend, str) or not cls.io_backend or cls.io_backend == "auto":
            problems.append("'io_backend' must be a non-empty string other than 'auto'")
        if not isinstance(cls.priority, int):
            problems.append("'priority' must be an int")
        unknown_ops = set(cls.operations) - set(OPERATIONS)
        if unknown_ops:
            problems.append(f"unknown operations {sorted(unknown_ops)}; known: {list(OPERATIONS)}")
        if cls.index_device not in INDEX_DEVICES:
            problems.append(f"'index_device' must be one of {INDEX_DEVICES}, got {cls.index_device!r}")
        if not set(cls.index_dtypes) <= {torch.int32, torch.int64} or not cls.index_dtypes:
            problems.append("'index_dtypes' must be a non-empty subset of {torch.int32, torch.int64}")
        for op in cls.operations:
            if getattr(cls, op, None) is getattr(Implementation, op, None):
                problems.append(f"claims {op} but does not implement it")
        if cls.engine not in ENGINES:
            problems.append(f"'engine' must be one of {ENGINES}, got {cls.engine!r}")
        return problems

    def tuning_variants(self) -> dict[str, dict[str, Any]]:
        """Settings a benchmark may time beside the defaults, by variant name (``{}``: none).

        Each value is a mapping for :meth:`tuned`. The bench asks for these instead of knowing
        an implementation's attributes.
        """
        return {}

    @contextlib.contextmanager
    def tuned(self, settings: Mapping[str, Any]) -> Iterator[None]:
        """Run the ``with`` block under ``settings`` (one value of :meth:`tuning_variants`), then restore."""
        if settings:
            raise ValueError(f"{self.name} declares no tuning variants; got settings {sorted(settings)}")
        yield

    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int) -> None:
        """Copy items ``host_indices`` of host layer ``layer`` to device rows ``device_indices``."""
        raise NotImplementedError

    def bind_load_check(self, verifier: Any) -> list[str]:
        """Check every per-layer load against ``verifier`` (a :class:`~hicache_core.verification.verify.PageVerifier`)
        in the copy from now on, and set :attr:`load_check`; ``None``: stop. Returns why it cannot (empty: it does).

        Only implementations that declare :attr:`checks_loads` are asked; a pool's verification binds its
        load implementations when it starts verifying and unbinds them when it stops. A load that checks in the
        copy reports a mismatch as the separate check does: the call's number in the verifier's failure word
        and in the failing pages' slots, on the call's own stream.
        """
        return [f"{self.name} does not check its loads in the copy"]

    def backup_from_device_per_layer(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int
    ) -> None:
        """Copy device rows ``device_indices`` of host layer ``layer`` to host items ``host_indices``."""
        raise NotImplementedError

    def backup_from_device_all_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Copy device rows to host items for every host layer (owned layers, then draft layers)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} io_backend={self.io_backend!r}>"
