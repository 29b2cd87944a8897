"""hicache-direct: io backend ``"direct"``, the copy engine (one copy per contiguous run), no kernel."""

from hicache_core import hookimpl
from hicache_core.lazy import lazy_face

# Lazy, so that its hicache.settings entry point (hicache_direct.variables) imports no torch.
__all__ = ["DirectCopy"]
__getattr__, __dir__ = lazy_face(globals(), {"DirectCopy": "copy_engine"})


@hookimpl
def hicache_register_backends(register):
    from .copy_engine import DirectCopy

    register(DirectCopy)
