"""SGLang's own transfer kernels, timed beside hicache in ``hicache bench`` (the SGLang baseline).

SGLang moves KV pages with sgl-kernel's ``transfer_kv_*`` functions (``sgl_kernel.kvcacheio``).
Where that module imports, ``hicache bench`` calls them on the very pools and index tensors it
times hicache on, after checking byte for byte that each call moved what hicache's oracle says
it should (so a wrong argument shows up as a refused row, not as a fast one). Where it does not
import, every anchor row is skipped, with the import error as the reason.

``HICACHE_BENCH_ANCHOR`` (or ``hicache bench --anchor-module``) names another module with the
same functions and signatures, such as a build of SGLang's ``transfer.cu`` from source
(``benchmarks/sgl_anchor/build.py``) on a machine where sgl-kernel's wheel cannot load.

What is called, from SGLang's host pools (``sglang/srt/mem_cache/memory_pool_host.py``):

| pool, layout | per-layer load | all-layer backup |
|---|---|---|
| MLA, layer_first | ``transfer_kv_per_layer_mla`` | ``transfer_kv_all_layer_mla`` (pointer tables) |
| MLA, page_first | ``transfer_kv_per_layer_mla_pf_lf`` | ``transfer_kv_all_layer_mla_lf_pf`` |
| MHA, layer_first | ``transfer_kv_per_layer`` | ``transfer_kv_all_layer`` (pointer tables) |
| MHA, page_first | ``transfer_kv_per_layer_pf_lf`` | ``transfer_kv_all_layer_lf_pf`` |

Sizes are in bytes: ``item_size`` is one token's bytes in one layer and part, a page_first
``layout_dim`` one token's bytes across every layer. Indices are token slots, int64, on the GPU.
SGLang's budget is ``block_quota`` blocks of ``num_warps_per_block`` warps (defaults 2 and 32).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...plugins.implementation import BACKUP_ALL, LOAD
from ...settings.variables import BENCH_ANCHOR

#: Where SGLang's functions are looked for when nothing else is named.
DEFAULT_MODULE = "sgl_kernel.kvcacheio"
ENV_MODULE = BENCH_ANCHOR.name
#: SGLang's default launch shape, then hicache's budget, then one block per SM (``None``).
BLOCK_QUOTAS: tuple[int | None, ...] = (2, 8, None)
WARPS_PER_BLOCK = 32
#: SGLang's function per (pool kind, layout, operation).
FUNCTIONS: dict[tuple[str, str, str], str] = {
    ("mla", "layer_first", LOAD): "transfer_kv_per_layer_mla",
    ("mla", "page_first", LOAD): "transfer_kv_per_layer_mla_pf_lf",
    ("mha", "layer_first", LOAD): "transfer_kv_per_layer",
    ("mha", "page_first", LOAD): "transfer_kv_per_layer_pf_lf",
    ("mla", "layer_first", BACKUP_ALL): "transfer_kv_all_layer_mla",
    ("mla", "page_first", BACKUP_ALL): "transfer_kv_all_layer_mla_lf_pf",
    ("mha", "layer_first", BACKUP_ALL): "transfer_kv_all_layer",
    ("mha", "page_first", BACKUP_ALL): "transfer_kv_all_layer_lf_pf",
}


@dataclass
class Anchor:
    """SGLang's transfer functions as found in this process, or why there are none."""

    module: str
    functions: Any = None  # the imported module
    why_not: str | None = None

    @property
    def available(self) -> bool:
        return self.functions is not None

    def describe(self) -> dict[str, Any]:
        """What the bench's JSON records about the anchor."""
        if not self.available:
            return {"module": self.module, "status": "skipped", "why": self.why_not}
        origin = getattr(self.functions, "__file__", None)
        return {"module": self.module, "status": "available", "file": origin,
                "functions": sorted(n for n in dir(self.functions) if n.startswith("transfer_kv"))}  # fmt: skip


def find_anchor(module: str | None = None) -> Anchor:
    """Import SGLang's functions from ``module`` (default: ``$HICACHE_BENCH_ANCHOR``, else sgl-kernel's)."""
    name = module or BENCH_ANCHOR.read() or DEFAULT_MODULE
    try:
        found = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure to import means: no anchor in this run, and why
        return Anchor(name, why_not=f"{name} does not import here ({type(exc).__name__}: {exc})")
    missing = sorted({f for f in FUNCTIONS.values() if not callable(getattr(found, f, None))})
    if missing:
        return Anchor(name, why_not=f"{name} imports but lacks {', '.join(missing)}")
    return Anchor(name, functions=found)


