"""HiSparse's host pools (``managers/hisparse_coordinator.py`` of SGLang 0.5.23), built by hicache.

``HiSparseCoordinator.__init__`` builds its host pool itself, from names in its own module:
``MLATokenToKVPoolHost`` for DSA models (DeepSeek-V3.2, GLM-5), ``HiSparseMHATokenToKVPoolHost``
for MiniMax-M3 and ``DeepSeekV4PagedHostPool`` for DeepSeek-V4. The adapter puts
:class:`SGLangHiSparseMLAHostPool` and :class:`SGLangHiSparseMHAHostPool` in place of the first
two (same constructors), and :class:`~hicache_sglang.builders.hisparse_dsv4.SGLangHiSparseDSV4HostPool`
in place of the third (its decode backup copies single tokens out of C4 page rows, a token being
two byte ranges: that module says how hicache moves them).

What the coordinator calls on its host pool, and how these pools answer:

- the HiSparse mixin's page-granular allocation (``alloc_page``, ``alloc_paged_token_slots``,
  ``allocated_host_indices``) and ``alloc``/``free``/``available_size``/``size``: whole pages of
  SGLang's page size, from hicache's slot allocator (double frees refused);
- ``backup_from_device_all_layer`` (prefill staging, decode eager backup, speculative commits)
  and ``load_to_device_per_layer`` (the direct-to-host preload, ``naive_load_topk``): token
  slots on both sides, **token-granular** (the device side is the HiSparse hot buffer, whose
  slots are single tokens), so the hicache pool underneath has page size 1 and every transfer
  goes through hicache's dispatcher and plugins (io backend ``kernel``, as the coordinator asks);
- ``kv_buffer[layer]`` / ``k_buffer[layer]``, ``v_buffer[layer]`` and ``token_stride_size``, in
  SGLang's ``layer_first`` shapes: the coordinator hands them to SGLang's decode-time swap-in
  kernels (``load_cache_to_device_buffer_mla``, ``load_blocks_to_device_buffer_mha``,
  ``copy_cache_planned_mla``, the speculative variant), which fuse the hot buffer's LRU
  bookkeeping with the gather of the misses from host memory. That gather cannot go through a
  host pool's transfer API without rewriting SGLang's kernel (its misses are known only on the
  GPU, inside a CUDA graph), so those reads are SGLang's, of hicache's bytes. That is half
  hicache and half SGLang, so it is refused unless asked for: :data:`ENV_SWAP_IN` ``=sglang``
  says so, and the pool's log line names it.
"""

from __future__ import annotations

from typing import Any

import torch

import hicache_core as hc
from hicache_core.pool.allocator import SlotAllocator

from ..errors import NotServedError
from ..host_memory import sglang_budget
from ..identity import describe, logger
from ..layers import device_layers
from ..pool import DeviceView, SGLangMHAHostPool, SGLangMLAHostPool
from ..variables import HISPARSE_SWAP_IN

#: ``sglang`` lets SGLang's HiSparse swap-in kernels read hicache's host pool (unset: HiSparse is refused).
SWAP_IN = HISPARSE_SWAP_IN
ENV_SWAP_IN = SWAP_IN.name
#: The io backend SGLang's coordinator passes on every call (its pools accept no other).
IO_BACKEND = "kernel"


def check_swap_in(family: str) -> None:
    """Refuse HiSparse unless :data:`ENV_SWAP_IN` accepts SGLang's swap-in kernels on hicache's bytes.

    :raises NotServedError: the variable is unset.
    :raises hicache_core.settings.SettingError: it holds anything but ``sglang``.
    """
    if SWAP_IN.read() == "sglang":
        return
    raise NotServedError(
        f"--enable-hisparse ({family}): hicache-sglang builds HiSparse's host pool and moves its backups and "
        "preloads, but the decode-time swap-in (load_cache_to_device_buffer_mla / load_blocks_to_device_buffer_mha, "
        "copy_cache_planned_mla) is SGLang's kernel reading the host buffer directly, which hicache cannot take "
        f"over. Set {ENV_SWAP_IN}=sglang to accept that split, or run without hicache_sglang.install()."
    )


def _log(pool: Any) -> None:
    """The identity line, naming what stays SGLang's."""
    logger.info(f"{describe(pool)}; decode swap-in: SGLang's HiSparse kernels read its layer_first buffers directly "
                f"({ENV_SWAP_IN}=sglang)")  # fmt: skip


