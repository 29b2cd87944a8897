"""Where vLLM 0.32's CPU attention backend keeps K and V inside one block page, written from its code.

``CPUAttentionBackendImpl`` views a layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits dim 2 into a K half and a V half;
``cpu_attn_reshape_and_cache`` with the ``vec`` ISA (fp32/fp16, or bf16 without AMX; block size a
multiple of 32) writes K transposed (``head_size x block_size``) and V as rows (``block_size x head_size``).
So inside a page, per KV head: ``[K: head_size x block_size | V: block_size x head_size]``.

This module states it independently of hicache's declarations, for the tests (it is the oracle).
"""

from __future__ import annotations

#: The ISA this oracle describes (vllm.v1.attention.backends.cpu_attn._get_attn_isa).
ORACLE_ISA = "vec"


def element_offset(*, part: str, head: int, token: int, dim: int, block_size: int, head_size: int) -> int:
    """Element offset of K or V (``part``) of one token, head and dim inside a block page."""
    if part not in ("k", "v"):
        raise ValueError(f"part must be 'k' or 'v', got {part!r}")
    if not (0 <= token < block_size and 0 <= dim < head_size and head >= 0):
        raise ValueError(f"token {token}, dim {dim}, head {head} out of a page of {block_size} x {head_size}")
    head_base = head * 2 * block_size * head_size
    if part == "k":
        return head_base + dim * block_size + token
    return head_base + block_size * head_size + token * head_size + dim


def page_bytes(*, num_kv_heads: int, block_size: int, head_size: int, element_size: int) -> int:
    """Bytes of one layer's page of one block: K and V of every head and token."""
    return num_kv_heads * 2 * block_size * head_size * element_size
