"""hicache-direct: io backend ``"direct"``, the copy engine (one copy per contiguous run), no kernel."""

from hicache_core import hookimpl

from .copy_engine import DirectCopy

__all__ = ["DirectCopy"]


@hookimpl
def hicache_register_backends(register):
    register(DirectCopy)
