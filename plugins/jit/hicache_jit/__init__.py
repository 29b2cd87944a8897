"""hicache-jit: one-layer transfers for io backend ``"kernel"``, with kernels specialised per pool shape.

Importing this package does not import triton, compile anything or touch CUDA: each
kernel is compiled the first time a pool of its shape transfers (or by ``warmup()``), and
kept for the rest of the process (:func:`compiled_keys`, :func:`compile_count`,
:func:`compile_seconds`). It does not need hicache-kernel.
"""

from collections.abc import Callable

from hicache_core import hookimpl

from .one_layer import (
    DEFAULT_VARIANT,
    VARIANTS,
    JitOneLayer,
    KernelKey,
    compile_count,
    compile_seconds,
    compiled_keys,
    triton_cache_entries,
)

__all__ = [
    "DEFAULT_VARIANT",
    "VARIANTS",
    "JitOneLayer",
    "KernelKey",
    "compile_count",
    "compile_seconds",
    "compiled_keys",
    "triton_cache_entries",
]


@hookimpl
def hicache_register_backends(register: Callable[[type], None]) -> None:
    """Register ``jit.one_layer`` (io backend ``"kernel"``, priority 60)."""
    register(JitOneLayer)