def _host_tokens(device_capacity_tokens: int, host_to_device_ratio: float, host_size: float, page_size: int) -> int:
    """SGLang's ``HostKVCache`` sizing: ``host_size`` GB is not used by HiSparse, so ratio times device, plus a page."""
    if host_size:
        raise NotServedError(f"HiSparse host pool with host_size={host_size} GB: the coordinator passes 0 (ratio only)")
    tokens = int(device_capacity_tokens * host_to_device_ratio)
    return (tokens // page_size + 1) * page_size


class _HiSparseSlots:
    """The HiSparse mixin's members: host slots in whole pages of SGLang's page size, moved as single tokens."""

    allocator: SlotAllocator
    page_size: int
    #: The device pool the coordinator passes, accepted by ``_bind`` at its first call.
    _device_pool: Any = None

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        return self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def clear(self) -> None:
        self.allocator.clear()

    def _round_up_to_page_size(self, size: int) -> int:
        return -(-size // self.page_size) * self.page_size

    def alloc_page(self, num_pages: int) -> torch.Tensor | None:
        return self.alloc(num_pages * self.page_size)

    def alloc_paged_token_slots(self, req_to_host_pool: torch.Tensor, req_to_host_pool_allocated_len: torch.Tensor,
                                req_pool_idx: int, start_pos: int, num_tokens: int) -> torch.Tensor:  # fmt: skip
        """Host slots for positions ``start_pos .. +num_tokens`` of a request, allocating whole pages as needed.

        The request's row of ``req_to_host_pool`` holds its slots by position; pages are added
        when the range passes the allocated length. Returns that row's slots for the range.
        """
        device = req_to_host_pool.device
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64, device=device)
        allocated = int(req_to_host_pool_allocated_len[req_pool_idx])
        end = start_pos + num_tokens
        if start_pos > allocated:
            raise ValueError(f"HiSparse host slots for request {req_pool_idx} start at {start_pos}, past its "
                             f"{allocated} allocated positions")  # fmt: skip
        page_end = self._round_up_to_page_size(end)
        if page_end > allocated:
            pages = (page_end - allocated) // self.page_size
            slots = self.alloc_page(pages)
            if slots is None:
                raise RuntimeError(f"HiSparse host mem pool alloc failed for {pages} pages")
            req_to_host_pool[req_pool_idx, allocated:page_end] = slots.to(device=device, non_blocking=True)
            req_to_host_pool_allocated_len[req_pool_idx] = page_end
        return req_to_host_pool[req_pool_idx, start_pos:end]

    def allocated_host_indices(self, req_to_host_pool: torch.Tensor, req_pool_idx: int,
                               allocated_len: int) -> torch.Tensor:  # fmt: skip
        """Every host slot a request holds (its whole pages), for freeing."""
        length = min(self._round_up_to_page_size(int(allocated_len)), req_to_host_pool.shape[1])
        row = req_to_host_pool[req_pool_idx, :length]
        return row[row >= 0]

    def _bind(self, device_pool: Any, buffers: list[torch.Tensor]) -> None:
        """Accept the device pool whose buffers this pool was built from (the coordinator passes it per call)."""
        if device_pool is self._device_pool:
            return
        theirs = _device_tensors(device_pool)
        if [t.data_ptr() for t in theirs] != [t.data_ptr() for t in buffers]:
            raise ValueError(f"device_pool {type(device_pool).__name__} does not hold the buffers this HiSparse host "
                             "pool was built from")  # fmt: skip
        self._device_pool = device_pool


def _device_tensors(device_pool: Any) -> list[torch.Tensor]:
    info = device_pool.get_device_pool_infos()[0].buffer_info
    buffers = info.buffers
    if hasattr(buffers, "k"):
        return list(buffers.k) + list(buffers.v)
    return list(buffers)


def _core(view: DeviceView, tokens: int, bytes_per_token: int, label: str, pin_memory: bool, layers: int):
    from hicache_core.verification.verify import ENV_VERIFY, verify_default

    if verify_default():
        # The swap-in reads host rows straight into the hot buffer, past hicache's checked load path.
        raise NotServedError(
            f"{label}: {ENV_VERIFY} is set, but SGLang's HiSparse swap-in kernels read the host pool directly, so no "
            f"load could be verified. Unset {ENV_VERIFY} for HiSparse."
        )
    try:
        return hc.make_host_pool(view, layout="layer_first", io_backend=IO_BACKEND, page_size=1, size=tokens,
                                 pin_memory=pin_memory, verify=False, label=label,
                                 host_memory_check=sglang_budget(label),
                                 # any device pool: _bind checks that it holds the buffers the pool was built from
                                 layer_map=device_layers(None, device_layer_num=layers,
                                                         kept=range(layers)))  # fmt: skip
    except hc.UnsupportedCombinationError as exc:
        exc.add_note(f"(SGLang's HiSparse coordinator asked for the {label}: layout layer_first, io backend kernel)")
        raise


class SGLangHiSparseMLAHostPool(_HiSparseSlots, SGLangMLAHostPool):
    """``MLATokenToKVPoolHost`` as the HiSparse coordinator builds it (DSA models), served by hicache's ``mla`` kind.

    ``layer_id`` is the device pool's local layer; ``kv_buffer`` is ``(layers, slots, 1, kv_cache_dim)``.
    """

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, host_size: float, page_size: int, layout: str,
                 pin_memory: bool = True, device: str = "cpu", allocator_type: str = "default",
                 override_kv_cache_dim: int | None = None, draft_buffer_infos=(), dcp_size: int = 1, dcp_rank: int = 0,
                 *, device_capacity_tokens: int, start_layer: int, end_layer: int, target_layer_num: int,
                 layer_shard_enabled: bool = False, pool_label: str = "hisparse",
                 host_token_capacity: int | None = None) -> None:  # fmt: skip
        label = "HiSparse MLA host pool"
        check_swap_in("MLA models")
        refused = {
            "layout": (layout != "layer_first", f"layout {layout!r} (SGLang's swap-in reads layer_first rows)"),
            "allocator_type": (allocator_type != "default", f"the {allocator_type!r} host allocator"),
            "draft_buffer_infos": (bool(draft_buffer_infos), "packed draft layers"),
            "dcp": (dcp_size != 1, "decode context parallelism"),
            "layer_shard": (layer_shard_enabled, "layer-split device pools"),
            "host_token_capacity": (host_token_capacity is not None, "a fixed host token capacity"),
            "scales": (buffer_info.scales is not None, "FP4 block scales beside the rows"),
            "split": (not isinstance(buffer_info.buffers, tuple), "native split MLA buffers"),
        }
        for _, (bad, what) in refused.items():
            if bad:
                raise NotServedError(f"{label}: {what} is not served")
        buffer_info.validate()
        kv_dim = override_kv_cache_dim or buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim
        layers = list(buffer_info.layer_indices)
        if layers != list(range(buffer_info.device_layer_num)) or len(layers) != target_layer_num:
            raise NotServedError(f"{label}: device layers {layers} are not the pool's {target_layer_num} local layers")
        buffers = list(buffer_info.buffers)
        if any(t.dim() != 3 or not t.is_contiguous() or t.shape[1:] != (1, kv_dim) for t in buffers):
            raise NotServedError(f"{label}: device rows are not contiguous [rows, 1, {kv_dim}] per layer")
        first = int(start_layer or 0)
        extras = {"kv_lora_rank": buffer_info.kv_lora_rank, "qk_rope_head_dim": buffer_info.qk_rope_head_dim}
        view = DeviceView(kind="mla", buffers={"kv_buffer": buffers}, page_size=1, size=device_capacity_tokens,
                          first_layer=first, owned=range(len(layers)), device_layer_num=len(layers),
                          extras=extras)  # fmt: skip
        tokens = _host_tokens(device_capacity_tokens, host_to_device_ratio, host_size, page_size)
        core = _core(view, tokens, buffers[0][0].nbytes * len(buffers), label, pin_memory, len(layers))
        super().__init__(core, kv_lora_rank=buffer_info.kv_lora_rank, qk_rope_head_dim=buffer_info.qk_rope_head_dim,
                         kv_cache_dim=kv_dim, packed_fp8=buffer_info.packed_fp8, sglang_start_layer=start_layer,
                         sglang_end_layer=end_layer,
                         device_capacity_tokens=device_capacity_tokens, pool_label=pool_label)  # fmt: skip
        self._buffers = buffers
        self.page_size = page_size
        self.page_num = tokens // page_size
        self.allocator = SlotAllocator(tokens, page_size)
        _log(self)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer: pointer, bytes, and bytes per SGLang page (PD decode registers these for direct-to-host)."""
        layers = [self.kv_buffer[i] for i in range(self.layer_num)]
        return ([t.data_ptr() for t in layers], [t.nbytes for t in layers],
                [self.token_stride_size * self.page_size] * self.layer_num)  # fmt: skip

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        self._bind(device_pool, self._buffers)
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                         is_draft=is_draft)  # fmt: skip

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        self._bind(device_pool, self._buffers)
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)


class SGLangHiSparseMHAHostPool(_HiSparseSlots, SGLangMHAHostPool):
    """``HiSparseMHATokenToKVPoolHost`` (MiniMax-M3's main KV), served by hicache's ``mha`` kind.

    As SGLang's: ``layer_id`` is the model's layer (``device_pool.start_layer`` and up), io backend
    ``kernel`` only, no draft layers; ``k_buffer``/``v_buffer`` are ``(layers, slots, heads, head_dim)``.
    """

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, page_size: int, *, device_capacity_tokens: int,
                 start_layer: int, end_layer: int) -> None:  # fmt: skip
        from sglang.srt.mem_cache.device_pool_info import KVBufferLayout

        label = "HiSparse MHA host pool"
        check_swap_in("MHA models: MiniMax-M3")
        buffer_info.validate()
        if buffer_info.scales is not None or buffer_info.transfer_buffers is not None:
            raise NotServedError(f"{label}: KV scales or relocated K/V backings are not served")
        if buffer_info.buffers.layout != KVBufferLayout.NHD:
            raise NotServedError(f"{label}: K/V stored as {buffer_info.buffers.layout.value}; hicache serves NHD rows")
        k, v = list(buffer_info.buffers.k), list(buffer_info.buffers.v)
        if buffer_info.head_dim != buffer_info.v_head_dim:
            raise NotServedError(f"{label}: head_dim {buffer_info.head_dim} != v_head_dim {buffer_info.v_head_dim}")
        if any(t.dim() != 3 or not t.is_contiguous() for t in k + v):
            raise NotServedError(f"{label}: device K/V are not contiguous [rows, heads, head_dim] per layer")
        first = int(start_layer or 0)
        if end_layer - first != len(k):
            raise NotServedError(f"{label}: layers {first}..{end_layer} are not the device pool's {len(k)} layers")
        view = DeviceView(kind="mha", buffers={"k_buffer": k, "v_buffer": v}, page_size=1, size=device_capacity_tokens,
                          first_layer=first, owned=range(len(k)), device_layer_num=len(k), extras={})  # fmt: skip
        tokens = _host_tokens(device_capacity_tokens, host_to_device_ratio, 0, page_size)
        core = _core(view, tokens, (k[0][0].nbytes + v[0][0].nbytes) * len(k), label, True, len(k))
        super().__init__(core, sglang_start_layer=start_layer, sglang_end_layer=end_layer,
                         device_capacity_tokens=device_capacity_tokens, pool_label="hisparse")  # fmt: skip
        self._buffers = k + v
        self.page_size = page_size
        self.page_num = tokens // page_size
        self.allocator = SlotAllocator(tokens, page_size)
        _log(self)

    @staticmethod
    def _kernel_only(io_backend: str, is_draft: bool = False) -> None:
        if io_backend != IO_BACKEND or is_draft:
            raise ValueError("MiniMax M3 HiSparse host transfers require the kernel backend.")

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        self._kernel_only(io_backend, is_draft)
        self._bind(device_pool, self._buffers)
        # SGLang's M3 pool takes the model's layer id; the base class takes the device pool's local one.
        super().load_to_device_per_layer(device_pool, host_indices, device_indices,
                                         int(layer_id) - int(device_pool.start_layer), io_backend)  # fmt: skip

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        self._kernel_only(io_backend)
        self._bind(device_pool, self._buffers)
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer, K then V: pointer, bytes, and bytes per page (SGLang's HiSparse MHA answer)."""
        buffers = list(self.k_buffer) + list(self.v_buffer)
        return ([b.data_ptr() for b in buffers], [b.nbytes for b in buffers],
                [b[0].nbytes * self.page_size for b in buffers])  # fmt: skip
