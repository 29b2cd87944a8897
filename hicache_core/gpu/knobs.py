"""Knobs of GPU implementations: integers from the environment, and the SM budget."""

from __future__ import annotations

import os


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
