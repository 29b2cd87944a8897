"""The QSA indexer host pool (compressed keys of QSA sparse attention, SGLang 0.5.23), built by hicache.

``build_hybrid_mamba_stack`` and ``build_full_draft_pools`` call the assembler's
``QSAIndexerPoolHost(device_pool, anchor_host, *, allocator_type, mtp_draft_device_pools)``.
SGLang's pool is a DeepSeek-V4 paged pool over the compressed-key buffers: one full-KV page
holds ``page_size // qsa_compress_ratio`` compressed groups, packed into one byte row, so a
page row moves both coordinate spaces with the full-KV page number (whole pages only). This
class is that, over hicache's ``dsv4_paged`` kind (the same page rows, the same host shapes).
"""

from __future__ import annotations

from typing import Any

import torch

from .dsv4 import SGLangDeepSeekV4PagedHostPool


class SGLangQSAIndexerHostPool(SGLangDeepSeekV4PagedHostPool):
    """``QSAIndexerPoolHost`` (same constructor), served by hicache."""

    def __init__(self, device_pool: Any, anchor_host: Any, *, allocator_type: str = "default",
                 mtp_draft_device_pools: tuple[Any, ...] = ()) -> None:  # fmt: skip
        page_size = anchor_host.page_size
        ratio = device_pool.qsa_compress_ratio
        if page_size % ratio:
            raise ValueError("QSA HiCache pages must be divisible by the compress ratio")
        pools = (device_pool, *mtp_draft_device_pools)
        buffers = [b for pool in pools for b in pool.qsa_compressed_k_buffer_pool]
        if not buffers:
            raise ValueError("QSA HiCache requires at least one local indexer layer")
        item_bytes = buffers[0][0].nbytes * (page_size // ratio)
        if any(pool.qsa_compress_ratio != ratio
               or any(b[0].nbytes * (page_size // ratio) != item_bytes for b in pool.qsa_compressed_k_buffer_pool)
               for pool in pools):  # fmt: skip
            raise ValueError("Packed QSA indexer pools must share the same page shape")
        super().__init__(pool_name="qsa_indexer", device_buffers=[b.view(torch.uint8).reshape(-1, item_bytes)
                                                                  for b in buffers],
                         item_bytes=item_bytes, num_host_pages=anchor_host.page_num, slot_page_size=page_size,
                         layout=anchor_host.layout, pin_memory=anchor_host.pin_memory, allocator_type=allocator_type,
                         page_aligned_only=True)  # fmt: skip
        self.device_pool = device_pool
        self.size_per_token = self.layer_num * item_bytes // page_size

    def get_size_per_token(self) -> int:
        return self.size_per_token

    def get_ksize_per_token(self) -> int:
        return self.size_per_token
