"""The page API that a storage backend carried until hicache-core 0.2, kept for one minor version.

Until 0.2 :class:`~hicache_core.storage.StorageBackend` was also the page store: a plugin's
instance answered ``batch_exists``, ``write_pages``, ``get_stats``, ``host_pool`` ... and
``bind(host_pool, namespace)`` tied it to a pool. Since 0.3 those belong to
:class:`~hicache_core.storage.PageStore`, which wraps the backend. Code that still calls them on a
backend (a plugin calling ``self.batch_exists``, an override calling ``super().get_stats()``, a
caller that built and bound a backend itself) reaches the backend's page store here, with a
``DeprecationWarning``; an unbound backend gets an unbound store, which refuses page calls as the
old base class did. This module goes in 0.4.
"""

from __future__ import annotations

import warnings
from typing import Any

SINCE, UNTIL = "0.3.0", "0.4.0"

#: The page-store members a 0.2 backend answered itself, and what replaces each.
MOVED_METHODS = (
    "batch_exists", "exists", "batch_set_from", "batch_get_into", "write_pages", "read_pages", "set", "get",
    "batch_set", "batch_get", "get_stats",
)  # fmt: skip
_OLD_ALIASES = {"batch_set_v1": "batch_set_from", "batch_get_v1": "batch_get_into"}
MOVED_ATTRIBUTES = ("host_pool",)


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new} (hicache-core {SINCE}); the old path goes in {UNTIL}",
                  DeprecationWarning, stacklevel=stacklevel)  # fmt: skip


def _forwarder(name: str, target: str) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        from .page_store import PageStore

        warn_moved(f"StorageBackend.{name}", f"PageStore.{target} (make_storage(...) returns the PageStore)")
        # PageStore's own method, not the instance's: a 0.2 override that calls super() must not loop back.
        return getattr(PageStore, target)(_page_store_of(self), *args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"Deprecated since hicache-core {SINCE}: use ``PageStore.{target}``."
    return forward


def _page_store_of(backend: Any) -> Any:
    store = backend.__dict__.get("_page_store")
    if store is None:  # a backend nobody bound: an unbound store, whose page calls say how to bind
        from .page_store import PageStore

        store = PageStore(backend)
    return store


class LegacyPageAPI:
    """The 0.2 page API on a backend, forwarded to its :class:`~hicache_core.storage.PageStore` with a warning."""

    def bind(self, host_pool: Any, namespace: Any) -> None:
        """Deprecated since hicache-core 0.3.0: ``PageStore(backend, host_pool, namespace)``."""
        from .page_store import PageStore

        warn_moved("StorageBackend.bind(host_pool, namespace)", "PageStore(backend, host_pool, namespace)")
        PageStore(self, host_pool, namespace)

    def __getattr__(self, name: str) -> Any:
        if name in MOVED_ATTRIBUTES:
            warn_moved(f"StorageBackend.{name}", f"PageStore.{name}")
            return getattr(_page_store_of(self), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)


for _name, _target in [*((n, n) for n in MOVED_METHODS), *_OLD_ALIASES.items()]:
    setattr(LegacyPageAPI, _name, _forwarder(_name, _target))
