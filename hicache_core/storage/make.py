""":func:`make_storage`: a URL's scheme picks the backend (through the registry); a :class:`PageStore` wraps it."""

from __future__ import annotations

from typing import Any

from ..plugins.plugin_sources import source_tree_plugins
from ..plugins.registry import Registry, get_registry
from .keys import namespace_for
from .page_auth import FROM_ENVIRONMENT, ClusterKey, resolve_key
from .page_store import PageStore
from .url import StorageURL, scrub_exception, secrets_of


class UnknownStorageScheme(ValueError):
    """No installed storage backend serves the URL's scheme."""


def make_storage(
    url: str,
    host_pool: Any = None,
    *,
    model_id: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    replicated: bool | None = None,
    weight_version: str = "",
    registry: Registry | None = None,
    cluster_key: ClusterKey | None | str = FROM_ENVIRONMENT,
    **options: Any,
) -> PageStore:
    """Build the storage backend of ``url`` and wrap it in a :class:`PageStore` bound to ``host_pool``'s pages.

    :param url: ``file:///dir``, ``redis://host:port/db``, ``mooncake://host:port``, or any
        scheme an installed plugin registers through ``hicache_register_storage_backends``.
    :param host_pool: the host pool whose pages move; ``None`` makes an unbound store
        (statistics and administration only).
    :param model_id: the model's name; required with a host pool (it is part of every key).
    :param tp_rank: this rank's tensor-parallel rank; ``tp_size`` the TP world size.
    :param replicated: every TP rank holds the same bytes (default: true for MLA pools);
        then all ranks share one copy of each page.
    :param weight_version: the weights' version, part of every key (``""``: unversioned); a server
        that updates its weights in place moves to the new one with ``PageStore.set_weight_version``.
    :param cluster_key: the cluster's key: pages are written with its MAC and load only when it
        checks. The default reads ``HICACHE_L3_KEY_FILE`` or ``HICACHE_L3_KEY`` (neither set:
        unauthenticated pages); ``None`` turns authentication off whatever the environment says. A store
        bound without a key logs one WARNING per process and URL on the ``hicache_core.storage`` logger
        (``memory://`` excepted: nothing outside the process writes it).
    :param options: backend options; they override the URL's query (``?capacity=...``).
    :raises UnknownStorageScheme: no installed backend serves the scheme (the message lists
        the installed schemes and what to install).
    :raises ValueError: a bad URL, option or argument, before anything is opened (a
        :class:`~hicache_core.storage.page_auth.ClusterKeyError` for a bad key setting).
    """
    parsed = StorageURL.parse(url)
    key = resolve_key(cluster_key)
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
        namespace = namespace_for(host_pool, model_id, tp_rank=tp_rank, tp_size=tp_size, replicated=replicated,
                                  weight_version=weight_version)  # fmt: skip
    try:
        backend = cls(parsed, **merged)
        try:
            return PageStore(backend, host_pool, namespace, cluster_key=key)
        except BaseException:
            backend.close()
            raise
    except BaseException as exc:  # a plugin's message, or its driver's, must not show a credential
        scrub_exception(exc, secrets_of(parsed, merged))
        raise


def check_url(url: str, registry: Registry | None = None) -> StorageURL:
    """``url`` parsed, where an installed backend serves its scheme; nothing is opened or created.

    :raises UnknownStorageScheme: no installed backend serves the scheme.
    :raises ValueError: not a storage URL.
    """
    parsed = StorageURL.parse(url)
    registry = registry or get_registry()
    if parsed.scheme not in registry.storage_backends:
        raise UnknownStorageScheme(_unknown_scheme_message(parsed, registry))
    return parsed


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
            lines.append(plugin.install_hint(f"serves {url.scheme}:// and"))
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
