"""The conformance kit on torch.gather: every pool kind and layout, on the CPU."""

from hicache_core.testing import ConformanceTests


class TestTorchGather(ConformanceTests):
    implementation = "torch.gather"
    device = "cpu"
