"""vLLM general plugin (entry point group ``vllm.general_plugins``): the spec's name, registered with vLLM.

vLLM calls its general plugins once in each process it starts (the front end, EngineCore, every
worker). This one registers ``HicacheOffloadingSpec`` with vLLM's ``OffloadingSpecFactory`` by module
and class name: nothing is imported until a config names the spec, and a config that names another
spec is untouched. So ``kv_connector_extra_config`` needs only ``"spec_name": "HicacheOffloadingSpec"``
beside vLLM's own ``--kv-offloading-size``. Where vLLM's allow-list ``VLLM_PLUGINS`` leaves ``hicache``
out, ``"spec_module_path": "hicache_vllm"`` finds the spec as before.
"""

from __future__ import annotations

SPEC_NAME = "HicacheOffloadingSpec"

_registered = False


def register() -> None:
    """Register :data:`SPEC_NAME` with vLLM's offloading spec factory (once per process)."""
    global _registered
    if _registered:
        return
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    except ImportError:  # a vLLM without the factory (not 0.32): no name to register; the spec refuses it when built
        return
    # Another package holding the name raises vLLM's "already registered" here, at start-up.
    OffloadingSpecFactory.register_spec(SPEC_NAME, "hicache_vllm.spec", SPEC_NAME)
    _registered = True
