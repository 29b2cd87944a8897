"""Faulty plugins: each is reported with a message naming it, none is silent, none takes the others down.

Entry points are faked by monkeypatching ``hicache_core.plugins.registry._entry_points``; a
plugin that fails on import is a real module on ``sys.path`` that raises.
"""

from __future__ import annotations

import json
import textwrap
import warnings
from types import SimpleNamespace

import pytest
import torch
from core_helpers import device_pool, device_tensors, fill_random, host_tensors, random_page_slots, same_bytes

import hicache_core as hc
import hicache_core.plugins.registry as registry_module
from hicache_core import hookimpl
from hicache_core.cli import main
from hicache_core.plugins.registry import Registry
from hicache_core.pool.host_pool import TransferError

H = random_page_slots(4, 2, 4, seed=1)
D = random_page_slots(6, 2, 4, seed=2, first=1)


class FakeEntryPoint:
    """What ``importlib.metadata`` hands the registry: a name, a distribution, and ``load()``."""

    def __init__(self, name: str, target, dist: str | None = None, version: str = "1.0") -> None:
        self.name = name
        self.dist = SimpleNamespace(name=dist or f"hicache-{name}", version=version)
        self._target = target

    def load(self):
        if isinstance(self._target, str):  # a module to import, as a real entry point does
            import importlib

            return importlib.import_module(self._target)
        return self._target


def copying(name: str, io_backend: str, priority: int = 0, **attrs) -> type[hc.Implementation]:
    """A correct CPU implementation (the reference copy) under a name and io backend."""

    def load(self, h, d, layer):
        hc.reference_copy(self.plan, h, d, [layer], to_device=True)

    def backup(self, h, d, layer):
        hc.reference_copy(self.plan, h, d, [layer], to_device=False)

    def backup_all(self, h, d):
        hc.reference_copy(self.plan, h, d, range(self.plan.num_layers), to_device=False)

    body = {
        "name": name,
        "io_backend": io_backend,
        "priority": priority,
        "device_types": frozenset({"cpu", "cuda"}),
        "index_dtypes": frozenset({torch.int32, torch.int64}),
        "load_to_device_per_layer": load,
        "backup_from_device_per_layer": backup,
        "backup_from_device_all_layer": backup_all,
        **attrs,
    }
    return type(name.replace(".", "_"), (hc.Implementation,), body)


class Registers:
    """A plugin object whose ``hicache_register_backends`` registers the given objects."""

    def __init__(self, *impls) -> None:
        self.impls = impls

    @hookimpl
    def hicache_register_backends(self, register):
        for impl in self.impls:
            register(impl)


def good_plugin() -> Registers:
    return Registers(copying("good.copy", "goodcopy"))


@pytest.fixture
def entry_points(monkeypatch):
    """Replace the installed plugins with ``direct`` (the real one) plus the fakes given, in a fresh registry.

    The process registry is loaded first, from the real entry points, so the fakes never leak into it.
    """
    hc.get_registry()
    real = [ep for ep in registry_module._entry_points() if ep.name == "direct"]

    def install(*fakes) -> Registry:
        monkeypatch.setattr(registry_module, "_entry_points", lambda: [*real, *fakes])
        return Registry.from_entry_points()

    return install


@pytest.fixture
def default_registry(monkeypatch):
    """The process-wide registry, rebuilt from the fake entry points given, and forgotten afterwards."""
    real = [ep for ep in registry_module._entry_points() if ep.name == "direct"]
    monkeypatch.delenv("HICACHE_PLUGINS", raising=False)

    def install(*fakes) -> Registry:
        monkeypatch.setattr(registry_module, "_entry_points", lambda: [*real, *fakes])
        hc.reset_registry()
        return hc.get_registry()

    yield install
    hc.reset_registry()


