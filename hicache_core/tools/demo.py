"""``hicache demo``: model-shaped pools of every kind, backed up, evicted and reloaded layer by layer.

Every byte is checked against the reference transfer; each step prints the
implementation that served it and its GB/s (bytes that crossed the link over wall time).
"""

from __future__ import annotations

import sys
import time

import torch

from ..plugins.dispatch import UnsupportedCombinationError
from ..plugins.implementation import BACKUP_ALL, LOAD, TransferRequest
from ..plugins.registry import get_registry
from ..pool.host_pool import make_host_pool
from .progress import progress
from .shapes import SHAPES

#: The demo's page size on each device type (tokens per transfer are a multiple of it).
PAGE_SIZE = {"cuda": 64, "cpu": 16}


def random_pages(num_pages: int, count: int, page_size: int, generator: torch.Generator) -> torch.Tensor:
    """Token slots of ``count`` distinct random pages out of pages ``1 .. num_pages-1`` (page 0 is padding)."""
    pages = torch.randperm(num_pages - 1, generator=generator)[:count] + 1
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def fill_random(tensors, generator: torch.Generator) -> None:
    """Random bytes, drawn on each tensor's own device (a CPU generator over GBs of GPU memory takes minutes)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    per_device: dict[torch.device, torch.Generator] = {}
    for t in tensors:
        gen = per_device.get(t.device)
        if gen is None:
            gen = per_device[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=t.device, generator=gen))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (``torch.equal`` on floats says NaN != NaN, and random bytes hold NaNs)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(device: str | None = None, tokens: int | None = None) -> int:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    tokens = tokens or (4096 if on_gpu else 256)
    page_size = PAGE_SIZE[device.type]
    if tokens % page_size:
        raise ValueError(f"--tokens {tokens}: takes a multiple of the page size, {page_size} on {device.type}")
    registry = get_registry()
    gen = torch.Generator().manual_seed(0)
    cases = [
        (shape, layout)
        for shape in SHAPES.values()
        for layout, decl in sorted(registry.layouts.items())
        if TransferRequest(
            "reference", LOAD, shape.geometry(page_size=page_size, device_type=device.type), decl
        ).storable
    ]
    print(f"hicache demo on {device} ({torch.cuda.get_device_name(device) if on_gpu else 'CPU'}), "
          f"{tokens} tokens per transfer, page size {page_size}")  # fmt: skip
    rows, failures = [], 0
    for shape, layout in progress(cases, len(cases), "pools"):
        layers = shape.layers if on_gpu else min(shape.layers, 4)
        dev = shape.device_pool(4 * tokens, page_size=page_size, device=device, layers=layers)
        try:
            host = make_host_pool(dev, layout=layout, io_backend="auto", size=dev.size)
        except UnsupportedCombinationError as exc:
            rows.append((shape.name, layout, "-", "refused", _first_reason(exc), ""))
            continue
        ref = make_host_pool(dev, layout=layout, io_backend="reference", size=dev.size)
        fill_random([t for ts in host.plan.parts for t in ts.device_layers], gen)
        fill_random(list(host.plan.host_buffers.values()) + list(ref.plan.host_buffers.values()), gen)
        for buf_name, buf in host.plan.host_buffers.items():
            ref.plan.host_buffers[buf_name].copy_(buf)
        num_pages = dev.size // page_size
        host_slots = host.alloc(tokens)
        dev_slots = random_pages(num_pages, tokens // page_size, page_size, gen)
        original = [t[_rows(host, dev_slots)].clone() for ts in host.plan.parts for t in ts.device_layers]
        item_bytes = sum(host.geometry.item_bytes) // (page_size if host.geometry.items_are_pages else 1)

        # One page first, untimed: thread pools, compiled kernels and converted indices are set up once.
        p = page_size
        host.backup_from_device_all_layer(dev, host_slots[:p].clone(), dev_slots[:p].to(device), "auto")
        host.load_to_device_per_layer(dev, host_slots[:p].clone(), dev_slots[:p].to(device), dev.start_layer, "auto")
        _sync(device)
        t0 = time.perf_counter()
        host.backup_from_device_all_layer(dev, host_slots, dev_slots.to(device), "auto")
        _sync(device)
        backup_s = time.perf_counter() - t0
        ref.backup_from_device_all_layer(dev, host_slots, dev_slots, "reference")
        ok_backup = all(same_bytes(host.plan.host_buffers[k], ref.plan.host_buffers[k]) for k in ref.plan.host_buffers)
        gbs = tokens * item_bytes * host.layer_num / backup_s / 1e9
        rows.append((shape.name, layout, "backup all", host.implementations[BACKUP_ALL], f"{gbs:.2f} GB/s",
                     "ok" if ok_backup else "MISMATCH"))  # fmt: skip

        for ts in host.plan.parts:  # evict
            for t in ts.device_layers:
                t[_rows(host, dev_slots)] = 0
        new_slots = random_pages(num_pages, tokens // page_size, page_size, gen).to(device)
        host_slots_dev = host_slots.to(device)
        _sync(device)
        t0 = time.perf_counter()
        for layer in range(dev.start_layer, dev.end_layer):
            host.load_to_device_per_layer(dev, host_slots_dev, new_slots, layer, "auto")
        _sync(device)
        load_s = time.perf_counter() - t0
        reloaded = [t[_rows(host, new_slots)] for ts in host.plan.parts for t in ts.device_layers]
        ok_load = all(torch.equal(a, b) for a, b in zip(original, reloaded))  # uint8 rows: NaN-free
        gbs = tokens * item_bytes * host.layer_num / load_s / 1e9
        rows.append((shape.name, layout, "load per layer", host.implementations[LOAD], f"{gbs:.2f} GB/s",
                     "ok" if ok_load else "MISMATCH"))  # fmt: skip
        failures += (not ok_backup) + (not ok_load)
    header = ("shape", "layout", "step", "implementation", "speed", "check")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    print("all bytes match the reference" if not failures else f"{failures} steps did NOT match the reference")
    if failures:
        print(f"hicache demo: {failures} steps did NOT match the reference (the table says which)", file=sys.stderr)
        return 1
    return 0


def _rows(host, slots: torch.Tensor) -> torch.Tensor:
    """Device rows of token slots (page rows for page-row pools)."""
    if host.geometry.items_are_pages:
        return slots[:: host.page_size] // host.page_size
    return slots


def _first_reason(exc: UnsupportedCombinationError) -> str:
    reasons = [r for rs in exc.reasons.values() for r in rs]
    return (reasons[0] if reasons else str(exc).splitlines()[0])[:64]
