"""The page API that a storage backend carried until hicache-core 0.2, kept for one minor version.

Until 0.2 :class:`~hicache_core.storage.StorageBackend` was also the page store: a plugin's
instance answered ``batch_exists``, ``write_pages``, ``get_stats``, ``host_pool`` ... and
``bind(host_pool, namespace)`` tied it to a pool. Since 0.3 those belong to
:class:`~hicache_core.storage.PageStore`, which wraps the backend. Code that still calls them on a
backend (a plugin calling ``self.batch_exists``, an override calling ``super().get_stats()``, a
caller that built and bound a backend itself) reaches the backend's page store here, with a
``DeprecationWarning``; an unbound backend gets an unbound store, which refuses page calls as the
old base class did. A plugin that overrides one of them keeps its override: the page store calls
it (``PageStore``'s ``_adopt_overrides``). This module goes in 0.4.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..lazy import Moved

#: Where 0.2's page API on a backend went.
TO_PAGE_STORE = Moved("hicache_core.storage.page_store", "PageStore", since="0.3.0", until="0.4.0")
#: The page methods a 0.2 backend answered itself, each with its PageStore method (SGLang's v1 names included).
PAGE_METHODS = {
    **{name: name for name in ("batch_exists", "exists", "batch_set_from", "batch_get_into", "write_pages",
                               "read_pages", "set", "get", "batch_set", "batch_get", "get_stats")},
    "batch_set_v1": "batch_set_from",
    "batch_get_v1": "batch_get_into",
}  # fmt: skip
_ATTRIBUTES = ("host_pool",)


def _forwarder(name: str, target: str) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        TO_PAGE_STORE.warn("StorageBackend", name if name == target else f"{name} (now {target})")
        store = _page_store_of(self)
        # PageStore's own method, not the instance's: a 0.2 override that calls super() must not loop back.
        return getattr(type(store), target)(store, *args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"Deprecated since hicache-core 0.3.0: use ``PageStore.{target}`` (make_storage returns it)."
    forward.hicache_forwarder = True  # type: ignore[attr-defined]  # not an override (PageStore reads this)
    return forward


def _page_store_of(backend: Any) -> Any:
    store = backend.__dict__.get("_page_store")
    if store is None:  # a backend nobody bound: an unbound store, whose page calls say how to bind
        from .page_store import PageStore

        store = PageStore(backend)
    return store


class LegacyPageAPI:
    """The 0.2 page API on a backend, forwarded to its :class:`~hicache_core.storage.PageStore` with a warning."""

    #: Read by PageStore to find a plugin's overrides of them.
    legacy_page_methods: ClassVar[dict[str, str]] = PAGE_METHODS

    def bind(self, host_pool: Any, namespace: Any) -> None:
        """Deprecated since hicache-core 0.3.0: ``PageStore(backend, host_pool, namespace)``."""
        from .page_store import PageStore

        TO_PAGE_STORE.warn("StorageBackend", "bind (now PageStore(backend, host_pool, namespace))")
        PageStore(self, host_pool, namespace)

    def __getattr__(self, name: str) -> Any:
        if name in _ATTRIBUTES:
            TO_PAGE_STORE.warn("StorageBackend", name)
            return getattr(_page_store_of(self), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)


for _name, _target in PAGE_METHODS.items():
    setattr(LegacyPageAPI, _name, _forwarder(_name, _target))