def works(registry: Registry, io_backend: str, layout: str = "layer_first") -> None:
    """A backup then a load through ``io_backend`` moves the right bytes."""
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout=layout, io_backend=io_backend, size=24, registry=registry)
    fill_random(device_tensors(dev), seed=5)
    host.backup_from_device_all_layer(dev, H, D, io_backend)
    for t in device_tensors(dev):
        t.zero_()
    host.load_to_device_per_layer(dev, H, D, 1, io_backend)
    original = device_pool("mha", 4)
    fill_random(device_tensors(original), seed=5)
    for slot in D.tolist():
        assert same_bytes(dev.k_buffer[1][slot], original.k_buffer[1][slot])
        assert same_bytes(dev.v_buffer[1][slot], original.v_buffer[1][slot])


def plugins_listing(monkeypatch, capsys, registry: Registry) -> tuple[str, list[dict]]:
    """What ``hicache plugins`` and ``hicache plugins --json`` print for ``registry``."""
    monkeypatch.setattr("hicache_core.cli.get_registry", lambda: registry)
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert main(["plugins", "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


# ---- a plugin that raises on import ---------------------------------------------------------------


def test_a_plugin_that_raises_on_import_is_listed_with_its_error(entry_points, tmp_path, monkeypatch, capsys):
    (tmp_path / "hicache_fault_broken.py").write_text('raise ImportError("needs libfoo.so.3")\n')
    (tmp_path / "hicache_fault_cuda.py").write_text('raise RuntimeError("CUDA driver initialisation failed")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = entry_points(
        FakeEntryPoint("broken", "hicache_fault_broken"),
        FakeEntryPoint("cudainit", "hicache_fault_cuda"),
        FakeEntryPoint("good", good_plugin()),
    )
    broken = registry.plugins["broken"]
    assert broken.status == "failed" and broken.distribution == "hicache-broken"
    assert broken.errors == ["ImportError: needs libfoo.so.3 (at hicache_fault_broken.py:1)"]
    assert registry.plugins["cudainit"].errors[0].startswith("RuntimeError: CUDA driver initialisation failed")
    # the others are untouched
    assert registry.plugins["good"].status == "loaded" and registry.plugins["direct"].status == "loaded"
    works(registry, "goodcopy")
    works(registry, "direct")
    # it shows in `hicache plugins`, and in every dispatch error
    text, records = plugins_listing(monkeypatch, capsys, registry)
    assert "broken (hicache-broken 1.0): failed" in text
    assert "    error: ImportError: needs libfoo.so.3 (at hicache_fault_broken.py:1)" in text
    assert {r["name"]: r["status"] for r in records}["broken"] == "failed"
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="brokenio", registry=registry)
    message = str(err.value)
    assert "Plugins that failed to load or register:" in message
    assert "    broken (hicache-broken): ImportError: needs libfoo.so.3" in message
    assert "    cudainit (hicache-cudainit): RuntimeError: CUDA driver initialisation failed" in message


def test_an_import_failure_reaches_the_process_registry(default_registry, tmp_path, monkeypatch):
    (tmp_path / "hicache_fault_broken2.py").write_text("import hicache_fault_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = default_registry(FakeEntryPoint("broken2", "hicache_fault_broken2"))
    assert (
        "ModuleNotFoundError: No module named 'hicache_fault_no_such_module'" in registry.plugins["broken2"].errors[0]
    )
    with pytest.raises(hc.UnsupportedCombinationError, match="broken2 \\(hicache-broken2\\): ModuleNotFoundError"):
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="kdma")
    host = hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="direct", size=24)
    assert host.implementations["load_to_device_per_layer"] == "direct.copy_engine"


# ---- a plugin whose hook raises, or is declared wrongly --------------------------------------------


class RaisesInRegisterBackends:
    @hookimpl
    def hicache_register_layouts(self, register):
        register(hc.Layout("fault_layout", ("page", "component", "layer", "token", "head", "dim")))

    @hookimpl
    def hicache_register_backends(self, register):
        raise RuntimeError("boom while registering")


class RaisesInRegisterLayouts:
    @hookimpl
    def hicache_register_layouts(self, register):
        register(hc.Layout("bad layout", ("page", "layer", "token", "head", "dim")))


class WrongSignature:
    @hookimpl
    def hicache_register_backends(self, register, device):
        register(copying("wrongsig.copy", "wrongsig"))


class Unmarked:
    def hicache_register_backends(self, register):  # forgot @hookimpl: pluggy would ignore it silently
        register(copying("unmarked.copy", "unmarked"))


