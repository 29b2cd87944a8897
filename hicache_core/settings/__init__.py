"""Settings read from the environment, each declared once: its variable, the values it takes, its default.

A :class:`Setting` is read where a pool, a plugin or a server is set up, never per call, through
:meth:`Setting.read`. Unset or blank gives the default; a value the setting does not take is
refused with :class:`SettingError`, which names the variable, what it holds and what it takes.
Nothing is coerced: ``HICACHE_VALIDATE=2`` is an error, not "on". The knobs of GPU
implementations (:mod:`hicache_core.gpu.knobs`) read their variables through the same parsers.

Every ``HICACHE_*`` variable is declared in a light module that imports nothing heavy: the core's in
:mod:`hicache_core.settings.variables`, each plugin's and adapter's in the module its ``hicache.settings`` entry
point names (a list of :class:`Setting`). :func:`hicache_core.settings.registry.declared` gathers them all without
importing torch or a plugin's implementation; ``hicache settings`` prints them with their values and
where each came from. A setting declared ``secret=True`` (a key, or a URL that may carry a password) is
never shown as set: its :attr:`Setting.show` hides it, and a value it refuses is named by its length only.
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
    :param keep_blank: a set but blank variable is parsed (``HICACHE_PLUGINS=""``: no plugin), not the default.
    :param show: the value as ``hicache settings`` prints it (default ``str``; for a secret, :func:`hidden`):
        a URL's password never shows.
    :param secret: the value is, or may carry, a secret (a key, a password, a token): ``hicache settings``
        prints only what :attr:`show` makes of it, a refused value's message does not quote it, and
        ``python -m hicache_core.settings.registry`` does not print it. Every setting that can hold one
        is declared so (tests/test_settings_secrets.py checks the names).
    """

    name: str
    parse: Callable[[str], Any]
    takes: str
    default: Any = None
    doc: str = ""
    keep_blank: bool = False
    show: Callable[[Any], str] = str
    secret: bool = False

    def __post_init__(self) -> None:
        if self.secret and self.show is str:  # a secret declared without its own way to show it shows none of it
            object.__setattr__(self, "show", hidden)

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value now in the environment (``environ``, default ``os.environ``), or :attr:`default`.

        :raises SettingError: the variable holds a value this setting does not take.
        """
        raw = self.raw(environ)
        if raw is None:
            return self.default
        return self.parse_text(raw)

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set, or ``None`` where :meth:`read` gives the default (unset, or blank)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or (not raw.strip() and not self.keep_blank):
            return None
        return raw

    def parse_text(self, raw: str) -> Any:
        """``raw`` as this setting's value (what :meth:`read` does with a set variable)."""
        try:
            return self.parse(raw.strip())
        except (ValueError, KeyError):
            given = f" (secret, {len(raw)} characters)" if self.secret else f"={raw!r}"
            raise SettingError(f"{self.name}{given} is not {self.takes}") from None


def hidden(value: Any) -> str:
    """A secret as ``hicache settings`` shows it by default: its length, nothing of its text."""
    return f"<secret, {len(str(value))} characters>"


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


def text(name: str, *, default: str | None = None, doc: str = "", takes: str = "text",
         show: Callable[[Any], str] = str, secret: bool = False) -> Setting:  # fmt: skip
    """Any text (a path, a URL, a module name); unset or blank: ``default``. ``takes`` says what in words.

    ``secret=True`` for text that is or may carry a secret (:attr:`Setting.secret`).
    """
    return Setting(name, str, takes, default, doc, show=show, secret=secret)


def knob(name: str, *, takes: str, doc: str) -> Setting:
    """The variable of a GPU implementation's knob (:class:`hicache_core.gpu.knobs.Knob`), declared for the list.

    The implementation reads and checks it when one is made (its knob's check names the variable and
    the range); here it is text, so that listing it never imports the implementation.
    """
    return Setting(name, str, takes, None, doc)
