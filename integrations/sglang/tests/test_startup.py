"""The launcher's start-up checks, ``--help`` section and host-memory reserve, and hicache storage's refusals.

The server-level behaviour (the launcher exits, nothing listens) is in ``e2e/test_e2e_refusals.py``;
these check the messages and the settings on SGLang's own objects, in-process.
"""

from __future__ import annotations

import pytest
from hicache_sglang import NotServedError, startup
from sglang_setup import publish_settings


def test_io_backend_no_plugin_names_what_is_installed():
    with pytest.raises(NotServedError, match=r"no installed hicache plugin serves io backend 'kernel_ascend'\. "
                                             r"Installed io backends: .*direct.*kernel"):  # fmt: skip
        startup.check_io_backend("kernel_ascend")
    startup.check_io_backend("direct")
    startup.check_io_backend("kernel")


@pytest.mark.parametrize("layout", ["page_head", "page_first_kv_split"])
def test_direct_with_a_layout_the_controller_cannot_drive(layout):
    args = publish_settings(layout=layout, io_backend="direct", page_size=16)
    with pytest.raises(NotServedError, match="prepares indices for io backend 'direct' only with layouts"):
        startup.check(args)


REWRITES = [("page_first", "direct", "page_first_direct"), ("page_first_direct", "kernel", "page_first_direct")]


@pytest.mark.parametrize(("layout", "io", "resolved"), REWRITES)
def test_sglang_rewrites_are_checked_after_resolution(layout, io, resolved):
    args = publish_settings(layout=layout, io_backend=io, page_size=16)
    from sglang.srt.arg_groups.overrides import resolving_view

    startup.check(args)  # SGLang rewrote them onto pairs the controller drives
    cfg = resolving_view(args)
    assert (cfg.hicache_mem_layout, cfg.hicache_io_backend) == (resolved, "direct")


def test_host_size_over_budget():
    with pytest.raises(NotServedError, match=r"--hicache-size 1000000 asks for 1000000\.00 GB but only"):
        startup.check_host_size(1_000_000)
    startup.check_host_size(0.001)


def test_host_reserve(monkeypatch):
    from hicache_sglang.host_memory import RESERVE, apply_host_reserve
    from sglang.srt.mem_cache.pool_host import base

    from hicache_core.settings import SettingError

    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", base.HICACHE_HOST_MEMORY_RESERVE_BYTES)
    monkeypatch.setenv(RESERVE.name, "0.5")
    apply_host_reserve()
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 1 << 29
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(RESERVE.name, bad)
        with pytest.raises(SettingError, match=rf"^{RESERVE.name}='{bad}' is not a number of GiB >= 0$"):
            apply_host_reserve()


def test_the_launcher_refuses_a_setting_it_does_not_take(monkeypatch):
    """Every setting is read before SGLang starts; junk ends the launcher, naming the variable and its values."""
    from hicache_sglang.metrics import INTERVAL

    wrapped = startup.wrap_prepare_server_args(
        lambda argv: publish_settings(layout="page_first", io_backend="kernel", page_size=16)
    )
    wrapped([])
    monkeypatch.setenv(INTERVAL.name, "0")
    with pytest.raises(SystemExit) as exit_:
        wrapped([])
    assert exit_.value.code == 2


def test_help_names_what_the_adapter_adds():
    text = startup.help_text()
    needles = ("hicache-sglang", "direct: direct.copy_engine", "kernel:", "HICACHE_SGLANG_HOST_RESERVE_GIB",
               "HICACHE_VALIDATE", "layer_first and page_first_direct", "'hicache-sglang host pool: ...'")  # fmt: skip
    for needle in needles:
        assert needle in text, needle


def _storage_config(**kw):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=False, model_name="m")  # fmt: skip
    base.update(kw)
    return HiCacheStorageConfig(**base)


def test_hicache_storage_refusals(monkeypatch):
    from hicache_sglang.storage import ENV_URL, HicacheStorage, extra_config

    monkeypatch.delenv(ENV_URL, raising=False)
    with pytest.raises(NotServedError, match="hicache storage needs a URL"):
        HicacheStorage(_storage_config(extra_config={"interface_v1": 1}))
    with pytest.raises(NotServedError, match='put "interface_v1": 1'):
        HicacheStorage(_storage_config(extra_config={"url": "memory://x"}))
    with pytest.raises(NotServedError, match="does not serve pipeline parallelism"):
        HicacheStorage(_storage_config(pp_size=2, extra_config={"url": "memory://x", "interface_v1": 1}))
    storage = HicacheStorage(_storage_config(extra_config={"url": "memory://x", "interface_v1": 1}))
    with pytest.raises(NotServedError, match="binds to hicache host pools; SGLang registered a object"):
        storage.register_mem_pool_host(object())
    assert '"class_name": "HicacheStorage"' in extra_config("file:///tmp/x")
