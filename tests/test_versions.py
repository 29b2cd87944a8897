"""The plugin API's version: ranges plugins require, checked at load and shown by ``hicache plugins``."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import hicache_core as hc
import hicache_core.registry as registry_module
from hicache_core import hookimpl, versions
from hicache_core.cli import main
from hicache_core.registry import Registry


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
    assert versions.core_version() == "0.3.0" == versions.CORE_VERSION


class Layouts:
    def __init__(self, name):
        self.name = name

    @hookimpl
    def hicache_register_layouts(self, register):
        axes = ("page", "layer", "component", "token", "head", "dim")
        register(hc.Layout(f"{self.name}_layout", axes if self.name == "old" else axes[1::-1] + axes[2:]))


def _entry_point(name, requires):
    dist = SimpleNamespace(name=f"hicache-{name}", version="0.1.0", requires=requires)
    return SimpleNamespace(name=name, dist=dist, load=lambda: Layouts(name))


def test_hicache_plugins_shows_each_range_and_what_is_incompatible(monkeypatch, capsys):
    hc.get_registry()
    monkeypatch.setattr(registry_module, "_entry_points", lambda: [
        _entry_point("old", ["hicache-core>=0.1,<0.2"]), _entry_point("fits", ["hicache-core>=0.3,<0.4"])])  # fmt: skip
    registry = Registry.from_entry_points()
    old, fits = registry.plugins["old"], registry.plugins["fits"]
    assert old.requires == ">=0.1,<0.2" and fits.requires == ">=0.3,<0.4" and not fits.errors
    assert old.errors == [
        'requires hicache-core >=0.1,<0.2, but 0.3.0 is running: it was written for another plugin API '
        '(docs/plugins.md, "Versions"); install a release of the plugin made for this one'
    ]
    monkeypatch.setattr("hicache_core.cli.get_registry", lambda: registry)
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hicache-core 0.3.0 (plugin API 0.3)\n")
    assert "old (hicache-old 0.1.0): loaded\n    requires hicache-core >=0.1,<0.2: INCOMPATIBLE\n" in text
    assert "fits (hicache-fits 0.1.0): loaded\n    requires hicache-core >=0.3,<0.4: compatible\n" in text
    assert main(["plugins", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert (records["old"]["requires"], records["old"]["compatible"]) == (">=0.1,<0.2", False)
    assert records["fits"]["compatible"] is True and records["hicache_core"]["requires"] is None


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


# ---- what 0.1 plugins wrote keeps working for one minor version, with a warning naming the replacement --


def test_layout_split_at_reads_and_constructs_with_a_warning(registry):
    split = registry.layouts["page_first_kv_split"]
    with pytest.warns(DeprecationWarning, match=r"Layout\.split_at is deprecated since hicache-core 0\.2\.0 and goes "
                                                r"in 0\.3\.0: use Layout\.split"):  # fmt: skip
        assert split.split_at == "kv_lora_rank"
    with pytest.warns(DeprecationWarning, match=r"Layout\.split_at"):
        assert registry.layouts["page_first"].split_at is None
    with pytest.warns(DeprecationWarning, match=r"Layout\(split_at=\.\.\.\) is deprecated.*pass split=True"):
        old = hc.Layout("old_split", ("component", "page", "layer", "token", "head", "dim"), split_at="kv_lora_rank")
    # The same arrangement as the registered split layout; only what a one-part kind is stored as (declared
    # since 0.3.0, unsplit_as) is left unset, as a 0.1 plugin's declaration had it.
    assert old.split and old.unsplit_as is None and old.same_arrangement(dataclasses.replace(split, unsplit_as=None))


def test_pool_kinds_read_as_a_set_works_with_a_warning(registry):
    layout = registry.layouts["page_first"]
    assert layout.pool_kinds == None and not layout.pool_kinds  # noqa: E711 - it is None-like, on purpose
    assert layout.allows("mla") and not registry.layouts["page_head"].allows("mla")
    with pytest.warns(DeprecationWarning, match=r"use layout\.allows\(kind\)"):
        assert "mla" in layout.pool_kinds
    with pytest.warns(DeprecationWarning, match=r"iterating Layout\.pool_kinds"):
        assert "mha" in list(layout.pool_kinds)
    assert "mha" in registry.layouts["page_head"].pool_kinds  # a real set: no warning, as in 0.1


def test_moved_modules_keep_their_old_names_with_a_warning():
    import hicache_core.geometry as geometry
    import hicache_core.storage.url as url
    from hicache_core.host_layout import host_layout_spec
    from hicache_core.storage.make import make_storage

    with pytest.warns(DeprecationWarning, match=r"hicache_core\.storage\.url\.make_storage moved to "
                                                r"hicache_core\.storage\.make_storage"):  # fmt: skip
        assert url.make_storage is make_storage
    with pytest.warns(DeprecationWarning, match=r"hicache_core\.geometry\.host_layout_spec moved"):
        assert geometry.host_layout_spec is host_layout_spec
    with pytest.raises(AttributeError):
        url.no_such_name  # noqa: B018
    assert hc.geometry_of.__module__ == "hicache_core.host_pool"  # the face's convenience resolves at the door
