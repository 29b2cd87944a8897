"""The storage conformance kit, run against file:// (buffered, and with O_DIRECT + fsync)."""

from __future__ import annotations

import os

import pytest

from hicache_core.testing.storage_kit import StorageConformanceTests


class TestFileStorage(StorageConformanceTests):
    @pytest.fixture
    def storage_url(self, tmp_path):
        return f"file://{tmp_path}/l3"

    def corrupt_object(self, backend, key, offset):
        from hicache_storage_file.backend import HEADER_BLOCK

        from hicache_core.storage.page_format import HEADER_SIZE

        path = backend.path_of(key)
        if offset >= HEADER_SIZE:  # on disk the header is padded to a block
            offset += HEADER_BLOCK - HEADER_SIZE
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
class TestFileStorageDirectFsync(TestFileStorage):
    variants = ("plain",)
    page_sizes = (4,)
    storage_options = {"o_direct": True, "fsync": True}

    @pytest.fixture
    def storage_url(self, tmp_path):
        # tmpfs refuses O_DIRECT; the test directory of a disk-backed /tmp takes it.
        probe = tmp_path / "probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
            os.close(fd)
        except OSError as exc:
            pytest.skip(f"{tmp_path} does not take O_DIRECT: {exc}")
        return f"file://{tmp_path}/l3"
