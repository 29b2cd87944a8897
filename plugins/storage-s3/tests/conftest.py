"""Fixtures: one real SeaweedFS server (S3 gateway) on 127.0.0.1 for this plugin's tests, and a bucket."""

from __future__ import annotations

import uuid

import pytest
from seaweedfs_server import ACCESS_KEY, SECRET_KEY, start_seaweedfs


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_bucket(seaweedfs):
    return seaweedfs.create_bucket("hicache-tests")


@pytest.fixture
def s3_env(monkeypatch):
    """The test server's credentials as the standard AWS environment variables (and nothing else of AWS's)."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_REGION", "AWS_DEFAULT_REGION"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/hicache-test-credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/hicache-test-config")


@pytest.fixture
def s3_url(seaweedfs, s3_bucket, s3_env):
    return seaweedfs.url(s3_bucket, f"t{uuid.uuid4().hex[:8]}")
