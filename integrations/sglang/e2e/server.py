"""Start SGLang's real HTTP server (``python -m hicache_sglang.launch_server``) and talk to it.

Every server binds 127.0.0.1 on a free port, runs in its own process group (so stopping it
stops SGLang's scheduler and detokenizer too), is bounded in time, and writes its log to a
file the tests read. On a CPU machine it runs SGLang's CPU engine with its plain-torch
attention; the test stand-in for ``sgl_kernel`` is on its PYTHONPATH only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = os.path.join(HERE, "test_standin")
#: SGLang's CPU engine with its plain-torch attention, float32, and a small device pool (2048 tokens)
#: so that a few requests evict a prefix to the host tier. --max-total-tokens fixes the pool; the
#: static fraction only has to pass SGLang's check that the weights left memory for it, which
#: measures free host memory before and after loading them: 0.05 passes on a quiet machine, but
#: other processes allocating meanwhile (a shared machine, the fleet's own servers) fail it.
#: --sleep-on-idle: without it SGLang's scheduler polls its sockets in a busy loop, so every idle
#: server of the fleet holds a whole core (measured: 20 s of CPU in 20 s idle; 1 s with the flag),
#: and seven of them on a 2-core machine starve the one that is serving. Requests wake it at once.
CPU_ENGINE_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                   "--dtype", "float32", "--max-total-tokens", "2048", "--mem-fraction-static", "0.3",
                   "--enable-metrics", "--log-level", "info", "--sleep-on-idle"]  # fmt: skip
#: What SGLang's HTTP server logs when its port is taken.
_BIND_FAILED = "error while attempting to bind on address"
START_TIMEOUT = float(os.environ.get("HICACHE_E2E_START_TIMEOUT", "420"))
REQUEST_TIMEOUT = 120.0


#: Ports handed out by this process, never handed out twice (a server may not have bound its port yet).
_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()


#: Where ports are handed out: below 22000, where SGLang picks its own (its ``nccl_port``, 22000-29999, which
#: the scheduler binds later), and below the kernel's ephemeral range.
_PORTS = (12000, 22000)


def free_port() -> int:
    """A port free now on 127.0.0.1, never handed out before by this process, outside the kernel's ephemeral
    range and SGLang's own.

    A port the kernel picks (bind to port 0) is in the ephemeral range, which every outgoing connection and
    every other listener that asks for any port (UCX under NIXL, the other suites' servers) draws from too:
    between this check and the server's own bind one of them took it (seen in CI: a server whose bind
    failed kept running, and the test waited out its whole start timeout)."""
    low, high = _PORTS
    start = low + os.getpid() % (high - low)  # another process running this starts elsewhere
    with _PORT_LOCK:
        for port in [*range(start, high), *range(low, start)]:
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 between {low} and {high}")


@dataclass
class Server:
    """One SGLang server process group: ``start()``, ``wait_ready()``, requests, ``stop()``."""

    name: str
    model: str
    args: list[str]
    log_dir: str
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: str = ""
    error: str | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "hicache_sglang.launch_server", "--model-path", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *CPU_ENGINE_ARGS, *self.args]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["TRITON_INTERPRET"] = "1"  # the kernel io backend's Triton kernels, on CPU pools
        env["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN, env.get("PYTHONPATH")) if p)
        # SGLang keeps 10 GiB of host memory back from HiCache; a 2-core CI machine may have less in all.
        env.setdefault("HICACHE_SGLANG_HOST_RESERVE_GIB", "0.5")
        # When a child process ends (the suite stops every server by its process group, and the refusals end
        # the scheduler), SGLang's launcher sleeps 5 s "to let GPU activity settle" before py-spy and CUDA
        # core dumps; there is no GPU here and no py-spy in the environment, so the sleep only delays the exit
        # (measured: 5 of the 6 s each stop took). The dumps stay on where asked for.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        env.update(self.env)
        return env

    def start(self) -> Server:
        self.port = self.port or free_port()
        self.log_path = os.path.join(self.log_dir, f"{self.name}.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        log.close()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        """Until ``/health_generate`` answers; records ``error`` (with the log's tail) if it does not.

        A server whose port was taken before it bound it (its log says so; SGLang then waits on its scheduler
        instead of exiting) is stopped and started again on another port, at most twice."""
        deadline = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.error = f"{self.name} exited with {self.proc.returncode} before it served"
                return self
            if restarts < 2 and _BIND_FAILED in self.log():
                restarts += 1
                self.stop()
                with open(self.log_path, "a") as f:
                    f.write(f"\n[e2e] port {self.port} was taken before this server bound it: restarting on another\n")
                os.replace(self.log_path, f"{self.log_path}.port-{self.port}")
                self.port = 0
                self.start()
                continue
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.error = f"{self.name} did not answer /health_generate within {timeout:.0f} s"
        self.stop()
        return self

    def wait_exit(self, timeout: float = START_TIMEOUT) -> int | None:
        """The exit status, or None (and the group killed) if it is still running after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def check_up(self) -> None:
        assert self.error is None, f"{self.error}\n--- {self.log_path} (tail) ---\n{self.log()[-6000:]}"

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> dict:
        """Greedy generation from token ids; SGLang's response (``output_ids``, ``meta_info``)."""
        sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        body = {"input_ids": input_ids, "sampling_params": sampling}
        return self._post("/generate", body)

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int = 8) -> list[dict]:
        """All prompts at once, one thread each, so that SGLang batches them."""
        out: list[dict | BaseException | None] = [None] * len(prompts)

        def one(i: int) -> None:
            try:
                out[i] = self.generate(prompts[i], max_new_tokens)
            except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
                out[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT)
        for r in out:
            if not isinstance(r, dict):
                raise AssertionError(f"a concurrent request failed: {r!r}")
        return out  # type: ignore[return-value]

    def flush_cache(self) -> None:
        self._post("/flush_cache", None)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{'name{labels}': value}``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def counter(self, name: str, **labels: str) -> float:
        """The sum of metric ``name`` over the series whose labels include ``labels``."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def _post(self, path: str, body: dict | None) -> dict:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            raw = r.read()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return {"text": raw.decode(errors="replace")}

    def terminate(self) -> None:
        """SIGTERM to the process group without waiting (``stop_all`` stops many servers at once)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if os.getpgid(self.proc.pid) == self.proc.pid:  # its own group (start_new_session), else never ours
                os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 15 s; always leaves no process of it behind."""
        if self.proc is None:
            return
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is None or pgid != self.proc.pid:  # not its own group (start_new_session): never ours to kill
            self.proc.kill()
            self.proc.wait(10)
            return
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # whatever of the group is left (SGLang's scheduler and detokenizer)
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def stop_all(servers: list[Server]) -> None:
    """Stop every server: all are sent SIGTERM first, so their shutdowns overlap instead of queueing."""
    for srv in servers:
        srv.terminate()
    for srv in servers:
        srv.stop()


def start_all(servers: list[Server], parallel: int) -> None:
    """Start ``servers``, at most ``parallel`` at a time starting up, and wait until each serves or failed."""
    pending = list(servers)
    starting: list[Server] = []
    while pending or starting:
        while pending and len(starting) < parallel:
            starting.append(pending.pop(0).start())
        done = starting.pop(0)
        done.wait_ready()


class RedisServer:
    """A real ``redis-server`` (Debian's) on 127.0.0.1, in its own process group, nothing persisted."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> RedisServer:
        import shutil

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server; .ci/run does)")
        os.makedirs(self.workdir, exist_ok=True)
        self.port = free_port()
        cmd = [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--dir", self.workdir]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on 127.0.0.1:{self.port} within {timeout:.0f} s")

    def keys(self) -> int:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port).dbsize()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
