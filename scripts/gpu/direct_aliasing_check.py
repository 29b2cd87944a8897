"""Does direct's worker deadlock when its side stream shares a hardware queue with a dependent stream?

Run on a CUDA machine (torch, hicache and the direct plugin installed, editable is fine):

    python scripts/gpu/direct_aliasing_check.py            # one JSON line per case, then a summary line

Each case runs in a child process bounded by a timeout (a deadlocked context cannot be recovered;
the child is killed). The pattern is SGLang's load order: a load stream ``S`` gets one layer's call
through the worker and an event after it, then every stream of torch's pool waits for that event
and runs a small kernel, all queued by the host *before* the worker submits its copies (the worker
is held back 0.2 s, as a busy GIL would). With ``CUDA_DEVICE_MAX_CONNECTIONS`` queues, 32 pool
streams cover every queue, so if a shared queue runs streams in submission order, one of those
waits sits ahead of the side stream's copies and the case deadlocks.

Expected: ``caller-thread`` ok (the control), ``connections=1`` ok with the worker refused; the
others are what this measures. On the H200 (2026-12-02) every worker case deadlocked (2, 8, the
default and 32 queues), so the worker is opt-in (``HICACHE_DIRECT_THREAD=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CASES = [
    ("caller-thread", {"HICACHE_DIRECT_THREAD": "0"}),
    # The worker is opt-in (off by default because of what this measures): every other case turns it on.
    ("connections=1", {"HICACHE_DIRECT_THREAD": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ("connections=2", {"HICACHE_DIRECT_THREAD": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "2"}),
    ("connections=8", {"HICACHE_DIRECT_THREAD": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}),
    ("connections=default", {"HICACHE_DIRECT_THREAD": "1"}),
    ("connections=32", {"HICACHE_DIRECT_THREAD": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
]
CHILD_TIMEOUT_S = 40
WAIT_S = 15.0


def child() -> None:
    import torch

    import hicache_core as hc

    page, pages, layers = 64, 128, 4
    dev = hc.MHADevicePool(2 * pages * page, page, torch.bfloat16, 2, 16, layers, "cuda")
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="direct", size=dev.size + page)
    gen = torch.Generator().manual_seed(5)
    for t in host.plan.host_buffers.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    hp = torch.randperm(host.page_num, generator=gen)[:pages]
    dp = torch.randperm(dev.size // page, generator=gen)[:pages]
    h = (hp[:, None] * page + torch.arange(page)).reshape(-1)
    d = (dp[:, None] * page + torch.arange(page)).reshape(-1)
    copier = host.implementation_for(hc.LOAD).copier
    copier.thread_min, copier.thread_max = 1, 0  # every call through the worker (where it is on)
    load = torch.cuda.Stream()
    with torch.cuda.stream(load):  # warm-up: the gate and its side stream exist before the pool streams are used
        host.load_to_device_per_layer(dev, h, d, 0, "direct")
    torch.cuda.synchronize()
    submit = copier._submit

    def held_back(batch, describe, stream):
        time.sleep(0.2)
        submit(batch, describe, stream)

    copier._submit = held_back
    consumers = [torch.cuda.Stream() for _ in range(32)]  # torch's pool hands out its 32 streams in turn
    event = torch.cuda.Event()
    with torch.cuda.stream(load):
        host.load_to_device_per_layer(dev, h, d, 1, "direct")
        event.record(load)
    ends = []
    for c in consumers:
        with torch.cuda.stream(c):
            c.wait_event(event)
            dev.k_buffer[1][:1].add_(0)
            end = torch.cuda.Event()
            end.record(c)
            ends.append(end)
    worker = copier._worker
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all(e.query() for e in ends):
        time.sleep(0.01)
    ok = all(e.query() for e in ends)
    result = {"result": "ok" if ok else "deadlock", "worker": worker is not None and bool(worker._gates),
              "thread_path": copier.thread_path}  # fmt: skip
    if worker is not None and not ok:
        try:
            result["words"] = {hex(s): list(v) for s, v in worker.words().items()}
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            result["words"] = repr(exc)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0 if ok else 3)  # a deadlocked context cannot be torn down


def main() -> int:
    summary = {}
    for name, env in CASES:
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)  # fmt: skip
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else {"result": "error", "rc": proc.returncode,
                                                           "stderr": proc.stderr[-2000:]}  # fmt: skip
        except subprocess.TimeoutExpired:
            row = {"result": "deadlock (child timed out)"}
        row = {"case": name, **row, "seconds": round(time.monotonic() - started, 1)}
        summary[name] = row["result"]
        print(json.dumps(row), flush=True)
    print("SUMMARY " + json.dumps(summary), flush=True)
    bad = summary.get("caller-thread") != "ok" or summary.get("connections=1") != "ok"
    return 1 if bad else 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        sys.exit(main())
