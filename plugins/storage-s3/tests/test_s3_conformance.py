"""The storage conformance kit against a real SeaweedFS S3 gateway."""

from __future__ import annotations

import pytest
from s3_objects import flip_byte

from hicache_core.testing.storage_kit import StorageConformanceTests


class TestS3Storage(StorageConformanceTests):
    page_sizes = (4,)

    @pytest.fixture
    def storage_url(self, s3_url):
        return s3_url

    def corrupt_object(self, backend, key, offset):
        flip_byte(backend, key, offset)
