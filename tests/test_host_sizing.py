"""``hicache size``: its figures against SGLang's shapes (the oracle) and against the pools make_host_pool builds."""

from __future__ import annotations

import json

import pytest
import torch

import hicache_core as hc
from hicache_core.cli import main
from hicache_core.host_memory import live_records, read_limits
from hicache_core.plugins.registry import get_registry
from hicache_core.pool.device_pools import DeclaredDevicePool
from hicache_core.tools.sizing import size_host_tier

LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16"}  # fmt: skip
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "num_attention_heads": 128, "hidden_size": 7168,
               "torch_dtype": "bfloat16"}  # fmt: skip
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48, "full_attention_interval": 4,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
              "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"}  # fmt: skip

# Bytes per token (or per request's Mamba state), every layer, from SGLang's device pool shapes.
LLAMA_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x kv heads x head_dim x bf16
DSV3_TOKEN = 61 * (512 + 64) * 2  # layers x (latent + rope) x bf16
QWEN_TOKEN = 2 * 12 * 2 * 256 * 2  # 12 full-attention layers of 48
QWEN_STATE = 36 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)  # SSM fp32 + conv bf16, 36 linear layers


def test_the_three_models_bytes_per_token_equal_sglangs_shapes():
    llama = size_host_tier(LLAMA_3_8B, hicache_size_gb=1.0, device="cpu").pools[0]
    assert (llama.device_bytes_per_unit, llama.host_bytes_per_unit) == (LLAMA_TOKEN, LLAMA_TOKEN)
    assert llama.slots == (int(1e9 // LLAMA_TOKEN) // 64 + 1) * 64  # SGLang: GB * 1e9 // bytes, then a padding page
    dsv3 = size_host_tier(DEEPSEEK_V3, hicache_size_gb=1.0, tp_size=8, device="cpu").pools[0]
    assert dsv3.host_bytes_per_unit == DSV3_TOKEN  # MLA's latent is not split by TP
    kv, state = size_host_tier(QWEN3_NEXT, hicache_size_gb=1.0, device="cpu").pools
    assert (kv.host_bytes_per_unit, state.host_bytes_per_unit, state.unit) == (QWEN_TOKEN, QWEN_STATE, "request")
    assert state.slots == int(1e9 // QWEN_STATE) + 1
    tp4 = size_host_tier(LLAMA_3_8B, hicache_size_gb=1.0, tp_size=4, device="cpu").pools[0]
    assert tp4.host_bytes_per_unit == LLAMA_TOKEN // 4
    assert (
        size_host_tier(LLAMA_3_8B, hicache_size_gb=1.0, tp_size=16, device="cpu").pools[0].host_bytes_per_unit
        == LLAMA_TOKEN // 8
    )  # fmt: skip  (SGLang replicates the 8 KV heads past TP 8)


@pytest.mark.parametrize("model,layout", [(LLAMA_3_8B, "page_first"), (LLAMA_3_8B, "layer_first"),
                                          (DEEPSEEK_V3, "page_first_direct"), (QWEN3_NEXT, "page_first")])  # fmt: skip
def test_the_report_equals_the_pools_make_host_pool_builds_byte_for_byte(model, layout):
    report = size_host_tier(model, hicache_size_gb=0.16 if model is QWEN3_NEXT else 0.02, layout=layout, device="cpu",
                            verify=True)  # fmt: skip
    for pool in report.pools:
        device_pool = _build_device_pool(model, pool)
        host = hc.make_host_pool(device_pool, layout=pool.layout, io_backend="auto", page_size=pool.page_size,
                                 size=pool.slots, label=pool.name, verify=True)  # fmt: skip
        assert host.host_memory.buffers == pool.memory.buffers
        assert (host.host_memory.mapped, host.size) == (pool.memory.mapped, pool.slots)
        assert host.get_size_per_token() == pool.host_bytes_per_unit
        held = {r.label: r.asked for r in live_records() if r.label.startswith(pool.name + ": ")}
        assert held[f"{pool.name}: checksum table"] + held[f"{pool.name}: failure words"] == pool.checksum_table_bytes
        host.destroy()


def _build_device_pool(model, pool):
    """The device pool a server would hold for ``pool``, shaped from the model config (SGLang's shapes)."""
    if pool.unit == "request":
        temporal = 32 * 128 * 128 * 4
        conv = (2 * 16 * 128 + 32 * 128) * 3 * 2
        return DeclaredDevicePool(get_registry().pool_kinds["mamba"], 2, 1, 36, "cpu", dtype=torch.uint8,
                                  rows={"temporal": (temporal,), "conv": (conv,)})  # fmt: skip
    if "kv_lora_rank" in model:
        return hc.MLADevicePool(size=pool.page_size, page_size=pool.page_size, dtype=torch.bfloat16,
                                kv_lora_rank=512, qk_rope_head_dim=64, layer_num=61, device="cpu")  # fmt: skip
    layers = 12 if "full_attention_interval" in model else model["num_hidden_layers"]
    heads, dim = (2, 256) if "full_attention_interval" in model else (8, 128)
    return hc.MHADevicePool(size=pool.page_size, page_size=pool.page_size, dtype=torch.bfloat16, head_num=heads,
                            head_dim=dim, layer_num=layers, device="cpu")  # fmt: skip


def test_a_host_tier_the_machine_cannot_give_is_said_not_to_fit(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    assert main(["size", "--config", str(tmp_path), "--hicache-size", "100000", "--device", "cpu", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and "KV host pool would not fit" in out["refusal"]
    assert out["pools"][0]["host_bytes_per_unit"] == LLAMA_TOKEN and out["pools"][0]["pinned_bytes"] == 0


def test_the_command_prints_the_figures_and_refuses_an_unknown_model(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_NEXT))
    assert main(["size", "--config", str(path), "--hicache-size", "0.05", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert f"bytes per token: device {QWEN_TOKEN}, host {QWEN_TOKEN}" in text
    assert f"bytes per request: device {QWEN_STATE}, host {QWEN_STATE}" in text and "fits" in text
    path.write_text(json.dumps({"num_hidden_layers": 2}))
    assert main(["size", "--config", str(path), "--hicache-size", "1"]) == 2
    assert "the model config has no 'num_attention_heads'" in capsys.readouterr().err


def test_size_checks_every_rank_on_the_host_together(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    available = read_limits().bound()[0]
    gb = f"{available * 0.3 / 1e9:.3f}"  # one rank's pool fits with room to spare; eight of them do not
    args = ["size", "--config", str(tmp_path), "--tp", "8", "--hicache-size", gb, "--device", "cpu"]
    assert main(args) == 1
    text, err = capsys.readouterr()
    assert err.startswith("hicache size: does not fit: 8 ranks on this host need") and err.count("\n") == 1, err
    assert "TP 8 (figures per TP rank); 8 ranks on this host (assumed: every TP rank on this one; " \
           "--ranks-per-host N to change)" in text  # fmt: skip
    assert "does not fit: 8 ranks on this host need" in text and "Ask for a smaller host pool" in text
    assert main([*args, "--ranks-per-host", "1"]) == 0
    text = capsys.readouterr().out
    assert "1 rank on this host (--ranks-per-host)" in text and text.rstrip().endswith("\nfits")
    assert main([*args, "--ranks-per-host", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["ranks_per_host"], out["ranks_per_host_assumed"], out["fits"]) == (2, False, True)
    assert out["bytes_per_host"] == 2 * out["bytes_per_rank"] == 2 * out["pools"][0]["mapped_bytes"]
    assert main([*args, "--ranks-per-host", "0"]) == 2  # bad usage: one line on stderr, nothing on stdout
    out, err = capsys.readouterr()
    assert out == "" and "argument --ranks-per-host: takes an integer from 1 to 2147483647, got '0'" in err