class Misspelled:
    @hookimpl
    def hicache_register_backend(self, register):
        register(copying("misspelled.copy", "misspelled"))


def test_a_plugin_whose_hook_raises_is_marked_failed_and_named(entry_points):
    registry = entry_points(
        FakeEntryPoint("raiser", RaisesInRegisterBackends()),
        FakeEntryPoint("badlayout", RaisesInRegisterLayouts()),
        FakeEntryPoint("good", good_plugin()),
    )
    raiser = registry.plugins["raiser"]
    assert raiser.status == "failed" and raiser.refused
    assert len(raiser.errors) == 1
    assert raiser.errors[0].startswith("hicache_register_backends raised RuntimeError: boom while registering (at ")
    # refused at load: the layout its earlier hook registered is withdrawn, and the error says so
    assert raiser.errors[0].endswith("; refused at load, withdrawn: layout fault_layout")
    assert raiser.layouts == [] and "fault_layout" not in registry.layouts
    badlayout = registry.plugins["badlayout"]
    assert badlayout.status == "failed"
    assert badlayout.errors[0].startswith("hicache_register_layouts raised ValueError: invalid layout 'bad layout'")
    works(registry, "goodcopy")


def test_a_hook_with_a_wrong_signature_is_refused_by_name(entry_points):
    registry = entry_points(FakeEntryPoint("wrongsig", WrongSignature()), FakeEntryPoint("good", good_plugin()))
    record = registry.plugins["wrongsig"]
    assert record.status == "failed" and "wrongsig.copy" not in registry.implementations
    assert record.errors[0].startswith("PluginValidationError: ")
    assert "hicache_register_backends" in record.errors[0] and "device" in record.errors[0]
    works(registry, "goodcopy")


def test_unmarked_and_misspelled_hooks_are_not_silent(entry_points):
    registry = entry_points(
        FakeEntryPoint("unmarked", Unmarked()),
        FakeEntryPoint("misspelled", Misspelled()),
        FakeEntryPoint("good", good_plugin()),
    )
    unmarked = registry.plugins["unmarked"]
    assert unmarked.status == "failed"
    assert unmarked.errors == [
        "implements no hicache hook (hicache_register_backends defined but not marked): "
        "mark hook functions with @hicache_core.hookimpl"
    ]
    misspelled = registry.plugins["misspelled"]
    assert misspelled.status == "failed"
    assert misspelled.errors[0] == (
        "implements hicache_register_backend, not a hicache hook "
        "(hooks: hicache_register_backends, hicache_register_layouts, hicache_register_pool_kinds, "
        "hicache_register_storage_backends)"
    )
    assert not misspelled.implementations and not unmarked.implementations
    works(registry, "goodcopy")


# ---- a plugin that registers a malformed implementation or layout ---------------------------------


class NotAnImplementation:
    name = "plain.class"


def test_malformed_implementations_are_refused_one_by_one(entry_points, capsys, monkeypatch):
    def unimplemented_load(cls):
        del cls.load_to_device_per_layer
        return cls

    malformed = Registers(
        "just a string",
        NotAnImplementation,
        copying("", "noname"),
        copying("malformed.auto", "auto"),
        copying("malformed.teleport", "tele", operations=frozenset({"teleport"})),
        unimplemented_load(copying("malformed.noload", "noload")),
        copying("malformed.gpu_index", "gpuidx", index_device="gpu"),
        copying("direct.copy_engine", "direct"),
        copying("malformed.ok", "malformed_ok"),
    )
    registry = entry_points(FakeEntryPoint("malformed", malformed), FakeEntryPoint("good", good_plugin()))
    record = registry.plugins["malformed"]
    errors = "\n".join(record.errors)
    assert "registered 'just a string', which is not a subclass of hicache_core.Implementation" in errors
    assert "registered <class 'test_plugin_faults.NotAnImplementation'>, which is not a subclass" in errors
    assert "'name' must be a non-empty string" in errors
    assert "implementation malformed_auto refused: 'io_backend' must be a non-empty string other than 'auto'" in errors
    assert "unknown operations ['teleport']" in errors
    assert (
        "implementation malformed_noload refused: claims load_to_device_per_layer but does not implement it" in errors
    )
    assert "'index_device' must be one of ('cpu', 'device'), got 'gpu'" in errors
    assert "implementation name 'direct.copy_engine' is already registered by direct" in errors
    assert len(record.errors) == 8
    # its well-formed implementation stands; the real direct is still the real direct
    assert record.implementations == ["malformed.ok"]
    assert registry.implementations["direct.copy_engine"].__module__ == "hicache_direct.copy_engine"
    works(registry, "malformed_ok")
    works(registry, "direct")
    works(registry, "goodcopy")
    text, _ = plugins_listing(monkeypatch, capsys, registry)
    assert "    error: implementation malformed_noload refused: claims load_to_device_per_layer" in text


