"""Plots a person reads at a glance: fractions of the ceiling, the ceiling drawn, a colour family per
engine (what moves the bytes) with one shade per implementation, and one line style per kind of layout.

Colours come from what the bench writes in each row: the implementation's declared ``engine`` and
its ``plugin``. Rows from before those fields were written still plot: an implementation registered
here answers from its declaration; any other's plugin is the name's first part
(``"<plugin>.<what>"``) and its engine unknown. Line styles come from the layout's declaration (its
axes and ``split``) where the layout is registered here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ...plugins.registry import Registry, get_registry

#: Per engine, the shades its implementations take in turn (sorted by plugin, then name).
FAMILIES = {
    "copy_engine": ("#d62728", "#ff9896", "#8c1c13"),
    "sm": ("#1f77b4", "#2ca02c", "#17becf", "#aec7e8", "#98df8a"),
    "cpu": ("#ff7f0e", "#8c564b", "#c49c94"),
    "auto": ("#9467bd", "#c5b0d5"),
}
#: Shades for engines without a family (and rows that do not say their engine).
OTHER = ("#7f7f7f", "#e377c2", "#bcbd22", "#c7c7c7")
#: Line styles by what a layout's declaration says about its bytes (see :func:`layout_style`).
STYLES = {"per (page, layer)": "-", "layer-major": "--", "token-major": ":", "split": "-.",
          "per (page, head)": (0, (1, 1))}  # fmt: skip
OTHER_STYLES = ((0, (3, 1, 1, 1, 1, 1)), (0, (5, 2)), (0, (1, 3)))


def identity(row: Mapping[str, Any], registry: Registry | None = None) -> tuple[str, str, str]:
    """``(engine, plugin, implementation)`` of a row: what its colour follows (variants share their base's).

    A row without ``engine`` (written before the field) asks ``registry`` for the declaration, where given.
    """
    name = str(row["implementation"]).split(" ")[0]
    if "engine" not in row and registry is not None and name in registry.implementations:
        return registry.implementations[name].engine, registry.plugin_of(name), name
    return row.get("engine") or "?", row.get("plugin") or name.split(".")[0], name


def palette(rows: Iterable[Mapping[str, Any]], registry: Registry | None = None) -> dict[tuple[str, str, str], str]:
    """A colour per :func:`identity` of ``rows``: its engine's family, shades in (plugin, name) order."""
    found = sorted({identity(r, registry) for r in rows})
    colours, taken = {}, {}
    for key in found:
        shades = FAMILIES.get(key[0], OTHER)
        family = key[0] if key[0] in FAMILIES else "?"
        colours[key] = shades[taken.get(family, 0) % len(shades)]
        taken[family] = taken.get(family, 0) + 1
    return colours


def layout_style(layout: Any) -> str | tuple | None:
    """The line style a layout declaration calls for (``None``: not a declaration this knows)."""
    axes = [a for a in getattr(layout, "axes", ()) if a != "component"]
    if len(axes) < 2:
        return None
    if axes[0] == "layer":
        return STYLES["layer-major"]
    if getattr(layout, "split", False):
        return STYLES["split"]
    return {"layer": STYLES["per (page, layer)"], "token": STYLES["token-major"],
            "head": STYLES["per (page, head)"]}.get(axes[1])  # fmt: skip


def layout_styles(names: Iterable[str], declared: Mapping[str, Any]) -> dict[str, str | tuple]:
    """A line style per layout name: from its declaration in ``declared`` (a registry's layouts), else the
    next of :data:`OTHER_STYLES`."""
    styles, spare = {}, 0
    for name in sorted(set(names)):
        style = layout_style(declared.get(name))
        if style is None:
            style, spare = OTHER_STYLES[spare % len(OTHER_STYLES)], spare + 1
        styles[name] = style
    return styles


def row_label(r: Mapping[str, Any]) -> str:
    """A row's label in the summary table, the log and the plots: implementation, SM budget, what auto chose."""
    label = str(r["implementation"])
    if r.get("max_ctas") is not None:
        label += f" {r['max_ctas'] or 'all'} CTAs"
    if r.get("chosen"):
        label += f" ({r['chosen']})"
    return label


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the JSON is the result
        print("matplotlib not installed: no plot")
        return None
    return plt


def _legends(ax, impls: list[str], colours: Mapping[str, str], layouts: list[str],
             styles: Mapping[str, str | tuple]) -> None:  # fmt: skip
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colours[i], lw=2, label=i) for i in impls]
    first = ax.legend(handles=handles, fontsize=7, loc="lower right", title="implementation", title_fontsize=7)
    ax.add_artist(first)
    lines = [Line2D([], [], color="black", ls=styles[x], label=x) for x in layouts]
    ax.legend(handles=lines, fontsize=7, loc="lower center", title="layout", title_fontsize=7)


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
    registry = get_registry()  # the CLI's: loaded already when a bench plots
    shades = palette(rows, registry)
    colour = {r["implementation"]: shades[identity(r, registry)] for r in rows}
    styles = layout_styles((r["layout"] for r in rows), registry.layouts)
    for ax, (shape, op) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["shape"], r["operation"]) == (shape, op)]
        impls = sorted({r["implementation"] for r in mine})
        layouts = sorted({r["layout"] for r in mine})
        for impl in impls:
            for layout in layouts:
                pts = sorted((r["tokens"], r["fraction_of_ceiling"]) for r in mine
                             if r["implementation"] == impl and r["layout"] == layout)  # fmt: skip
                if pts:
                    ax.plot([t for t, _ in pts], [f for _, f in pts], color=colour[impl],
                            ls=styles[layout], marker="o", ms=3, lw=1.5)  # fmt: skip
        ax.axhline(1.0, color="black", lw=1)
        ax.text(0.01, 1.01, "ceiling (pinned 2 GiB memcpy)", fontsize=7,
                transform=ax.get_yaxis_transform())  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{shape}: {op}" + (" (kernels at 8 CTAs)" if any(r.get("max_ctas") == 8 for r in mine)
                                          else ""), fontsize=9)  # fmt: skip
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("fraction of the ceiling")
        ax.grid(alpha=0.3)
        _legends(ax, impls, colour, layouts, styles)
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
    registry = get_registry()
    shades = palette(rows, registry)
    for (ax_eff, ax_gemm), case in zip(axes, cases):
        best: dict[str, dict] = {}
        for r in rows:
            if case_of(r) == case and (r["implementation"] not in best
                                       or r["efficiency"] > best[r["implementation"]]["efficiency"]):  # fmt: skip
                best[r["implementation"]] = r
        mine = sorted(best.values(), key=lambda r: r["implementation"])
        labels = [row_label(r) for r in mine]
        y = list(range(len(mine)))
        colours = [shades[identity(r, registry)] for r in mine]
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


