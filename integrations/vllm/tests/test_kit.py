"""hicache's conformance kit on the vllm_page pool kind: every layout it allows, through the direct copy engine
(and, on CUDA, the Triton kernels), byte for byte against the reference and each layout's oracle."""

from __future__ import annotations

import importlib.util

from conftest import DEVICE

from hicache_core.testing import ConformanceTests


class TestVllmPageDirect(ConformanceTests):
    implementation = "direct.copy_engine"
    only_pool_kinds = ("vllm_page",)
    device = DEVICE


if DEVICE == "cuda" and importlib.util.find_spec("hicache_kernel") is not None:

    class TestVllmPageKernel(ConformanceTests):
        implementation = "kernel.triton_uva"
        only_pool_kinds = ("vllm_page",)
        device = DEVICE
