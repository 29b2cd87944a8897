"""install(): what it replaces, what it refuses, and how SGLang's processes get it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest


@pytest.fixture
def uninstalled(adapter):
    """The adapter taken out for one test, and put back after (the session keeps it installed)."""
    adapter.uninstall()
    yield adapter
    adapter.uninstall()
    adapter.install()


def assembler():
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    return hybrid_pool_assembler


def test_install_replaces_build_kv_host_pool_everywhere(uninstalled, monkeypatch):
    from hicache_sglang.build import build_kv_host_pool

    original = assembler().build_kv_host_pool
    assert original is not build_kv_host_pool and not uninstalled.is_installed()
    # A module that imported the name before install(), as SGLang's decode-offload manager does.
    early = types.ModuleType("early_importer")
    early.build_kv_host_pool = original
    monkeypatch.setitem(sys.modules, "early_importer", early)
    uninstalled.install()
    uninstalled.install()  # idempotent
    assert uninstalled.is_installed()
    assert assembler().build_kv_host_pool is build_kv_host_pool and early.build_kv_host_pool is build_kv_host_pool
    uninstalled.uninstall()
    assert assembler().build_kv_host_pool is original and early.build_kv_host_pool is original


def test_host_pool_classes_answer_sglangs_isinstance_checks(adapter):
    from sglang.srt.mem_cache.pool_host.base import HostKVCache
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    assert issubclass(adapter.SGLangMHAHostPool, MHATokenToKVPoolHost)
    assert issubclass(adapter.SGLangMLAHostPool, MLATokenToKVPoolHost)
    assert not issubclass(adapter.SGLangMHAHostPool, MLATokenToKVPoolHost)
    assert issubclass(adapter.SGLangMLAHostPool, HostKVCache)
    # Virtual subclasses: not one method of SGLang's pools is inherited.
    assert MHATokenToKVPoolHost not in adapter.SGLangMHAHostPool.__mro__


@pytest.mark.parametrize("version, found", [("0.5.22", "SGLang 0.5.22 is installed"),
                                            (None, "SGLang is not installed")])  # fmt: skip
def test_another_sglang_version_is_refused(adapter, monkeypatch, version, found):
    import hicache_sglang.installer as inst

    monkeypatch.setattr(inst, "sglang_version", lambda: version)
    with pytest.raises(adapter.NotServedError, match=f"serves SGLang 0.5.23 exactly; {found}"):
        adapter.install()


def test_a_modified_build_kv_host_pool_is_refused(uninstalled, monkeypatch):
    def build_kv_host_pool(*, kv_pool, page_size, use_mla=None, pool_label="kv"):
        raise AssertionError("never called")

    monkeypatch.setattr(assembler(), "build_kv_host_pool", build_kv_host_pool)
    with pytest.raises(uninstalled.NotServedError, match=r"takes \(kv_pool, page_size, use_mla, pool_label\); SGLang "
                                                         r"0.5.23's takes"):  # fmt: skip
        uninstalled.install()
    assert not uninstalled.is_installed()


def test_sglang_plugin_installs_only_when_asked(uninstalled, monkeypatch):
    """SGLang's own plugin loader finds the entry point; HICACHE_SGLANG=1 is what turns it on."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    activate, dist = plugins["hicache"]
    assert dist == "hicache-sglang"
    monkeypatch.delenv("HICACHE_SGLANG", raising=False)
    activate()
    assert not uninstalled.is_installed()
    monkeypatch.setenv("HICACHE_SGLANG", "1")
    activate()
    assert uninstalled.is_installed()


def test_sglang_plugin_failure_is_never_silent(uninstalled, monkeypatch):
    """SGLang logs and ignores a plugin that raises; a failed install must still stop hicache-less serving."""
    import hicache_sglang.installer as inst
    from hicache_sglang._sglang_plugin import activate

    monkeypatch.setattr(assembler(), "build_kv_host_pool", assembler().build_kv_host_pool)  # restored after
    monkeypatch.setattr(inst, "sglang_version", lambda: "0.4.0")
    monkeypatch.setenv("HICACHE_SGLANG", "1")
    with pytest.raises(uninstalled.NotServedError, match="SGLang 0.4.0 is installed"):
        activate()
    with pytest.raises(RuntimeError, match="HICACHE_SGLANG asked for hicache host pools, but installing "
                                           "hicache-sglang failed") as info:  # fmt: skip
        assembler().build_kv_host_pool(kv_pool=None, page_size=1)
    assert isinstance(info.value.__cause__, uninstalled.NotServedError)


