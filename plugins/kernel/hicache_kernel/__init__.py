"""hicache-kernel: io backend ``"kernel"``, Triton kernels over UVA-mapped pinned host memory.

Importing this package does not import triton, compile anything or touch CUDA; the
kernels are compiled on the first transfer (or by ``warmup()``).
"""

from hicache_core import hookimpl
from hicache_core.lazy import lazy_face

# Lazy, so that its hicache.settings entry point (hicache_kernel.variables) imports no torch.
__all__ = ["TritonUVA"]
__getattr__, __dir__ = lazy_face(globals(), {"TritonUVA": "triton_uva"})


@hookimpl
def hicache_register_backends(register):
    from .triton_uva import TritonUVA

    register(TritonUVA)
