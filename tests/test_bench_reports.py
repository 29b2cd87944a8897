"""The benchmark's reports on the CPU: the overlap summary, the copy-engine variants, the plots (from records)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

import hicache_core as hc
from hicache_core.tools.bench import records, sweep
from hicache_core.tools.bench.overlap import MODELS
from hicache_core.tools.bench.overlap_command import overlap_summary


def _row(impl, eff, model="llama-8b", n=2048, m=8192, layout="page_first_direct", **kw):
    return {"implementation": impl, "efficiency": eff, "gemm_slowdown": 0.05, "model": model, "new_tokens": n,
            "cached_tokens": m, "layout": layout, "max_ctas": kw.pop("max_ctas", None), **kw}  # fmt: skip


def test_overlap_summary_compares_auto_with_the_best_non_auto_row():
    rows = [_row("jit.one_layer", 0.90, max_ctas=8), _row("direct.copy_engine", 0.95),
            _row("auto", 0.94, chosen="direct.copy_engine"), _row("auto-rule", 0.99)]  # fmt: skip
    text = overlap_summary(rows)
    line = text.splitlines()[-1]
    cells = [c.strip() for c in line.strip(" |").split("|")]
    assert cells[0] == "interleaved"  # rows from before the modes were named: issue 11's order
    assert "direct.copy_engine: 0.95" in cells[2]  # best: never an auto row
    assert cells[-2:] == ["0.989", "1.042"]  # auto 0.94 / 0.95, the static rule 0.99 / 0.95


def test_overlap_summary_keeps_the_modes_apart():
    rows = [_row("direct.copy_engine", 0.95, mode="sglang"), _row("direct.copy_engine", 0.80, mode="interleaved"),
            _row("auto", 0.76, mode="interleaved"), _row("auto", 0.95, mode="sglang")]  # fmt: skip
    lines = overlap_summary(rows).splitlines()[2:]
    assert [ln.split("|")[1].strip() for ln in lines] == ["interleaved", "sglang"]
    assert lines[0].split("|")[-3].strip() == "0.950" and lines[1].split("|")[-3].strip() == "1.000"


def test_compute_models_split_the_regimes_as_issue_11_does():
    llama = MODELS["llama-8b"]
    # ~0.9 TFLOP of dense work per layer for 2048 new tokens, as 6-7 GEMMs of [2048, 4096] @ [4096, 8192].
    assert llama.launches(2048) in (6, 7)
    assert MODELS["deepseek-v3"].launches(2048) == 10


class _Plain(hc.Implementation):
    name = "fake.plain"


def test_an_implementation_without_variants_is_timed_at_its_defaults():
    impl = _Plain.__new__(_Plain)
    assert sweep._variants(impl, 4096) == {"default": {}}
    with impl.tuned({}):
        pass
    with pytest.raises(ValueError, match="fake.plain declares no tuning variants"):
        with impl.tuned({"streams": 2}):
            pass


def test_variants_are_the_copy_engines_declaration_and_restore_its_knobs():
    pytest.importorskip("hicache_direct")
    dev = hc.MHADevicePool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    impl = hc.make_host_pool(dev, layout="page_first_direct", io_backend="direct", pin_memory=False).implementation_for(
        hc.LOAD
    )
    assert impl.engine == "copy_engine"
    assert sweep._variants(impl, 4096) == {"default": {}}  # CPU pools: the host copier has no knobs
    # The CUDA copier's knobs, as data (the copier itself needs a GPU):
    impl.copier = types.SimpleNamespace(path="batched", streams=1, max_batch=32, prefer_overlap=True, batch=True,
                                        batch_2d=False)  # fmt: skip
    assert sweep._variants(impl, 64) == {"default": {}}
    variants = sweep._variants(impl, 4096)
    assert list(variants)[0] == "default" and variants["streams2"] == {"streams": 2} and "batch_2d" not in variants
    streams, batch = impl.copier.streams, impl.copier.batch
    with impl.tuned(variants["streams2"]):
        assert impl.copier.streams == 2
    assert impl.copier.streams == streams
    with impl.tuned(variants["one_by_one"]):
        assert impl.copier.batch is False
    assert impl.copier.batch is batch
    with pytest.raises(ValueError, match="unknown tuning settings"):
        with impl.tuned({"warp_speed": 9}):
            pass


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plots_draw_from_records(tmp_path):
    sweep = [{"shape": "llama-8b", "operation": hc.LOAD, "implementation": impl, "layout": layout, "tokens": t,
              "page_size": 64, "max_ctas": 8 if impl != "direct.copy_engine" else None, "fraction_of_ceiling": 0.5}
             for impl in ("direct.copy_engine", "jit.one_layer") for layout in ("layer_first", "page_first_direct")
             for t in (64, 4096)]  # fmt: skip
    records._plot(tmp_path / "sweep.png", sweep)
    overlap = [_row("direct.copy_engine", 0.9), _row("jit.one_layer", 0.8, max_ctas=8, layout="layer_first")]
    records._plot(tmp_path / "overlap.png", overlap)
    assert (tmp_path / "sweep.png").stat().st_size > 10_000 and (tmp_path / "overlap.png").stat().st_size > 10_000


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_submission_plot_draws_from_the_committed_h200_records(tmp_path):
    import json
    from pathlib import Path

    from hicache_core.tools.bench.plots import plot_submission

    committed = Path(__file__).parents[1] / "benchmarks" / "results" / "submission-check-h200.json"
    records = json.loads(committed.read_text())["records"]
    assert {r["metric"] for r in records} >= {"prefix_submission", "mla_load_queued", "small_host_us"}
    plot_submission(tmp_path / "submission.png", records)
    assert (tmp_path / "submission.png").stat().st_size > 10_000


def test_overlap_modes_are_named_and_an_unknown_one_is_refused_before_any_work():
    from hicache_core.tools.bench.overlap import MODES, prefill_run

    assert MODES == ("sglang", "interleaved")
    with pytest.raises(ValueError, match="sglang, interleaved"):
        prefill_run(None, 1, None, False, mode="sglang-ish")
