"""``hicache size``: what a server's host tier will hold and pin, from the model's config, before it starts.

From a Hugging Face ``config.json``, the TP size, the layout, the page size and SGLang's host sizing
arguments (``--hicache-size`` GB, or ``--hicache-ratio`` times the device pool), it computes each
host pool a server builds (the KV pool; for a hybrid model also the Mamba state pool) through the
same code :func:`hicache_core.make_host_pool` uses: bytes per token on the device, the host and L3;
tokens and prefixes held; the bytes that will be mapped and pinned, on which NUMA node; and whether
this machine can give them to every rank that runs on it (each TP rank builds its own pools).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..host_memory import RESERVE_GIB, HostMemoryPlan, fit_refusal, read_limits
from ..plugins.registry import get_registry
from ..pool.geometry import example_geometry, pages_for
from ..pool.host_layout import host_layout_spec
from ..pool.host_pool import plan_pool_memory
from ..storage.page_format import HEADER_SIZE
from ..verification.verify import table_shapes

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # fmt: skip


@dataclass(frozen=True)
class PoolSize:
    """One host pool's figures (``unit``: what one slot holds, ``token`` or ``request``)."""

    name: str
    kind: str
    layout: str
    page_size: int
    unit: str
    device_bytes_per_unit: int
    host_bytes_per_unit: int
    l3_bytes_per_page: int
    slots: int
    memory: HostMemoryPlan
    checksum_table_bytes: int

    @property
    def pinned_bytes(self) -> int:
        return self.memory.pinned_bytes + (self.checksum_table_bytes if self.memory.pinned else 0)

    @property
    def held_bytes(self) -> int:
        """Host memory the pool takes, pinned or not: its buffers and its checksum table."""
        return self.memory.mapped + self.checksum_table_bytes


@dataclass(frozen=True)
class SizingReport:
    """Every host pool of the server, what it holds, and whether this machine can give it to ``ranks_per_host``
    ranks (``ranks_assumed``: not given, taken to be every TP rank)."""

    model: str
    tp_size: int
    pools: tuple[PoolSize, ...]
    prefix_tokens: int
    available: int
    limit_name: str
    refusal: str | None
    ranks_per_host: int = 1
    ranks_assumed: bool = False

    @property
    def bytes_per_rank(self) -> int:
        return sum(p.held_bytes for p in self.pools)

    @property
    def bytes_per_host(self) -> int:
        return self.bytes_per_rank * self.ranks_per_host

    def _ranks_line(self) -> str:
        ranks = f"{self.ranks_per_host} rank{'s' if self.ranks_per_host != 1 else ''} on this host"
        if self.ranks_assumed:
            return f"{ranks} (assumed: every TP rank on this one; --ranks-per-host N to change)"
        return f"{ranks} (--ranks-per-host)"

    def as_json(self) -> dict[str, Any]:
        pools = []
        for p in self.pools:
            pools.append({
                "name": p.name, "kind": p.kind, "layout": p.layout, "page_size": p.page_size, "unit": p.unit,
                "device_bytes_per_unit": p.device_bytes_per_unit, "host_bytes_per_unit": p.host_bytes_per_unit,
                "l3_bytes_per_page": p.l3_bytes_per_page, "slots": p.slots, "asked_bytes": p.memory.asked,
                "mapped_bytes": p.memory.mapped, "checksum_table_bytes": p.checksum_table_bytes,
                "pinned_bytes": p.pinned_bytes, "numa_node": p.memory.node, "numa": p.memory.node_reason,
                "buffers": [{"name": n, "asked": a, "mapped": m} for n, a, m in p.memory.buffers],
                "prefixes_held": _prefixes(p, self.prefix_tokens),
            })  # fmt: skip
        return {"model": self.model, "tp_size": self.tp_size, "ranks_per_host": self.ranks_per_host,
                "ranks_per_host_assumed": self.ranks_assumed, "prefix_tokens": self.prefix_tokens, "pools": pools,
                "bytes_per_rank": self.bytes_per_rank, "bytes_per_host": self.bytes_per_host,
                "available_bytes": self.available, "limit": self.limit_name, "fits": self.refusal is None,
                "refusal": self.refusal}  # fmt: skip

    def text(self) -> str:
        lines = [f"{self.model}, TP {self.tp_size} (figures per TP rank); {self._ranks_line()}"]
        for p in self.pools:
            per = f"per {p.unit}"
            lines += [
                f"{p.name}: {p.kind}, layout {p.layout}, page size {p.page_size}",
                f"  bytes {per}: device {p.device_bytes_per_unit}, host {p.host_bytes_per_unit}, "
                f"L3 {p.l3_bytes_per_page / p.page_size:.1f} ({p.l3_bytes_per_page} a page with its "
                f"{HEADER_SIZE}-byte header)",
                f"  holds {p.slots} {p.unit}s" + (f", {_prefixes(p, self.prefix_tokens)} prefixes of "
                                                  f"{self.prefix_tokens} tokens" if p.unit == "token" else ""),
                f"  maps {p.memory.mapped} bytes for {p.memory.asked} asked; checksum table {p.checksum_table_bytes}; "
                f"pins {p.pinned_bytes} bytes ({p.pinned_bytes / (1 << 30):.2f} GiB)",
                f"  NUMA: {p.memory.node_reason}",
            ]  # fmt: skip
        rank, host = self.bytes_per_rank, self.bytes_per_host
        each = "" if self.ranks_per_host == 1 else \
            f" a rank, {host} bytes ({host / (1 << 30):.2f} GiB) for {self.ranks_per_host} ranks"  # fmt: skip
        lines.append(f"total: {rank} bytes ({rank / (1 << 30):.2f} GiB){each}; {self.limit_name}: {self.available} "
                     "bytes")  # fmt: skip
        lines.append(f"does not fit: {self.refusal}" if self.refusal else "fits")
        return "\n".join(lines)


