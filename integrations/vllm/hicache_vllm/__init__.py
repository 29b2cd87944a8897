"""vLLM's ``OffloadingConnector`` with hicache as its host tier and L3.

vLLM loads the spec by name (registered by :mod:`hicache_vllm._vllm_plugin`), sized by vLLM's own flag::

    --kv-offloading-size 8 --kv-transfer-config '{"kv_connector_extra_config": {"spec_name": "HicacheOffloadingSpec"}}'

``HicacheOffloadingSpec`` imports vLLM (and checks its version) on first use; the block mover
(:mod:`hicache_vllm.mover`) and the pool kind (:mod:`hicache_vllm.pool_kind`) import without vLLM.
"""

from __future__ import annotations

from hicache_core.lazy import lazy_face

from .errors import NotServedError
from .version import SERVED_VLLM_VERSIONS

_LAZY = {
    "HicacheOffloadingSpec": "spec",
    "HicacheOffloadingManager": "spec",
    "HicacheOffloadingWorker": "spec",
    "HicacheLoadStoreSpec": "spec",
    "HicacheCachePolicy": "retention",
    "BlockMover": "mover",
    "VllmPagePool": "pool_kind",
    "VLLM_PAGE": "pool_kind",
}

__all__ = ["NotServedError", "SERVED_VLLM_VERSIONS", *_LAZY]

__getattr__, __dir__ = lazy_face(globals(), _LAZY)