def test_sglang_plugin_refuses_a_value_it_does_not_take(uninstalled, monkeypatch):
    """HICACHE_SGLANG=maybe is neither on nor off: never a silent "off", so SGLang's own pools are refused too."""
    from hicache_sglang._sglang_plugin import activate

    from hicache_core.settings import SettingError

    monkeypatch.setattr(assembler(), "build_kv_host_pool", assembler().build_kv_host_pool)  # restored after
    monkeypatch.setenv("HICACHE_SGLANG", "maybe")
    with pytest.raises(SettingError, match=r"^HICACHE_SGLANG='maybe' is not 1 or 0"):
        activate()
    with pytest.raises(RuntimeError, match="HICACHE_SGLANG asked for hicache host pools"):
        assembler().build_kv_host_pool(kv_pool=None, page_size=1)
    assert not uninstalled.is_installed()


# The subprocesses import SGLang with the GPU visible: on a GPU machine without sgl_kernel (see
# conftest.py) that cannot work, and what they check does not depend on the device.
_needs_plain_import = pytest.mark.skipif(
    os.environ.get("HICACHE_TEST_DEVICE", "cpu") != "cpu" and importlib.util.find_spec("sgl_kernel") is None,
    reason="SGLang imports sgl_kernel where it sees a GPU; checked by the CPU run",
)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_SGLANG"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


@_needs_plain_import
def test_launch_server_installs_in_spawned_processes():
    """SGLang starts its schedulers with spawn, which runs the parent's main module as __mp_main__.

    multiprocessing does exactly this (runpy.run_module(name, run_name="__mp_main__")) for a
    parent started with ``python -m hicache_sglang.launch_server``.
    """
    result = _python(
        "import runpy, os, hicache_sglang\n"
        "assert not hicache_sglang.is_installed()\n"
        "runpy.run_module('hicache_sglang.launch_server', run_name='__mp_main__', alter_sys=True)\n"
        "print('installed', hicache_sglang.is_installed(), os.environ['HICACHE_SGLANG'])\n"
    )
    assert result.returncode == 0, result.stderr
    assert "installed True 1" in result.stdout


@_needs_plain_import
def test_launch_server_runs_sglangs_launcher():
    """``python -m hicache_sglang.launch_server --help``: SGLang's own argument parser answers."""
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_SGLANG"}
    result = subprocess.run([sys.executable, "-m", "hicache_sglang.launch_server", "--help"], capture_output=True,
                            text=True, env=env, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--hicache-mem-layout" in result.stdout and "--hicache-io-backend" in result.stdout


def test_uninstall_gives_sglang_its_constructors_back():
    import hicache_sglang
    from hicache_sglang import builders, families
    from sglang.srt.mem_cache.pool_host import dsa

    dsa_family = next(f for f in families.TAKEOVERS if f.attr == "DSAIndexerPoolHost")
    assert dsa.DSAIndexerPoolHost is builders.resolve(dsa_family.builder)
    hicache_sglang.uninstall()
    try:
        assert isinstance(dsa.DSAIndexerPoolHost, type) and dsa.DSAIndexerPoolHost.__module__ == dsa.__name__
        assert not builders._patched
    finally:
        hicache_sglang.install()
    assert dsa.DSAIndexerPoolHost is builders.resolve(dsa_family.builder)


def test_every_family_names_its_builder_and_pool_class():
    """The one family table: each takeover's SGLang constructor exists, and so do its builder and pool class."""
    import importlib

    from hicache_sglang import builders, families

    assert len({f.family for f in families.FAMILIES}) == len(families.FAMILIES)
    assert len({(f.module, f.attr) for f in families.TAKEOVERS}) == len(families.TAKEOVERS)
    for family in families.TAKEOVERS:
        assert callable(builders.resolve(family.builder)), family.family
        assert isinstance(builders.resolve(family.pool_class), type), family.family
        replaced = next(original for module, attr, original in builders._patched
                        if module.__name__ == family.module and attr == family.attr)  # fmt: skip
        assert replaced is not getattr(importlib.import_module(family.module), family.attr)

