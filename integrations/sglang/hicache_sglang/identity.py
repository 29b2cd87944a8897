"""The one log line that names a host pool the adapter built (the end-to-end suite asserts it).

An operator reading a server log, or a test reading it, sees which hicache class serves the
pool, in which layout, with which io backend and which implementation per operation: the
answer to "is this server really on hicache, and on which code path".
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("hicache_sglang")
#: Every identity line starts with this (grep for it).
PREFIX = "hicache-sglang host pool:"


def describe(pool: Any) -> str:
    """``PREFIX`` then label, classes, layout, io backend, sizes and ``op=implementation`` per operation."""
    core = pool.core
    ops = ", ".join(f"{op}={impl}" for op, impl in sorted(core.implementations.items()))
    return (
        f"{PREFIX} {pool.pool_label!r} {type(pool).__module__}.{type(pool).__qualname__} over "
        f"{type(core).__module__}.{type(core).__qualname__}, pool kind {core.geometry.kind}, "
        f"layout {core.layout}, io backend {core.io_backend}, {core.layer_num} host layers, {core.size} tokens, "
        f"page size {core.page_size}; implementations: {ops}"
    )


def log_pool(pool: Any) -> Any:
    """Log :func:`describe` of ``pool`` at INFO (SGLang's server log shows INFO) and return the pool."""
    logger.info(describe(pool))
    return pool
