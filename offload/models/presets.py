"""Presets: the shapes of released models, so `--model 8B` plans, dry-runs and benchmarks without
the checkpoint. Parameter counts are checked against the published ones in tests/test_families_infer.py."""

from __future__ import annotations

from offload.models.config import ConfigError, ModelConfig

# ---- presets --------------------------------------------------------------------------------
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    # A few hundred thousand parameters: fast enough for any unit test.
    "tiny": ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        bos_token_id=1, eos_token_id=2),
    # ~100M with tied embeddings: a training benchmark that fits anywhere.
    "small": ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                         tie_word_embeddings=True, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-3.2-1B
    "1B": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE),
                      max_position_embeddings=131072, tie_word_embeddings=True,
                      bos_token_id=128000, eos_token_id=128001, dtype="bfloat16"),
    # meta-llama/Llama-3.2-3B
    "3B": ModelConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                      head_dim=128, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE),
                      max_position_embeddings=131072, tie_word_embeddings=True,
                      bos_token_id=128000, eos_token_id=128001, dtype="bfloat16"),
    # meta-llama/Llama-2-7b-hf
    "7B": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, dtype="float16"),
    # meta-llama/Meta-Llama-3-8B
    "8B": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=8192,
                      bos_token_id=128000, eos_token_id=128001, dtype="bfloat16"),
    # meta-llama/Llama-2-13b-hf
    "13B": ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, dtype="float16"),
    # meta-llama/Llama-2-70b-hf
    "70B": ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, dtype="float16"),
    # mistralai/Mistral-7B-v0.1
    "mistral-7B": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              max_position_embeddings=32768, sliding_window=4096,
                              architecture="MistralForCausalLM", bos_token_id=1, eos_token_id=2,
                              dtype="bfloat16"),
    # Qwen/Qwen2.5-0.5B
    "qwen2-0.5B": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                              attention_bias=True, tie_word_embeddings=True,
                              architecture="Qwen2ForCausalLM", bos_token_id=151643,
                              eos_token_id=151643, dtype="bfloat16"),
}
PRESETS["100M"] = PRESETS["small"]


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def _gemma3_layers(n: int, pattern: int = 6) -> tuple[str, ...]:
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))


PRESETS.update({
    # Qwen/Qwen3-8B (published: 8.2B parameters)
    "qwen3-8B": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            max_position_embeddings=40960, architecture="Qwen3ForCausalLM",
                            qk_norm=True, bos_token_id=151643, eos_token_id=151645, dtype="bfloat16"),
    # Qwen/Qwen3-32B (published: 32.8B)
    "qwen3-32B": ModelConfig(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                             num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                             head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                             max_position_embeddings=40960, architecture="Qwen3ForCausalLM",
                             qk_norm=True, bos_token_id=151643, eos_token_id=151645, dtype="bfloat16"),
    # google/gemma-3-27b-it's text decoder (published: 27.4B with its 0.42B SigLIP vision tower)
    "gemma3-27B": ModelConfig(vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                              num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                              head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0},
                              rope_local_theta=10000.0, max_position_embeddings=131072,
                              sliding_window=1024, layer_types=_gemma3_layers(62),
                              query_pre_attn_scalar=168, tie_word_embeddings=True,
                              architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh",
                              norm_style="gemma", sandwich_norms=True, qk_norm=True, embed_scale=True,
                              bos_token_id=2, eos_token_id=(1, 106), pad_token_id=0, dtype="bfloat16"),
    # google/gemma-3-270m (published: 268M), the suite's second real model
    "gemma3-270M": ModelConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                               rope_local_theta=10000.0, max_position_embeddings=32768,
                               sliding_window=512, layer_types=_gemma3_layers(18),
                               query_pre_attn_scalar=256, tie_word_embeddings=True,
                               architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh",
                               norm_style="gemma", sandwich_norms=True, qk_norm=True, embed_scale=True,
                               bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16"),
    # microsoft/phi-4 (published: 14.7B)
    "phi4-14B": ModelConfig(vocab_size=100352, hidden_size=5120, intermediate_size=17920,
                            num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                            rms_norm_eps=1e-5, rope_theta=250000.0, max_position_embeddings=16384,
                            architecture="Phi3ForCausalLM", fused_projections=True,
                            bos_token_id=100257, eos_token_id=100265, pad_token_id=100349,
                            dtype="bfloat16"),
})
# ---- mixtures of experts ----------------------------------------------------------------------
PRESETS.update({
    # Qwen/Qwen3-30B-A3B (published: 30.5B, 3.3B activated)
    "qwen3-30B-A3B": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                 head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                 max_position_embeddings=40960, architecture="Qwen3MoeForCausalLM",
                                 qk_norm=True, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, norm_topk_prob=True,
                                 router_aux_loss_coef=0.001, bos_token_id=151643,
                                 eos_token_id=151645, dtype="bfloat16"),
    # Qwen/Qwen3-235B-A22B (published: 235B, 22B activated)
    "qwen3-235B-A22B": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                   num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                   head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                   max_position_embeddings=40960, architecture="Qwen3MoeForCausalLM",
                                   qk_norm=True, num_experts=128, num_experts_per_tok=8,
                                   moe_intermediate_size=1536, norm_topk_prob=True,
                                   router_aux_loss_coef=0.001, bos_token_id=151643,
                                   eos_token_id=151645, dtype="bfloat16"),
    # mistralai/Mixtral-8x7B-v0.1 (published: 46.7B, 12.9B active)
    "mixtral-8x7B": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
                                architecture="MixtralForCausalLM", num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, moe_router="softmax_topk_fp32",
                                router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2,
                                dtype="bfloat16"),
})
# openai/gpt-oss-20b and -120b (OpenAI's model card: 20.91B total, 3.61B active; 116.83B, 5.13B),
# as their config.json describes them (experts stored MXFP4 there; shapes here)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _gpt_oss(layers: int, experts: int) -> ModelConfig:
    return ModelConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                       num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
                       rope_scaling=dict(_GPT_OSS_ROPE), max_position_embeddings=131072,
                       attention_bias=True, o_proj_bias=True, sliding_window=128, norm_style="fp32_scale",
                       layer_types=_gemma3_layers(layers, 2), architecture="GptOssForCausalLM",
                       num_experts=experts, num_experts_per_tok=4, moe_router="topk_softmax",
                       attention_sinks=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                       router_aux_loss_coef=0.9, eos_token_id=200002, pad_token_id=199999,
                       dtype="bfloat16")


