"""The soak: random backups, loads, evictions and slot reuse on every layout and io backend, verification on.

    python scripts/gpu/soak.py --bytes 1TB --out soak.json         # the GPU gate's step (240 s at most)
    python scripts/gpu/soak.py --device cpu --bytes 64M           # the same loop on CPU pools (the suite runs it)

Per combination (pool kind x layout x io backend, every one the registry serves on the device) a device
pool and a verifying host pool are made, and rounds run until the combination's share of ``--bytes`` has
moved. A round:

1. evicts random host pages when the pool is short of room (their slots are handed out again);
2. writes fresh content into random device pages, backs them up to newly allocated host slots (all layers
   at once, or layer by layer), and overwrites the device pages (the device slots are reused);
3. loads random held host pages into random device pages: part of them through ``submit_load`` (the
   loader's thread and stream) with consumer streams waiting on each layer, the rest layer by layer on a
   side stream, both at once;
4. compares every loaded page with the content its host page must hold.

The content is a counter-based hash of (page tag, token, layer, component, word), computed on the device
from the tag alone: the reference is independent of hicache's copies and of its checksums. Verification
must report nothing (a failed check is counted as a mismatch too). The last line is ``SUMMARY {...}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_MASK32 = (1 << 32) - 1


def parse_bytes(text: str) -> int:
    """``1TB`` is 10**12 bytes (the gate's bar says TB), ``1TiB`` and ``1T`` 2**40; likewise K, M, G."""
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    text = text.strip().upper()
    decimal = text.endswith("B") and not text.endswith("IB")
    text = text.removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in powers else ""
    return int(float(text[: len(text) - len(unit)]) * (1000 if decimal else 1024) ** powers[unit])


def content(tags: torch.Tensor, page: int, words: int, layer: int, comp: int) -> torch.Tensor:
    """``(len(tags) * page, words)`` int32: the words page ``tags[i]`` holds in one layer and component."""
    dev = tags.device
    token = (tags[:, None] * page + torch.arange(page, device=dev)).reshape(-1, 1)
    j = torch.arange(words, device=dev)[None, :]
    x = token * 0x9E3779B1 + j * 0x85EBCA77 + (layer * 131 + comp * 7 + 1) * 0xC2B2AE3D
    x = x & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    x = x ^ (x >> 15)
    return (x - ((x >> 31) << 32)).to(torch.int32)


def device_rows(dev: Any) -> list[list[torch.Tensor]]:
    """Per layer, per component: the device pool's rows as ``(slots, words)`` int32 views."""
    if hasattr(dev, "kv_buffer"):
        buffers = [[b] for b in dev.kv_buffer]
    else:
        buffers = [[k, v] for k, v in zip(dev.k_buffer, dev.v_buffer)]
    return [[b.reshape(b.shape[0], -1).view(torch.int32) for b in layer] for layer in buffers]


@dataclass
class Combo:
    kind: str
    layout: str
    io_backend: str
    implementation: str | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.layout}/{self.implementation or self.io_backend}"


@dataclass
class Tally:
    rounds: int = 0
    pages_backed_up: int = 0
    pages_loaded: int = 0
    bytes_moved: int = 0
    mismatched_pages: int = 0
    verification_failures: int = 0
    evicted_pages: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def make_pools(combo: Combo, device: str, tokens: int, page: int, layers: int) -> tuple[Any, Any]:
    import hicache_core as hc

    if combo.kind == "mla":
        dev = hc.MLADevicePool(tokens, page, torch.bfloat16, 512, 64, layers, device)
    else:
        dev = hc.MHADevicePool(tokens, page, torch.bfloat16, 8, 128, layers, device)
    kw = {"implementation": combo.implementation} if combo.implementation else {}
    host = hc.make_host_pool(dev, layout=combo.layout, io_backend=combo.io_backend, size=2 * tokens,
                             verify=True, **kw)  # fmt: skip
    return dev, host


