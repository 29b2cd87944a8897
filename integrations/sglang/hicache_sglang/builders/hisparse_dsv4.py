"""DeepSeek-V4's HiSparse host pool (``DeepSeekV4PagedHostPool`` as ``HiSparseCoordinator`` builds it), by hicache.

The coordinator mirrors the C4 KV sub-pool (``hisparse_kvcache.kv_buffer``): one page row of
``item_bytes`` per (layer, page) of ``slot_page_size`` compressed tokens. SGLang's page row is
``[value 0 .. value P-1][scale 0 .. scale P-1][padding]`` (its ``deepseek_v4/kvcacheio.cuh``:
576-byte values, 8-byte scales, P = 64), so a single token is two byte ranges of its row. The
coordinator moves whole pages (prefill staging of a page multiple, the direct-to-host preload)
and single tokens (``backup_tokens_from_device_all_layer`` at each decode step, staging or
preloads of a partial page).

Both go through hicache's dispatcher and plugins with one pool: the device rows and the host
rows are viewed as :data:`WORD`-byte words (every value, scale and row boundary of SGLang's
layout falls on one), hicache's ``dsv4_paged`` kind with one word per item and page size 1.
A whole page is its row's words; a token is its value's words and its scale's word. The host
buffer of that pool, ``(layers, pages x words, WORD)``, is byte for byte SGLang's ``layer_first``
``kv_buffer[layer]`` of ``(pages, item_bytes)``, which is what SGLang's decode-time swap-in
kernel (``load_cache_to_device_buffer_dsv4_mla``) reads: the same opt-in as the other HiSparse
families (:data:`~hicache_sglang.builders.hisparse.ENV_SWAP_IN`).

Cost: a word per index, so a token takes ``value/WORD + 1`` indices (73) and a page
``item_bytes/WORD`` (4680); measure it on a GPU before relying on it for long prefills.
"""

from __future__ import annotations

import torch

import hicache_core as hc
from hicache_core.pool.allocator import SlotAllocator

from ..errors import NotServedError
from ..host_memory import sglang_budget
from ..identity import describe, logger
from ..sidecar import SidecarView
from .hisparse import ENV_SWAP_IN, IO_BACKEND, _HiSparseSlots, check_swap_in

#: The byte granularity both views use: SGLang's value, scale and page boundaries are all multiples of it.
WORD = 8
#: SGLang's DSv4 C4 token (``kvcacheio.cuh``: ``kPageSize``, ``kValueBytes``, ``kScaleBytes``); its
#: token-granular copy is written for these only.
C4_PAGE_TOKENS, C4_VALUE_BYTES, C4_SCALE_BYTES = 64, 576, 8


