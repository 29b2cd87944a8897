"""hicache-jit: one-layer transfers for io backend ``"kernel"``, with kernels specialised per pool shape.

Importing this package does not import triton, compile anything or touch CUDA: each
kernel is compiled the first time a pool of its shape transfers (or by ``warmup()``), and
kept for the rest of the process (:func:`compiled_keys`, :func:`compile_count`,
:func:`compile_seconds`). It does not need hicache-kernel.
"""

from collections.abc import Callable

from hicache_core import hookimpl
from hicache_core.lazy import lazy_face

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
# Lazy, so that its hicache.settings entry point (hicache_jit.variables) imports no torch.
__getattr__, __dir__ = lazy_face(globals(), dict.fromkeys(__all__, "one_layer"))


@hookimpl
def hicache_register_backends(register: Callable[[type], None]) -> None:
    """Register ``jit.one_layer`` (io backend ``"kernel"``, priority 60)."""
    from .one_layer import JitOneLayer

    register(JitOneLayer)
