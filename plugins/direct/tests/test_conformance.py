"""The direct plugin runs hicache's conformance kit: every claimed combination, byte-exact against the reference."""

from hicache_core.testing import ConformanceTests


class TestDirectCopyConformance(ConformanceTests):
    implementation = "direct.copy_engine"
