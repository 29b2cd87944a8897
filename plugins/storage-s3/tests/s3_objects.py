"""Damage stored objects through the S3 API itself (the tests' hands on the server's bytes)."""

from __future__ import annotations

from typing import Any


def _backend(store: Any) -> Any:
    return getattr(store, "backend", store)


def read_object(store: Any, key: str) -> bytes:
    import obstore

    b = _backend(store)
    return bytes(obstore.get(b.store, b._path(key)).bytes())


def write_object(store: Any, key: str, data: bytes) -> None:
    import obstore

    b = _backend(store)
    obstore.put(b.store, b._path(key), data, use_multipart=False)


def flip_byte(store: Any, key: str, offset: int) -> None:
    data = bytearray(read_object(store, key))
    data[offset] ^= 0xFF
    write_object(store, key, bytes(data))