class MalformedLayouts:
    @hookimpl
    def hicache_register_layouts(self, register):
        register("page_first")
        register(hc.Layout("page_first", ("component", "layer", "page", "token", "head", "dim")))
        register(hc.Layout("fine_layout", ("page", "component", "layer", "token", "head", "dim")))


class LayoutNamedReference:
    @hookimpl
    def hicache_register_layouts(self, register):
        register(hc.Layout("reference", ("page", "layer", "component", "token", "head", "dim")))


def test_owners_are_kept_per_kind_of_declaration():
    """A layout named like an implementation does not take over that implementation's owner."""
    registry = Registry()
    registry.add_plugin(LayoutNamedReference(), "namesake")
    assert registry.plugin_of("reference") == "hicache_core"
    assert registry.plugin_of("reference", "layout") == "namesake"
    assert registry.plugin_of("memory", "storage backend") == registry.plugin_of_storage("memory") == "hicache_core"
    assert registry.plugin_of("mla", "pool kind") == "hicache_core"


def test_malformed_layouts_are_refused_and_builtins_are_kept(entry_points):
    registry = entry_points(FakeEntryPoint("layouts", MalformedLayouts()))
    record = registry.plugins["layouts"]
    assert record.errors == [
        "registered 'page_first', which is not a hicache_core.Layout",
        "layout 'page_first' refused: layout 'page_first' is already registered by hicache_core",
    ]
    assert record.layouts == ["fine_layout"]
    assert registry.layouts["page_first"].axes == ("component", "page", "token", "layer", "head", "dim")
    works(registry, "direct", layout="fine_layout")


# ---- two plugins whose claims collide ------------------------------------------------------------


def test_two_plugins_claiming_the_same_request_at_one_priority_warn_naming_both(entry_points):
    registry = entry_points(
        FakeEntryPoint("beta", Registers(copying("beta.copy", "twin", priority=7))),
        FakeEntryPoint("alpha", Registers(copying("alpha.copy", "twin", priority=7))),
    )
    dev = device_pool("mha", 4)
    with pytest.warns(UserWarning) as caught:
        host = hc.make_host_pool(dev, layout="layer_first", io_backend="twin", size=24, registry=registry)
    messages = {str(w.message) for w in caught}
    assert (
        "hicache: alpha.copy (plugin alpha) and beta.copy (plugin beta) claim the same request at priority 7; "
        "alpha.copy is chosen by name. Give them different priorities."
    ) in messages
    assert set(host.implementations.values()) == {"alpha.copy"}
    # forcing one of them is not a tie, and says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forced = hc.make_host_pool(
            dev, layout="layer_first", io_backend="twin", size=24, registry=registry, implementation="beta.copy"
        )
    assert set(forced.implementations.values()) == {"beta.copy"}


def test_different_priorities_do_not_collide(entry_points):
    registry = entry_points(
        FakeEntryPoint("alpha", Registers(copying("alpha.copy", "twin", priority=7))),
        FakeEntryPoint("beta", Registers(copying("beta.copy", "twin", priority=8))),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host = hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="twin", registry=registry)
    assert set(host.implementations.values()) == {"beta.copy"}


