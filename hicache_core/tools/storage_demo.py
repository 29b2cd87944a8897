"""``hicache demo --storage URL``: a prefix crosses processes through L3.

Process 1 computes a prefix's KV (seeded random bytes in its device pool), backs it up
device -> host -> store, and exits. Process 2 starts with a fresh device pool and a fresh
host pool, finds the prefix in the store, prefetches it into the host pool, loads it to the
device layer by layer, and compares every byte with what process 1 computed (regenerated
from the seed, since process 1 is gone).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import torch

from ..pool.host_pool import make_host_pool
from ..storage.controller import StorageController
from ..storage.make import make_storage
from ..storage.url import redact_url
from .shapes import SHAPES

SHAPE = "llama-8b"
LAYERS = 4
PAGE = 16


def _pools(tokens: int, device: str):
    shape = SHAPES[SHAPE]
    dev = shape.device_pool(2 * tokens, page_size=PAGE, device=device, layers=LAYERS)
    host = make_host_pool(dev, layout="page_first_direct", io_backend="auto", size=2 * tokens)
    return dev, host


def _prefix(tokens: int, seed: int, dev) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """The prompt's token ids, the device slots its KV sits in, and that KV (per layer K, V), from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32000, (tokens,), generator=gen).tolist()
    pages = torch.randperm(2 * tokens // PAGE - 1, generator=gen)[: tokens // PAGE] + 1
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    kv = [torch.randint(0, 256, (tokens, _byte_rows(t).shape[1]), dtype=torch.uint8, generator=gen)
          for t in _device_rows(dev)]  # fmt: skip
    return ids, slots, kv


def _device_rows(dev) -> list[torch.Tensor]:
    return [t for pair in zip(dev.k_buffer, dev.v_buffer) for t in pair]


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A device tensor as (rows, bytes per row)."""
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def role_backup(url: str, model_id: str, tokens: int, seed: int, device: str, stay: bool = False) -> int:
    dev, host = _pools(tokens, device)
    ids, slots, kv = _prefix(tokens, seed, dev)
    for rows, data in zip(_device_rows(dev), kv):
        _byte_rows(rows)[slots] = data.to(rows.device)
    host_slots = host.alloc(tokens)
    host.backup_from_device_all_layer(dev, host_slots, slots.to(device), "auto")
    if device == "cuda":
        torch.cuda.synchronize()
    storage = make_storage(url, host, model_id=model_id)
    with StorageController(storage) as ctl:
        result = ctl.backup(ids, host_slots).result(120)
    ok = not result.failed and result.stored_prefix == tokens // PAGE
    print(f"process 1 (pid {_pid()}): computed {tokens} tokens, backed up {result.written} pages "
          f"({len(result.failed)} failed) to {url}; {'staying until process 2 is done' if stay else 'exiting'}",
          flush=True)  # fmt: skip
    if stay and ok:
        sys.stdin.read()  # the demo closes our stdin when process 2 has finished
        storage.close()
    return 0 if ok else 1


def role_load(url: str, model_id: str, tokens: int, seed: int, device: str) -> int:
    dev, host = _pools(tokens, device)
    ids, _, kv = _prefix(tokens, seed, dev)
    storage = make_storage(url, host, model_id=model_id)
    with StorageController(storage, prefetch_policy="wait_complete") as ctl:
        t0 = time.perf_counter()
        res = ctl.prefetch(ids).result(120)
        prefetch_s = time.perf_counter() - t0
    stats = storage.get_stats()
    print(f"process 2 (pid {_pid()}): fresh pools; found {res.local_hits} of {tokens // PAGE} pages, "
          f"prefetched {res.completed} in {prefetch_s * 1e3:.1f} ms; the store's counters: pages_read "
          f"{stats.pages_read}, bytes_read {stats.bytes_read}, read_corrupt {stats.read_corrupt}")  # fmt: skip
    if res.completed != tokens // PAGE:
        print(f"hicache demo --storage: process 2: the prefix is not complete: "
              f"{res.error or [r.detail for r in res.results if not r.ok][:3]}",
              file=sys.stderr)  # fmt: skip
        return 1
    new_slots = torch.arange(PAGE, PAGE + tokens)  # any free device pages
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, res.host_indices, new_slots.to(device), layer, "auto")
    rows = _device_rows(dev)
    same = all(torch.equal(_byte_rows(r)[new_slots].cpu(), data) for r, data in zip(rows, kv))
    print(
        f"process 2: loaded to {device} layer by layer; the bytes {'match' if same else 'DO NOT match'} "
        "what process 1 computed"
    )
    return 0 if same else 1


def _pid() -> int:
    import os

    return os.getpid()


def run_storage_demo(url: str, device: str | None = None, tokens: int = 512, writer_stays: bool = False) -> int:
    """Run process 1, wait for it to exit, then process 2; the exit code says whether the bytes matched.

    ``writer_stays``: process 1 stays alive, holding its host pool, until process 2 is done (a tier
    whose pages live in their writer's memory, such as ``peer://``).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_id = f"hicache-demo-{uuid.uuid4().hex[:8]}"
    seed = int(time.time()) % 100000
    if writer_stays:
        return _demo_with_writer(url, model_id, tokens, seed, device)
    for role in ("backup", "load"):
        cmd = [sys.executable, "-m", __name__, role, url, model_id, str(tokens), str(seed), device]
        done = subprocess.run(cmd, timeout=300)
        if done.returncode != 0:
            print(f"hicache demo --storage: the {role} process failed (exit {done.returncode})", file=sys.stderr)
            if role == "load" and url.lower().startswith("mooncake://"):
                print(
                    "hicache demo --storage: mooncake:// keeps a page in the segment of the client that stored "
                    "it, and process 1's segment left with it. Keep pages beyond their writer with a "
                    "mooncake_client that lends memory to the store: mooncake_client "
                    "-master_server_address=HOST:PORT -global_segment_size=1GB -protocol=tcp "
                    "-metadata_server=P2PHANDSHAKE",
                    file=sys.stderr,
                )
            return 1
    print("L3 demo passed: a prefix backed up by one process was found, prefetched and loaded by another")
    return 0


def _demo_with_writer(url: str, model_id: str, tokens: int, seed: int, device: str) -> int:
    args = [url, model_id, str(tokens), str(seed), device]
    writer = subprocess.Popen([sys.executable, "-m", __name__, "backup-stay", *args], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = "?"
        while line and not line.startswith("process 1"):  # its report comes once its pages are stored
            line = writer.stdout.readline()
            print(line, end="")  # and whatever its libraries logged before
        if "staying" not in line:
            print("hicache demo --storage: the backup process failed", file=sys.stderr)
            return 1
        done = subprocess.run([sys.executable, "-m", __name__, "load", *args], timeout=300)
    finally:
        writer.stdin.close()
        try:
            writer.wait(60)
        finally:
            writer.kill()
    if done.returncode != 0:
        print(f"hicache demo --storage: the load process failed (exit {done.returncode})", file=sys.stderr)
        return 1
    print(
        "L3 demo passed: a prefix backed up by one process was found, prefetched and loaded by another "
        "while the first one held it"
    )
    return 0


def _role(argv: list[str]) -> int:
    """One process of the demo; whatever stops it is one line on stderr (the parent says which process failed)."""
    role, url, model_id, tokens, seed, device = argv[:6]
    try:
        if role == "load":
            return role_load(url, model_id, int(tokens), int(seed), device)
        return role_backup(url, model_id, int(tokens), int(seed), device, stay=role == "backup-stay")
    except Exception as exc:  # noqa: BLE001 - the store or the pools refused: say so, no traceback
        text = " ".join(redact_url(str(exc)).split())
        print(f"hicache demo --storage: process {'2' if role == 'load' else '1'}: {type(exc).__name__}: {text}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(_role(sys.argv[1:7]))
