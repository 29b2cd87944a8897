"""Plots a person reads at a glance: fractions of the ceiling, the ceiling drawn, one colour per
implementation and one line style per layout (../shared/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

#: Fixed colours, so an implementation keeps its colour from plot to plot.
COLOURS = {
    "direct.copy_engine": "#d62728",
    "kernel.triton_uva": "#1f77b4",
    "jit.one_layer": "#2ca02c",
    "auto": "#9467bd",
    "sglang": "#7f7f7f",
}
EXTRA_COLOURS = ("#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
STYLES = {"page_first_direct": "-", "layer_first": "--", "page_first": ":", "page_first_kv_split": "-.",
          "page_head": (0, (1, 1))}  # fmt: skip


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the JSON is the result
        print("matplotlib not installed: no plot")
        return None
    return plt


def colour(name: str, seen: dict[str, str]) -> str:
    if name in COLOURS:
        return COLOURS[name]
    if name not in seen:
        seen[name] = EXTRA_COLOURS[len(seen) % len(EXTRA_COLOURS)]
    return seen[name]


def _legends(ax, impls: list[str], layouts: list[str], seen: dict[str, str]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colour(i, seen), lw=2, label=i) for i in impls]
    first = ax.legend(handles=handles, fontsize=7, loc="lower right", title="implementation", title_fontsize=7)
    ax.add_artist(first)
    styles = [Line2D([], [], color="black", ls=STYLES.get(x, "-"), label=x) for x in layouts]
    ax.legend(handles=styles, fontsize=7, loc="lower center", title="layout", title_fontsize=7)


def plot_sweep(path: Path, records: list[dict]) -> None:
    """Fraction of the ceiling against tokens per call; one panel per (shape, operation); kernels at 8 CTAs."""
    plt = _pyplot()
    if plt is None:
        return
    rows = [r for r in records if "fraction_of_ceiling" in r and r.get("page_size") == 64
            and r.get("max_ctas") in (None, 8) and r.get("variant", "default") == "default"]  # fmt: skip
    panels = sorted({(r["shape"], r["operation"]) for r in rows})
    if not panels:
        return
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    seen: dict[str, str] = {}
    for ax, (shape, op) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["shape"], r["operation"]) == (shape, op)]
        impls = sorted({r["implementation"] for r in mine})
        layouts = sorted({r["layout"] for r in mine})
        for impl in impls:
            for layout in layouts:
                pts = sorted((r["tokens"], r["fraction_of_ceiling"]) for r in mine
                             if r["implementation"] == impl and r["layout"] == layout)  # fmt: skip
                if pts:
                    ax.plot([t for t, _ in pts], [f for _, f in pts], color=colour(impl, seen),
                            ls=STYLES.get(layout, "-"), marker="o", ms=3, lw=1.5)  # fmt: skip
        ax.axhline(1.0, color="black", lw=1)
        ax.text(0.01, 1.01, "ceiling (pinned 2 GiB memcpy)", fontsize=7,
                transform=ax.get_yaxis_transform())  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{shape}: {op}" + (" (kernels at 8 CTAs)" if any("kernel" in i or "jit" in i for i in impls)
                                          else ""), fontsize=9)  # fmt: skip
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("fraction of the ceiling")
        ax.grid(alpha=0.3)
        _legends(ax, impls, layouts, seen)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_overlap(path: Path, records: list[dict]) -> None:
    """Efficiency (fraction of ideal) and GEMM slowdown, one row of panels per (mode, case, layout), one bar per
    implementation at its best setting (so a panel holds about eight bars), ideal as a line."""
    plt = _pyplot()
    if plt is None:
        return
    rows = [r for r in records if "efficiency" in r]

    def case_of(r):
        return (r.get("mode", "interleaved"), r["model"], r["new_tokens"], r["cached_tokens"], r["layout"])

    cases = sorted({case_of(r) for r in rows})
    if not cases:
        return
    fig, axes = plt.subplots(len(cases), 2, figsize=(13, 2.6 * len(cases)), squeeze=False)
    seen: dict[str, str] = {}
    for (ax_eff, ax_gemm), case in zip(axes, cases):
        best: dict[str, dict] = {}
        for r in rows:
            if case_of(r) == case and (r["implementation"] not in best
                                       or r["efficiency"] > best[r["implementation"]]["efficiency"]):  # fmt: skip
                best[r["implementation"]] = r
        mine = sorted(best.values(), key=lambda r: r["implementation"])
        labels = [_label(r).rsplit(" [", 1)[0] for r in mine]
        y = list(range(len(mine)))
        colours = [colour(r["implementation"].split(" ")[0], seen) for r in mine]
        hatches = ["//" if " " in r["implementation"] else "" for r in mine]
        for ax, key, title in ((ax_eff, "efficiency", "fraction of ideal"), (ax_gemm, "gemm_slowdown",
                                                                              "GEMMs' own slowdown")):  # fmt: skip
            bars = ax.barh(y, [r[key] for r in mine], color=colours)
            for bar, hatch in zip(bars, hatches):
                bar.set_hatch(hatch)
            ax.set_yticks(y, labels, fontsize=7)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
            ax.set_title(f"{case[0]}: {case[1]}, {case[2]} new / {case[3]} cached, {case[4]}: {title}", fontsize=8)
        ax_eff.axvline(1.0, color="black", lw=1.2)
        ax_eff.set_xlim(0, 1.05)
        ax_gemm.axvline(0.0, color="black", lw=1.2)
    fig.text(0.01, 0.005, "ideal = max(compute alone, bytes / copy-engine ceiling of this run): the black line at 1; "
             "each implementation at its best setting; hatched: a variant", fontsize=7)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _label(r: dict) -> str:
    name = r["implementation"]
    if r.get("max_ctas") is not None:
        name += f" {r['max_ctas'] or 'all'} CTAs"
    if r.get("chosen"):
        name += f" -> {r['chosen']}"
    return f"{name} [{r['layout']}]"
