"""The layer loader on a real GPU: no deadlock whatever the hardware queues, and a randomized stress.

    python scripts/gpu/layer_loads_check.py --aliasing      # one child per CUDA_DEVICE_MAX_CONNECTIONS case
    python scripts/gpu/layer_loads_check.py --stress 1000   # randomized rounds, bytes checked

Aliasing: in a child process per case (1, 2, 8, 32 and the default number of hardware queues),
a prefix load of 8 layers is handed to ``HostPool.submit_load`` while its first layer is held
back 0.2 s (a busy submitter); 32 consumer streams (they cover every hardware queue) each wait for
every layer and run a small kernel after it, and the caller's stream computes meanwhile. A case
deadlocks if the consumers' last events do not complete within the bound; the child is killed.

Stress: rounds with 1-4 consumer threads on streams of their own that wait for random layers
before, during or after the submission; about one round in eight fails a random layer on purpose
and one in five submits slowly. Every wait either returns with the layer's bytes in place
(compared on the GPU with a synchronous load of the same pages) or raises the planted error for
its layer; every host wait is bounded. One JSON line per case or result; the last line is
``SUMMARY {...}``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

CASES = [
    ("connections=1", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ("connections=2", {"CUDA_DEVICE_MAX_CONNECTIONS": "2"}),
    ("connections=8", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}),
    ("connections=default", {}),
    ("connections=32", {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
]
CHILD_TIMEOUT_S = 60
WAIT_S = 20.0
LAYERS = 8


def _pools(pages: int = 64, page: int = 64):
    import torch

    import hicache_core as hc

    dev = hc.MHADevicePool(4 * pages * page, page, torch.bfloat16, 8, 128, LAYERS, "cuda")
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="direct", size=dev.size)
    gen = torch.Generator().manual_seed(5)
    for t in host.plan.host_buffers.values():
        flat = t.view(torch.uint8).reshape(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    hp = torch.randperm(host.page_num, generator=gen)[:pages]
    h = (hp[:, None] * page + torch.arange(page)).reshape(-1)
    slots = torch.randperm(dev.size // page, generator=gen)
    ref = (slots[:pages, None] * page + torch.arange(page)).reshape(-1)
    dst = (slots[pages : 2 * pages, None] * page + torch.arange(page)).reshape(-1)
    for layer in range(LAYERS):  # the reference: a synchronous load of the same host pages
        host.load_to_device_per_layer(dev, h, ref, layer, "direct")
    torch.cuda.synchronize()
    return dev, host, h, ref, dst


def _same(dev, layer, ref, dst) -> bool:
    import torch

    a = dev.k_buffer[layer].view(torch.int16)
    b = dev.v_buffer[layer].view(torch.int16)
    r, d = ref.cuda(), dst.cuda()
    return bool(torch.equal(a[r], a[d]) and torch.equal(b[r], b[d]))


def aliasing_child() -> None:
    import torch

    dev, host, h, ref, dst = _pools()
    impl = host.implementation_for("load_to_device_per_layer")
    real = impl.load_to_device_per_layer

    def held_back(h_, d_, layer):
        if layer == 0:
            time.sleep(0.2)
        real(h_, d_, layer)

    impl.load_to_device_per_layer = held_back
    consumers = [torch.cuda.Stream() for _ in range(32)]
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    ok, rounds = True, 3
    for round_ in range(rounds):
        for layer in range(LAYERS):
            dev.k_buffer[layer][dst.cuda()] = 0
        load = host.submit_load(dev, h, dst, "direct")
        for _ in range(20):  # the caller's stream keeps computing while the loader submits
            x = torch.tanh(x @ x)
        ends = []
        for layer in range(LAYERS):
            for c in consumers:
                with torch.cuda.stream(c):
                    load.wait(layer, c)
                    dev.k_buffer[layer][:1].add_(0)
                    end = torch.cuda.Event()
                    end.record(c)
                    ends.append(end)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not all(e.query() for e in ends):
            time.sleep(0.01)
        if not all(e.query() for e in ends):
            print("RESULT " + json.dumps({"result": "deadlock", "round": round_}), flush=True)
            os._exit(3)  # a deadlocked context cannot be torn down
        torch.cuda.synchronize()
        ok = ok and all(_same(dev, layer, ref, dst) for layer in range(LAYERS))
    print("RESULT " + json.dumps({"result": "ok" if ok else "wrong bytes", "rounds": rounds}), flush=True)
    os._exit(0 if ok else 4)


def aliasing() -> dict:
    summary = {}
    for name, env in CASES:
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, __file__, "--aliasing-child"], env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)  # fmt: skip
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else {"result": "error", "rc": proc.returncode,
                                                           "stderr": proc.stderr[-2000:]}  # fmt: skip
        except subprocess.TimeoutExpired:
            row = {"result": "deadlock (child timed out)"}
        row = {"case": name, **row, "seconds": round(time.monotonic() - started, 1)}
        summary[name] = row["result"]
        print(json.dumps(row), flush=True)
    return summary


def stress(rounds: int, seed: int = 1) -> dict:
    import torch

    from hicache_core.loads.layer_loads import LayerLoadError, layer_loader

    dev, host, h, ref, dst = _pools()
    loader = layer_loader(dev.k_buffer[0].device)
    rng = random.Random(seed)
    problems: list[str] = []
    counts = {"rounds": 0, "failed_rounds": 0, "slow_rounds": 0, "waits": 0, "errors_raised": 0}
    dst_cuda = dst.cuda()
    started = time.monotonic()
    for round_ in range(rounds):
        fail_at = rng.randrange(LAYERS) if rng.random() < 0.125 else None
        slow = rng.random() < 0.2
        for layer in range(LAYERS):
            dev.k_buffer[layer][dst_cuda] = 0
            dev.v_buffer[layer][dst_cuda] = 0

        def step(layer, fail_at=fail_at, slow=slow):
            if slow:
                time.sleep(0.001)
            if layer == fail_at:
                raise RuntimeError(f"planted at {layer}")
            host.load_to_device_per_layer(dev, h, dst, layer, "direct")

        box: list = []

        def consume(layer, delay, fail_at=fail_at, round_=round_, box=box):
            stream = torch.cuda.Stream()
            time.sleep(delay)
            while not box:
                time.sleep(0)
            try:
                box[0].wait(layer, stream)
            except LayerLoadError as exc:
                counts["errors_raised"] += 1
                if fail_at is None or layer < fail_at or f"planted at {fail_at}" not in str(exc.__cause__):
                    problems.append(f"round {round_} layer {layer}: unexpected {exc}")
                return
            stream.synchronize()
            counts["waits"] += 1
            if fail_at is not None and layer >= fail_at:
                problems.append(f"round {round_} layer {layer}: no error after the planted one")
            elif not _same(dev, layer, ref, dst):
                problems.append(f"round {round_} layer {layer}: wrong bytes after the wait")

        consumers = [threading.Thread(target=consume, args=(rng.randrange(LAYERS), rng.choice([0, 1e-4, 1e-3])))
                     for _ in range(rng.randint(1, 4))]  # fmt: skip
        early = rng.random() < 0.5
        if early:
            for c in consumers:
                c.start()
        with torch.cuda.stream(torch.cuda.current_stream()):
            box.append(loader.submit(LAYERS, step, keep=(h, dst), what=f"round {round_}"))
        if not early:
            for c in consumers:
                c.start()
        for c in consumers:
            c.join(30)
            if c.is_alive():
                problems.append(f"round {round_}: a consumer hung")
                break
        try:
            box[0].synchronize()
        except LayerLoadError:
            counts["failed_rounds"] += fail_at is not None
            # synchronize() raises a failed load's error only once its copies finished: the next round zeroes
            # these rows on another stream.
            if not box[0].settled():
                problems.append(f"round {round_}: synchronize() raised before the failed load settled")
        counts["rounds"] += 1
        counts["slow_rounds"] += slow
        if len(problems) > 20:
            break
    counts["seconds"] = round(time.monotonic() - started, 1)
    return {"result": "ok" if not problems else "failed", **counts, "problems": problems[:20]}


def main() -> int:
    summary: dict = {}
    if "--aliasing" in sys.argv:
        summary["aliasing"] = aliasing()
    if "--stress" in sys.argv:
        rounds = int(sys.argv[sys.argv.index("--stress") + 1])
        summary["stress"] = stress(rounds)
        print(json.dumps(summary["stress"]), flush=True)
    print("SUMMARY " + json.dumps(summary), flush=True)
    bad = any(v != "ok" for v in summary.get("aliasing", {}).values())
    return 1 if bad or summary.get("stress", {}).get("result", "ok") != "ok" else 0


if __name__ == "__main__":
    if "--aliasing-child" in sys.argv:
        aliasing_child()
    sys.exit(main())