def test_two_plugins_with_one_entry_point_name_are_both_kept_and_flagged(entry_points):
    registry = entry_points(
        FakeEntryPoint("blob", Registers(copying("blob_a.copy", "blob_a")), dist="hicache-blob-a"),
        FakeEntryPoint("blob", Registers(copying("blob_b.copy", "blob_b")), dist="hicache-blob-b"),
    )
    first, second = registry.plugins["blob"], registry.plugins["blob@hicache-blob-b"]
    assert first.implementations == ["blob_a.copy"] and not first.errors
    assert second.implementations == ["blob_b.copy"]
    assert second.errors == ["entry point name 'blob' is also used by hicache-blob-a; loaded as 'blob@hicache-blob-b'"]
    assert registry.plugin_of("blob_b.copy") == "blob@hicache-blob-b"
    works(registry, "blob_a")
    works(registry, "blob_b")


def test_a_plugin_named_in_hicache_plugins_but_not_installed_is_reported(entry_points, monkeypatch):
    monkeypatch.setattr(registry_module, "_entry_points", lambda: [FakeEntryPoint("good", good_plugin())])
    registry = Registry.from_entry_points({"good", "kernal"})
    assert registry.plugins["kernal"].status == "missing"
    assert registry.plugins["kernal"].errors == [
        "HICACHE_PLUGINS names 'kernal', but no installed plugin has that entry point or distribution"
    ]
    with pytest.raises(hc.UnsupportedCombinationError, match="HICACHE_PLUGINS names 'kernal'"):
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="kernel", registry=registry)
    works(registry, "goodcopy")


# ---- a plugin that raises mid-transfer, or while deciding ------------------------------------------


class Flaky(hc.Implementation):
    """Loads raise as a hung DMA engine would; backups work."""

    name = "flaky.copy"
    io_backend = "flaky"
    device_types = frozenset({"cpu", "cuda"})

    def load_to_device_per_layer(self, h, d, layer):
        raise RuntimeError("DMA engine hung")

    def backup_from_device_per_layer(self, h, d, layer):
        hc.reference_copy(self.plan, h, d, [layer], to_device=False)

    def backup_from_device_all_layer(self, h, d):
        if int(h.max()) >= self.plan.num_items:
            raise IndexError(f"host slot {int(h.max())} is past the end")
        hc.reference_copy(self.plan, h, d, range(self.plan.num_layers), to_device=False)


def test_an_implementation_raising_mid_transfer_is_named_with_its_plugin(default_registry):
    default_registry(FakeEntryPoint("flaky", Registers(Flaky)))
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="flaky", size=24)
    fill_random(device_tensors(dev) + host_tensors(host), seed=9)
    with pytest.raises(TransferError) as err:
        host.load_to_device_per_layer(dev, H, D, 1, "flaky")
    assert str(err.value) == (
        "flaky.copy (plugin flaky, io backend 'flaky') raised during load_to_device_per_layer: "
        "RuntimeError: DMA engine hung"
    )
    assert (err.value.implementation, err.value.plugin, err.value.operation) == (
        "flaky.copy",
        "flaky",
        "load_to_device_per_layer",
    )
    assert isinstance(err.value.__cause__, RuntimeError)
    # input errors raised inside keep their type (callers catch them as bad input) and name the implementation
    with pytest.raises(IndexError) as bad:
        host.backup_from_device_all_layer(dev, H + 16, D, "flaky")
    assert any("raised by flaky.copy" in note for note in getattr(bad.value, "__notes__", []))
    # the same pool's other operations, and other plugins' pools, go on working
    host.backup_from_device_all_layer(dev, H, D, "flaky")
    for slot, src in zip(H.tolist(), D.tolist()):
        assert same_bytes(host.k_buffer[0][slot], dev.k_buffer[0][src])
    works(hc.get_registry(), "direct")


def test_mid_transfer_errors_name_the_plugin_with_a_custom_registry(entry_points):
    registry = entry_points(FakeEntryPoint("flaky", Registers(Flaky)))
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="flaky", size=24, registry=registry)
    with pytest.raises(TransferError, match=r"flaky.copy \(plugin flaky,"):
        host.load_to_device_per_layer(dev, H, D, 1, "flaky")


