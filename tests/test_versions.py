"""The plugin API's version: ranges plugins require, checked at load and shown by ``hicache plugins``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import hicache_core as hc
import hicache_core.plugins.registry as registry_module
from hicache_core import hookimpl
from hicache_core.cli import main
from hicache_core.plugins import versions
from hicache_core.plugins.registry import Registry


@pytest.mark.parametrize("spec, version, expect", [
    (">=0.2,<0.3", "0.2.0", True), (">=0.2,<0.3", "0.3.0", False), (">=0.1", "0.2.0", True),
    (">=0.1,<0.2", "0.2.0", False), ("~=0.2", "0.2.7", True), ("~=0.2", "1.0", False), ("==0.2.*", "0.2.1", True),
    ("!=0.2.0", "0.2.0", False), ("", "0.2.0", True), (">=0.2a1", "0.2.0", None), ("===0.2", "0.2.0", None),
])  # fmt: skip
def test_the_ranges_plugins_pin_are_read_and_never_guessed(spec, version, expect):
    assert versions.admits(spec, version) is expect


def test_the_requirement_on_the_core_is_read_from_the_distribution():
    assert versions.core_requirement(["torch>=2.1", "hicache-core<0.3,>=0.2"]) == "<0.3,>=0.2"
    assert versions.core_requirement(["hicache_core (>=0.1)"]) == ">=0.1"
    assert versions.core_requirement(["hicache-core"]) == ""
    assert versions.core_requirement(["pytest>=7; extra == 'test'"]) is None
    assert versions.core_version() == "0.4.0" == versions.CORE_VERSION


class Layouts:
    def __init__(self, name):
        self.name = name

    @hookimpl
    def hicache_register_layouts(self, register):
        axes = ("page", "layer", "component", "token", "head", "dim")
        order = {"old": axes, "previous": axes[2::-1] + axes[3:]}.get(self.name, axes[1::-1] + axes[2:])
        register(hc.Layout(f"{self.name}_layout", order))


def _entry_point(name, requires):
    dist = SimpleNamespace(name=f"hicache-{name}", version="0.1.0", requires=requires)
    return SimpleNamespace(name=name, dist=dist, load=lambda: Layouts(name))


def test_hicache_plugins_shows_each_range_and_what_is_incompatible(monkeypatch, capsys):
    hc.get_registry()
    imported = []

    def entry_point(name, requires):
        ep = _entry_point(name, requires)
        return SimpleNamespace(name=ep.name, dist=ep.dist, load=lambda: imported.append(name) or ep.load())

    monkeypatch.setattr(registry_module, "_entry_points", lambda: [
        entry_point("old", ["hicache-core>=0.2,<0.3"]), entry_point("previous", ["hicache-core>=0.3,<0.4"]),
        entry_point("fits", ["hicache-core>=0.4,<0.5"])])  # fmt: skip
    registry = Registry.from_entry_points()
    old, previous, fits = (registry.plugins[n] for n in ("old", "previous", "fits"))
    assert (old.requires, previous.requires, fits.requires) == (">=0.2,<0.3", ">=0.3,<0.4", ">=0.4,<0.5")
    assert not fits.errors and not previous.errors and previous.status == fits.status == "loaded"
    assert previous.layouts == ["previous_layout"], "a plugin written for the previous API loads"
    # Older than the previous API: refused before its import, with what changed since the API it was written for.
    assert imported == ["fits", "previous"] and old.status == "failed" and old.refused and old.layouts == []
    (error,) = old.errors
    assert error.startswith("requires hicache-core >=0.2,<0.3, but 0.4.0 is running: refused at load, nothing of it "
                            "is used. It was written for plugin API 0.2; changed since: 0.3: the storage page API "
                            "moved off StorageBackend to PageStore")  # fmt: skip
    assert "| 0.4: 0.2's page API on a storage backend" in error and "Layout.split_at" in error
    assert error.endswith('Install a release of the plugin made for plugin API 0.4 (docs/plugins.md, "Versions")')
    assert "0.2:" not in error.split("changed since:")[1], "only what changed after its API"
    monkeypatch.setattr("hicache_core.cli.get_registry", lambda: registry)
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hicache-core 0.4.0 (plugin API 0.4)\n")
    assert "old (hicache-old 0.1.0): failed\n    requires hicache-core >=0.2,<0.3: INCOMPATIBLE\n" in text
    assert ("previous (hicache-previous 0.1.0): loaded\n    requires hicache-core >=0.3,<0.4: compatible (written for "
            "plugin API 0.3, which 0.4 still serves (it removed only what 0.3 deprecated))\n") in text  # fmt: skip
    assert "fits (hicache-fits 0.1.0): loaded\n    requires hicache-core >=0.4,<0.5: compatible\n" in text
    assert main(["plugins", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert (records["old"]["requires"], records["old"]["compatible"]) == (">=0.2,<0.3", False)
    assert records["previous"]["compatible"] is True and records["fits"]["compatible"] is True
    assert records["hicache_core"]["requires"] is None


@pytest.mark.parametrize("spec, api, refused", [
    (">=0.4,<0.5", "0.4", False), (">=0.3,<0.4", "0.3", False), ("==0.3.2", "0.3", False), (">=0.1", "0.4", False),
    ("<0.3", "0.2", True), (">=0.1,<0.2", "0.1", True), (">=0.5", None, True), ("!=0.4.0", "0.4", True),
])  # fmt: skip
def test_the_api_a_range_was_written_for_decides_whether_it_loads(spec, api, refused):
    assert versions.written_for(spec) == api
    assert versions.refuses(spec, "0.4.0") is refused
    assert (versions.compatibility_problem(spec, "0.4.0") is not None) is refused
    if refused and api is None:
        assert "written for a hicache-core other than this one" in versions.compatibility_problem(spec, "0.4.0")


def test_every_plugin_in_the_tree_pins_a_range_that_admits_this_core():
    """Read from the manifests, installed or not: a plugin pinned to another core loads as INCOMPATIBLE."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    manifests = sorted([*root.glob("plugins/*/pyproject.toml"), *root.glob("integrations/*/pyproject.toml")])
    assert len(manifests) >= 10, manifests
    wrong = {}
    for manifest in manifests:
        project = tomllib.loads(manifest.read_text())["project"]
        spec = versions.core_requirement(project.get("dependencies", []))
        if spec is None or not versions.admits(spec, versions.core_version()):
            wrong[str(manifest.relative_to(root))] = spec
    assert not wrong, f"these manifests pin no hicache-core range that admits {versions.core_version()}: {wrong}"


