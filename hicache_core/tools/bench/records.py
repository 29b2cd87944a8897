"""The bench's records: the machine they were measured on, and the JSON (and plot) they are written to."""

from __future__ import annotations

import json
import platform
import time
from importlib import metadata
from pathlib import Path

import torch

from ...plugins.autoselect import AutoChooser
from ...plugins.implementation import Implementation
from ...plugins.registry import CORE_PLUGIN, Registry


def environment() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": {
            d: version(d)
            for d in ("torch", "triton", "hicache-core", "hicache-direct", "hicache-kernel", "hicache-jit")
        },  # fmt: skip
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "sms": props.multi_processor_count, "cuda": torch.version.cuda}
    return env


def made_by(registry: Registry, impl: Implementation | type[Implementation]) -> dict[str, str]:
    """The row fields that say what moved the bytes: the implementation's declared ``engine`` and its plugin
    (``auto`` is the core's chooser: engine ``"auto"``, whatever it picks per call)."""
    if isinstance(impl, AutoChooser) or (isinstance(impl, type) and issubclass(impl, AutoChooser)):
        return {"engine": "auto", "plugin": CORE_PLUGIN}
    return {"engine": impl.engine, "plugin": registry.plugin_of(impl.name)}


def write_records(out: Path, name: str, meta: dict, records: list[dict], plot: bool = True) -> Path:
    """Write ``<out>/<name>.json`` (``meta`` and the records) and, with ``plot``, its figure beside it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**meta, "records": records}, indent=1, default=str))
    if records and plot:
        plot_records(out / f"{name}.png", records)
    return path


def plot_records(path: Path, records: list[dict]) -> None:
    from .plots import plot_overlap, plot_sweep

    if any("efficiency" in r for r in records):
        plot_overlap(path, records)
    else:
        plot_sweep(path, records)
