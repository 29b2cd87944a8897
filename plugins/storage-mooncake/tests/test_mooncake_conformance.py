"""The storage conformance kit against a real mooncake_master, over TCP."""

from __future__ import annotations

import pytest

from hicache_core.testing.storage_kit import StorageConformanceTests


class TestMooncakeStorage(StorageConformanceTests):
    page_sizes = (4,)

    @pytest.fixture
    def storage_url(self, mooncake_url):
        return mooncake_url

    def corrupt_object(self, backend, key, offset):
        data = bytearray(backend.store.get(key))
        data[offset] ^= 0xFF
        backend.store.batch_remove([key], True)
        assert backend.store.put(key, bytes(data)) == 0
