"""Integer arguments, taken exactly: a bool, a float or a string is refused, never truncated or coerced."""

from __future__ import annotations

import operator
from typing import Any


def strict_int(value: Any, what: str) -> int:
    """``value`` as an int; a bool (``True`` is not layer 1) or anything without ``__index__`` is a TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def positive_int(value: Any, what: str) -> int:
    """``value`` as an int >= 1 (see :func:`strict_int`); 0 and negatives are a ValueError."""
    number = strict_int(value, what)
    if number < 1:
        raise ValueError(f"{what} must be >= 1, got {number}")
    return number
