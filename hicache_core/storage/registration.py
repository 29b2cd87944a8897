"""Checks on a storage backend class handed to ``register`` (kept out of the registry module)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .backend import Capabilities, StorageBackend

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


def storage_backend_problems(backend: Any, registered: Mapping[str, type], owner: Mapping[str, str]) -> list[str]:
    """Why ``backend`` cannot be registered (empty when it can)."""
    if not (isinstance(backend, type) and issubclass(backend, StorageBackend)):
        return [f"{backend!r} is not a subclass of hicache_core.storage.StorageBackend"]
    problems = []
    scheme = getattr(backend, "scheme", "")
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        problems.append(f"scheme must be a URL scheme such as 'file' or 'redis', got {scheme!r}")
    elif scheme in registered:
        problems.append(f"scheme {scheme!r} is already registered by {owner.get(f'storage:{scheme}', '?')}")
    if not isinstance(backend.capabilities, Capabilities):
        problems.append("capabilities must be a hicache_core.storage.Capabilities")
    else:
        reader = "get_objects_into" if backend.capabilities.zero_copy else "get_objects"
        needed = ["exists_objects", "put_objects", reader]
        for name in needed:
            if getattr(backend, name) is getattr(StorageBackend, name):
                problems.append(f"does not implement {name}")
    return problems
