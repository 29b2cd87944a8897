"""Which host layer a caller's layer id names: the one mapping from a server's layer numbering to a host pool's.

A host pool keeps its owned target layers first, then one layer per MTP draft pool. Callers number layers
their own way: hicache's API takes absolute model layers, SGLang's pools take ids local to the device pool
(or, for its page-row and Mamba pools, the host layer itself). A :class:`LayerMap` declares one numbering as
data; :meth:`LayerMap.host_layer` is the only code that reads a layer id, so every pool refuses a bad one with
the same words. ``make_host_pool(..., layer_map=...)`` gives a pool a numbering other than the absolute one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..settings.variables import VALIDATE
from .validation import strict_int

#: What :meth:`LayerMap.host_layer` returns for a layer the pool keeps nothing for: the call checks its
#: arguments and moves nothing (as SGLang's pools do for another rank's layer).
NOT_HERE = -1


@dataclass(frozen=True)
class LayerMap:
    """A server's layer numbering for one host pool, declared as data.

    :param host_of: per target layer id ``0..len-1``, the host layer it is kept in, or ``None`` where the pool
        keeps nothing for it (another rank's layer, a layer that shares another's rows): such a call is a no-op,
        reported under ``validate``.
    :param device_pool: the device pool callers pass with a target layer id; ``None``: any (the pool addresses
        its own buffers whatever is passed).
    :param draft_pools: the draft device pools; draft ``d`` is layer id ``draft_base + d``, kept in host layer
        ``draft_host_base + d``.
    :param draft_base: the layer id of draft 0 (default ``len(host_of)``).
    :param draft_host_base: the host layer of draft 0 (default: one past the last target host layer).
    :param numbering: whose layer ids these are, for messages ("absolute model layers", "SGLang's local ...").
    :param skipped: why a ``None`` layer keeps nothing, completing "layer_id N ...".
    :param skips_are_calls: callers pass ``None`` layers in normal operation (SGLang loads every layer id, its
        shared-topk and other ranks' layers included), so ``validate`` does not report them.
    :param outside_is_noop: a target id outside ``host_of`` is a no-op (SGLang's pools return for one), reported
        under ``validate``; otherwise an IndexError.
    :param drafts_refused: drafts are refused with this reason (``is_draft=True`` is a ValueError).
    :param drafts_are_layers: ``is_draft`` is ignored: draft layers are numbered as plain host layers after the
        target's (SGLang's page-row and Mamba pools).
    """

    host_of: tuple[int | None, ...]
    device_pool: Any = None
    draft_pools: tuple[Any, ...] = ()
    draft_base: int | None = None
    draft_host_base: int | None = None
    numbering: str = "absolute model layers"
    skipped: str = "is not kept by this host pool"
    skips_are_calls: bool = False
    outside_is_noop: bool = False
    drafts_refused: str | None = None
    drafts_are_layers: bool = False
    #: The target layer ids the pool keeps, in order: what a load or backup of "every layer" goes through.
    kept_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kept_ids", tuple(i for i, h in enumerate(self.host_of) if h is not None))
        kept = [self.host_of[i] for i in self.kept_ids]
        if len(set(kept)) != len(kept):
            raise ValueError(f"a layer map keeps two layer ids in one host layer: {self.host_of}")
        if self.draft_base is None:
            object.__setattr__(self, "draft_base", len(self.host_of))
        if self.draft_host_base is None:
            object.__setattr__(self, "draft_host_base", max(kept, default=-1) + 1)
        object.__setattr__(self, "draft_pools", tuple(self.draft_pools))

    @classmethod
    def owned_range(cls, model_layers: int, start: int, end: int, *, device_pool: Any = None,
                    draft_pools: Sequence[Any] = (), **kw: Any) -> LayerMap:  # fmt: skip
        """Ids ``0..model_layers-1`` of which ``[start, end)`` are kept, in host layers ``0..end-start-1``."""
        host_of = tuple(i - start if start <= i < end else None for i in range(model_layers))
        kw.setdefault("skipped", f"is not owned by this rank (it owns layers [{start}, {end}) of {model_layers})")
        return cls(host_of, device_pool, tuple(draft_pools), draft_host_base=end - start, **kw)

    @property
    def host_layers(self) -> int:
        """The host layers this map addresses: its kept target layers and its drafts."""
        return len(self.kept_ids) + len(self.draft_pools)

    def host_layer(self, device_pool: Any, layer_id: Any, is_draft: bool, label: str, validate: bool) -> int:
        """The host layer ``layer_id`` names, or :data:`NOT_HERE`; a bad id or pool raises, naming ``label``."""
        layer_id = strict_int(layer_id, "layer_id")
        reported = f"reported because {VALIDATE.name} / validate is set"
        if is_draft and not self.drafts_are_layers:
            if self.drafts_refused is not None:
                raise ValueError(f"{label}: {self.drafts_refused} (is_draft=True, layer_id {layer_id})")
            depth = layer_id - self.draft_base
            if not 0 <= depth < len(self.draft_pools):
                raise IndexError(
                    f"draft layer_id {layer_id} is out of range: the draft layers of the {label} are "
                    f"[{self.draft_base}, {self.draft_base + len(self.draft_pools)}) ({self.numbering})"
                )
            if device_pool is not self.draft_pools[depth]:
                raise ValueError(f"device_pool {type(device_pool).__name__} is not draft pool {depth} the {label} "
                                 "was made with")  # fmt: skip
            return self.draft_host_base + depth
        self.check_pool(device_pool, label)
        if not 0 <= layer_id < len(self.host_of):
            where = f"[0, {len(self.host_of)}) ({self.numbering})"
            if not self.outside_is_noop:
                raise IndexError(f"layer_id {layer_id} is out of range {where} of the {label}")
            if validate:
                raise ValueError(f"layer_id {layer_id} is outside the device pool's layers {where}: the call would "
                                 f"be a no-op, {reported}")  # fmt: skip
            return NOT_HERE
        host = self.host_of[layer_id]
        if host is None:
            if validate and not self.skips_are_calls:
                raise ValueError(f"layer_id {layer_id} {self.skipped}: the call would be a no-op, {reported}")
            return NOT_HERE
        return host

    def check_pool(self, device_pool: Any, label: str) -> None:
        """An all-layer call's device pool: the target's (any, where the map takes any)."""
        if self.device_pool is not None and device_pool is not self.device_pool:
            got = type(device_pool).__name__
            raise ValueError(f"device_pool {got} is not the device pool the {label} was made for")
