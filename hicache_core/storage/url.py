"""Storage URLs and the option parsers every storage plugin uses (a leaf: it imports only hicache_core.lazy)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..lazy import Moved, lazy_face

#: Query options whose values are secrets: never printed (see :func:`redact_url`).
SECRET_OPTIONS = frozenset({"password", "passwd", "pass", "token", "secret", "auth"})


def redact_url(url: str) -> str:
    """``url`` with the user-info password and secret query values replaced by ``***`` (for messages)."""
    if not isinstance(url, str):
        return type(url).__name__
    head, sep, rest = url.partition("://")
    secret = r"(?i)((?:^|[?&])(?:" + "|".join(sorted(SECRET_OPTIONS)) + r")=)[^&#]*"
    if not sep:
        return re.sub(secret, r"\1***", url)
    netloc = re.match(r"[^/?#]*", rest).group(0)
    tail = rest[len(netloc) :]
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}{':***' if colon else ''}@{hostport}"
    return head + sep + netloc + re.sub(secret, r"\1***", tail)


@dataclass(frozen=True)
class StorageURL:
    """A parsed storage URL: ``scheme://[user[:password]@][host[:port]]/path?option=value&...``.

    ``repr`` and :attr:`redacted` never show a password (user-info or ``?password=``).
    """

    raw: str = field(repr=False)
    scheme: str
    host: str | None
    port: int | None
    path: str
    query: dict[str, str] = field(default_factory=dict, repr=False)
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @property
    def redacted(self) -> str:
        """The URL as it may be printed: secrets replaced by ``***``."""
        return redact_url(self.raw)

    def __repr__(self) -> str:
        return f"StorageURL({self.redacted!r})"

    @classmethod
    def parse(cls, url: str) -> StorageURL:
        if not isinstance(url, str) or "://" not in url:
            shown = redact_url(url) if isinstance(url, str) else type(url).__name__
            raise ValueError(
                f"a storage URL looks like file:///path, redis://host:port/db or mooncake://host:port; got {shown!r}"
            )
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port in storage URL {redact_url(url)!r}: {redact_url(str(exc))}") from None
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        return cls(url, parts.scheme.lower(), parts.hostname, port, unquote(parts.path), query, user, password)


def option_bool(value: Any, name: str) -> bool:
    """A boolean option from a URL query string or a keyword (``1/0``, ``true/false``, ``yes/no``, ``on/off``)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"option {name}={value!r} is not a boolean (use 1/0, true/false)")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def option_bytes(value: Any, name: str) -> int:
    """A size option: an int, or text like ``512MiB``, ``10GB``, ``4096``."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = digits, text[len(digits) :]
    try:
        out = int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"option {name}={value!r} is not a size (e.g. 4096, 512MiB, 10GB)") from None
    if out < 0:
        raise ValueError(f"option {name}={value!r} must not be negative")
    return out


def option_float(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r} is not a number") from None


# Moved in hicache-core 0.2.0; kept here for one minor version (docs/plugins.md, "Versions").
_TO_MAKE = Moved("hicache_core.storage.make", "hicache_core.storage")
_MOVED = {"make_storage": _TO_MAKE, "UnknownStorageScheme": _TO_MAKE}
__getattr__ = lazy_face(globals(), {}, moved=_MOVED)[0]
