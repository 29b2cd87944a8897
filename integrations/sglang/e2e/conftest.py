"""SGLang's real server on hicache host pools: the suite's servers, shared by every test.

Servers are expensive (20-40 s to start on 2 cores), so the whole session shares one fleet:
one baseline server without HiCache per page size, and one HiCache server per case below,
started together (``HICACHE_E2E_PARALLEL`` at a time, default 3) when the first test needs
them and stopped, each by its process group, at the end of the session (also on failure).
Each server gets the workload once (:func:`workload.run`); the tests check its outcome.
The stores the cases need (a redis-server, SeaweedFS) start on 127.0.0.1 first.
``HICACHE_E2E_LOG_DIR`` keeps the server logs (default: a temporary directory).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass, field

import pytest
import workload
from object_store import ObjectStore
from server import RedisServer, Server, start_all, stop_all
from tiny_model import make_llama

PARALLEL = int(os.environ.get("HICACHE_E2E_PARALLEL", "3"))


@dataclass(frozen=True)
class Case:
    """A HiCache server: layout and io backend as given to SGLang, and as SGLang resolves them."""

    name: str
    layout: str
    io_backend: str
    page_size: int
    write_policy: str
    #: L3: "file" (SGLang's own backend), "hicache-file" / "hicache-redis" / "hicache-s3" / "hicache-peer"
    #: (hicache's tier through SGLang's dynamic backend, hicache_sglang.storage)
    storage: str | None = None
    resolved: tuple[str, str] | None = None  # (layout, io backend) after SGLang's resolution, when it rewrites
    extra: tuple[str, ...] = field(default=())
    #: Run as a GPU server runs by default, beside the CPU defaults of the other cases: host-tier verification
    #: on (HICACHE_VERIFY=1; on CUDA it is on unless turned off) and the L3 pages keyed (HICACHE_L3_KEY_FILE).
    as_gpu_server: bool = False

    @property
    def expected(self) -> tuple[str, str]:
        return self.resolved or (self.layout, self.io_backend)

    def args(self, storage_url: str | None = None) -> list[str]:
        out = ["--page-size", str(self.page_size), "--enable-hierarchical-cache",
               "--hicache-mem-layout", self.layout, "--hicache-io-backend", self.io_backend,
               "--hicache-write-policy", self.write_policy, "--hicache-ratio", "4", *self.extra]  # fmt: skip
        if self.storage == "file":
            out += ["--hicache-storage-backend", "file"]
        elif self.storage:
            from hicache_sglang.storage import extra_config

            out += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                    extra_config(storage_url)]  # fmt: skip
        if self.storage:
            out += ["--hicache-storage-prefetch-policy", "wait_complete"]
        return out


#: Every (layout, io backend) SGLang 0.5.23 keeps after its resolution and its controller drives
#: for an MHA model (tests/sglang_setup.MHA_PAIRS), page sizes 1 and 16, write_through and
#: write_back: each value is covered, not the cross product. page_first+direct and
#: page_first_direct+kernel are SGLang's rewrites onto two of these (checked in test_e2e_refusals).
CASES = [
    Case("lf-direct-p1-wt", "layer_first", "direct", 1, "write_through"),
    Case("pfd-direct-p16-wb-hfile", "page_first_direct", "direct", 16, "write_back", storage="hicache-file",
         as_gpu_server=True),
    Case("lf-kernel-p16-wb", "layer_first", "kernel", 16, "write_back"),
    Case("pf-kernel-p1-wt-file", "page_first", "kernel", 1, "write_through", storage="file"),
    Case("ph-kernel-p16-wt-redis", "page_head", "kernel", 16, "write_through", storage="hicache-redis",
         as_gpu_server=True),
    Case("lf-direct-p16-wt-s3", "layer_first", "direct", 16, "write_through", storage="hicache-s3"),
]
CASE_IDS = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}
#: Cases whose server restarts on the same L3 store (test_e2e_storage).
STORAGE_CASES = [c for c in CASES if c.storage]


@dataclass
class Fleet:
    root: str
    model: str
    servers: dict[str, Server]
    outcomes: dict[str, workload.Outcome] = field(default_factory=dict)
    prompts: workload.Prompts = field(default_factory=workload.Prompts.make)
    redis: RedisServer | None = None
    s3: ObjectStore | None = None

    def server(self, name: str) -> Server:
        srv = self.servers[name]
        srv.check_up()
        return srv

    def baseline(self, page_size: int) -> workload.Outcome:
        return self.outcome(f"base-p{page_size}")

    def outcome(self, name: str) -> workload.Outcome:
        if name not in self.outcomes:
            self.outcomes[name] = workload.run(self.server(name), self.prompts)
        return self.outcomes[name]

    def retire(self, names: list[str]) -> None:
        """Stop the servers ``names`` once no later test needs them live, to free their memory (~2 GiB each,
        which CI's other stages use meanwhile). A baseline's outcome is kept: it is what later tests compare
        with. A retired server that is asked for again fails its test with why (``check_up``)."""
        live = [n for n in names if n in self.servers and self.servers[n].error is None]
        for name in live:
            if name.startswith("base-"):
                self.outcome(name)
        stop_all([self.servers[n] for n in live])
        for name in live:
            self.servers[name].error = f"{name} was stopped after its last test (Fleet.retire)"

    def corrupt_flag(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.corrupt")

    def cluster_key_file(self) -> str:
        """The fleet's cluster key, in a file only its owner reads (as hicache requires of a key file)."""
        path = os.path.join(self.root, "cluster.key")
        if not os.path.exists(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        return path

    def storage_dir(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.l3")

    def storage_url(self, case: Case) -> str | None:
        if case.storage == "hicache-file":
            return f"file://{self.storage_dir(case.name)}"
        if case.storage == "hicache-redis":
            return f"redis://127.0.0.1:{self.redis.port}/0"
        if case.storage == "hicache-s3":
            return self.s3.url(case.name)
        return None

    def new_server(self, name: str, case: Case) -> Server:
        """A server for ``case`` (same environment as the fleet's), not started."""
        env = {"HICACHE_E2E_CORRUPT_FLAG": self.corrupt_flag(name)}
        if case.storage == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.storage_dir(case.name)
        if case.storage == "hicache-s3":
            env.update(self.s3.env())
        if case.as_gpu_server:
            env.update(HICACHE_VERIFY="1", HICACHE_L3_KEY_FILE=self.cluster_key_file())
        return Server(name, self.model, case.args(self.storage_url(case)), self.log_dir, env=env)

    @property
    def log_dir(self) -> str:
        return os.environ.get("HICACHE_E2E_LOG_DIR") or self.root


def selected(names: list[str]) -> list[str]:
    only = os.environ.get("HICACHE_E2E_ONLY")  # development: a comma-separated subset of the servers
    return names if not only else [n for n in names if n in only.split(",")]


def _interrupt_on_sigterm() -> None:
    """SIGTERM (a CI timeout, ``timeout``, CI stopping its background jobs) ends the session like Ctrl-C, so every
    server is still stopped: each runs in a session of its own, which a signal to the suite's group misses."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def pytest_configure(config):
    # for every module (the refusals' servers too), not only once the fleet starts
    _interrupt_on_sigterm()


@pytest.fixture(scope="session")
def fleet():
    root = tempfile.mkdtemp(prefix="hicache-sglang-e2e-")
    log_dir = os.environ.get("HICACHE_E2E_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    model = make_llama(os.path.join(root, "tiny-llama"))
    f = Fleet(root, model, {})
    names = selected(["base-p1", "base-p16", *CASE_IDS])
    try:
        if any(c.storage == "hicache-redis" and c.name in names for c in CASES):
            f.redis = RedisServer(os.path.join(root, "redis")).start()
        if any(c.storage == "hicache-s3" and c.name in names for c in CASES):
            f.s3 = ObjectStore(os.path.join(root, "seaweedfs"))
        for page_size in (1, 16):
            name = f"base-p{page_size}"
            f.servers[name] = Server(name, model, ["--page-size", str(page_size)], f.log_dir)
        for case in CASES:
            os.makedirs(f.storage_dir(case.name), exist_ok=True)
            if case.name in names:
                f.servers[case.name] = f.new_server(case.name, case)
        f.servers = {n: s for n, s in f.servers.items() if n in names}
        start_all(list(f.servers.values()), PARALLEL)
        yield f
    finally:
        stop_all(list(f.servers.values()))
        if f.redis is not None:
            f.redis.stop()
        if f.s3 is not None:
            f.s3.stop()
        shutil.rmtree(root, ignore_errors=True)


def need(fleet: Fleet, *names: str) -> None:
    missing = [n for n in names if n not in fleet.servers]
    if missing:
        pytest.skip(f"HICACHE_E2E_ONLY leaves out server(s) {', '.join(missing)}")