class AnchorCalls:
    """SGLang's calls on one hicache bench pool: the same host buffers, device buffers and index tensors.

    ``host`` is hicache's host pool (its buffers have SGLang's host shapes), ``dev`` its device
    pool (one tensor per layer and part, SGLang's shape).
    """

    def __init__(self, anchor: Anchor, host: Any, dev: Any) -> None:
        self.fns = anchor.functions
        self.host, self.dev = host, dev
        self.kind = host.geometry.kind
        self.layout = host.layout
        self.layers = host.layer_num
        self.mla = self.kind == "mla"
        # Each part's host buffer (K and V, or MLA's one): layer_first (L, size, ...), page_first (size, L, ...);
        # and each part's device tensors, per layer.
        self.parts = [host.kv_buffer] if self.mla else [host.k_buffer, host.v_buffer]
        self.dev_layers = [list(dev.kv_buffer)] if self.mla else [list(dev.k_buffer), list(dev.v_buffer)]
        self.dev_device = self.dev_layers[0][0].device
        self._tables: dict[str, torch.Tensor] = {}

    @staticmethod
    def supports(host: Any) -> bool:
        """Whether SGLang has a kernel for this pool (MHA or MLA token pools, layer_first or page_first)."""
        return (host.geometry.kind in ("mla", "mha") and not host.geometry.items_are_pages
                and host.layout in ("layer_first", "page_first"))  # fmt: skip

    def function(self, op: str) -> str | None:
        return FUNCTIONS.get((self.kind, self.layout, op))

    # ---- the tensors SGLang's host pool would pass --------------------------------------------

    def item_size(self) -> int:
        """One token's bytes in one layer and part."""
        t = self.dev_layers[0][0]
        return t[0].numel() * t.element_size()

    def _pointer_table(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        table = self._tables.get(name)
        if table is None:
            ptrs = [t.data_ptr() for t in tensors]
            table = self._tables[name] = torch.tensor(ptrs, dtype=torch.uint64, device=self.dev_device)
        return table

    # ---- calls ----------------------------------------------------------------------------------

    def call(self, op: str, h: torch.Tensor, d: torch.Tensor, layer: int, block_quota: int,
             warps: int = WARPS_PER_BLOCK) -> Callable[[], None]:  # fmt: skip
        """A callable running SGLang's ``op`` with these token indices (int64 on the GPU)."""
        fn = getattr(self.fns, self.function(op))
        item, parts, dev = self.item_size(), self.parts, self.dev_layers
        lf = self.layout == "layer_first"
        layout_dim = item * self.layers
        if op == LOAD:
            if lf:
                srcs = [p[layer] for p in parts]
                if self.mla:
                    return lambda: fn(srcs[0], dev[0][layer], h, d, item, block_quota, warps)
                return lambda: fn(srcs[0], dev[0][layer], srcs[1], dev[1][layer], h, d, item, block_quota, warps)
            if self.mla:
                return lambda: fn(parts[0], dev[0][layer], h, d, layer, item, layout_dim, block_quota, warps)
            return lambda: fn(parts[0], dev[0][layer], parts[1], dev[1][layer], h, d, layer, item, layout_dim,
                              block_quota, warps)  # fmt: skip
        # All-layer backup: device layers through pointer tables; host by tables (layer_first) or strides.
        src = [self._pointer_table(f"dev{i}", layers) for i, layers in enumerate(dev)]
        if lf:
            dst = [self._pointer_table(f"host{i}", list(p.unbind(0))) for i, p in enumerate(parts)]
            if self.mla:
                return lambda: fn(src[0], dst[0], d, h, item, self.layers, block_quota, warps)
            return lambda: fn(src[0], dst[0], src[1], dst[1], d, h, item, self.layers, block_quota, warps)
        if self.mla:
            return lambda: fn(src[0], parts[0], d, h, item, layout_dim, self.layers, block_quota, warps)
        return lambda: fn(src[0], parts[0], src[1], parts[1], d, h, item, layout_dim, self.layers, block_quota,
                          warps)  # fmt: skip

    # ---- the check before any timing ------------------------------------------------------------

    def moved_right(self, op: str, h: torch.Tensor, d: torch.Tensor, layer: int) -> str | None:
        """Run ``op`` once and compare with what SGLang's semantics say moved; None when exact.

        Load: device rows ``d`` of ``layer`` must equal host rows ``h``. Backup: host rows ``h`` of
        every layer must equal device rows ``d``. Only those rows are written first (random bytes at
        the source, zeros at the destination), read through SGLang's shapes (a layer of a layer_first
        buffer is ``buf[layer]``, of a page_first one ``buf[:, layer]``).
        """
        from ..demo import same_bytes

        gen = torch.Generator().manual_seed(12)
        parts, dev = self.parts, self.dev_layers
        hi, di = h.cpu(), d.cpu()
        layers = [layer] if op == LOAD else list(range(self.layers))

        def host_rows(i: int, lay: int) -> torch.Tensor:
            return parts[i][lay] if self.layout == "layer_first" else parts[i][:, lay]

        for i in range(len(parts)):
            for lay in layers:
                rows = host_rows(i, lay)
                noise = torch.randint(0, 256, (len(hi), rows[0].numel() * rows.element_size()), dtype=torch.uint8,
                                      generator=gen)  # fmt: skip
                src = noise.view(rows.dtype).view(len(hi), *rows.shape[1:])
                if op == LOAD:
                    rows[hi] = src
                    dev[i][lay][di] = torch.zeros_like(src).to(dev[i][lay].device)
                else:
                    dev[i][lay][di] = src.to(dev[i][lay].device)
                    rows[hi] = torch.zeros_like(src)
        self.call(op, h, d, layer, 2)()
        if self.dev_device.type == "cuda":
            torch.cuda.synchronize()
        for i in range(len(parts)):
            for lay in layers:
                if not same_bytes(host_rows(i, lay)[hi], dev[i][lay][di].cpu()):
                    what = "device rows after the load" if op == LOAD else "host rows after the backup"
                    return f"{self.function(op)}: part {i}, layer {lay}: the {what} differ from the source"
        return None
