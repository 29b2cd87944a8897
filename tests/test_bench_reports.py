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
    assert cells[0] == "interleaved"  # rows from before the modes were named: the interleaved order
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
    records.plot_records(tmp_path / "sweep.png", sweep)
    overlap = [_row("direct.copy_engine", 0.9), _row("jit.one_layer", 0.8, max_ctas=8, layout="layer_first")]
    records.plot_records(tmp_path / "overlap.png", overlap)
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

    assert MODES == ("sglang", "loader", "interleaved")
    with pytest.raises(ValueError, match="sglang, loader, interleaved"):
        prefill_run(None, 1, None, False, mode="sglang-ish")


def test_colours_follow_the_declared_engine_and_plugin_and_old_rows_still_get_one():
    from hicache_core.tools.bench.plots import FAMILIES, OTHER, identity, palette

    rows = [{"implementation": "kernel.triton_uva", "engine": "sm", "plugin": "kernel"},
            {"implementation": "jit.one_layer", "engine": "sm", "plugin": "jit"},
            {"implementation": "direct.copy_engine", "engine": "copy_engine", "plugin": "direct"},
            {"implementation": "direct.copy_engine caller-thread", "engine": "copy_engine", "plugin": "direct"},
            {"implementation": "auto", "engine": "auto", "plugin": "hicache_core"},
            {"implementation": "mine.dma", "engine": "copy_engine", "plugin": "mine"},
            {"implementation": "old.row"}]  # fmt: skip
    colours = palette(rows)
    assert identity(rows[3]) == identity(rows[2]) == ("copy_engine", "direct", "direct.copy_engine")  # a variant
    assert identity(rows[-1]) == ("?", "old", "old.row")  # from before the fields: plugin from the name
    sm = FAMILIES["sm"]
    assert colours[identity(rows[1])] == sm[0] and colours[identity(rows[0])] == sm[1]  # jit, kernel: by plugin
    dma = FAMILIES["copy_engine"]
    assert (colours[identity(rows[2])], colours[identity(rows[5])]) == (dma[0], dma[1])
    assert colours[identity(rows[4])] == FAMILIES["auto"][0] and colours[identity(rows[-1])] == OTHER[0]
    # The same implementations keep their colours whatever else a plot holds, within their engine:
    assert palette(rows[2:3])[identity(rows[2])] == dma[0]


def test_line_styles_follow_the_layout_declaration():
    from hicache_core.declared.layouts import Layout
    from hicache_core.tools.bench.plots import OTHER_STYLES, STYLES, layout_styles

    registry = hc.get_registry()
    declared = dict(registry.layouts)
    # A plugin's layout that lays bytes out as layer_first does gets layer_first's style, by declaration.
    declared["mine_layers"] = Layout("mine_layers", registry.layouts["layer_first"].axes, merge_slots=True)
    styles = layout_styles(["page_first_direct", "layer_first", "page_first", "page_first_kv_split", "page_head",
                            "mine_layers", "not_here"], declared)  # fmt: skip
    assert styles == {"page_first_direct": STYLES["per (page, layer)"], "layer_first": STYLES["layer-major"],
                      "page_first": STYLES["token-major"], "page_first_kv_split": STYLES["split"],
                      "page_head": STYLES["per (page, head)"], "mine_layers": STYLES["layer-major"],
                      "not_here": OTHER_STYLES[0]}  # fmt: skip


def test_one_row_label_for_the_summary_the_log_and_the_plots():
    from hicache_core.tools.bench.plots import row_label

    assert row_label(_row("auto", 0.9, chosen="jit.one_layer 8 CTAs")) == "auto (jit.one_layer 8 CTAs)"
    assert row_label(_row("kernel.triton_uva", 0.9, max_ctas=0)) == "kernel.triton_uva all CTAs"
    rows = [_row("direct.copy_engine", 0.95), _row("auto", 0.94, chosen="direct.copy_engine")]
    assert "auto (direct.copy_engine): 0.94" in overlap_summary(rows)


def test_rows_name_the_engine_and_plugin_that_moved_the_bytes():
    registry = hc.get_registry()
    assert records.made_by(registry, registry.implementations["reference"]) == {"engine": "cpu",
                                                                                 "plugin": "hicache_core"}  # fmt: skip
    from hicache_core.plugins.autoselect import AutoChooser

    assert records.made_by(registry, AutoChooser) == {"engine": "auto", "plugin": "hicache_core"}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_committed_records_from_before_engine_and_plugin_still_plot(tmp_path):
    import json
    from pathlib import Path

    results = Path(__file__).parents[1] / "benchmarks" / "results"
    for name in ("direct-bench-h200", "overlap-sglang-h200"):
        rows = json.loads((results / f"{name}.json").read_text())["records"]
        assert not any("engine" in r for r in rows)  # written before the fields existed
        records.plot_records(tmp_path / f"{name}.png", rows)
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def test_rows_from_before_the_fields_take_the_registered_declaration():
    from hicache_core.tools.bench.plots import identity

    registry = hc.get_registry()
    assert identity({"implementation": "reference"}, registry) == ("cpu", "hicache_core", "reference")
    assert identity({"implementation": "gone.impl"}, registry) == ("?", "gone", "gone.impl")
