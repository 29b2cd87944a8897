"""KV scale sidecars of SGLang 0.5.23's block-scaled MHA pools, moved by a second hicache pool beside the payload.

``MHATokenToKVPoolMXFP8`` keeps FP8 K/V and, per layer, UE8M0 scales; at ``page_size == 128``
(``KVScaleLayout.MXFP8_INTERLEAVED``) a page's scales are one block in the FA4 interleaved
layout ``(pages, heads, 32, page_size // 32, sf_dim)``. SGLang's ``MHATokenToKVPoolMXFP8Host``
(``pool_host/mha_mxfp8.py``) moves them as whole-page rows of ``heads * page_size * sf_dim``
bytes into ``k_scale_host`` / ``v_scale_host`` of ``(pages, layers, sf_page_bytes)``, beside the
page_first payload, with the payload's indices. :class:`SGLangScaledMHAHostPool` does the same
with hicache's ``kv_scale_pages`` kind: the scales move in the same call as their rows, on the
same pages, through hicache's plugins.

L3: SGLang's MXFP8 pool exposes no flat pages or page pointers (a page's scales live outside
``kv_buffer``). Neither does this one; both raise, and hicache's storage refuses the pool at
registration, so no page is ever stored without its scales.

``KVScaleLayout.TOKEN`` (per-slot scales: ``MHATokenToKVPoolFP4``, MXFP8 at another page size)
stays refused at construction, as SGLang's own host pool refuses it.
"""

from __future__ import annotations

from typing import Any

import torch

import hicache_core as hc
from hicache_core.pool.host_pool import HostPool
from hicache_core.pool.layer_map import LayerMap

from .errors import NotServedError
from .host_memory import sglang_budget
from .pool import SGLangMHAHostPool

#: What hicache serves for scale-carrying MHA KV, named in every refusal.
SERVED = "MXFP8 K/V with interleaved scales (page size 128), layout page_first, io backend kernel"


class ScaleView:
    """The device scale blocks as hicache's ``kv_scale_pages`` kind reads them: per layer ``(pages, bytes)`` rows."""

    pool_kind = "kv_scale_pages"

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], *, page_size: int) -> None:
        self.k_scale_device_rows = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in k]
        self.v_scale_device_rows = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in v]
        self.page_size = page_size
        self.size = self.k_scale_device_rows[0].shape[0] * page_size
        self.start_layer = 0
        self.end_layer = self.layer_num = len(k)


def check_scale_layout(info: Any, label: str) -> None:
    """Refuse per-slot scales (SGLang's host pools refuse them too), naming what would work."""
    from sglang.srt.mem_cache.device_pool_info import KVScaleLayout

    scales = info.scales
    if scales.layout != KVScaleLayout.MXFP8_INTERLEAVED:
        raise NotServedError(
            f"the device pool keeps per-slot KV scales ({scales.layout.value!r}, e.g. MHATokenToKVPoolFP4 or MXFP8 "
            f"below page size 128), which SGLang's host pools refuse too ({label}); hicache-sglang serves {SERVED}. "
            "Use --page-size 128 with the MXFP8 KV cache, or run this KV dtype without hicache_sglang.install()."
        )


def check_scales(info: Any, *, drafts: tuple, label: str) -> None:
    """Refuse, before any allocation, scales this adapter does not carry (with what would work)."""
    check_scale_layout(info, label)
    scales = info.scales
    if info.head_dim != info.v_head_dim:
        raise NotServedError(f"MXFP8 KV with head_dim != v_head_dim ({label}); SGLang refuses it as well")
    if drafts:
        raise NotServedError(f"MXFP8 KV with packed MTP draft layers ({label}); SGLang's MXFP8 host pool refuses "
                             "them as well")  # fmt: skip
    if len(scales.k) != len(info.buffers.k) or len(scales.v) != len(info.buffers.v):
        raise NotServedError(f"{len(scales.k)} K and {len(scales.v)} V scale layers for {len(info.buffers.k)} K/V "
                             f"layers ({label})")  # fmt: skip
    for t in (*scales.k, *scales.v):
        if not t.is_contiguous() or t.shape[0] * info.page_size != info.buffers.k[0].shape[0]:
            raise NotServedError(f"MXFP8 scales of shape {tuple(t.shape)} are not one contiguous block per device "
                                 f"page ({label})")  # fmt: skip


