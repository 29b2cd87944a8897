"""TEST STAND-IN for ``sgl_kernel``, on the PYTHONPATH of the end-to-end suite's servers only.

Not what users install, and not a port of sgl-kernel. SGLang 0.5.23's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports two functions from ``sgl_kernel`` at module level,
``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``) and
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``), and the package index has only
CUDA builds of sgl-kernel, which do not load on a machine without a GPU. This module gives
those two plain implementations so that SGLang can run its plain-torch layers. Other names
SGLang's CPU mode imports at module level (speculative decoding's tree kernels, ...) resolve
to functions that raise ``NotImplementedError`` naming themselves when called, so a server
path that would need one fails loudly instead of computing anything. It registers no
``torch.ops.sgl_kernel`` operator, so every sgl-kernel path SGLang probes for stays
unavailable, as on a CPU machine without sgl-kernel.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]
#: SGLang logs sgl-kernel's version in places; this says what it is.
__version__ = "0.0.0+hicache-test-standin"


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:  # fmt: skip
    """Row ``src_loc[i]`` -> row ``tgt_loc[i]`` in every buffer (``data_ptrs[b]``, ``strides[b]`` bytes a row).

    Every source row is read before any target row is written, as the kernel's gather/scatter does.
    """
    src = src_loc.to("cpu", torch.int64).tolist()
    tgt = tgt_loc.to("cpu", torch.int64).tolist()
    for base, stride in zip(data_ptrs.to("cpu").tolist(), strides.to("cpu").tolist()):
        base, stride = int(base), int(stride)
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:  # fmt: skip
    """``req_to_token[req, start:end] = `` the request's run of ``out_cache_loc`` (runs follow each other)."""
    taken = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_in_the_stand_in(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in hicache's test stand-in for sgl_kernel (only "
            f"{', '.join(__all__)} are): this server path is not one the end-to-end suite covers"
        )

    not_in_the_stand_in.__name__ = name
    return not_in_the_stand_in
