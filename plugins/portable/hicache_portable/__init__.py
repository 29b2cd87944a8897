"""hicache-portable: io backend ``"torch"``, vectorised torch copies for every pool kind and layout on the CPU.

Without a GPU there is no copy engine to drive and no Triton kernel outside the
interpreter, so ``page_first`` (SGLang's default layout) and ``page_head`` would have
no implementation at all under ``auto``. This plugin claims every pool kind, layout
and operation on the CPU, at the lowest priority, so it serves what nothing faster
claims there.
"""

from hicache_core import hookimpl

from .gather import TorchGather

__all__ = ["TorchGather"]


@hookimpl
def hicache_register_backends(register):
    register(TorchGather)