def scale_bytes_per_token(info: Any) -> int:
    """Scale bytes per token slot, all layers (SGLang's ``get_size_per_token`` adds them to the payload's)."""
    k, v = info.scales.k, info.scales.v
    return sum(t[0].nbytes for t in (*k, *v)) // info.page_size


def make_scale_core(
    info: Any, *, layout: str, io_backend: str, tokens: int, label: str, layer_map: LayerMap
) -> HostPool:
    """hicache's pool for the scales: ``tokens`` host slots, the payload's, in the payload's layout and layer map."""
    view = ScaleView(list(info.scales.k), list(info.scales.v), page_size=info.page_size)
    try:
        core = hc.make_host_pool(view, layout=layout, io_backend=io_backend, page_size=info.page_size,
                                 size=tokens, label=f"{label}: scales",
                                 host_memory_check=sglang_budget(f"scale sidecar of the {label}"),
                                 layer_map=layer_map)  # fmt: skip
    except hc.UnsupportedCombinationError as exc:
        exc.add_note(f"(the scale sidecar of the {label}; hicache-sglang serves {SERVED})")
        raise
    return core


class SGLangScaledMHAHostPool(SGLangMHAHostPool):
    """``MHATokenToKVPoolMXFP8Host``: the FP8 K/V payload (hicache's ``mha`` pool) plus its scale sidecar.

    Attributes SGLang's MXFP8 host pool has: ``k_scale_host``, ``v_scale_host``
    ``(pages, layers, sf_page_bytes)``, their per-layer views ``k_scale_host_layers`` /
    ``v_scale_host_layers``, ``k_sf_page_bytes``, ``v_sf_page_bytes``, and the device rows
    ``k_scale_device_rows`` / ``v_scale_device_rows``.
    """

    #: hicache's storage refuses this pool: its L3 pages would lack their scales.
    l3_refusal = ("MXFP8 KV host pools expose no flat storage (L3) pages: a page's UE8M0 scales live outside "
                  "kv_buffer (SGLang's MXFP8 host pool has none either); run without a storage backend")  # fmt: skip

    def __init__(self, core: Any, *, scale_core: Any, **kw: Any) -> None:
        super().__init__(core, **kw)
        self.scales = scale_core
        scale_view = scale_core.device_pool
        self.k_sf_page_bytes = scale_view.k_scale_device_rows[0].shape[1]
        self.v_sf_page_bytes = scale_view.v_scale_device_rows[0].shape[1]
        self.k_scale_device_rows = scale_view.k_scale_device_rows
        self.v_scale_device_rows = scale_view.v_scale_device_rows
        self.size_per_token = self.get_size_per_token()

    @property
    def k_scale_host(self) -> torch.Tensor:
        return self.scales.k_scale_host

    @property
    def v_scale_host(self) -> torch.Tensor:
        return self.scales.v_scale_host

    @property
    def k_scale_host_layers(self) -> list[torch.Tensor]:
        return list(self.k_scale_host.transpose(0, 1))

    @property
    def v_scale_host_layers(self) -> list[torch.Tensor]:
        return list(self.v_scale_host.transpose(0, 1))

    def get_size_per_token(self) -> int:
        return self.core.get_size_per_token() + (self.k_sf_page_bytes + self.v_sf_page_bytes) // self.page_size * (
            self.layer_num
        )

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        """One layer's K/V rows, then its K and V scale blocks, host -> device, on the same pages."""
        if is_draft:
            raise NotImplementedError("MXFP8 KV host pool has no draft layers.")
        self.core.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)
        self.scales.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Every layer's K/V rows, then every layer's scale blocks, device -> host, on the same pages."""
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        self.scales.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def _storage_pages_unsupported(self) -> NotImplementedError:
        return NotImplementedError(self.l3_refusal)

    def get_data_page(self, index: int, flat: bool = True):
        raise self._storage_pages_unsupported()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise self._storage_pages_unsupported()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise self._storage_pages_unsupported()

    def get_page_buffer_meta(self, indices: torch.Tensor):
        raise self._storage_pages_unsupported()

    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor, split_factor: int):
        raise self._storage_pages_unsupported()

    def get_page_buffer_element_size(self, split_factor: int = 1):
        raise self._storage_pages_unsupported()

    def get_contiguous_buf_infos(self):
        raise self._storage_pages_unsupported()

    def destroy(self) -> None:
        self.scales.destroy()
        super().destroy()
