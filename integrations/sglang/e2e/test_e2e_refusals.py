"""Bad HiCache input ends the server with one clear message, before it serves anything.

The launcher's checks (``hicache_sglang.startup``) run on SGLang's resolved arguments before
SGLang starts a process; what only the pool build can tell (a layout no hicache plugin serves
for this pool kind, a ratio over the host memory) ends SGLang's scheduler, and SGLang then
stops the whole server. Either way: the process exits, nothing listens, the log says why.
"""

from __future__ import annotations

import shutil
import socket
import tempfile

import pytest
from server import Server, start_all, stop_all
from tiny_model import make_llama

#: (name, HiCache arguments, what the log must say, who refuses)
REFUSED = [
    ("io-backend-no-plugin", ["--hicache-io-backend", "kernel_ascend", "--hicache-mem-layout", "page_first"],
     "no installed hicache plugin serves io backend 'kernel_ascend'", "launcher"),
    ("io-backend-unknown-name", ["--hicache-io-backend", "nosuch"],
     "argument --hicache-io-backend: invalid choice: 'nosuch'", "sglang's parser"),
    ("layout-controller-cannot-drive", ["--hicache-io-backend", "direct", "--hicache-mem-layout", "page_head"],
     "SGLang's cache controller prepares indices for io backend 'direct' only with layouts layer_first and "
     "page_first_direct", "launcher"),
    ("layout-no-plugin-for-pool", ["--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first_kv_split"],
     "No implementation of io backend 'kernel' can run load_to_device_per_layer", "pool build"),
    ("host-size-over-memory", ["--hicache-size", "100000"],
     "Not enough host memory for the HiCache host pool: --hicache-size 100000", "launcher"),
    ("host-ratio-over-memory", ["--hicache-ratio", "1000000"], "Not enough host memory for the 'kv' host pool",
     "pool build"),
]  # fmt: skip


@pytest.fixture(scope="module")
def refused():
    root = tempfile.mkdtemp(prefix="hicache-sglang-refused-")
    model = make_llama(f"{root}/tiny-llama")
    servers = {name: Server(name, model, ["--enable-hierarchical-cache", *args], root) for name, args, _, _ in REFUSED}
    try:
        # They must exit on their own: wait_ready records that each exited before it served.
        start_all(list(servers.values()), parallel=3)
        yield servers
    finally:
        stop_all(list(servers.values()))
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name, args, message, who", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_at_startup(refused, name, args, message, who):
    srv = refused[name]
    log = srv.log()
    assert srv.error is not None and "exited" in srv.error, f"{name} did not exit: {srv.error}\n{log[-4000:]}"
    assert srv.proc.returncode != 0
    assert message in log, f"{name}: {message!r} not in the log\n{log[-4000:]}"
    if who == "launcher":
        # refused before SGLang started anything: no model was loaded, no host pool built
        assert "hicache-sglang: refusing to start:" in log
        assert "Load weight begin" not in log
    assert "hicache-sglang host pool:" not in log or who == "pool build"
    assert "Uvicorn running" not in log and "The server is fired up" not in log
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", srv.port)) != 0, f"something listens on {name}'s port {srv.port}"
