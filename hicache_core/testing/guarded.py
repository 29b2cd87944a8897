"""Test helpers for implementations that compute addresses themselves (kernels): guarded memory, bad indices.

Every host buffer and device layer of a :func:`guarded_plan` is cut out of a larger
random-filled allocation with guard bytes on both sides, so a stray write anywhere near the
pool shows. :func:`bad_pairs` mixes valid index pairs with every kind of bad index, and
:func:`check_masked_call` runs an implementation on them and compares every byte (pools and
guards) with the reference moving the valid pairs alone.

Reads of pinned host memory that a kernel may still be writing must wait for the device:
every snapshot and comparison here synchronises first (:func:`synchronize`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence

import pytest
import torch

from ..plugins.implementation import LOAD
from ..plugins.reference import reference_copy
from ..plugins.registry import get_registry
from ..pool.device_pools import MHADevicePool, MLADevicePool, PageRowsDevicePool
from ..pool.drops import DroppedIndicesError
from ..pool.host_layout import host_layout_spec
from ..pool.host_pool import geometry_of
from ..pool.plan import TransferPlan

#: Bytes of random guard on each side of every guarded tensor.
GUARD = 256


def default_to_interpreter() -> None:
    """Where there is no CUDA, run Triton kernels in Triton's interpreter (call before any kernel is defined).

    Triton reads ``TRITON_INTERPRET`` when a kernel is defined; hicache's plugins define theirs on
    first use, so a test package's ``conftest.py`` may call this at import.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_test_device() -> str:
    """The device type Triton kernels run on here: ``"cpu"`` under the interpreter, else ``"cuda"``; or skip."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: Triton kernels cannot run here")


def tiny_pool(kind: str, device: str, *, page_size: int = 4, pages: int = 8, layers: int = 3, **kw):
    """A tiny device pool of ``pages`` pages (page-row pools: ``pages + 1`` rows), bf16 where it has a dtype.

    Kinds: ``mha`` (2 heads x 8), ``mha_asym`` (V heads of 4), ``mla`` (16 + 8), ``mla_odd``
    (12 + 6: 36-byte items, 4-byte words), ``page_rows`` (24-byte rows), ``wide_rows`` (16400-byte
    rows, wider than a row kernel's register tile). ``kw`` goes to the pool (e.g. ``start_layer``).
    """
    size = pages * page_size
    if kind == "mha":
        return MHADevicePool(size, page_size, torch.bfloat16, 2, 8, layers, device, **kw)
    if kind == "mha_asym":
        return MHADevicePool(size, page_size, torch.bfloat16, 2, 8, layers, device, v_head_dim=4, **kw)
    if kind == "mla":
        return MLADevicePool(size, page_size, torch.bfloat16, 16, 8, layers, device, **kw)
    if kind == "mla_odd":
        return MLADevicePool(size, page_size, torch.bfloat16, 12, 6, layers, device, **kw)
    if kind == "wide_rows":
        return PageRowsDevicePool(pages + 1, page_size, 16400, layers, device, **kw)
    if kind == "page_rows":
        return PageRowsDevicePool(pages + 1, page_size, 24, layers, device, **kw)
    raise ValueError(f"unknown tiny pool kind {kind!r}")


def record_grids(impl, monkeypatch, method: str = "_launch") -> list[int]:
    """Record the grid of every launch ``impl`` makes through ``method`` (its second argument)."""
    seen: list[int] = []
    real = getattr(impl, method)

    def record(group, grid, *args):
        seen.append(grid)
        return real(group, grid, *args)

    monkeypatch.setattr(impl, method, record)
    return seen


def synchronize() -> None:
    """Wait for every CUDA stream (no-op without CUDA): kernels write pinned host memory asynchronously."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class GuardedMemory:
    """Tensors carved out of random-filled allocations, each with :data:`GUARD` bytes on either side."""

    def __init__(self, device: str, seed: int, *, pinned: bool = False) -> None:
        self.device, self.pinned = device, pinned
        self.gen = torch.Generator().manual_seed(seed)
        self.allocations: list[torch.Tensor] = []

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, generator=self.gen)
        raw = raw.pin_memory() if self.pinned else raw.to(self.device)
        self.allocations.append(raw)
        if raw.device.type == "cpu":
            # Storage offset 0 over the middle: host views (BoundPart.host_layer_view) count from the storage start.
            middle = torch.frombuffer(raw.numpy()[GUARD : GUARD + nbytes], dtype=torch.uint8)
        else:
            middle = raw[GUARD : GUARD + nbytes]
        return middle.view(dtype).view(shape)

    def scramble(self) -> None:
        synchronize()
        for raw in self.allocations:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=self.gen))

    def snapshot(self) -> list[torch.Tensor]:
        synchronize()
        return [raw.cpu().clone() for raw in self.allocations]

    def restore(self, images: list[torch.Tensor]) -> None:
        synchronize()
        for raw, image in zip(self.allocations, images):
            raw.copy_(image)
        synchronize()

    def equals(self, images: list[torch.Tensor]) -> bool:
        synchronize()
        return all(torch.equal(raw.cpu(), image) for raw, image in zip(self.allocations, images))


