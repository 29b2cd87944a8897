"""A tiny randomly initialised Llama and a word-level tokenizer, written by the tests (nothing downloaded).

vLLM's CPU attention wants head_dim >= 32 and blocks of a multiple of 32 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
WORDS = [f"w{i}" for i in range(VOCAB - 3)]


def make_llama(path: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write a 2-layer Llama (hidden 64, 2 heads of 32, 1 KV head, fp32) and its tokenizer under ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        torch_dtype="float32", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float32)
    # Spread the weights so that greedy decoding does not settle on one token.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 4096
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` token ids (never the special ones), the same for the same seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def make_mla(path: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write a 2-layer DeepSeek-V2 (multi-head latent attention, dense MLPs, fp32) and its tokenizer."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=layers,
        max_position_embeddings=4096, torch_dtype="float32", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        rope_scaling=None,
    )  # fmt: skip
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return path
