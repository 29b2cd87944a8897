"""``kv_connector_extra_config`` of the hicache spec: vLLM's CPU spec's keys plus hicache's, checked once.

A vLLM user switches from ``CPUOffloadingSpec`` by changing ``spec_name``: every key vLLM 0.32's CPU
spec and OffloadingConnector read means here what it means there. A key neither knows is refused,
naming the keys that are known, rather than ignored.

The host tier's size is ``cpu_bytes_to_use`` (bytes; what vLLM's own ``--kv-offloading-size`` sets) or
``kv_offloading_size`` (GiB, read as that flag reads it); given both, they must agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_core.storage.url import redact_url

from .errors import NotServedError

#: Keys vLLM 0.32.0 itself reads from kv_connector_extra_config for an offloading spec
#: (the connector, OffloadingSpec and CPUOffloadingSpec), passed through unchanged.
VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path",                       # vllm/v1/kv_offload/factory.py
    "cpu_bytes_to_use", "eviction_policy", "cache_policy_module_path",
    "store_threshold", "max_tracker_size",                 # vllm/v1/kv_offload/cpu/spec.py
    "offload_prompt_only", "self_describing_kv_events",    # vllm/v1/kv_offload/base.py
    "block_size", "blocks_per_chunk", "canonical_layout",  # .../offloading/config.py
})  # fmt: skip

#: hicache's own keys.
HICACHE_KEYS = {
    "kv_offloading_size": "the host tier's size in GiB, as vLLM's --kv-offloading-size reads it (or cpu_bytes_to_use, "
    "in bytes)",
    "hicache_layout": "host layout: page_first (default; a chunk's layers in one run, one L3 object), layer_first, "
    "page_first_direct",
    "hicache_io_backend": "io backend: auto (default), direct, kernel, jit, torch, or any installed plugin's",
    "hicache_storage_url": "L3 behind the host tier: file:///dir, redis://host:port/db, mooncake://host:port, "
    "s3://bucket/prefix",
    "hicache_storage_options": "a dict of the store's options (as in the URL's query)",
}


@dataclass(frozen=True)
class HicacheOptions:
    """hicache's settings, from the extra config."""

    host_bytes: int = 0  #: the host tier's size (cpu_bytes_to_use, or kv_offloading_size GiB in bytes)
    layout: str = "page_first"
    io_backend: str = "auto"
    storage_url: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)


def parse_extra_config(extra: Mapping[str, Any]) -> HicacheOptions:
    """Check every key and return hicache's options; raises :class:`NotServedError` naming what is wrong."""
    unknown = sorted(set(extra) - VLLM_KEYS - set(HICACHE_KEYS))
    if unknown:
        hint = ""
        if "secondary_tiers" in unknown:
            hint = " (vLLM's TieringOffloadingSpec key: with hicache, L3 is hicache_storage_url)"
        raise NotServedError(
            f"kv_connector_extra_config has key(s) HicacheOffloadingSpec does not know: {', '.join(unknown)}{hint}. "
            f"vLLM's keys: {', '.join(sorted(VLLM_KEYS))}. hicache's keys: "
            + "; ".join(f"{k} ({v})" for k, v in HICACHE_KEYS.items())
        )
    out: dict[str, Any] = {"host_bytes": host_bytes(extra)}
    if extra.get("canonical_layout"):
        raise NotServedError(
            "canonical_layout is not served by HicacheOffloadingSpec: hicache keeps this worker's own pages "
            "(drop canonical_layout, or use vLLM's TieringOffloadingSpec)"
        )
    for key, name in (("hicache_layout", "layout"), ("hicache_io_backend", "io_backend")):
        if key in extra:
            value = extra[key]
            if not isinstance(value, str) or not value:
                raise NotServedError(f"{key} must be a non-empty string, got {value!r}")
            out[name] = value
    url = extra.get("hicache_storage_url")
    if url is not None:
        if not isinstance(url, str) or "://" not in url:
            shown = redact_url(url) if isinstance(url, str) else type(url).__name__
            raise NotServedError(f"hicache_storage_url must be a URL such as file:///dir, got {shown!r}")
        out["storage_url"] = url
        if int(extra.get("store_threshold", 0) or 0) >= 2:
            raise NotServedError(
                "store_threshold >= 2 with hicache_storage_url is not served: pages promoted from L3 enter the host "
                "tier without being offered twice"
            )
    options = extra.get("hicache_storage_options")
    if options is not None:
        if not isinstance(options, Mapping):
            raise NotServedError(f"hicache_storage_options must be a dict, got {type(options).__name__}")
        if url is None:
            raise NotServedError("hicache_storage_options given without hicache_storage_url")
        out["storage_options"] = dict(options)
    return HicacheOptions(**out)


#: A GiB, as vLLM 0.32 turns --kv-offloading-size into cpu_bytes_to_use (vllm/config/vllm.py).
GIB = 1 << 30


def host_bytes(extra: Mapping[str, Any]) -> int:
    """The host tier's size in bytes: ``cpu_bytes_to_use``, or ``kv_offloading_size`` GiB; both must agree.

    vLLM's ``--kv-offloading-size N`` arrives as ``cpu_bytes_to_use = N * 2**30`` (a float), so a
    ``kv_offloading_size`` beside that flag must name the same size.
    """
    gib = _positive(extra, "kv_offloading_size", "GiB")
    given = _positive(extra, "cpu_bytes_to_use", "bytes")
    if gib is None and given is None:
        raise NotServedError(
            "the host tier's size must be given: vLLM's --kv-offloading-size GIB, or in kv_connector_extra_config "
            "kv_offloading_size (GiB) or cpu_bytes_to_use (bytes)"
        )
    from_gib = None if gib is None else int(gib * GIB)
    from_bytes = None if given is None else int(given)
    if from_gib is not None and from_bytes is not None and from_gib != from_bytes:
        raise NotServedError(
            f"kv_offloading_size {extra['kv_offloading_size']!r} GiB is {from_gib} bytes, but cpu_bytes_to_use is "
            f"{from_bytes}: give one of them (vLLM's --kv-offloading-size sets cpu_bytes_to_use)"
        )
    key, size = ("cpu_bytes_to_use", from_bytes) if from_bytes is not None else ("kv_offloading_size", from_gib)
    if not size:
        raise NotServedError(f"{key} {extra[key]!r} is less than a byte")
    return size


def _positive(extra: Mapping[str, Any], key: str, unit: str) -> int | float | None:
    """``extra[key]`` as a finite number above 0 (a string of one is taken, as vLLM's ``int()`` takes it), or None
    when the key is absent or null; raises :class:`NotServedError` naming the key otherwise."""
    value = extra.get(key)
    if value is None:
        return None
    number: int | float
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        number = value if isinstance(value, (int, float)) else _parse(value)
    except (TypeError, ValueError):
        raise NotServedError(f"{key} must be a number of {unit}, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise NotServedError(f"{key} must be a positive number of {unit}, got {value!r}")
    return number


def _parse(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)