def guarded_plan(pool, layout: str, device: str, *, drafts: Sequence = (), num_pages: int = 3, seed: int = 5):
    """A plan over guarded memory for ``pool``'s shape (and draft pools'), ``num_pages`` host pages.

    Returns ``(plan, host memory, device memory)``. The pools passed only give shapes: the plan's
    tensors are all guarded copies, on ``device`` (the host side pinned where it is CUDA).
    """
    geometry = geometry_of(pool, draft_pools=tuple(drafts))
    spec = host_layout_spec(geometry, get_registry().layouts[layout], num_pages=num_pages)
    host_mem = GuardedMemory("cpu", seed=seed, pinned=device == "cuda")
    dev_mem = GuardedMemory(device, seed=seed + 1)
    host_buffers = {b.attr: host_mem.tensor(b.shape, geometry.dtype) for b in spec.buffers}
    device_layers = {}
    for comp in geometry.components:
        layers = list(getattr(pool, comp.attr)) + [getattr(d, comp.attr)[0] for d in drafts]
        device_layers[comp.attr] = [dev_mem.tensor(t.shape, t.dtype) for t in layers]
    return TransferPlan(geometry, spec, host_buffers, device_layers), host_mem, dev_mem


def bad_pairs(plan: TransferPlan, dtype: torch.dtype):
    """Valid pairs mixed with every kind of bad index (negative, one past the end, huge); and the valid pairs alone.

    Returns ``(h, d, valid h, valid d)``; the first two in ``dtype``, the valid ones ``int64``, all on the CPU.
    """
    huge = 2**31 - 1 if dtype == torch.int32 else 2**42
    items, rows = plan.num_items, plan.min_device_rows
    h = [1, items - 1, -1, items, items + 2, huge, 4 % items, 0, -huge, 6 % items]
    d = [rows - 1, 2 % rows, 3 % rows, 5 % rows, 1, 0, -1, rows, 4 % rows, -huge]
    valid = [(a, b) for a, b in zip(h, d) if 0 <= a < items and 0 <= b < rows]
    hv = torch.tensor([a for a, _ in valid], dtype=torch.int64)
    dv = torch.tensor([b for _, b in valid], dtype=torch.int64)
    return torch.tensor(h, dtype=dtype), torch.tensor(d, dtype=dtype), hv, dv


def clear_drops(plan: TransferPlan) -> None:
    """Forget a dropped-index report on ``plan`` (after a test has checked it)."""
    try:
        plan.drop_report.raise_if_dropped()
    except DroppedIndicesError:
        pass


def check_masked_call(plan: TransferPlan, host_mem: GuardedMemory, dev_mem: GuardedMemory,
                      call: Callable[[], None], hv: torch.Tensor, dv: torch.Tensor, layers, to_device: bool,
                      what: str) -> tuple[int, int]:  # fmt: skip
    """Run ``call`` from random bytes; every byte (pools and guards) must equal the reference moving ``hv``/``dv``.

    The call is numbered on the plan's drop report first, as a host pool would. Returns
    ``(number of the call, what the drop word held after it)``: equal where the implementation
    masked an index, 0 for the second where it masked none.
    """
    clear_drops(plan)
    host_mem.scramble()
    dev_mem.scramble()
    start = host_mem.snapshot(), dev_mem.snapshot()
    seq = plan.drop_report.begin(what, None, len(hv))
    call()
    got = host_mem.snapshot(), dev_mem.snapshot()  # synchronises: the kernel has finished
    flagged = plan.drop_report.dropped()
    clear_drops(plan)
    host_mem.restore(start[0])
    dev_mem.restore(start[1])
    reference_copy(plan, hv, dv, layers, to_device=to_device)
    assert host_mem.equals(got[0]), f"{what}: host bytes (pool or guards) differ from moving the valid pairs only"
    assert dev_mem.equals(got[1]), f"{what}: device bytes (pool or guards) differ from moving the valid pairs only"
    assert not (host_mem.equals(start[0]) and dev_mem.equals(start[1])), f"{what} moved nothing"
    return seq, flagged


