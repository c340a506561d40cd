"""Small random checkpoints of every family, built with transformers' own classes.

Each case is one transformers config that switches on the options its family exercises (Qwen3's
q/k norms and head_dim != hidden/heads, Gemma 2's soft-capping and alternating windows, Gemma 3's
per-kind RoPE bases and q/k norms, Phi-3's fused projections with partial rotation and LongRoPE).
Windows and LongRoPE's switch are short enough that a test's prompts cross them. Every weight is
random, norms included (a norm of exactly 1 -- or 0 in Gemma's (1 + w) -- hides a wrong formula).
"""

from __future__ import annotations

import os

import torch
import transformers

VOCAB = 211
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, max_position_embeddings=256)

# name -> (transformers config class, model class, overrides)
FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              {"head_dim": 24, "tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3-sliding-bias": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                           {"head_dim": 16, "attention_bias": True, "use_sliding_window": True,
                            "sliding_window": 6, "max_window_layers": 2}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 32, "num_hidden_layers": 5, "sliding_window": 6, "sliding_window_pattern": 3,
                "query_pre_attn_scalar": 20, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"rope_theta": 1e4}),
    "phi3-longrope-partial": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                              {"partial_rotary_factor": 0.75, "max_position_embeddings": 64,
                               "original_max_position_embeddings": 16, "sliding_window": 9,
                               "rope_scaling": {"rope_type": "longrope",
                                                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                "long_factor": [2.0 + 0.3 * i for i in range(6)]}}),
}


def random_family_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A transformers model of family case `name` with every weight random, in eval mode, fp32."""
    cfg_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(seed)
    overrides = {k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}  # transformers mutates them
    hf = model_cls(cfg_cls(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if "gemma" in name else 1.0))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return hf


def save_family_checkpoint(name: str, path: str | os.PathLike, seed: int = 0, sharded: bool = False,
                           dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`random_family_model` saved with save_pretrained at `path` (several shards if `sharded`);
    returns the model (in `dtype`)."""
    hf = random_family_model(name, seed).to(dtype)
    hf.save_pretrained(path, **({"max_shard_size": "40KB"} if sharded else {}))
    return hf
