"""0.2's storage API, where the backend was the page store, is gone in 0.4: a plugin still written for it is told.

A storage plugin written for 0.2 subclassed ``StorageBackend`` and could override page methods (a
native prefix query), call them on itself (``self.get_stats()``), or be built and bound by hand
(``bind``); its users read backend members on what ``make_storage`` returned (``store.client``).
0.3 kept each working with a warning; 0.4 refuses the class at registration, or fails the read,
with a message that names the change and how to port.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest

from hicache_core import hookimpl
from hicache_core.plugins.registry import Registry
from hicache_core.storage import PageStore, StorageBackend, make_storage, page_hashes
from hicache_core.storage.legacy import PAGE_API, page_api_problems
from hicache_core.storage.memory import MemoryStorage
from hicache_core.storage.url import StorageURL
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

CASE = StorageCase("mha", "page_first", "plain", 4)
CHANGE = r"moved to PageStore in hicache-core 0\.3\.0 and left the backend in 0\.4\.0"


def _url() -> str:
    return f"memory://legacy-{uuid.uuid4().hex[:8]}"


class _Overrides(MemoryStorage):
    """0.2 style: a native prefix query as an override of the page method."""

    scheme = "legacy-override"
    description = "a plugin written for hicache-core 0.2"

    def batch_exists(self, keys: Sequence[str], extra_info=None) -> int:
        return 0


class _CallsItself(MemoryStorage):
    """0.2 style: reads its page store's statistics and pool on itself, once inside a closure."""

    scheme = "legacy-calls"
    description = "a plugin written for hicache-core 0.2"

    def stored_count(self) -> int:
        return self.get_stats().exists_hits

    def later(self):
        return lambda: self.host_pool


class _OwnAttribute(MemoryStorage):
    """0.4 style: a backend may keep an attribute of its own under a 0.2 page name, and read it."""

    scheme = "own-attribute"
    description = "a plugin that keeps its own 'host_pool' attribute"

    def __init__(self, url: StorageURL, **options) -> None:
        super().__init__(url, **options)
        self.host_pool = "its own"

    def which(self) -> str:
        return self.host_pool


def _plugin(*classes: type) -> object:
    class Plugin:
        @hookimpl
        def hicache_register_storage_backends(self, register):
            for cls in classes:
                register(cls)

    return Plugin()


def test_a_backend_that_overrides_or_calls_the_page_api_is_refused_at_registration_naming_the_change():
    reg = Registry()
    record = reg.add_plugin(_plugin(_Overrides, _CallsItself, _OwnAttribute), "legacyplugin")
    assert set(record.storage_backends) == {"own-attribute"}, "only the 0.4-style class registered"
    text = "\n".join(record.errors)
    assert "storage backend '_Overrides' refused: defines _Overrides.batch_exists: " in text
    assert "the PageStore answers prefix queries from exists_objects" in text
    assert "_CallsItself.stored_count reads get_stats on the backend" in text
    assert "_CallsItself.later reads host_pool on the backend" in text  # inside the lambda
    assert "register_memory(spans)" in text and "backend_stats()" in text
    assert len(record.errors) == 2 and all("left the backend in 0.4.0" in e for e in record.errors)
    with pytest.raises(ValueError, match="No storage backend serves legacy-override://") as err:
        make_storage("legacy-override://x", registry=reg)
    assert "legacyplugin: storage backend '_Overrides' refused: defines _Overrides.batch_exists" in str(err.value)


def test_super_calls_and_wrapped_methods_are_read_too():
    class _Super(MemoryStorage):
        scheme = "legacy-super"

        def put_objects(self, keys, values):  # wrapped by StorageBackend's scrubbing: its original is read
            super().get_stats()
            return super().put_objects(keys, values)

    problems = page_api_problems(_Super, StorageBackend)
    assert len(problems) == 1 and problems[0].split(":")[0].endswith(
        "<locals>._Super.put_objects reads get_stats on the backend"
    )

    class _Comprehension(MemoryStorage):
        def hits(self):
            return [self.get_stats() for _ in range(2)]  # inlined into the method since Python 3.12

    (problem,) = page_api_problems(_Comprehension, StorageBackend)
    assert "_Comprehension.hits reads get_stats on the backend" in problem
    assert page_api_problems(MemoryStorage, StorageBackend) == []
    assert page_api_problems(_OwnAttribute, StorageBackend) == []


def test_the_first_party_backends_use_none_of_it():
    for scheme, cls in Registry.from_entry_points().storage_backends.items():
        assert page_api_problems(cls, StorageBackend) == [], scheme


def test_a_page_method_read_on_a_backend_fails_naming_what_replaces_it():
    backend = MemoryStorage(StorageURL.parse(_url()))
    for name in PAGE_API:
        with pytest.raises(AttributeError, match=rf"^MemoryStorage\.{name}: 0\.2's page API .*{CHANGE}") as err:
            getattr(backend, name)
        assert err.value.name == name
    assert not hasattr(backend, "bind") and not isinstance(backend, PageStore)
    with pytest.raises(AttributeError, match=r"^'MemoryStorage' object has no attribute 'no_such_member'$"):
        backend.no_such_member  # noqa: B018 - anything else: Python's own message


def test_a_backend_built_by_hand_in_the_02_style_is_refused_by_the_page_store():
    backend = _Overrides(StorageURL.parse(_url()))
    with pytest.raises(TypeError, match=r"_Overrides is written for 0\.2's page API: defines _Overrides\.batch_exists"):
        PageStore(backend)


def test_a_backend_member_read_or_set_through_the_store_fails_naming_store_backend():
    host = make_pool(CASE, pages=8, seed=1)
    store = make_storage(_url(), host, model_id="m")
    assert isinstance(store, PageStore) and not isinstance(store, StorageBackend)
    moved = r"has no attribute 'capabilities': it is the backend's \(MemoryStorage\.capabilities\).*store\.backend\."
    with pytest.raises(AttributeError, match=moved):
        store.capabilities  # noqa: B018
    real = store.backend.put_objects
    with pytest.raises(AttributeError, match=r"use store\.backend\.put_objects"):
        store.put_objects = lambda keys, values: real(keys, values)  # a patch must not land silently on the store
    assert "put_objects" not in vars(store)
    keys = page_hashes(list(range(8)), 4)
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2], 4)))
    assert store.batch_exists(keys) == 2
    with pytest.raises(AttributeError, match=r"^'PageStore' object has no attribute 'no_such_member'$"):
        store.no_such_member  # noqa: B018 - neither the store nor the backend has it: Python's own message
    store.close()