PRESETS.update({"gpt-oss-20b": _gpt_oss(24, 32), "gpt-oss-120b": _gpt_oss(36, 128)})
# deepseek-ai/DeepSeek-V3 (and -V3.1, -R1, Kimi-K2 at other sizes) as its config.json describes it:
# latent attention, 3 dense layers then 58 MoE layers of 256 routed experts (top-8 of the best 4
# of 8 groups) and one shared; published 671B (its 14B multi-token-prediction layer aside, as
# transformers builds it), 37B activated
PRESETS["deepseek-v3"] = ModelConfig(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    max_position_embeddings=163840, architecture="DeepseekV3ForCausalLM", num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True, moe_router="sigmoid_group_topk",
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_interleave=True, first_k_dense_replace=3, n_shared_experts=1, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, dtype="bfloat16")
# published parameter counts the presets are held to (within 1%: tests/test_families_infer.py)
PUBLISHED_PARAMS = {"qwen3-8B": 8.19e9, "qwen3-32B": 32.8e9, "gemma3-27B": 27.43e9 - 0.417e9,
                    "gemma3-270M": 268e6, "phi4-14B": 14.7e9, "1B": 1.24e9, "3B": 3.21e9,
                    "8B": 8.03e9, "7B": 6.74e9, "13B": 13.0e9, "70B": 69.0e9, "mistral-7B": 7.24e9,
                    "qwen3-30B-A3B": 30.5e9, "qwen3-235B-A22B": 235e9, "mixtral-8x7B": 46.7e9,
                    "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9, "deepseek-v3": 671e9}
# published parameters active per token (config.num_active_params: tests/test_moe.py). Qwen3-30B-A3B's
# "3.3B" is 3.35B cut to two digits: the count is held to that (3.3 <= n / 1e9 < 3.4), the others to 1%
PUBLISHED_ACTIVE = {"qwen3-30B-A3B": 3.3e9, "qwen3-235B-A22B": 22e9, "mixtral-8x7B": 12.9e9}
# gpt-oss's (tests/test_gpt_oss.py, 1%), apart: tests/test_moe.py holds PUBLISHED_ACTIVE's experts
# to 3 x hidden x width parameters each, and gpt-oss's carry biases besides (config.expert_params)
PUBLISHED_ACTIVE_GPT_OSS = {"gpt-oss-20b": 3.61e9, "gpt-oss-120b": 5.13e9}
# DeepSeek-V3's "37B activated" (tests/test_deepseek_v3.py: 37.55B, held to 37 <= n / 1e9 < 38 as
# Qwen3-30B-A3B's "3.3B" is), apart: its dense layers' experts are no 3 x hidden x width each
PUBLISHED_ACTIVE_DEEPSEEK = {"deepseek-v3": 37e9}
