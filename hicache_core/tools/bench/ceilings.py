"""The ceilings ``hicache bench`` measures beside its transfers: what the link gives each way of copying.

- ``memcpy``: the copy engine moving one contiguous pinned buffer (``cudaMemcpyAsync``), the
  ceiling every fraction in the bench divides by (2 GiB), and the same at each transfer's own
  byte count (a 4.7 MB copy pays a fixed cost a 2 GiB one hides).
- ``sm``: GPU threads copying one contiguous buffer through UVA (:mod:`hicache_core.gpu.stream_copy`),
  the best of a few launch shapes: the most any SM-driven copy can reach on this machine, with no
  indices and no address arithmetic. hicache's kernels and SGLang's are SM-driven copies, so this,
  not the copy engine, bounds them; with 8 CTAs and with one CTA per SM or more.

All are timed on the queued clock (:func:`hicache_core.tools.bench.clock.queued_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...gpu.uva import make_anchor
from .clock import queued_seconds

#: Launch shapes of the streaming copy tried for the SM ceiling: (CTAs per SM or an absolute count, warps, words
#: per iteration). ``"sm"`` multiplies by the SM count.
SHAPES: tuple[tuple[Any, int, int], ...] = (
    (8, 8, 2048), (8, 8, 8192), (8, 16, 8192), (8, 32, 16384),
    ("1sm", 8, 2048), ("1sm", 8, 8192), ("2sm", 8, 4096), ("4sm", 4, 2048), ("4sm", 8, 8192),
)  # fmt: skip
WORD = 8  # bytes: the kernel moves int64 words


class SMCopy:
    """The streaming copy between a pinned host buffer and a device buffer of ``nbytes`` (a multiple of 128 KiB)."""

    def __init__(self, nbytes: int, device: torch.device | str = "cuda") -> None:
        from ...gpu.stream_copy import stream_copy

        if nbytes % (16384 * WORD):
            raise ValueError(f"nbytes must be a multiple of {16384 * WORD}, got {nbytes}")
        self.kernel = stream_copy
        self.nbytes, self.words = nbytes, nbytes // WORD
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self.host = torch.empty(self.words, dtype=torch.int64, pin_memory=pinned)
        self.dev = torch.empty(self.words, dtype=torch.int64, device=self.device)
        self.anchor = make_anchor(self.device)
        base = self.anchor.data_ptr()
        self.host_off = (self.host.data_ptr() - base) // WORD
        self.dev_off = (self.dev.data_ptr() - base) // WORD
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if pinned else 4

    def ctas(self, shape: Any) -> int:
        return shape if isinstance(shape, int) else int(shape.removesuffix("sm")) * self.sms

    def call(self, to_device: bool, shape: tuple[Any, int, int]) -> Callable[[], None]:
        ctas, warps, block = shape
        src, dst = (self.host_off, self.dev_off) if to_device else (self.dev_off, self.host_off)
        grid = (min(self.ctas(ctas), self.words // block),)
        return lambda: self.kernel[grid](self.anchor, src, dst, self.words, BLOCK=block, num_warps=warps)


def memcpy_seconds(nbytes: int, to_device: bool, reps: int = 8) -> float:
    """GPU seconds per contiguous pinned copy of ``nbytes`` by the copy engine, queued."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if to_device else (dev, host)
    return queued_seconds([lambda: dst.copy_(src, non_blocking=True)] * reps)


def sm_ceiling(nbytes: int, link: dict[str, float], shapes=SHAPES) -> list[dict]:
    """Rows of the SM-driven copy at ``nbytes``: each launch shape, each direction, as a fraction of ``link``."""
    copy = SMCopy(nbytes)
    rows = []
    for to_device in (True, False):
        ceiling = link["h2d_gbps"] if to_device else link["d2h_gbps"]
        for shape in shapes:
            call = copy.call(to_device, shape)
            seconds = queued_seconds([call] * 6)
            gbps = nbytes / seconds / 1e9
            rows.append({"metric": "sm_copy", "direction": "h2d" if to_device else "d2h", "bytes": nbytes,
                         "ctas": copy.ctas(shape[0]), "num_warps": shape[1], "block_words": shape[2],
                         "gbps": gbps, "fraction_of_ceiling": gbps / ceiling})  # fmt: skip
    del copy
    return rows


def best(rows: list[dict], direction: str, max_ctas: int | None = None) -> dict | None:
    """The fastest SM-copy row of a direction, at most ``max_ctas`` CTAs if given."""
    fit = [r for r in rows if r["direction"] == direction and (max_ctas is None or r["ctas"] <= max_ctas)]
    return max(fit, key=lambda r: r["gbps"]) if fit else None


def ceilings_at_sizes(sizes: list[int], link: dict[str, float], shapes=SHAPES) -> list[dict]:
    """At each transfer size: the copy engine, and the best SM copy with <= 8 CTAs and unlimited."""
    rows = []
    for nbytes in sorted(set(sizes)):
        padded = -(-nbytes // (16384 * WORD)) * (16384 * WORD)
        sm_rows = sm_ceiling(padded, link, shapes)
        for to_device, direction in ((True, "h2d"), (False, "d2h")):
            ceiling = link["h2d_gbps"] if to_device else link["d2h_gbps"]
            engine = nbytes / memcpy_seconds(nbytes, to_device) / 1e9
            row = {"metric": "ceiling_at_size", "direction": direction, "bytes": nbytes,
                   "memcpy_fraction": engine / ceiling}  # fmt: skip
            for label, cap in (("sm_8ctas", 8), ("sm_any", None)):
                top = best(sm_rows, direction, cap)
                row[f"{label}_fraction"] = top["fraction_of_ceiling"]
                row[f"{label}_shape"] = [top["ctas"], top["num_warps"], top["block_words"]]
            rows.append(row)
    return rows