def plot_submission(path: Path, records: list[dict]) -> None:
    """The copy engine's submission figures: the prefix load's host time (the 1.5 ms bar as a line) and its GPU
    time as a fraction of the link, and MLA loads as a fraction of the copy engine at their size (1 = the
    ceiling, a line); one colour per submission path (caller's thread, worker)."""
    plt = _pyplot()
    if plt is None:
        return
    prefix = [r for r in records if r.get("metric") == "prefix_submission"]
    mla = [r for r in records if r.get("metric") == "mla_load_queued"]
    if not prefix and not mla:
        return
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), squeeze=False)
    (ax_host, ax_gpu), (ax_mla, ax_none) = axes
    ax_none.axis("off")
    paths = {"caller": "#1f77b4", "worker": "#d62728"}

    def col(setting: str) -> str:
        return paths["worker"] if setting.startswith("worker") else paths["caller"]

    labels = [f"{r['setting']} [{r['layout']}]" for r in prefix]
    y = list(range(len(prefix)))
    ax_host.barh(y, [r["host_submit_s"] * 1e3 for r in prefix], color=[col(r["setting"]) for r in prefix])
    ax_host.axvline(1.5, color="black", lw=1.2)
    ax_host.set_yticks(y, labels, fontsize=7)
    ax_host.invert_yaxis()
    ax_host.set_title("32 layers x 128 pages (llama-8b 8192 tokens): host ms to return (line: 1.5 ms)", fontsize=8)
    ax_gpu.barh(y, [r["fraction_of_ceiling"] for r in prefix], color=[col(r["setting"]) for r in prefix])
    ax_gpu.axvline(1.0, color="black", lw=1.2)
    ax_gpu.set_yticks(y, [""] * len(y))  # the same rows as the panel on the left
    ax_gpu.invert_yaxis()
    ax_gpu.set_xlim(0, 1.05)
    ax_gpu.set_title("the same load: bytes / GPU time, fraction of the link (line: pinned memcpy)", fontsize=8)
    labels = [f"{r['setting']} [{r['tokens']} tokens]" for r in mla]
    y = list(range(len(mla)))
    ax_mla.barh(y, [r["fraction_of_ceiling"] for r in mla], color=[col(r["setting"]) for r in mla])
    ax_mla.axvline(1.0, color="black", lw=1.2)
    ax_mla.axvline(0.85, color="black", lw=0.8, ls="--")
    ax_mla.set_yticks(y, labels, fontsize=7)
    ax_mla.invert_yaxis()
    ax_mla.set_xlim(0, 1.05)
    ax_mla.set_title("MLA per-layer loads, queued: fraction of the copy engine at that size (dashed: 0.85)",
                     fontsize=8)  # fmt: skip
    for ax in (ax_host, ax_gpu, ax_mla):
        ax.grid(axis="x", alpha=0.3)
    fig.text(0.01, 0.01, "blue: submitted on the caller's thread; red: from direct's worker thread", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