# ---- through a host pool -------------------------------------------------------------------------


def _pool_call(pool, device_pool, op: str, h: torch.Tensor, d: torch.Tensor, layer_id: int | None) -> None:
    if layer_id is None:
        getattr(pool, op)(device_pool, h, d, pool.io_backend)
    else:
        getattr(pool, op)(device_pool, h, d, layer_id, pool.io_backend)


def fill_random(tensors, seed: int) -> None:
    """Random bytes (never zeros, which hide unwritten outputs) into every tensor, reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(t.device))


def byte_images(tensors) -> list[torch.Tensor]:
    """CPU byte copies of ``tensors``, after every stream has finished (kernels write pinned memory late)."""
    synchronize()
    return [t.reshape(-1).view(torch.uint8).cpu().clone() for t in tensors]


def _restore(tensors, images) -> None:
    for t, image in zip(tensors, images):
        t.reshape(-1).view(torch.uint8).copy_(image.to(t.device))
    synchronize()


def _check_like_reference(host, ref, device_pool, op, h, d, hv, dv, layer_id, device_tensors, what: str):
    """Run ``op`` on ``host`` with ``h``/``d`` and on ``ref`` with the valid pairs, from the same bytes; compare all.

    Returns the byte images of ``host``'s buffers and the device tensors after ``host``'s call
    (the device tensors are left as that call left them).
    """
    hosts, refs = list(host.plan.host_buffers.values()), list(ref.plan.host_buffers.values())
    synchronize()
    for a, b in zip(refs, hosts):
        a.copy_(b)
    before = byte_images(device_tensors)
    _pool_call(host, device_pool, op, h.to(host.plan.device), d.to(host.plan.device), layer_id)
    got = byte_images(hosts + device_tensors)  # synchronises: the transfer has run
    _restore(device_tensors, before)
    _pool_call(ref, device_pool, op, hv, dv, layer_id)
    want = byte_images(refs + device_tensors)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: tensor {i} differs from the reference moving the valid pairs only"
    _restore(device_tensors, got[len(hosts) :])
    return got


def check_reported_at_next_call(host, ref, device_pool, op: str, layer_id: int | None) -> None:
    """A call with bad indices on ``host`` (not validating) returns, moves exactly the valid pairs, and is named
    by the :class:`~hicache_core.pool.drops.DroppedIndicesError` that the pool's next call raises; a good call after
    that works.

    ``ref`` is a reference host pool over the same ``device_pool`` and layout (token pools: indices
    are token slots). Both pools and the device pool are compared whole, byte for byte.
    """
    assert not host.validate, "the pool must not check bounds itself"
    device_tensors = list({id(t): t for p in host.plan.parts for t in p.device_layers}.values())
    hosts = list(host.plan.host_buffers.values())
    h, d, hv, dv = bad_pairs(host.plan, torch.int64)
    fill_random(hosts + device_tensors, seed=21)
    got = _check_like_reference(host, ref, device_pool, op, h, d, hv, dv, layer_id, device_tensors, op)
    faulty = host.plan.drop_report.seq

    # The next call on the pool, whatever it is, raises before moving anything, and names the faulty call.
    where = host.plan.device
    with pytest.raises(DroppedIndicesError) as caught:
        _pool_call(host, device_pool, LOAD, hv[:1].to(where), dv[:1].to(where), 0)
    err = caught.value
    assert isinstance(err, IndexError)
    assert (err.call, err.operation, err.layer_id) == (faulty, op, layer_id), (err.call, err.operation, err.layer_id)
    assert f"call #{faulty}" in str(err) and op in str(err)
    after = byte_images(hosts + device_tensors)
    assert all(torch.equal(a, b) for a, b in zip(after, got)), "the raising call moved bytes"

    # Reported once: a good call after it works (byte-exact), and reports nothing.
    again = f"{op} after the report"
    _check_like_reference(host, ref, device_pool, op, hv, dv, hv, dv, layer_id, device_tensors, again)
    assert host.plan.drop_report.dropped() == 0, "a call with good indices was reported"
