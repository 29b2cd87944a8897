"""A dependency-free progress bar for ``hicache demo`` and ``hicache bench`` (stderr, one line)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str = "", width: int = 30) -> Iterator[T]:
    """Yield ``items`` while drawing ``[#####     ] k/total label`` on stderr (redrawn in place on a terminal)."""
    start = time.perf_counter()
    tty = sys.stderr.isatty()
    for done, item in enumerate(items):
        _draw(done, total, label, width, start, tty)
        yield item
    _draw(total, total, label, width, start, tty)
    sys.stderr.write("\n" if tty else "")
    sys.stderr.flush()


def _draw(done: int, total: int, label: str, width: int, start: float, tty: bool) -> None:
    if not tty and done not in (0, total):
        return
    filled = width * done // max(total, 1)
    line = f"[{'#' * filled}{' ' * (width - filled)}] {done}/{total} {label} {time.perf_counter() - start:.1f}s"
    sys.stderr.write(("\r" + line) if tty else (line + "\n"))
    sys.stderr.flush()
