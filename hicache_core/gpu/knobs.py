"""Knobs of GPU implementations: integers from the environment, and the SM budget."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def env_int(name: str, default: int | None, *, minimum: int) -> int | None:
    """An integer knob from the environment (unset or blank: ``default``); refuses junk with a clear error."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value



class SMBudget:
    """The SM budget knob of a kernel implementation: at most ``max_ctas`` CTAs per launch.

    ``0`` or ``None`` means one CTA per tile, up to the SM count (``self._sm_count``, set by the
    subclass before the budget). A small budget leaves the SMs to the attention kernels beside it.
    """

    _sm_count: int
    _max_ctas: int | None = None
    _cap: int = 1

    @property
    def max_ctas(self) -> int | None:
        """At most this many CTAs per launch (``0``/``None``: one per tile, up to the SM count)."""
        return self._max_ctas

    @max_ctas.setter
    def max_ctas(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"max_ctas must be None or an int >= 0, got {value!r}")
        self._max_ctas = value
        self._cap = value or self._sm_count


class Knob:
    """A tuning knob, declared once: its check, its environment variable, and what a change redoes.

    ``check(name, value)`` returns the value to keep or raises ``ValueError`` naming the knob and
    its range (:func:`checked` builds one). ``env`` is the variable's suffix after the owner's
    ``env_prefix`` (``"NUM_WARPS"``: ``HICACHE_KERNEL_NUM_WARPS``); ``parse(variable, text)`` reads
    its text (default: an integer of at least ``minimum``). Every set, the environment's included,
    goes through the check and then calls the owner's ``changed`` method.
    """

    def __init__(
        self,
        check: Callable[[str, Any], Any],
        *,
        env: str | None = None,
        minimum: int = 0,
        parse: Callable[[str, str], Any] | None = None,
        changed: str = "_reconfigure",
        doc: str = "",
    ) -> None:
        self.check, self.env, self.minimum, self.parse, self.changed = check, env, minimum, parse, changed
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, self.check(self.name, value))
        getattr(obj, self.changed)()

    def read_environment(self, obj: Any, prefix: str) -> None:
        """Set the knob from ``<prefix>_<env>`` where that is set (unset or blank: keep the value)."""
        if self.env is None:
            return
        variable = f"{prefix}_{self.env}"
        raw = os.environ.get(variable)
        if raw is None or raw.strip() == "":
            return
        self.__set__(obj, self.parse(variable, raw) if self.parse else env_int(variable, None, minimum=self.minimum))


def checked(ok: Callable[[Any], bool], expected: str, keep: Callable[[Any], Any] | None = None):
    """A :class:`Knob` check: ``ok(value)`` or ``ValueError("<knob> must be <expected>, got <value>")``."""

    def check(name: str, value: Any) -> Any:
        if not ok(value):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
        return keep(value) if keep else value

    return check


def knobs_of(cls: type) -> list[Knob]:
    """Every :class:`Knob` of ``cls`` and its bases, base classes' first."""
    seen: dict[str, Knob] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Knob):
                seen[name] = value
    return list(seen.values())


def read_knobs(obj: Any, prefix: str) -> None:
    """Set every knob of ``obj`` that declares an environment variable from ``<prefix>_<env>``."""
    for knob in knobs_of(type(obj)):
        knob.read_environment(obj, prefix)