def combos(device: str, kinds: list[str], backends: list[str]) -> list[Combo]:
    """Every (kind, layout, backend) the registry serves on ``device``; a refused one is left out, not faked."""
    from hicache_core import UnsupportedCombinationError, get_registry

    out = []
    for kind in kinds:
        for layout in sorted(get_registry().layouts):
            for backend in backends:
                io_backend, _, impl = backend.partition("=")
                combo = Combo(kind, layout, io_backend, impl or None)
                try:
                    dev, host = make_pools(combo, device, 64, 16, 2)
                except (UnsupportedCombinationError, ValueError):
                    continue
                host.destroy()
                del dev
                out.append(combo)
    return out


def soak_one(combo: Combo, device: str, budget: int, deadline: float, args: argparse.Namespace,
             rng: random.Random) -> Tally:  # fmt: skip
    page, layers = args.page_size, args.layers
    dev, host = make_pools(combo, device, args.device_tokens, page, layers)
    rows = device_rows(dev)
    comps = len(rows[0])
    words = [r.shape[1] for r in rows[0]]
    page_bytes = page * layers * sum(words) * 4
    dev_pages = dev.size // page
    held: dict[int, int] = {}  # host page -> tag of the content it holds
    next_tag = 1
    tally = Tally()
    cuda = device == "cuda"
    side = torch.cuda.Stream() if cuda else None
    consumers = [torch.cuda.Stream() for _ in range(3)] if cuda else []
    backend = combo.io_backend
    per_round = max(2, args.round_tokens // page)
    start = time.monotonic()

    def slots(pages: list[int]) -> torch.Tensor:
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * page + torch.arange(page)).reshape(-1)

    def fill(dpages: list[int], tags: list[int]) -> None:
        s = slots(dpages).to(device)
        t = torch.tensor(tags, dtype=torch.int64, device=device)
        for layer in range(layers):
            for c in range(comps):
                rows[layer][c][s] = content(t, page, words[c], layer, c)

    def mismatched(dpages: list[int], tags: list[int]) -> int:
        s = slots(dpages).to(device)
        t = torch.tensor(tags, dtype=torch.int64, device=device)
        bad = torch.zeros(len(dpages), dtype=torch.bool, device=device)
        for layer in range(layers):
            for c in range(comps):
                diff = rows[layer][c][s] != content(t, page, words[c], layer, c)
                bad |= diff.reshape(len(dpages), -1).any(dim=1)
        return int(bad.sum())

    try:
        while tally.bytes_moved < budget and time.monotonic() < deadline:
            # 1. room: evict random held pages (their slots go back to the allocator, to be reused)
            want = per_round * page
            while host.available_size() < want and held:
                victims = rng.sample(sorted(held), min(len(held), per_round))
                host.free(slots(victims))
                for v in victims:
                    del held[v]
                tally.evicted_pages += len(victims)
            # 2. backup fresh content from random device pages
            dpages = rng.sample(range(dev_pages), per_round)
            tags = list(range(next_tag, next_tag + per_round))
            next_tag += per_round
            fill(dpages, tags)
            hslots = host.alloc(want)
            if hslots is None:
                raise RuntimeError(f"host pool full after eviction ({host.available_size()} free)")
            dslots = slots(dpages).to(device)
            if rng.random() < 0.75:
                host.backup_from_device_all_layer(dev, hslots, dslots, backend)
            else:
                for layer in range(layers):
                    host.backup_from_device_per_layer(dev, hslots, dslots, layer, backend)
            hpages = (hslots[::page] // page).tolist()
            held.update(zip(hpages, tags))
            tally.pages_backed_up += per_round
            # the device pages are reused by other requests
            fill(dpages, [0] * per_round)
            # 3. load random held pages into random device pages: the loader and a side stream at once
            chosen = rng.sample(sorted(held), min(len(held), per_round))
            targets = rng.sample(range(dev_pages), len(chosen))
            half = len(chosen) // 2 if cuda else 0
            groups = [(chosen[:half], targets[:half]), (chosen[half:], targets[half:])]
            load = None
            if half:
                load = host.submit_load(dev, slots(groups[0][0]), slots(groups[0][1]).to(device), backend)
            hs, ds = slots(groups[1][0]), slots(groups[1][1]).to(device)
            if cuda:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for layer in range(layers):
                        host.load_to_device_per_layer(dev, hs, ds, layer, backend)
            else:
                for layer in range(layers):
                    host.load_to_device_per_layer(dev, hs, ds, layer, backend)
            if load is not None:
                for layer in range(layers):
                    load.wait(layer, consumers[layer % len(consumers)])
                for c in consumers:
                    torch.cuda.current_stream().wait_stream(c)
                load.result()
            if cuda:
                torch.cuda.current_stream().wait_stream(side)
            # 4. compare with the reference; verification must have found nothing
            tally.mismatched_pages += mismatched(targets, [held[h] for h in chosen])
            try:
                host.check_verified(synchronize=True)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the soak goes on
                tally.verification_failures += 1
                tally.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                failed = host.take_failed_pages()
                if failed.numel():
                    host.free(failed)
                    for p in (failed[::page] // page).tolist():
                        held.pop(p, None)
            tally.pages_loaded += len(chosen)
            tally.bytes_moved += (per_round + len(chosen)) * page_bytes
            tally.rounds += 1
        if cuda:
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a combination that fails is reported, the others still run
        tally.errors.append(f"{type(exc).__name__}: {str(exc)[:500]}")
    finally:
        tally.seconds = round(time.monotonic() - start, 2)
        host.destroy()
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bytes", default="1TB", help="bytes to move in all (backups and loads), e.g. 1TB, 64MiB")
    ap.add_argument("--seconds", type=float, default=240.0, help="stop after this long, whatever has moved")
    ap.add_argument("--kinds", default="mha,mla")
    ap.add_argument("--backends", default=None,
                    help="io backends, backend=implementation to force one (default: the device's)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--device-tokens", type=int, default=32768)
    ap.add_argument("--round-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the summary JSON here")
    args = ap.parse_args(argv)
    device = args.device
    default_backends = "direct,kernel,kernel=kernel.triton_uva" if device == "cuda" else "direct,torch"
    backends = (args.backends or default_backends).split(",")
    todo = combos(device, args.kinds.split(","), backends)
    if not todo:
        print("no combination is served on this device", file=sys.stderr)
        return 2
    total = parse_bytes(args.bytes)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    deadline = started + args.seconds
    results = {}
    for i, combo in enumerate(todo):
        share = (total - sum(t.bytes_moved for t in results.values())) // (len(todo) - i)
        left = deadline - time.monotonic()
        tally = soak_one(combo, device, share, time.monotonic() + left / (len(todo) - i), args, rng)
        results[combo.name] = tally
        print(json.dumps({"combo": combo.name, **tally.__dict__}), flush=True)
    moved = sum(t.bytes_moved for t in results.values())
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "combinations": len(results),
        "rounds": sum(t.rounds for t in results.values()),
        "pages_backed_up": sum(t.pages_backed_up for t in results.values()),
        "pages_loaded": sum(t.pages_loaded for t in results.values()),
        "bytes_moved": moved,
        "target_bytes": total,
        "mismatched_pages": sum(t.mismatched_pages for t in results.values()),
        "verification_failures": sum(t.verification_failures for t in results.values()),
        "evicted_pages": sum(t.evicted_pages for t in results.values()),
        "errors": {n: t.errors for n, t in results.items() if t.errors},
        "seconds": round(time.monotonic() - started, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    clean = not (summary["mismatched_pages"] or summary["verification_failures"] or summary["errors"])
    summary["result"] = "ok" if clean and moved >= total else "failed"
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**summary, "per_combination": {n: t.__dict__ for n, t in results.items()}}, f, indent=1)
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0 if summary["result"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
