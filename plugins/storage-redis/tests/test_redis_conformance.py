"""The storage conformance kit against a real redis-server."""

from __future__ import annotations

import pytest

from hicache_core.testing.storage_kit import StorageConformanceTests


class TestRedisStorage(StorageConformanceTests):
    page_sizes = (4,)

    @pytest.fixture
    def storage_url(self, redis_url):
        return redis_url

    def corrupt_object(self, backend, key, offset):
        k = backend._k(key)
        byte = backend.client.getrange(k, offset, offset)
        backend.client.setrange(k, offset, bytes([byte[0] ^ 0xFF]))
