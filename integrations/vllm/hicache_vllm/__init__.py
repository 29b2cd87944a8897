"""vLLM's ``OffloadingConnector`` with hicache as its host tier and L3.

vLLM loads the spec by name::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_module_path": "hicache_vllm",
                                    "spec_name": "HicacheOffloadingSpec",
                                    "cpu_bytes_to_use": 4000000000}}'

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