def _prefixes(p: PoolSize, prefix_tokens: int) -> int | None:
    if p.unit != "token":
        return None
    return p.slots // (math.ceil(prefix_tokens / p.page_size) * p.page_size)


def load_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (or a folder holding one); a multimodal model's ``text_config`` inside.

    :raises ValueError: the file is not JSON, or not a JSON object (a model config is one).
    :raises OSError: no such file, or it cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = path.read_bytes()
    except ValueError as exc:  # a path with a NUL byte
        raise ValueError(f"--config {str(path)!r}: {exc}") from None
    try:
        config = json.loads(data)
    except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
        raise ValueError(f"--config {str(path)!r}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {str(path)!r}: a model config is a JSON object, got a JSON {_json_type(config)}")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"--config {str(path)!r}: text_config is a JSON object, got a JSON {_json_type(text)}")
    return {**config, **text} if text is not None else config


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def size_host_tier(config: dict[str, Any], *, tp_size: int = 1, layout: str = "page_first", page_size: int = 64,
                   kv_dtype: str = "auto", hicache_size_gb: float = 0.0, hicache_ratio: float = 2.0,
                   device_tokens: int | None = None, mamba_slots: int | None = None, prefix_tokens: int = 4096,
                   device: str = "cuda", verify: bool | None = None,
                   ranks_per_host: int | None = None) -> SizingReport:  # fmt: skip
    """The report for one TP rank of a server of ``config`` (see the module docstring), checked for
    ``ranks_per_host`` such ranks on this machine (``None``: all ``tp_size``, and the report says it assumed so).

    Host tokens follow SGLang: ``hicache_size_gb * 1e9 // bytes per token`` where it is > 0, else
    ``device_tokens * hicache_ratio``; then one padding page. Mamba slots likewise, plus one padding slot.

    :raises ValueError: a config this does not know how to size, or a missing host size.
    """
    if tp_size < 1 or page_size < 1 or prefix_tokens < 1 or (ranks_per_host is not None and ranks_per_host < 1):
        raise ValueError("tp_size, page_size, prefix_tokens and ranks_per_host must be >= 1")
    ranks = tp_size if ranks_per_host is None else ranks_per_host
    if not 0 <= hicache_size_gb < math.inf or not 0 < hicache_ratio < math.inf:
        raise ValueError(f"--hicache-size takes a finite number >= 0 and --hicache-ratio a finite number > 0, got "
                         f"{hicache_size_gb} and {hicache_ratio}")  # fmt: skip
    if hicache_size_gb * 1e9 == math.inf:
        raise ValueError(f"--hicache-size {hicache_size_gb:g} GB is more bytes than a number can hold")
    if (device_tokens is not None and device_tokens < 1) or (mamba_slots is not None and mamba_slots < 1):
        raise ValueError("device_tokens and mamba_slots must be >= 1")
    if hicache_size_gb <= 0 and device_tokens is None:
        raise ValueError("give the host size: --hicache-size GB, or --device-tokens N with --hicache-ratio")
    dtype = _dtype(config, kv_dtype)
    registry = get_registry()
    if layout not in registry.layouts:
        raise ValueError(f"unknown layout {layout!r}; registered layouts: {', '.join(sorted(registry.layouts))}")
    pinned = device == "cuda"
    verifying = pinned if verify is None else verify
    pools = []
    attention_layers, mamba = _layers(config)
    kv = _kv_geometry(config, tp_size, attention_layers, dtype, page_size, device)
    pools.append(_pool("KV host pool", kv, registry.layouts[layout], "token", hicache_size_gb, hicache_ratio,
                       device_tokens, pinned, verifying, device))  # fmt: skip
    if mamba:
        geometry = _mamba_geometry(config, tp_size, mamba, dtype, device)
        slots = mamba_slots if mamba_slots is not None else device_tokens
        if hicache_size_gb <= 0 and slots is None:
            raise ValueError("a hybrid model's Mamba pool needs --hicache-size GB, or --mamba-slots N")
        mamba_layout = layout if layout in ("page_first", "page_first_direct") else "page_first"
        pools.append(_pool("Mamba state host pool", geometry, registry.layouts[mamba_layout], "request",
                           hicache_size_gb, hicache_ratio, slots, pinned, verifying, device))  # fmt: skip
    limits = read_limits()
    available, which = limits.bound()
    refusal = None
    for p in pools:  # what a server would be refused, even where HICACHE_HOST_MEMORY_CHECK=0 lets it build
        refused = fit_refusal(p.memory, limits)
        if refused is not None:
            refusal = str(refused)
            break
    per_rank = sum(p.held_bytes for p in pools)
    reserve = int(RESERVE_GIB.read() * (1 << 30))
    keep = f" and keep {reserve} bytes free ({RESERVE_GIB.name})" if reserve else ""
    if refusal is None and ranks * per_rank + reserve > available:
        if ranks == 1:
            need = f"the pools together need {per_rank} bytes"
        else:
            need = f"{ranks} ranks on this host need {ranks * per_rank} bytes together ({per_rank} a rank)"
        refusal = (f"{need}{keep}, but {which} leaves {available} bytes. Ask for a smaller host pool (SGLang's "
                   "--hicache-size is per rank), or run fewer ranks on this host")  # fmt: skip
    architectures = config.get("architectures")
    if not isinstance(architectures, list):
        architectures = [] if architectures is None else [architectures]
    name = config.get("_name_or_path") or ",".join(map(str, architectures)) or config.get("model_type") or "?"
    return SizingReport(str(name), tp_size, tuple(pools), prefix_tokens, available, which, refusal, ranks,
                        ranks_per_host is None)  # fmt: skip


