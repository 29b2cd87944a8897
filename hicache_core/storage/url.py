"""Storage URLs and :func:`make_storage`: a scheme picks the backend, through the registry."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..plugin_sources import source_tree_plugins

if TYPE_CHECKING:
    from ..registry import Registry
    from .backend import StorageBackend



class UnknownStorageScheme(ValueError):
    """No installed storage backend serves the URL's scheme."""


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


def make_storage(
    url: str,
    host_pool: Any = None,
    *,
    model_id: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    replicated: bool | None = None,
    registry: Registry | None = None,
    **options: Any,
) -> StorageBackend:
    """Build the storage backend of ``url`` and bind it to ``host_pool``'s pages.

    :param url: ``file:///dir``, ``redis://host:port/db``, ``mooncake://host:port``, or any
        scheme an installed plugin registers through ``hicache_register_storage_backends``.
    :param host_pool: the host pool whose pages move; ``None`` makes an unbound backend
        (statistics and administration only).
    :param model_id: the model's name; required with a host pool (it is part of every key).
    :param tp_rank: this rank's tensor-parallel rank; ``tp_size`` the TP world size.
    :param replicated: every TP rank holds the same bytes (default: true for MLA pools);
        then all ranks share one copy of each page.
    :param options: backend options; they override the URL's query (``?capacity=...``).
    :raises UnknownStorageScheme: no installed backend serves the scheme (the message lists
        the installed schemes and what to install).
    :raises ValueError: a bad URL, option or argument, before anything is opened.
    """
    from ..registry import get_registry
    from .keys import namespace_for

    parsed = StorageURL.parse(url)
    registry = registry or get_registry()
    backends = registry.storage_backends
    cls = backends.get(parsed.scheme)
    if cls is None:
        raise UnknownStorageScheme(_unknown_scheme_message(parsed, registry))
    if host_pool is not None and not model_id:
        raise ValueError("make_storage needs model_id= with a host pool: pages of different models must never mix")
    merged = {**parsed.query, **options}
    namespace = None
    if host_pool is not None:
        namespace = namespace_for(host_pool, model_id, tp_rank=tp_rank, tp_size=tp_size, replicated=replicated)
    backend = cls(parsed, **merged)
    if host_pool is not None:
        try:
            backend.bind(host_pool, namespace)
        except BaseException:
            backend.close()
            raise
    return backend


def _unknown_scheme_message(url: StorageURL, registry: Registry) -> str:
    installed = registry.storage_backends
    lines = [f"No storage backend serves {url.scheme}:// (URL {url.redacted!r})."]
    if installed:
        listed = ", ".join(f"{s}:// ({registry.plugin_of_storage(s)})" for s in sorted(installed))
        lines.append(f"Installed storage backends: {listed}.")
    else:
        lines.append("No storage backend is installed.")
    # Install hints from the plugins' own metadata in hicache's source tree: they are on no package index.
    for plugin in source_tree_plugins():
        if url.scheme in plugin.storage_schemes:
            lines.append(
                f"{plugin.distribution} serves {url.scheme}:// and is not installed; it ships in hicache's source "
                f"tree and is on no package index: pip install -e {plugin.path}"
            )
    others = [
        f"{p.distribution} ({', '.join(s + '://' for s in p.storage_schemes)})"
        for p in source_tree_plugins()
        if p.storage_schemes and url.scheme not in p.storage_schemes and not set(p.storage_schemes) & set(installed)
    ]
    if others:
        lines.append("Other first-party storage plugins in the source tree: " + ", ".join(others) + ".")
    failed = [f"{r.name}: {' | '.join(r.errors)}" for r in registry.failed_plugins()]
    if failed:
        lines.append("Plugins that failed to load or register: " + "; ".join(failed) + ".")
    return "\n".join(lines)


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
