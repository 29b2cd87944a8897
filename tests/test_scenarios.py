"""The five requests of design.md's table that SGLang refuses, and what hicache does with each."""

from __future__ import annotations

import json

import pytest
import torch
from core_helpers import DEVICE, device_tensors, fill_random, random_page_slots, same_bytes

import hicache_core as hc
from hicache_core.cli import main


def _kernel_installed(registry) -> bool:
    return "kernel.triton_uva" in registry.implementations


# 1. MHA, head_dim != v_head_dim, io_backend="kernel", page_first_direct, load one layer
def test_scenario_1_without_kernel_plugin_says_what_to_install(without_kernel):
    dev = hc.MHADevicePool(64, 16, torch.bfloat16, 2, 8, 2, DEVICE, v_head_dim=4)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(
            dev, layout="page_first_direct", io_backend="kernel", operations=[hc.LOAD], registry=without_kernel
        )
    message = str(err.value)
    assert "No installed plugin serves io backend 'kernel'" in message
    assert "hicache-kernel (io backend 'kernel') is not installed; it ships in hicache's source tree" in message
    assert "pip install -e " in message and message.rstrip().endswith("plugins/kernel")
    assert "io backends for layout 'page_first_direct': 'direct'" in message
    assert err.value.pool_kind == "mha_asym" and err.value.layout == "page_first_direct"


# 2. MLA, layer-sharded (context parallelism), page_first_kv_split, backup
def test_scenario_2_sharded_mla_kv_split_backup_works(registry):
    dev = hc.MLADevicePool(64, 16, torch.bfloat16, 16, 8, 4, DEVICE, start_layer=2, end_layer=4)
    host = hc.make_host_pool(dev, layout="page_first_kv_split", io_backend="auto", size=64, registry=registry)
    ref = hc.make_host_pool(dev, layout="page_first_kv_split", io_backend="reference", size=64, registry=registry)
    fill_random(device_tensors(dev), seed=1)
    for t in list(host.plan.host_buffers.values()) + list(ref.plan.host_buffers.values()):
        t.zero_()
    h, d = random_page_slots(4, 2, 16, seed=2), random_page_slots(5, 2, 16, seed=3, first=1)
    for layer in range(4):  # what a layer-sharded server runs: per-layer backup of every layer id
        host.backup_from_device_per_layer(dev, h, d, layer, "auto")
        ref.backup_from_device_per_layer(dev, h, d, layer, "reference")
    host.backup_from_device_all_layer(dev, h, d, "auto")
    assert same_bytes(host.k_buffer, ref.k_buffer) and same_bytes(host.v_buffer, ref.v_buffer)
    assert tuple(host.k_buffer.shape) == (4, 2, 16, 1, 16) and tuple(host.v_buffer.shape) == (4, 2, 16, 1, 8)
    assert host.k_buffer.view(torch.uint8).any()


# 3. paged page-row pool, backup all layers, io backend nobody implements
def test_scenario_3_unknown_io_backend_names_what_exists(registry):
    dev = hc.PageRowsDevicePool(8, 64, 8448, 3, DEVICE)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(dev, layout="page_first", io_backend="kdma", registry=registry)
    message = str(err.value)
    assert "No implementation of io backend 'kdma' can run" in message
    assert "No installed plugin serves io backend 'kdma'. Valid io backends: auto, " in message
    assert "direct" in message.split("Valid io backends:")[1].splitlines()[0]
    assert "io backends for layout 'page_first': " in message and "'direct'" in message
    assert err.value.io_backend == "kdma" and err.value.pool_kind == "page_rows"


# 4. asymmetric MHA, load one layer with io backend "memcpy" / None
@pytest.mark.parametrize("io_backend", ["memcpy", None])
def test_scenario_4_invalid_io_backend_lists_valid_ones(io_backend, registry):
    dev = hc.MHADevicePool(64, 16, torch.bfloat16, 2, 8, 2, DEVICE, v_head_dim=4)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(dev, layout="page_first_direct", io_backend=io_backend, registry=registry)
    message = str(err.value)
    assert f"No installed plugin serves io backend {io_backend!r}. Valid io backends: auto, " in message
    assert "direct" in message


# 5. DSA indexer, layer-sharded, page_first, io_backend="kernel", backup per layer
def test_scenario_5_without_kernel_plugin_says_what_to_install(without_kernel):
    dev = hc.PageRowsDevicePool(8, 64, 8448, 4, DEVICE, start_layer=2, end_layer=4)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(
            dev, layout="page_first", io_backend="kernel", operations=[hc.BACKUP_LAYER], registry=without_kernel
        )
    assert "hicache-kernel (io backend 'kernel') is not installed" in str(err.value)
    assert err.value.sharded is True and err.value.operation == hc.BACKUP_LAYER


@pytest.mark.parametrize(
    "argv, resolved",
    [
        (["--pool", "mha_asym", "--layout", "page_first_direct", "--op", "load_to_device_per_layer",
          "--io-backend", "kernel"], "kernel"),
        (["--pool", "mla", "--layout", "page_first_kv_split", "--op", "backup_from_device_per_layer",
          "--io-backend", "auto", "--sharded"], True),
        (["--pool", "page_rows", "--layout", "page_first", "--op", "backup_from_device_all_layer",
          "--io-backend", "kdma"], False),
        (["--pool", "mha_asym", "--layout", "page_first_direct", "--op", "load_to_device_per_layer",
          "--io-backend", "memcpy"], False),
        (["--pool", "page_rows", "--layout", "page_first", "--op", "backup_from_device_per_layer",
          "--io-backend", "kernel", "--sharded"], "kernel"),
    ],
    ids=["scenario1", "scenario2", "scenario3", "scenario4", "scenario5"],
)  # fmt: skip
def test_explain_gives_the_outcomes_of_the_table(argv, resolved, capsys, monkeypatch, registry):
    monkeypatch.setattr("hicache_core.cli.get_registry", lambda: registry)
    code = main(["explain", *argv, "--device", "cuda", "--json"])  # the scenarios are CUDA servers
    out = json.loads(capsys.readouterr().out)
    if resolved == "kernel":  # works once a kernel plugin is installed; until then, the install hint
        resolved = _kernel_installed(registry)
        if not resolved:
            assert "hicache-kernel" in out["error"]
    assert out["resolved"] is resolved and code == (0 if resolved else 1)
    if resolved:
        assert out["implementation"] in registry.implementations and out["plugin"] in registry.plugins
    else:
        assert out["error"].startswith("No implementation of io backend")
