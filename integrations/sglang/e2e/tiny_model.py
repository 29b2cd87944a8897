"""Tiny randomly initialised models for SGLang's real server, made offline (no hub, no download).

The weights are random but fixed by a seed, and drawn with a large initialiser range so that
a token's logits depend strongly on the attention over the cached prefix: a KV cache that
comes back wrong changes the greedy output (the negative control checks that it does).
"""

from __future__ import annotations

import json
import os

VOCAB = 512
#: Token ids the prompts use (ids below are the tokenizer's special tokens).
FIRST_WORD = 4


def _tokenizer(path: str) -> None:
    """A word-level tokenizer over ``w0 .. w{VOCAB - FIRST_WORD - 1}``, built with ``tokenizers`` offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": FIRST_WORD + i for i in range(VOCAB - FIRST_WORD)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")  # fmt: skip
    fast.save_pretrained(path)


def make_llama(path: str, *, seed: int = 0) -> str:
    """A 2-layer LlamaForCausalLM (hidden 64, 4 query heads over 2 KV heads of 16) saved under ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return _save(LlamaForCausalLM, config, path, seed)


def make_deepseek_v2(path: str, *, seed: int = 0) -> str:
    """A 2-layer DeepseekV2ForCausalLM (MLA: kv_lora_rank 32, rope 16; dense MLPs) saved under ``path``.

    Not served end to end by the suite: SGLang 0.5.23's CPU engine builds its MLA pool (and
    hicache's host pool for it), then fails the first prefill in its torch_native attention
    backend, which reads the 48-wide latent rows of the MLA pool as 32-wide K heads
    (``RuntimeError: Expected size for first two dimensions of batch2 tensor to be: [4, 32] but
    got: [4, 48]``). Its CPU MLA path is the intel_amx backend, which needs sgl-kernel's CPU
    build and an AMX CPU. Kept to reproduce that (``python tiny_model.py DIR deepseek_v2``).
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,  # both layers dense: no MoE kernels on the CPU
        moe_layer_freq=1,  # read by SGLang's DeepseekV2 (not a transformers field)
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=4096,
        # SGLang's CPU engine builds DeepSeek's rotary embedding only as deepseek_yarn (factor 1: plain RoPE).
        rope_parameters={"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0},  # fmt: skip
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return _save(DeepseekV2ForCausalLM, config, path, seed)


def _save(cls, config, path: str, seed: int) -> str:
    import torch

    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, f)
    return path


if __name__ == "__main__":
    import sys

    makers = {"llama": make_llama, "deepseek_v2": make_deepseek_v2}
    print(makers[sys.argv[2] if len(sys.argv) > 2 else "llama"](sys.argv[1]))
