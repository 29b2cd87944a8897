"""A real mooncake_master on 127.0.0.1 for the Mooncake tests (from the wheel; a clear skip without it)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import uuid
from pathlib import Path

import pytest

from hicache_core.testing.servers import ServerProcess, free_port


def master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    spec = importlib.util.find_spec("mooncake")
    if spec and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
        if candidate.exists():
            return str(candidate)
    candidate = Path(sys.executable).parent / "mooncake_master"
    return str(candidate) if candidate.exists() else None


def client_problem() -> str | None:
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake Store's client does not import ({exc}): pip install mooncake-transfer-engine-non-cuda "
                "(CPU) or mooncake-transfer-engine (CUDA), and apt-get install libibverbs1")  # fmt: skip
    return None


def start_master(tmp_path) -> ServerProcess:
    problem = client_problem()
    if problem:
        pytest.skip(problem)
    binary = master_binary()
    if binary is None:
        pytest.skip("mooncake_master is not installed (it ships in the mooncake-transfer-engine wheels)")
    metrics = free_port()

    def argv(port):
        return [binary, "-rpc_address=127.0.0.1", f"-rpc_port={port}", "-metrics_host=127.0.0.1",
                f"-metrics_port={metrics}"]  # fmt: skip

    return ServerProcess(argv, tmp_path / f"master-{uuid.uuid4().hex[:6]}.log", start_timeout=30).start()





def start_holder(tmp_path, master: ServerProcess) -> ServerProcess:
    """A mooncake_client process that lends 256 MB to the store, so pages outlive the servers that wrote them."""
    binary = str(Path(master_binary()).parent / "mooncake_client")
    if not Path(binary).exists():
        pytest.skip("mooncake_client is not in the Mooncake wheel here")

    def argv(port):
        return [binary, "-host=127.0.0.1", f"-port={port}", "-global_segment_size=256MB", "-protocol=tcp",
                f"-master_server_address=127.0.0.1:{master.port}", "-metadata_server=P2PHANDSHAKE"]  # fmt: skip

    return ServerProcess(argv, tmp_path / f"holder-{uuid.uuid4().hex[:6]}.log", start_timeout=30).start()
