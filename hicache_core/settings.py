"""Settings read from the environment, each declared once: its variable, the values it takes, its default.

A :class:`Setting` is read where a pool, a plugin or a server is set up, never per call, through
:meth:`Setting.read`. Unset or blank gives the default; a value the setting does not take is
refused with :class:`SettingError`, which names the variable, what it holds and what it takes.
Nothing is coerced: ``HICACHE_VALIDATE=2`` is an error, not "on". The knobs of GPU
implementations (:mod:`hicache_core.gpu.knobs`) read their variables through the same parsers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable holds a value its setting does not take (the message says which it takes)."""


@dataclass(frozen=True)
class Setting:
    """One environment variable, declared once.

    :param name: the variable (``HICACHE_VALIDATE``).
    :param parse: the stripped text -> the value; raises ``ValueError`` (or ``KeyError``) for text it
        does not take.
    :param takes: the values it takes, in words, for the error (``"1 or 0"``).
    :param default: the value when the variable is unset or blank.
    :param doc: one line: what it does (``--help`` texts list it).
    """

    name: str
    parse: Callable[[str], Any]
    takes: str
    default: Any = None
    doc: str = ""

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value now in the environment (``environ``, default ``os.environ``), or :attr:`default`.

        :raises SettingError: the variable holds a value this setting does not take.
        """
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse_text(raw)

    def parse_text(self, raw: str) -> Any:
        """``raw`` as this setting's value (what :meth:`read` does with a set variable)."""
        try:
            return self.parse(raw.strip())
        except (ValueError, KeyError):
            raise SettingError(f"{self.name}={raw!r} is not {self.takes}") from None


def _flag(text: str) -> bool:
    word = text.lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(text)


def flag(name: str, *, doc: str = "", default: bool | None = False) -> Setting:
    """An on/off setting: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (unset: ``default``,
    off unless given; ``None`` lets the reader decide)."""
    return Setting(name, _flag, f"1 or 0 (also {'/'.join(_TRUE[1:])} or {'/'.join(_FALSE[1:])})", default, doc)


def integer(name: str, *, minimum: int, default: int | None = None, doc: str = "") -> Setting:
    """A whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(text)
        return value

    return Setting(name, parse, f"an integer >= {minimum}", default, doc)


def number(name: str, *, minimum: float = 0.0, above: bool = False, default: float | None = None,
           unit: str = "", doc: str = "") -> Setting:  # fmt: skip
    """A finite number ``>= minimum`` (``above=True``: ``> minimum``), in ``unit`` where given."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise ValueError(text)
        return value

    what = f"a number{' of ' + unit if unit else ''} {'>' if above else '>='} {minimum:g}"
    return Setting(name, parse, what, default, doc)


def choice(name: str, values: Sequence[str], *, default: str | None = None, doc: str = "") -> Setting:
    """One of ``values``, exactly as written."""

    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(text)
        return text

    return Setting(name, parse, "one of: " + ", ".join(repr(v) for v in values), default, doc)


def text(name: str, *, default: str | None = None, doc: str = "") -> Setting:
    """Any text (a path, a URL, a list the caller parses); unset or blank: ``default``."""
    return Setting(name, str, "text", default, doc)
