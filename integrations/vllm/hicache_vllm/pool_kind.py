"""vLLM's KV page as a hicache pool kind: one byte row per (layer, block).

vLLM's OffloadingConnector hands a spec each layer's KV cache as a ``[num_blocks, page_bytes]``
int8 view (``CanonicalKVCaches``): a block of one layer is one opaque page, whatever its interior
(on vLLM's CPU attention backend ``[kv_head][K | V]``, see :mod:`hicache_vllm.page_oracle`). So
the kind is a page-item kind: hicache moves whole rows as bytes, and every layout and io backend
that computes addresses from the declaration serves it with no change to the core.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_core import ComponentDecl, PoolKind, hookimpl
from hicache_core.declared.pool_kinds import has_layers

from .errors import NotServedError

#: The device attribute holding the per-layer ``[num_blocks, page_bytes]`` byte views.
DEVICE_ATTR = "vllm_kv_pages"

VLLM_PAGE = PoolKind(
    "vllm_page",
    (ComponentDecl("page", DEVICE_ATTR, "kv_buffer", (64,)),),
    item="page",
    detect=has_layers(DEVICE_ATTR),
    layouts=frozenset({"layer_first", "page_first", "page_first_direct"}),
    description="vLLM's KV page: one byte row per block and layer ([num_blocks, page_bytes], any attention kind)",
)


@hookimpl
def hicache_register_pool_kinds(register) -> None:
    register(VLLM_PAGE)


class VllmPagePool:
    """vLLM's per-layer KV pages, shaped as hicache's device pools of kind ``vllm_page``.

    :param pages: one ``[num_blocks, page_bytes]`` tensor per layer (int8 or uint8, contiguous,
        same shape and device); held as uint8 views of the same memory.
    :param block_size: tokens per vLLM block (hicache's ``page_size``: one row is one whole page).

    It has no ``size``: vLLM sizes its host tier in bytes (``cpu_bytes_to_use``), which may hold
    fewer blocks than the device, so hicache's "host at least as large as the device" rule does not apply.
    """

    pool_kind = VLLM_PAGE.name

    def __init__(self, pages: Sequence[torch.Tensor], block_size: int) -> None:
        pages = list(pages)
        if not pages:
            raise NotServedError("vLLM registered no KV cache layers to offload")
        first = pages[0]
        views = []
        for i, t in enumerate(pages):
            if t.dim() != 2 or t.dtype not in (torch.int8, torch.uint8):
                raise NotServedError(f"layer {i}: vLLM's page view must be a 2-D int8 tensor, got {t.dtype} "
                                     f"{tuple(t.shape)}")  # fmt: skip
            if t.shape != first.shape or t.device != first.device:
                raise NotServedError(
                    f"layer {i}: pages of {tuple(t.shape)} on {t.device}, layer 0 has {tuple(first.shape)} on "
                    f"{first.device}; hicache-vllm serves models whose layers all have one page size "
                    "(not hybrid models with several KV cache groups)"
                )
            if not t.is_contiguous():
                raise NotServedError(
                    f"layer {i}: vLLM's block rows are strided ({tuple(t.stride())}): packed cross-layer "
                    "layouts (one block holding every layer) are not served"
                )
            views.append(t.view(torch.uint8))
        self.vllm_kv_pages = views
        self.page_size = int(block_size)
        self.num_pages = int(first.shape[0])
        self.page_bytes = int(first.shape[1])
        self.dtype = torch.uint8
        self.device = first.device
        self.layer_num = len(views)
