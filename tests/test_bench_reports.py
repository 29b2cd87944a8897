"""The benchmark's reports on the CPU: the overlap summary, the copy-engine variants, the plots (from records)."""

from __future__ import annotations

import importlib.util

import pytest

import hicache_core as hc
from hicache_core import bench
from hicache_core.overlap import MODELS


def _row(impl, eff, model="llama-8b", n=2048, m=8192, layout="page_first_direct", **kw):
    return {"implementation": impl, "efficiency": eff, "gemm_slowdown": 0.05, "model": model, "new_tokens": n,
            "cached_tokens": m, "layout": layout, "max_ctas": kw.pop("max_ctas", None), **kw}  # fmt: skip


def test_overlap_summary_compares_auto_with_the_best_non_auto_row():
    rows = [_row("jit.one_layer", 0.90, max_ctas=8), _row("direct.copy_engine", 0.95),
            _row("auto", 0.94, chosen="direct.copy_engine"), _row("auto-rule", 0.99)]  # fmt: skip
    text = bench.overlap_summary(rows)
    line = text.splitlines()[-1]
    cells = [c.strip() for c in line.strip(" |").split("|")]
    assert cells[0] == "interleaved"  # rows from before the modes were named: issue 11's order
    assert "direct.copy_engine: 0.95" in cells[2]  # best: never an auto row
    assert cells[-2:] == ["0.989", "1.042"]  # auto 0.94 / 0.95, the static rule 0.99 / 0.95


def test_overlap_summary_keeps_the_modes_apart():
    rows = [_row("direct.copy_engine", 0.95, mode="sglang"), _row("direct.copy_engine", 0.80, mode="interleaved"),
            _row("auto", 0.76, mode="interleaved"), _row("auto", 0.95, mode="sglang")]  # fmt: skip
    lines = bench.overlap_summary(rows).splitlines()[2:]
    assert [ln.split("|")[1].strip() for ln in lines] == ["interleaved", "sglang"]
    assert lines[0].split("|")[-3].strip() == "0.950" and lines[1].split("|")[-3].strip() == "1.000"


def test_compute_models_split_the_regimes_as_issue_11_does():
    llama = MODELS["llama-8b"]
    # ~0.9 TFLOP of dense work per layer for 2048 new tokens, as 6-7 GEMMs of [2048, 4096] @ [4096, 8192].
    assert llama.launches(2048) in (6, 7)
    assert MODELS["deepseek-v3"].launches(2048) == 10


class _Copier:
    streams, max_batch, prefer_overlap, batch, batch_2d = 1, 0, True, True, False


class _Direct(hc.Implementation):
    name = "fake.direct"

    def __init__(self):
        self.copier = _Copier()


def test_variants_set_and_restore_the_copier_knobs():
    impl = _Direct()
    assert bench._variants(impl, 64) == ("default",)
    names = bench._variants(impl, 4096)
    assert names[0] == "default" and "streams2" in names and "batch_2d" not in names
    with bench.variant_applied(impl, "streams2"):
        assert impl.copier.streams == 2
    assert impl.copier.streams == 1
    with bench.variant_applied(impl, "one_by_one"):
        assert impl.copier.batch is False
    assert impl.copier.batch is True


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plots_draw_from_records(tmp_path):
    sweep = [{"shape": "llama-8b", "operation": hc.LOAD, "implementation": impl, "layout": layout, "tokens": t,
              "page_size": 64, "max_ctas": 8 if impl != "direct.copy_engine" else None, "fraction_of_ceiling": 0.5}
             for impl in ("direct.copy_engine", "jit.one_layer") for layout in ("layer_first", "page_first_direct")
             for t in (64, 4096)]  # fmt: skip
    bench._plot(tmp_path / "sweep.png", sweep)
    overlap = [_row("direct.copy_engine", 0.9), _row("jit.one_layer", 0.8, max_ctas=8, layout="layer_first")]
    bench._plot(tmp_path / "overlap.png", overlap)
    assert (tmp_path / "sweep.png").stat().st_size > 10_000 and (tmp_path / "overlap.png").stat().st_size > 10_000


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_submission_plot_draws_from_the_committed_h200_records(tmp_path):
    import json
    from pathlib import Path

    from hicache_core.plots import plot_submission

    committed = Path(__file__).parents[1] / "benchmarks" / "results" / "submission-check-h200.json"
    records = json.loads(committed.read_text())["records"]
    assert {r["metric"] for r in records} >= {"prefix_submission", "mla_load_queued", "small_host_us"}
    plot_submission(tmp_path / "submission.png", records)
    assert (tmp_path / "submission.png").stat().st_size > 10_000


def test_overlap_modes_are_named_and_an_unknown_one_is_refused_before_any_work():
    from hicache_core.overlap import MODES, prefill_run

    assert MODES == ("sglang", "interleaved")
    with pytest.raises(ValueError, match="sglang, interleaved"):
        prefill_run(None, 1, None, False, mode="sglang-ish")
