"""The routing benchmark (benchmarks/kv_routing.py) at a tiny size: its record's shape, and that the router
fed by every tier's events recomputes less than the GPU-only one on a trace where it must. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_routing.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("kv_routing_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "kv-routing.json"
    # Small GPU caches, roomy host tiers and a store smaller than both: a returning user's pages are gone from
    # every GPU and from the store, but still in the host tier of the instance that served the last turn.
    _bench().main(
        [
            "--tiny",
            "--instances",
            "3",
            "--gpu-pages",
            "12",
            "--host-pages",
            "64",
            "--l3-pages",
            "16",
            "--staging-pages",
            "16",
            "--audit-every",
            "5",
            "--out",
            str(out),
            "--l3-parent",
            str(tmp_path),
        ]
    )
    record = json.loads(out.read_text())
    assert {"machine", "versions", "trace", "costs", "simulated", "real", "results", "plot"} <= set(record)
    by = {r["router"]: r for r in record["results"]}
    assert set(by) == {"gpu_only", "tier_aware"}
    for r in by.values():
        assert r["requests"] == record["trace"]["requests"] > 0
        assert set(r["hit_rate"]) == {"gpu", "host", "l3", "computed"}
        assert sum(r["hit_rate"].values()) == pytest.approx(1.0)
        assert r["prompt_tokens"] == r["gpu_tokens"] + r["host_tokens"] + r["l3_tokens"] + r["computed_tokens"]
        assert 0 <= r["recomputed_tokens"] <= r["computed_tokens"]
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
        assert r["events"]["received"] > 0
        assert r["events"]["received"] <= r["events"]["published"]
        tiers = {t["kind"] for per_instance in r["tier_stats_at_end"] for t in per_instance}
        assert tiers == {"host", "disk"}
    assert by["tier_aware"]["recomputed_tokens"] < by["gpu_only"]["recomputed_tokens"]
    assert by["tier_aware"]["computed_tokens"] <= by["gpu_only"]["computed_tokens"]
    assert record["tier_aware_vs_gpu_only"]["recomputed_tokens_cut"] > 0
