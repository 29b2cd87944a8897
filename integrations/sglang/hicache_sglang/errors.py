"""The one error the adapter raises for what it does not serve."""

from __future__ import annotations


class NotServedError(ValueError):
    """hicache-sglang does not serve this SGLang setup, pool or call.

    Raised at :func:`hicache_sglang.install` (another SGLang version) or when SGLang asks
    for a host pool (decode context parallelism, page-interleaved pools, quantized KV with
    separate scales, ...), never halfway through serving. The message says what was asked,
    why it is refused, and what to do instead.
    """