def test_the_size_rule_says_what_changed_and_since_when():
    dev = hc.MHADevicePool(24, 4, torch.bfloat16, 2, 8, 2, "cpu")
    with pytest.raises(ValueError, match=r"Changed in hicache-core 0\.2\.0: 0\.1 accepted a host pool smaller"):
        hc.make_host_pool(dev, layout="layer_first", io_backend="reference", size=8)


# ---- what 0.2 deprecated and 0.3 kept went in 0.4: each is gone, and what replaces it works --------------------


def test_the_names_announced_to_go_are_gone_and_their_replacements_work(registry):
    import hicache_core.pool.geometry as geometry
    import hicache_core.storage.backend as backend
    import hicache_core.storage.url as url

    split = registry.layouts["page_first_kv_split"]
    assert split.split and not hasattr(split, "split_at")
    with pytest.raises(TypeError, match="split_at"):
        hc.Layout("old_split", ("component", "page", "layer", "token", "head", "dim"), split_at="kv_lora_rank")
    layout = registry.layouts["page_first"]
    assert layout.pool_kinds is None and layout.allows("mla") and not registry.layouts["page_head"].allows("mla")
    assert "mha" in registry.layouts["page_head"].pool_kinds  # a real set
    gone = {url: ("make_storage", "UnknownStorageScheme"), geometry: ("host_layout_spec", "HostPart"),
            backend: ("STORAGE_BATCH_SIZE", "StorageStats", "check_keys", "parallel_checksums")}  # fmt: skip
    for module, names in gone.items():
        for name in names:
            assert not hasattr(module, name), f"{module.__name__}.{name}"
    assert hc.geometry_of.__module__ == "hicache_core.pool.host_pool"  # the face's convenience resolves at the door
