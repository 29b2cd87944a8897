"""hicache's conformance kit on jit.one_layer: every claimed combination, byte-exact against the reference."""

from hicache_core.testing import ConformanceTests


class TestJitOneLayerConformance(ConformanceTests):
    implementation = "jit.one_layer"
