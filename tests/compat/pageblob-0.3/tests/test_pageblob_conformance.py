"""hicache's conformance kit, run on the installed plugin: every claimed combination against the reference."""

from hicache_core.testing import ConformanceTests


class TestPageBlobGather(ConformanceTests):
    implementation = "pageblob.gather"
