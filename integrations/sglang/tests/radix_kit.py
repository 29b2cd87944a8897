"""SGLang's shipped UnifiedRadixCache test kit (``sglang.test.kits.unified_radix_cache``), pointed at a pool.

The kit builds SGLang's own radix tree, allocator and request pool (``build_fixture``) and
brings its HiCache up through ``UnifiedRadixCache.init_hicache`` (``_init_hicache``). Three
of its choices are fixed in the kit, and this module sets them, without touching its logic:

* the device pool: ``build_fixture`` always makes an ``MHATokenToKVPool`` starting at layer 0;
  here it makes the MHA or MLA pool asked for, starting at ``start_layer``;
* the device: ``build_fixture`` asks SGLang's ``get_device()``, which answers ``cpu`` only in
  SGLang's CPU-engine mode (that mode needs sgl_kernel's CPU build); here it is ``DEVICE``;
* the host layout and io backend: ``_init_hicache`` always asks for ``kernel`` with the default
  layout; here they are the pair under test.
"""

from __future__ import annotations

import unittest
from contextlib import ExitStack, contextmanager
from unittest import mock

from sglang_setup import DEVICE, LAYERS, mha_pool, mla_pool


def make_case(page_size: int):
    """A kit test case (the kit's mixins need unittest's assertions and cleanups), bound to a config."""
    from sglang.test.kits.unified_radix_cache.config import CacheConfig
    from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

    class KitCase(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
        def runTest(self) -> None:  # the kit's helpers are called from pytest tests
            pass

    case = KitCase()
    case.cfg = CacheConfig(page_size=page_size, num_layers=LAYERS, head_num=2, head_dim=16, kv_size=64 * page_size,
                           max_context_len=64 * page_size)  # fmt: skip
    return case


@contextmanager
def kit_pointed_at(kind: str, layout: str, io_backend: str, start_layer: int):
    from sglang.srt.server_args import ServerArgs
    from sglang.test.kits.unified_radix_cache import fixtures, mixins

    def pool(**kw):
        pages = kw["size"] // kw["page_size"]
        if kind == "mla":
            return mla_pool(kw["page_size"], pages=pages, layers=kw["layer_num"], start_layer=start_layer)
        return mha_pool(kw["page_size"], pages=pages, layers=kw["layer_num"], start_layer=start_layer,
                        head_num=kw["head_num"], head_dim=kw["head_dim"])  # fmt: skip

    def server_args(**kw):
        return ServerArgs(**{**kw, "hicache_mem_layout": layout, "hicache_io_backend": io_backend})

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(fixtures, "MHATokenToKVPool", pool))
        stack.enter_context(mock.patch.object(fixtures, "get_device", lambda: DEVICE))
        stack.enter_context(mock.patch.object(mixins, "ServerArgs", server_args))
        yield
