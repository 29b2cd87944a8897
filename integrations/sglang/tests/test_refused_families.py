"""Families hicache does not serve yet stay SGLang's: refused when SGLang builds them, named at start-up."""

from __future__ import annotations

import importlib
import logging

import pytest


def _refusals():
    from hicache_sglang import builders

    return builders.REFUSALS


@pytest.mark.parametrize("refusal", _refusals(), ids=lambda r: r.family)
def test_builder_refuses_with_the_flag_or_model(refusal):
    from hicache_sglang import NotServedError

    builder = getattr(importlib.import_module(refusal.module), refusal.attr)
    with pytest.raises(NotServedError, match=rf"does not serve SGLang's {refusal.family} host pools") as caught:
        builder(kv_pool=None)
    message = str(caught.value)
    assert refusal.how in message and refusal.pools in message and "half by hicache and half by SGLang" in message


def test_install_names_them_in_one_line(caplog):
    import hicache_sglang
    from hicache_sglang import builders

    hicache_sglang.uninstall()
    with caplog.at_level(logging.INFO, logger="hicache_sglang"):
        hicache_sglang.install()
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache_sglang"]
    assert lines == [builders.not_served_line()] and "\n" not in lines[0]
    assert all(r.family in lines[0] and r.how in lines[0] for r in builders.REFUSALS)


def test_uninstall_gives_sglang_its_constructors_back():
    import hicache_sglang
    from hicache_sglang import builders
    from sglang.srt.mem_cache.pool_host import dsa

    assert dsa.DSAIndexerPoolHost is builders.resolve(builders.TAKEOVERS[0].builder)
    hicache_sglang.uninstall()
    try:
        assert isinstance(dsa.DSAIndexerPoolHost, type) and dsa.DSAIndexerPoolHost.__module__ == dsa.__name__
        assert not builders._patched
    finally:
        hicache_sglang.install()
    assert dsa.DSAIndexerPoolHost is builders.resolve(builders.TAKEOVERS[0].builder)
