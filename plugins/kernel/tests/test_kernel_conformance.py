"""The kernel plugin runs hicache's conformance kit: every claimed combination, byte-exact against the reference."""

import os

from hicache_core.testing import ConformanceTests


class TestTritonUVAConformance(ConformanceTests):
    implementation = "kernel.triton_uva"
    # The interpreter is slow; test_kernel_roundtrip.py covers int32 indices on every layout there.
    if os.environ.get("TRITON_INTERPRET") == "1":
        index_dtypes = ("int64",)
