"""Small helpers every plugin that launches Triton kernels needs (no triton import here).

Claims must be honest without importing triton (importing it is slow) and must follow
Triton's interpreter switch, which is how CI tests kernels on CPUs; the launch path
wants the cheapest way to read torch's current device and stream.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

_triton_found: bool | None = None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Whether triton can be imported (looked up once, without importing it)."""
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


class CudaOrInterpreter:
    """A ``device_types`` claim read at dispatch time: CUDA, plus the CPU while the interpreter is on."""

    def __get__(self, obj: object, owner: type | None = None) -> frozenset[str]:
        return frozenset({"cuda", "cpu"}) if interpreting() else frozenset({"cuda"})


def cuda_current_functions() -> tuple[Callable[[], int], Callable[[int], int]]:
    """The cheapest callables for (current device index, current raw stream of a device)."""
    get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_stream is None:

        def get_stream(index: int) -> int:
            return torch.cuda.current_stream(index).cuda_stream

    return get_device, get_stream


def bind_uva_device(name: str, plan, cpu_programs: int) -> tuple[bool, int, int]:
    """Check that implementation ``name`` can reach ``plan`` through UVA; return (CUDA?, device index, programs).

    On CUDA the host buffers must be pinned, and the interpreter must be off (it runs kernels on
    host copies of CUDA tensors, so addresses computed from the pools would point elsewhere). On
    the CPU (interpreter) the device index is -1 and ``cpu_programs`` stands in for the SM count.
    """
    device = plan.device
    if device.type != "cuda":
        return False, -1, cpu_programs
    if interpreting():
        raise ValueError(
            f"{name} cannot run CUDA pools while TRITON_INTERPRET=1 (the Triton interpreter copies CUDA "
            "tensors to the host, so addresses into the pools would be wrong); unset it, or test with CPU pools"
        )
    unpinned = [attr for attr, t in plan.host_buffers.items() if not t.is_pinned()]
    if not plan.drop_report.word.is_pinned():
        unpinned.append("the drop report's word (hicache_core.pool.drops)")
    if unpinned:
        raise ValueError(f"{name} needs pinned host buffers on CUDA (UVA); not pinned: {', '.join(unpinned)}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return True, index, torch.cuda.get_device_properties(index).multi_processor_count
