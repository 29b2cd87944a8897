"""hicache's first-party plugins as their source tree describes them, for install hints.

The first-party plugins are separate distributions that live beside the core in
hicache's source tree (``plugins/<name>/pyproject.toml``) and on no package index.
Each declares what it serves in its own metadata, ``[tool.hicache]`` (``io-backends``,
``storage-schemes``), so the core never keeps a list of them: an install hint names a
plugin only when its metadata is found, with the command that works.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: no TOML reader in the standard library, so no hints from the tree
    tomllib = None  # type: ignore[assignment]


@dataclass(frozen=True)
class PluginSource:
    """One plugin distribution found in the source tree."""

    distribution: str
    path: str
    io_backends: tuple[str, ...]
    storage_schemes: tuple[str, ...]

    def install_hint(self, serves: str) -> str:
        """The one sentence that says how to install this plugin: ``<distribution> <serves> is not installed;
        ...: pip install -e <path>`` (``serves``: what the reader asked for, e.g. ``"(io backend 'kernel')"``)."""
        return (f"{self.distribution} {serves} is not installed; it ships in hicache's source tree and is on no "
                f"package index: pip install -e {self.path}")  # fmt: skip


def source_tree() -> Path | None:
    """The source tree this hicache_core was installed from (an editable install), if it is one."""
    root = Path(__file__).resolve().parents[2]  # hicache_core/plugins/ -> the tree
    return root if (root / "plugins").is_dir() and (root / "pyproject.toml").is_file() else None


@functools.cache
def source_tree_plugins() -> tuple[PluginSource, ...]:
    """Every plugin under ``<tree>/plugins`` that declares ``[tool.hicache]`` metadata."""
    root = source_tree()
    if root is None or tomllib is None:
        return ()
    found = []
    for manifest in sorted(root.glob("plugins/*/pyproject.toml")):
        try:
            data = tomllib.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        meta = data.get("tool", {}).get("hicache", {})
        name = data.get("project", {}).get("name")
        if not name or not meta:
            continue
        found.append(
            PluginSource(
                distribution=name,
                path=str(manifest.parent),
                io_backends=tuple(meta.get("io-backends", ())),
                storage_schemes=tuple(meta.get("storage-schemes", ())),
            )
        )
    return tuple(found)