class ShakyReasons(hc.Implementation):
    name = "shaky.buggy"
    io_backend = "shaky"
    priority = 20
    device_types = frozenset({"cpu"})

    @classmethod
    def not_supported_reasons(cls, request):
        return super().not_supported_reasons(request) + [request.geometry.extra("no_such_attribute")]

    def load_to_device_per_layer(self, h, d, layer):
        raise AssertionError("never chosen")

    backup_from_device_per_layer = backup_from_device_all_layer = load_to_device_per_layer


def test_an_implementation_raising_while_deciding_is_refused_at_load(entry_points):
    fallback = copying("shaky.fallback", "shaky", priority=10)
    other = copying("steady.copy", "steady")
    registry = entry_points(FakeEntryPoint("shaky", Registers(ShakyReasons, fallback)),
                            FakeEntryPoint("steady", Registers(other)))  # fmt: skip
    record = registry.plugins["shaky"]
    assert record.status == "failed" and record.refused
    assert record.errors[0].startswith(
        "implementation shaky.buggy: not_supported_reasons raised ValueError: the mha pool has no attribute "
        "'no_such_attribute'"
    )
    assert "refused at load, withdrawn: implementation shaky.buggy, implementation shaky.fallback" in record.errors[0]
    assert "shaky.buggy" not in registry.implementations and "shaky.fallback" not in registry.implementations
    works(registry, "steady")  # the other plugins are untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing surfaces inside dispatch: the refusal happened at load
        with pytest.raises(hc.UnsupportedCombinationError) as err:
            hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="shaky", registry=registry)
    message = str(err.value)
    assert "): implementation shaky.buggy: not_supported_reasons raised ValueError" in message


class FailsToConstruct(hc.Implementation):
    name = "ctor.fails"
    io_backend = "ctorfail"
    device_types = frozenset({"cpu", "cuda"})  # the suite runs on CUDA pools too (HICACHE_TEST_DEVICE)

    def __init__(self, plan):
        raise RuntimeError("could not map host memory")

    def load_to_device_per_layer(self, h, d, layer):
        pass

    backup_from_device_per_layer = backup_from_device_all_layer = load_to_device_per_layer


def test_an_implementation_failing_to_construct_is_named(default_registry):
    default_registry(FakeEntryPoint("ctor", Registers(FailsToConstruct)))
    with pytest.raises(Exception, match=r"ctor\.fails.*plugin ctor.*could not map host memory"):
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="ctorfail")


# ---- all at once ---------------------------------------------------------------------------------


def test_all_faults_at_once_take_nothing_else_down(entry_points, tmp_path, monkeypatch, capsys):
    (tmp_path / "hicache_fault_broken3.py").write_text(
        textwrap.dedent(
            """
            from hicache_core import hookimpl

            raise ImportError("compiled against another torch")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = entry_points(
        FakeEntryPoint("broken", "hicache_fault_broken3"),
        FakeEntryPoint("raiser", RaisesInRegisterBackends()),
        FakeEntryPoint("wrongsig", WrongSignature()),
        FakeEntryPoint("unmarked", Unmarked()),
        FakeEntryPoint("malformed", Registers(copying("", "noname"))),
        FakeEntryPoint("flaky", Registers(Flaky)),
        FakeEntryPoint("good", good_plugin()),
    )
    text, records = plugins_listing(monkeypatch, capsys, registry)
    status = {r["name"]: r["status"] for r in records}
    assert status == {
        "hicache_core": "loaded",
        "broken": "failed",
        "direct": "loaded",
        "flaky": "loaded",
        "good": "loaded",
        "malformed": "loaded",
        "raiser": "failed",
        "unmarked": "failed",
        "wrongsig": "failed",
    }
    errors = {r["name"]: r["errors"] for r in records}
    assert all(errors[name] for name in ("broken", "raiser", "wrongsig", "unmarked", "malformed"))
    assert not any(errors[name] for name in ("hicache_core", "direct", "flaky", "good"))
    works(registry, "direct")
    works(registry, "goodcopy")
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="flaky", size=24, registry=registry)
    with pytest.raises(TransferError, match="DMA engine hung"):
        host.load_to_device_per_layer(dev, H, D, 0, "flaky")
    works(registry, "direct")
