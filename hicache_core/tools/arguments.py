"""Argument types of the ``hicache`` command: a value they do not take is refused by argparse, in one line.

Each type raises :class:`argparse.ArgumentTypeError` with what it takes, so that the command says
``hicache demo: error: argument --tokens: takes an integer >= 1, got '-5'`` and exits 2 before any work.
Checks that need the registry (a layout, a shape, a storage scheme) run after parsing, in ``hicache_core.cli``.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Collection

_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def _fail(takes: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"takes {takes}, got {text!r}")


#: The largest whole number an option takes: tokens, pages and layers become int32 slot indices and tensor sizes.
INT_MAX = 2**31 - 1


def _integer(text: str, minimum: int) -> int:
    takes = f"an integer from {minimum} to {INT_MAX}"
    try:
        value = int(text.strip())
    except ValueError:
        raise _fail(takes, text) from None
    if not minimum <= value <= INT_MAX:
        raise _fail(takes, text)
    return value


def positive_int(text: str) -> int:
    """A whole number from 1 to :data:`INT_MAX` (tokens, pages, layers, ranks)."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number from 0 to :data:`INT_MAX` (a rank, a count of pages held)."""
    return _integer(text, 0)


def _number(text: str, *, above_zero: bool) -> float:
    takes = "a finite number > 0" if above_zero else "a finite number >= 0"
    try:
        value = float(text.strip())
    except ValueError:
        raise _fail(takes, text) from None
    if not math.isfinite(value) or value < 0 or (above_zero and value == 0):
        raise _fail(takes, text)
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (a ratio)."""
    return _number(text, above_zero=True)


def non_negative_number(text: str) -> float:
    """A finite number >= 0 (a size in GB, where 0 means "not given")."""
    return _number(text, above_zero=False)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated whole numbers from 1 to :data:`INT_MAX` (``64,512,4096``), at least one."""
    takes = f"comma-separated integers from 1 to {INT_MAX}"
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise _fail(takes, text)
    values = []
    for part in parts:
        try:
            values.append(_integer(part, 1))
        except argparse.ArgumentTypeError:
            raise _fail(takes, text) from None
    return tuple(values)


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, at least one (each is checked against what is registered after parsing)."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise _fail("comma-separated names", text)
    return names


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE.match(text.strip()):
        raise _fail("cpu, cuda or cuda:N", text)
    return text.strip()


def unknown_names(option: str, given: tuple[str, ...] | None, known: Collection[str], what: str) -> str | None:
    """Why ``given`` (the value of ``option``) names a ``what`` not in ``known``, or ``None``."""
    unknown = [n for n in given or () if n not in known]
    if not unknown:
        return None
    return f"argument {option}: unknown {what} {', '.join(map(repr, unknown))}; {what}s: {', '.join(sorted(known))}"