def _pool(name, geometry, layout, unit, size_gb, ratio, device_units, pinned, verifying, device) -> PoolSize:
    per_unit = sum(geometry.item_bytes) * geometry.host_layers  # one token (or one request's state), every layer
    page = geometry.page_size
    units = int(size_gb * 1e9 // per_unit) if size_gb > 0 else int(device_units * ratio)
    slots = (units // page + 1) * page if unit == "token" else units + 1  # SGLang's padding page (slot)
    spec = host_layout_spec(geometry, layout, pages_for(slots, page))
    memory = plan_pool_memory(geometry, spec, label=name, pinned=pinned, device=torch.device(device))
    table = 0
    # what hicache_core.verification.verify pins beside the buffers: checksums, then one failure word a page
    if verifying:
        tokens_per_page = 1 if geometry.items_are_pages else page
        shapes = table_shapes(spec.num_pages, geometry.host_layers, len(geometry.components), tokens_per_page)
        table = sum(math.prod(shape) * 8 for shape in shapes)
    device_bytes = sum(geometry.item_bytes) * geometry.layer_num
    return PoolSize(name, geometry.kind, spec.layout.name, page, unit, device_bytes, memory.asked // slots,
                    memory.asked // spec.num_pages + HEADER_SIZE, slots, memory, table)  # fmt: skip


def _dtype(config: dict[str, Any], kv_dtype: str) -> torch.dtype:
    if kv_dtype != "auto":
        where, name = "--kv-dtype", kv_dtype
    else:
        key = "torch_dtype" if config.get("torch_dtype") else "dtype"
        where, name = f"the model config's {key} (--kv-dtype auto)", config.get(key) or "bfloat16"
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"KV cache dtype {name!r} from {where} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _layers(config: dict[str, Any]) -> tuple[int, int]:
    """(attention layers, linear-attention (Mamba) layers)."""
    n = _need(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise ValueError(f"the model config's 'layer_types' must be a list of names, got {json.dumps(types)[:80]}")
    if types:
        mamba = sum(1 for t in types if t in ("linear_attention", "mamba"))
        return len(types) - mamba, mamba
    interval = _optional(config, "full_attention_interval")
    if interval and "linear_num_value_heads" in config:
        attention = n // interval
        return attention, n - attention
    return n, 0


def _kv_geometry(config, tp, layers, dtype, page_size, device):
    kinds = get_registry().pool_kinds
    latent = _optional(config, "kv_lora_rank")
    if latent:
        rope = _need(config, "qk_rope_head_dim")
        return example_geometry(kinds["mla"], page_size=page_size, layer_num=layers, device_type=device, dtype=dtype,
                                rows={"kv": (1, latent + rope)},
                                extras={"kv_lora_rank": latent, "qk_rope_head_dim": rope})  # fmt: skip
    heads = _optional(config, "num_key_value_heads") or _need(config, "num_attention_heads")
    head_dim = _optional(config, "head_dim") or _need(config, "hidden_size") // _need(config, "num_attention_heads")
    if head_dim < 1:
        raise ValueError(f"the model config's hidden_size {config['hidden_size']} is smaller than its "
                         f"{config['num_attention_heads']} attention heads")  # fmt: skip
    per_rank = max(1, heads // tp)  # SGLang replicates KV heads when TP exceeds them
    return example_geometry(kinds["mha"], page_size=page_size, layer_num=layers, device_type=device, dtype=dtype,
                            rows={"k": (per_rank, head_dim), "v": (per_rank, head_dim)})  # fmt: skip


def _mamba_geometry(config, tp, layers, dtype, device):
    """Qwen3-Next's gated delta net state, as SGLang holds it: SSM state fp32, conv state in the model dtype."""
    k_heads, k_dim = _need(config, "linear_num_key_heads"), _need(config, "linear_key_head_dim")
    v_heads, v_dim = _need(config, "linear_num_value_heads"), _need(config, "linear_value_head_dim")
    kernel = _need(config, "linear_conv_kernel_dim")
    if k_heads % tp or v_heads % tp:
        raise ValueError(f"{k_heads} key and {v_heads} value heads of linear attention do not divide by TP {tp} "
                         "(SGLang then extends the key groups per rank; hicache size does not model that)")  # fmt: skip
    temporal = v_heads // tp * k_dim * v_dim * 4
    conv = (2 * k_heads * k_dim + v_heads * v_dim) // tp * (kernel - 1) * torch.empty((), dtype=dtype).element_size()
    return example_geometry(get_registry().pool_kinds["mamba"], page_size=1, layer_num=layers, device_type=device,
                            rows={"temporal": (temporal,), "conv": (conv,)})  # fmt: skip


def _need(config: dict[str, Any], key: str) -> int:
    """The config's ``key``, a whole number >= 1 (the model's shape: layers, heads, dims)."""
    if key not in config:
        raise ValueError(f"the model config has no {key!r}: hicache size knows MHA/GQA, MLA (kv_lora_rank) and "
                         "Qwen3-Next-style hybrid (linear_* keys) models")  # fmt: skip
    return _count(config, key)


def _optional(config: dict[str, Any], key: str) -> int | None:
    """The config's ``key`` where it is set (not absent, null or 0), a whole number >= 1; else ``None``."""
    if config.get(key) in (None, 0):
        return None
    return _count(config, key)


def _count(config: dict[str, Any], key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the model config's {key!r} must be a whole number >= 1, got {json.dumps(value)}")
    return value