def c4_page_bytes(page_tokens: int = C4_PAGE_TOKENS) -> int:
    """SGLang's padded C4 page row: values and scales, rounded up to whole 576-byte units."""
    return -(-(C4_VALUE_BYTES + C4_SCALE_BYTES) * page_tokens // 576) * 576


class SGLangHiSparseDSV4HostPool(_HiSparseSlots):
    """``DeepSeekV4PagedHostPool`` as the HiSparse coordinator builds it (same constructor), served by hicache.

    ``kv_buffer[layer]`` is SGLang's ``(num_host_pages, item_bytes)`` uint8 page rows; indices are
    token slots (``slot_page_size`` per page) on both sides.
    """

    def __init__(self, pool_name: str, device_buffers: list[torch.Tensor], item_bytes: int, num_host_pages: int,
                 slot_page_size: int, layout: str = "layer_first", device: str = "cpu", pin_memory: bool = True,
                 allocator_type: str = "default", page_aligned_only: bool = False) -> None:  # fmt: skip
        label = f"HiSparse DeepSeek-V4 host pool {pool_name!r}"
        check_swap_in("DeepSeek-V4")
        refused = (
            (layout != "layer_first", f"layout {layout!r} (SGLang's swap-in reads layer_first rows)"),
            (allocator_type != "default", f"the {allocator_type!r} host allocator (hicache allocates)"),
            (page_aligned_only, "page_aligned_only (the coordinator moves single tokens)"),
            (not device_buffers, "no device buffers"),
            (slot_page_size != C4_PAGE_TOKENS or item_bytes != c4_page_bytes(),
             f"pages of {slot_page_size} tokens in rows of {item_bytes} bytes (SGLang's token-granular C4 copy, "
             f"which this pool serves, is written for {C4_PAGE_TOKENS} tokens in rows of {c4_page_bytes()} bytes)"),
        )  # fmt: skip
        for bad, what in refused:
            if bad:
                raise NotServedError(f"{label}: {what} is not served")
        buffers = list(device_buffers)
        for layer, t in enumerate(buffers):
            if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != item_bytes or not t.is_contiguous():
                raise NotServedError(f"{label}: device buffer {layer} (shape {tuple(t.shape)}, dtype {t.dtype}) is "
                                     f"not contiguous uint8 page rows of {item_bytes} bytes")  # fmt: skip
        self.row_words = item_bytes // WORD
        words = [t.view(-1, WORD) for t in buffers]
        host_words = num_host_pages * self.row_words
        from hicache_core.verification.verify import ENV_VERIFY, verify_default

        if verify_default():
            raise NotServedError(f"{label}: {ENV_VERIFY} is set, but SGLang's HiSparse swap-in kernels read the "
                                 f"host pool directly, so no load could be verified. Unset {ENV_VERIFY} for "
                                 "HiSparse.")  # fmt: skip
        # The C4 device pool is HiSparse's hot buffer, not a tier the host mirrors whole: SGLang sizes the host from
        # the logical context (size_full / compress_ratio), which may be fewer pages. Device indices stay checked
        # against the device rows themselves.
        self._view = SidecarView(kind="dsv4_paged", attr="device_buffers", buffers=words, page_size=1,
                                 size=min(words[0].shape[0], host_words))  # fmt: skip
        try:
            self.core = hc.make_host_pool(self._view, layout="layer_first", io_backend=IO_BACKEND, page_size=1,
                                          size=host_words, pin_memory=pin_memory, verify=False, label=label,
                                          host_memory_check=sglang_budget(label))  # fmt: skip
        except hc.UnsupportedCombinationError as exc:
            exc.add_note(
                f"(SGLang's HiSparse coordinator asked for the {label}: layout layer_first, io backend kernel)"
            )
            raise
        self.pool_name = self.pool_label = pool_name
        self.device_buffers = buffers
        self.layer_num = len(buffers)
        self.start_layer, self.end_layer = 0, self.layer_num
        self.item_bytes = self.size_per_token = item_bytes
        self.num_host_pages = num_host_pages
        self.slot_page_size = self.page_size = slot_page_size
        self.page_num = num_host_pages
        self.size = num_host_pages * slot_page_size
        self.layout = layout
        self.dtype = torch.uint8
        self.device = device
        self.page_aligned_only = page_aligned_only
        self.allocator = SlotAllocator(self.size, slot_page_size)
        host = self.core.kv_buffer
        # SGLang's layer_first list of (pages, item_bytes) rows: the same bytes as hicache's word rows.
        self.kv_buffer = [host[i].view(num_host_pages, item_bytes) for i in range(self.layer_num)]
        self.data_refs = list(self.kv_buffer)
        # hicache's items here are WORD-byte words (its "tokens" in the identity line); SGLang's slots are C4 tokens.
        logger.info(f"{describe(self)}; items are {WORD}-byte words of {item_bytes}-byte C4 page rows "
                    f"({self.size} C4 token slots, pages of {slot_page_size}); decode swap-in: SGLang's HiSparse "
                    f"kernels read its layer_first buffers directly ({ENV_SWAP_IN}=sglang)")  # fmt: skip

    # ---- SGLang's indices -> word rows --------------------------------------------------------------

    def _offsets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        page = torch.arange(self.row_words, dtype=torch.int64, device=device)
        value = torch.arange(C4_VALUE_BYTES // WORD, dtype=torch.int64, device=device)
        return page, value

    def _page_words(self, slots: torch.Tensor) -> torch.Tensor:
        """Whole pages of token slots -> every word of their page rows."""
        rows = slots.reshape(-1, self.slot_page_size)[:, 0].to(torch.int64) // self.slot_page_size
        page, _ = self._offsets(slots.device)
        return (rows[:, None] * self.row_words + page).reshape(-1)

    def _token_words(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots -> each token's value words, then its scale word (SGLang's ``get_pointer_paged``)."""
        slots = slots.to(torch.int64)
        base = (slots // self.slot_page_size) * self.row_words
        off = slots % self.slot_page_size
        _, value = self._offsets(slots.device)
        values = base[:, None] + off[:, None] * (C4_VALUE_BYTES // WORD) + value
        scales = base + (self.slot_page_size * C4_VALUE_BYTES + off * C4_SCALE_BYTES) // WORD
        return torch.cat([values, scales[:, None]], dim=1).reshape(-1)

    def _whole_pages(self, slots: torch.Tensor) -> bool:
        p = self.slot_page_size
        if slots.numel() % p:
            return False
        pages = slots.reshape(-1, p).to(torch.int64)
        return bool(((pages[:, 0] % p == 0)
                     & (pages == pages[:, :1] + torch.arange(p, device=slots.device)).all(dim=1)).all())  # fmt: skip

    def _words(self, host_indices, device_indices, *, tokens: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        if host_indices is None or device_indices is None:
            return None
        if host_indices.numel() != device_indices.numel():
            raise ValueError(f"{self.pool_name} transfer index size mismatch: host={host_indices.numel()}, "
                             f"device={device_indices.numel()}")  # fmt: skip
        if host_indices.numel() == 0:
            return None
        if not tokens and self._whole_pages(host_indices) and self._whole_pages(device_indices):
            # Whole pages move whole rows (padding included), as SGLang's page-row copy does.
            return self._page_words(host_indices), self._page_words(device_indices)
        return self._token_words(host_indices), self._token_words(device_indices)

    # ---- what the coordinator calls -----------------------------------------------------------------

    def _device(self, device_pool) -> None:
        theirs = getattr(device_pool, "kv_buffer", None)
        if theirs is None or [t.data_ptr() for t in theirs] != [t.data_ptr() for t in self.device_buffers]:
            raise ValueError(f"device_pool {type(device_pool).__name__} does not hold the C4 buffers this HiSparse "
                             "host pool was built from")  # fmt: skip

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Every layer: whole pages as page rows, anything else token by token (SGLang's rule)."""
        self._device(device_pool)
        words = self._words(host_indices, device_indices, tokens=False)
        if words is not None:
            self.core.backup_from_device_all_layer(self._view, words[0], words[1], io_backend)

    def backup_tokens_from_device_all_layer(self, host_indices, device_indices) -> None:
        """Every layer, token by token (the decode step's one new compressed token per request)."""
        words = self._words(host_indices, device_indices, tokens=True)
        if words is not None:
            self.core.backup_from_device_all_layer(self._view, words[0], words[1], IO_BACKEND)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        """Layer ``layer_id`` (the C4 pool's own layer), host to device, by SGLang's rule."""
        if is_draft:
            raise ValueError(f"{self.pool_name} has no draft layers")
        self._device(device_pool)
        layer = int(layer_id)
        if not 0 <= layer < self.layer_num:
            raise IndexError(f"layer_id {layer_id} is outside the {self.pool_name} host pool's {self.layer_num} layers")
        words = self._words(host_indices, device_indices, tokens=False)
        if words is not None:
            self.core.load_to_device_per_layer(self._view, words[0], words[1], layer, io_backend)

    # ---- SGLang's other members ---------------------------------------------------------------------

    def get_size_per_token(self) -> int:
        return self.item_bytes

    def get_ksize_per_token(self) -> int:
        return self.item_bytes

    def init_kv_buffer(self) -> list[torch.Tensor]:
        return self.kv_buffer

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return self.kv_buffer

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer: pointer, bytes, and bytes per page row (PD direct-to-host registers these)."""
        return ([t.data_ptr() for t in self.kv_buffer], [t.nbytes for t in self.kv_buffer],
                [self.item_bytes] * self.layer_num)  # fmt: skip

    def destroy(self) -> None:
        self.core.destroy()
