"""hicache-kernel: io backend ``"kernel"``, Triton kernels over UVA-mapped pinned host memory.

Importing this package does not import triton, compile anything or touch CUDA; the
kernels are compiled on the first transfer (or by ``warmup()``).
"""

from hicache_core import hookimpl

from .triton_uva import TritonUVA

__all__ = ["TritonUVA"]


@hookimpl
def hicache_register_backends(register):
    register(TritonUVA)
