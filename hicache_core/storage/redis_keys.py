"""Deleting every Redis key under a prefix, for the plugins that keep data in Redis (no redis import here)."""

from __future__ import annotations

from typing import Any

#: Keys deleted per DEL command.
_BATCH = 1000


def glob_literal(text: bytes) -> bytes:
    """``text`` as a Redis glob pattern that matches only itself (``* ? [ ] \\`` escaped)."""
    out = bytearray()
    for byte in text:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def delete_under_prefix(client: Any, prefix: str | bytes) -> None:
    """Delete every key of ``client`` (a redis-py client) that starts with ``prefix``, matched literally."""
    raw = prefix.encode() if isinstance(prefix, str) else prefix
    batch = []
    for key in client.scan_iter(match=glob_literal(raw) + b"*", count=_BATCH):
        batch.append(key)
        if len(batch) >= _BATCH:
            client.delete(*batch)
            batch = []
    if batch:
        client.delete(*batch)
