"""Non-packed MTP draft KV pools (``_build_mha_mla_host_pool`` of SGLang 0.5.23), built by hicache.

``build_full_draft_pools`` (a draft model with its own KV pool, indices following the target's
FULL KV) and ``build_swa_draft_pools`` (an SWA draft, indices following the target's SWA) call
``_build_mha_mla_host_pool`` from the assembler. :func:`build_mha_mla_host_pool` takes the
same arguments and returns the adapter's MHA / MLA pool for the draft's own device pool: the
host keeps the draft's layers (host layer ``i`` is the draft's local layer ``i``, which its
layer mapping ``{i: i}`` sends), sized to exactly ``host_token_capacity`` slots (the anchor's
logical size) when given, else ``host_to_device_ratio`` times the draft pool's, with SGLang's
padding page.
"""

from __future__ import annotations

from typing import Any

from ..errors import NotServedError


def build_mha_mla_host_pool(
    *,
    pool: Any,
    host_to_device_ratio: float,
    page_size: int,
    layout: str,
    allocator_type: str,
    pool_label: str,
    host_token_capacity: int | None = None,
):
    """``_build_mha_mla_host_pool``'s arguments; returns :class:`~hicache_sglang.SGLangHostPool`."""
    from sglang.srt.mem_cache.hybrid_cache.host_pool_config import is_mla_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_memory

    from ..build import build_kv_host_pool

    if allocator_type != "default":
        raise NotServedError(
            f"the {pool_label!r} draft host pool asks for the {allocator_type!r} host allocator, which is SGLang's; "
            "hicache allocates host memory itself"
        )
    # SGLang's own rule: page_first_kv_split is MLA-only, so an MHA draft of an MLA target takes page_first_direct.
    if isinstance(pool, MHATokenToKVPool) and layout == "page_first_kv_split":
        layout = "page_first_direct"
    with get_memory().override(hicache_mem_layout=layout, hicache_size=0, hicache_ratio=host_to_device_ratio):
        return build_kv_host_pool(kv_pool=pool, page_size=page_size, use_mla=is_mla_pool(pool), pool_label=pool_label,
                                  host_token_capacity=host_token_capacity)  # fmt: skip
