"""0.2's storage API, where the backend was the page store, keeps working until 0.4 with a DeprecationWarning.

A third-party storage plugin written for 0.2 subclassed ``StorageBackend`` and could call page
methods on itself (``self.batch_exists``), override them (a native prefix query), or be built and
bound by hand (``bind``); its users read backend members on what ``make_storage`` returned
(``store.client``) and patched primitives there in tests. Each still works, and says what replaces it.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Sequence

import pytest

from hicache_core.registry import Registry
from hicache_core.storage import PageStore, StorageBackend, make_storage, page_hashes
from hicache_core.storage.keys import namespace_for
from hicache_core.storage.memory import MemoryStorage
from hicache_core.storage.pages import PageMap
from hicache_core.storage.url import StorageURL
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

CASE = StorageCase("mha", "page_first", "plain", 4)


def _url() -> str:
    return f"memory://legacy-{uuid.uuid4().hex[:8]}"


class _Counting(MemoryStorage):
    """A 0.2-style plugin: overrides a page method and calls another one on itself."""

    scheme = "legacy"
    description = "a plugin written for hicache-core 0.2"

    def __init__(self, url: StorageURL, **options) -> None:
        super().__init__(StorageURL.parse(f"memory://{url.host or 'x'}{url.path}"), **options)
        self.prefix_queries = 0

    def batch_exists(self, keys: Sequence[str], extra_info=None) -> int:
        self.prefix_queries += 1
        return super().batch_exists(keys, extra_info)

    def stored_count(self, keys: Sequence[str]) -> int:
        return self.get_stats().exists_hits  # a 0.2 plugin reading its own statistics


class _LegacyPlugin:
    from hicache_core import hookimpl

    @hookimpl
    def hicache_register_storage_backends(self, register):
        register(_Counting)


def test_a_backend_member_read_or_patched_through_the_store_warns_and_reaches_the_backend():
    host = make_pool(CASE, pages=8, seed=1)
    store = make_storage(_url(), host, model_id="m")
    assert isinstance(store, PageStore) and not isinstance(store, StorageBackend)
    moved = r"make_storage\(\.\.\.\)\.capabilities moved to make_storage\(\.\.\.\)\.backend\.capabilities .*0\.4"
    with pytest.warns(DeprecationWarning, match=moved):
        assert store.capabilities is store.backend.capabilities
    real = store.backend.put_objects
    calls = []

    def counting(keys, values):
        calls.append(len(keys))
        return real(keys, values)

    with pytest.warns(DeprecationWarning, match=r"make_storage\(\.\.\.\)\.put_objects \(set\) moved"):
        store.put_objects = counting
    keys = page_hashes(list(range(8)), 4)
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2], 4)))
    assert calls == [2], "the patch reached the backend the store writes through"
    with pytest.warns(DeprecationWarning, match=r"make_storage\(\.\.\.\)\.put_objects \(deleted\) moved"):
        del store.put_objects
    assert "put_objects" not in store.backend.__dict__
    with pytest.raises(AttributeError, match="no_such_member"):
        store.no_such_member  # noqa: B018 - neither the store nor the backend has it: Python's own error
    store.close()


def test_page_methods_called_on_a_backend_reach_its_page_store_with_a_warning():
    host = make_pool(CASE, pages=8, seed=2)
    store = make_storage(_url(), host, model_id="m")
    backend = store.backend
    keys = page_hashes(list(range(8)), 4)
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.write_pages moved to PageStore\.write_pages"):
        assert all(r.ok for r in backend.write_pages(keys, slots_of([1, 2], 4)))
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.batch_exists"):
        assert backend.batch_exists(keys) == 2
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.batch_get_v1 \(now batch_get_into\) moved"):
        assert backend.batch_get_v1(keys, slots_of([3, 4], 4)) == [True, True]
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.host_pool"):
        assert backend.host_pool is host
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.get_stats"):
        assert backend.get_stats().pages_written == 2 == store.get_stats().pages_written
    store.close()


def test_a_backend_bound_by_hand_gets_a_page_store_and_an_unbound_one_says_how_to_bind():
    host = make_pool(CASE, pages=8, seed=3)
    backend = MemoryStorage(StorageURL.parse(_url()))
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.get_stats"):
        assert backend.get_stats().pages_written == 0  # statistics work unbound, as in 0.2
    unbound = r"not bound to a host pool: make it with make_storage\(url, host_pool"
    with pytest.warns(DeprecationWarning), pytest.raises(RuntimeError, match=unbound):
        backend.batch_exists(["a"])
    with pytest.warns(DeprecationWarning, match=r"StorageBackend\.bind \(now PageStore\(backend, host_pool, namespace"):
        backend.bind(host, namespace_for(host, "m"))
    assert backend.page_bytes == PageMap(host).page_bytes and backend.namespace == namespace_for(host, "m")
    keys = page_hashes(list(range(4)), 4)
    with pytest.warns(DeprecationWarning):
        assert backend.batch_set_from(keys, slots_of([1], 4)) == [True]
    assert backend.exists_objects(backend.namespace.keys(keys)) == [True]


def test_a_backend_that_overrides_a_page_method_keeps_it_with_a_warning():
    reg = Registry()
    reg.add_plugin(_LegacyPlugin(), "legacyplugin")
    host = make_pool(CASE, pages=8, seed=4)
    overrides = r"_Counting\.batch_exists overrides a page method that moved to PageStore\.batch_exists"
    with pytest.warns(DeprecationWarning, match=overrides):
        store = make_storage(f"legacy://{uuid.uuid4().hex[:8]}", host, model_id="m", registry=reg)
    keys = page_hashes(list(range(8)), 4)
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2], 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the override's super() call warns; no loop
        assert store.batch_exists(keys) == 2
        assert store.backend.stored_count(keys) == 2
    assert store.backend.prefix_queries == 1, "the store called the plugin's override"
    store.close()
