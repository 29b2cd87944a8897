"""Fixtures: a real redis-server (the directory) and owner processes on 127.0.0.1; UCX over TCP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache_core.testing.servers import start_redis, stop_process

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import TEST_OPTIONS  # noqa: E402

pytest.importorskip("nixl_cu13", reason="NIXL is not installed (pip install nixl-cu13==1.5.1)")
pytest.importorskip("redis", reason="the redis package is not installed (pip install redis==8.1.0)")
# The tier's transport in these tests is UCX over TCP on loopback (as between two machines without RDMA).
os.environ.setdefault("UCX_TLS", "tcp,self")
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A directory server of the test's own (one the test kills and restarts)."""
    (tmp_path / "redis").mkdir()
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def peer_url(redis_server):
    return f"peer://127.0.0.1:{redis_server.port}/0?prefix=t{uuid.uuid4().hex[:8]}:&timeout=2&lease=3{TEST_OPTIONS}"


class Proc:
    """A peer_proc.py process; ``stop()`` asks it to finish and returns what it reported."""

    def __init__(self, role: str, url: str, workdir: Path, n_pages: int = 16, verify: bool | None = None) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / f"{role}.log", "ab")
        argv = [sys.executable, str(HERE / "peer_proc.py"), role, url, str(workdir), str(n_pages)]
        argv += [] if verify is None else ["verify" if verify else "noverify"]  # None: the kit's pool
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_for(self, name: str, timeout: float = 60.0) -> Path:
        path = self.workdir / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited ({self.proc.returncode}): {self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {name} after {timeout} s: {self.output()}")
            time.sleep(0.05)
        return path

    def ready(self) -> dict:
        return json.loads(self.wait_for("ready.json").read_text())

    def output(self) -> str:
        self.log.flush()
        text = "\n".join(line for line in Path(self.log.name).read_text().splitlines()
                         if "NIXL INFO" not in line)  # fmt: skip
        return text[-3000:]

    def signal(self, sig: int) -> None:
        """Send ``sig``; SIGSTOP returns once every thread has stopped (until then one may still serve a read)."""
        if sig == signal.SIGSTOP:
            stop_process(self.proc.pid)
        else:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> dict:
        (self.workdir / "stop").write_text("1")
        try:
            self.proc.wait(timeout)
            said = self.output()
        finally:
            self.kill()
        assert self.proc.returncode == 0, f"exit code {self.proc.returncode}: {said}"
        return json.loads((self.workdir / "owner-final.json").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@dataclass
class SharedOwner:
    """The module's shared owner process, its URL (a directory prefix of its own) and the keys it published."""

    proc: Proc
    url: str
    keys: list[str]


@pytest.fixture(scope="module")
def shared_owner(redis_server, tmp_path_factory):
    """One owner process for the tests that only read from it (each process start costs seconds of CPU).

    When the module's last such test is done, the owner must still publish all its pages under its
    two NIXL registrations, with no failed heartbeat: readers, dying ones included, never change that.
    """
    url = f"peer://127.0.0.1:{redis_server.port}/0?prefix=s{uuid.uuid4().hex[:8]}:&timeout=2&lease=3{TEST_OPTIONS}"
    owner = Proc("owner", url, tmp_path_factory.mktemp("shared-owner"))
    try:
        yield SharedOwner(owner, url, owner.ready()["keys"])
        final = owner.stop()["stats"]
        assert (final["published_pages"], final["nixl_registrations"], final["heartbeat_failed"]) == (16, 2, 0), final
    finally:
        owner.kill()


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(role: str, url: str, workdir: Path, n_pages: int = 16, verify: bool | None = None) -> Proc:
        p = Proc(role, url, workdir, n_pages, verify)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
