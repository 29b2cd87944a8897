"""Knobs of GPU implementations, each declared once (:class:`Knob`): checks, environment variables, the SM budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..settings import Setting, integer

_NO_DEFAULT = object()


def env_int(name: str, default: int | None, *, minimum: int) -> int | None:
    """An integer knob from the environment (unset or blank: ``default``); refuses junk naming what it takes."""
    return integer(name, minimum=minimum, default=default).read()


class Knob:
    """A tuning knob, declared once: its check, its environment variable, and what a change redoes.

    ``check(name, value)`` returns the value to keep or raises ``ValueError`` naming the knob and
    its range (:func:`checked` builds one). ``env`` is the variable's suffix after the owner's
    ``env_prefix`` (``"NUM_WARPS"``: ``HICACHE_KERNEL_NUM_WARPS``); ``parse(variable, text)`` reads
    its text (default: an integer of at least ``minimum``). Every set, the environment's included,
    goes through the check and then calls the owner's ``changed`` method (``None``: nothing to
    redo). A ``default``, where given, is checked once and is the value until the first set.
    ``preset=True`` marks a knob that sets others: :func:`read_knobs` reads it first, so that the
    other knobs' variables override what it set.
    """

    def __init__(
        self,
        check: Callable[[str, Any], Any],
        *,
        env: str | None = None,
        minimum: int = 0,
        parse: Callable[[str, str], Any] | None = None,
        changed: str | None = "_reconfigure",
        default: Any = _NO_DEFAULT,
        preset: bool = False,
        doc: str = "",
    ) -> None:
        self.check, self.env, self.minimum, self.parse, self.changed = check, env, minimum, parse, changed
        self.default, self.preset = default, preset
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name
        if self.default is not _NO_DEFAULT:
            setattr(owner, self.slot, self.check(name, self.default))

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, self.check(self.name, value))
        if self.changed is not None:
            getattr(obj, self.changed)()

    def setting(self, prefix: str) -> Setting | None:
        """The environment variable ``<prefix>_<env>`` as a :class:`~hicache_core.settings.Setting` (None: no env)."""
        if self.env is None:
            return None
        variable = f"{prefix}_{self.env}"
        if self.parse is None:
            return integer(variable, minimum=self.minimum, default=_NO_DEFAULT)
        parse = self.parse
        return Setting(variable, lambda text: parse(variable, text), f"a value knob {self.name} takes", _NO_DEFAULT)

    def read_environment(self, obj: Any, prefix: str) -> None:
        """Set the knob from ``<prefix>_<env>`` where that is set (unset or blank: keep the value)."""
        setting = self.setting(prefix)
        value = _NO_DEFAULT if setting is None else setting.read()
        if value is _NO_DEFAULT:
            return
        try:
            self.__set__(obj, value)
        except ValueError as exc:  # the variable is what the user wrote: name it beside the knob's range
            raise ValueError(f"{setting.name}={(setting.raw() or '').strip()!r}: {exc}") from None


def checked(ok: Callable[[Any], bool], expected: str, keep: Callable[[Any], Any] | None = None):
    """A :class:`Knob` check: ``ok(value)`` or ``ValueError("<knob> must be <expected>, got <value>")``."""

    def check(name: str, value: Any) -> Any:
        if not ok(value):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
        return keep(value) if keep else value

    return check


def knobs_of(cls: type) -> list[Knob]:
    """Every :class:`Knob` of ``cls`` and its bases, presets first, then base classes' first."""
    seen: dict[str, Knob] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Knob):
                seen[name] = value
    return sorted(seen.values(), key=lambda knob: not knob.preset)


def read_knobs(obj: Any, prefix: str) -> None:
    """Set every knob of ``obj`` that declares an environment variable from ``<prefix>_<env>``."""
    for knob in knobs_of(type(obj)):
        knob.read_environment(obj, prefix)


def int_at_least(minimum: int) -> Callable[[str, Any], Any]:
    """A :class:`Knob` check for a whole number of at least ``minimum`` (a bool is not one)."""
    return checked(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum, f"an int >= {minimum}")


def flag() -> Callable[[str, Any], bool]:
    """A :class:`Knob` check for an on/off switch: ``True``/``False`` or ``1``/``0``, kept as a bool."""
    return checked(lambda v: isinstance(v, int) and v in (0, 1), "True or False (1 or 0)", keep=bool)


class SMBudget:
    """The SM budget knob of a kernel implementation: at most ``max_ctas`` CTAs per launch.

    ``0`` or ``None`` means one CTA per tile, up to the SM count (``self._sm_count``, set by the
    subclass before the budget). A small budget leaves the SMs to the attention kernels beside it.
    """

    _sm_count: int
    _cap: int = 1

    max_ctas = Knob(
        checked(lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                "None or an int >= 0"),
        env="MAX_CTAS", default=None, changed="_budget_changed",
        doc="At most this many CTAs per launch (``0``/``None``: one per tile, up to the SM count).",
    )  # fmt: skip

    def _budget_changed(self) -> None:
        self._cap = self._max_ctas or self._sm_count
