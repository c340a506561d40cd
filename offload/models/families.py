"""Each family's config.json, read into a ModelConfig and written back as transformers writes it.

One decoder (llama.py) serves every family; what differs is which options a family's
config.json switches on, each family's defaults for keys a config leaves out (they differ: a
Gemma config that omits tie_word_embeddings is tied, a Qwen3 one that omits head_dim has 128),
and which combinations transformers can express at all. Every key read here was checked
against transformers' configuration_<family>.py and modeling_<family>.py (5.24):

| family   | options                                                                   |
|----------|---------------------------------------------------------------------------|
| llama    | attention_bias (q, k, v and o), mlp_bias                                  |
| mistral  | sliding_window on every layer                                             |
| qwen2    | q/k/v bias                                                                |
| qwen3    | q/k norms; attention_bias on q, k, v, o; per-layer sliding window         |
| gemma2   | (1 + w) norms around attention and MLP, GeGLU, embedding scale,           |
|          | query_pre_attn_scalar, attention and final logit soft-capping,            |
|          | sliding window on alternate layers                                        |
| gemma3   | gemma2 without soft-capping by default, plus q/k norms, sliding layers    |
|          | with their own RoPE base (5 of 6 layers)                                  |
| phi3     | fused qkv_proj and gate_up_proj, partial rotation, LongRoPE, a sliding    |
|          | window on every layer                                                     |
| qwen3_moe| qwen3's attention (window on every layer) + a sparse MoE MLP on every     |
|          | layer: softmax router, top-k, norm_topk_prob                              |
| olmoe    | q/k norms over the whole q/k projection width, clip_qkv, sparse MoE MLP   |
| mixtral  | mistral's attention + a sparse MoE MLP (`block_sparse_moe`, experts'      |
|          | w1/w3/w2), top-k always renormalised, routing weights kept in fp32        |
| gpt_oss  | q/k/v/o bias, attention sinks, sliding window on alternate layers, YaRN;  |
|          | MoE: biased router (`mlp.router`), top-k then softmax over the k, experts |
|          | with biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit)           |
| deepseek_v3 | multi-head latent attention (mla.py), interleaved RoPE, YaRN mscale;   |
|          | dense MLP on the first first_k_dense_replace layers, then MoE: sigmoid    |
|          | group-limited router with a score-correction bias, shared experts         |

RoPE in config.json comes in two spellings. Real hub checkpoints (written by transformers 4.x)
carry a top-level `rope_theta` plus an optional `rope_scaling` dict; transformers 5 writes one
`rope_parameters` dict that holds `rope_theta` and `rope_type` together (per layer kind for
Gemma 3). transformers reads both (a non-null `rope_scaling` wins over `rope_parameters`;
`rope_theta` inside the dict wins over the top-level one). We read both with the same priority
and write `rope_parameters` plus `rope_theta`/`rope_scaling`, so a 4.x reader also gets the
scaling right.
"""

from __future__ import annotations

from typing import Any, Mapping

# ModelConfig (config.py) is built on this file: a config here is any object with its fields.
ModelConfig = Any

# architecture name in config.json -> model_type transformers expects next to it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


class ConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message says which field and why."""


GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GPT_OSS = "GptOssForCausalLM"
DEEPSEEK = "DeepseekV3ForCausalLM"  # also Kimi-K2 and Moonlight (model_type kimi_k2 / deepseek_v3)
MOE = ("Qwen3MoeForCausalLM", "OlmoeForCausalLM", "MixtralForCausalLM", GPT_OSS, DEEPSEEK)
# per MoE architecture: the MoE module's name in a layer, and each expert's (gate, up, down)
# projections -- the names transformers' save_pretrained writes (Mixtral keeps its original
# checkpoint's `block_sparse_moe.experts.E.w1/w3/w2`; transformers renames them on load)
MOE_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "OlmoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}
# how routing weights are made: softmax over every expert in fp32, top-k, renormalised when
# norm_topk_prob; "softmax_topk" casts them to the compute dtype before they scale the experts'
# outputs (Qwen3-MoE, OLMoE), "softmax_topk_fp32" keeps them in fp32 (Mixtral); "topk_softmax":
# the top-k of the biased router's logits, softmax over those k in the compute dtype (gpt-oss);
# "sigmoid_group_topk": sigmoid scores in fp32, top-k among the best topk_group of n_group groups
# by the scores plus a correction bias, weighted by the unbiased scores (DeepSeek-V3)
ROUTERS = ("softmax_topk", "softmax_topk_fp32", "topk_softmax", "sigmoid_group_topk")
SLIDING, FULL = "sliding_attention", "full_attention"

# keys a config may leave out, per family: transformers' own defaults for them
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "MistralForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                         "head_dim": 128, "tie_word_embeddings": False, "sliding_window": 4096,
                         "max_window_layers": 28},
    "Gemma2ForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                          "head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                          "query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0,
                          "attn_logit_softcapping": 50.0, "pad_token_id": 0, "eos_token_id": 1,
                          "bos_token_id": 2},
    "Gemma3ForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                          "head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                          "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
                          "attn_logit_softcapping": None, "pad_token_id": 0, "eos_token_id": 1,
                          "bos_token_id": 2},
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                        "tie_word_embeddings": False, "original_max_position_embeddings": 4096,
                        "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000},
    # no head_dim default: Qwen3-MoE and OLMoE take hidden_size / num_attention_heads
    "Qwen3MoeForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                            "tie_word_embeddings": False, "sliding_window": 4096, "num_experts": 128,
                            "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                            "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    "OlmoeForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                         "tie_word_embeddings": False, "num_experts": 64, "num_experts_per_tok": 8,
                         "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "pad_token_id": 1,
                         "eos_token_id": 50279},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                           "rope_theta": 1_000_000.0, "tie_word_embeddings": False, "num_experts": 8,
                           "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                           "bos_token_id": 1, "eos_token_id": 2},
    GPT_OSS: {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 150000.0,
              "head_dim": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
              "sliding_window": 128, "attention_bias": True, "num_experts": 128,
              "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001, "swiglu_alpha": 1.702,
              "swiglu_limit": 7.0},
    DEEPSEEK: {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
               "norm_topk_prob": True, "bos_token_id": 0, "eos_token_id": 1, "num_experts": 256,
               "n_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "rope_interleave": True,
               "num_nextn_predict_layers": 1},
}
# DeepSeek-V3's own keys, carried into ModelConfig under the same names
_DEEPSEEK_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                  "topk_group", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
                  "num_nextn_predict_layers")
_NOT_DEEPSEEK = {**dict.fromkeys(_DEEPSEEK_KEYS, 0), "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "q_lora_rank": None, "rope_interleave": False}
# gpt-oss's RoPE when its config.json names none (GptOssConfig's own default)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
# the MoE keys' spellings: (ours, transformers' alternative name for the same attribute)
_EXPERT_KEYS = ("num_experts", "num_local_experts")
_DENSE = {"num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
          "norm_topk_prob": False, "moe_router": "softmax_topk", "router_aux_loss_coef": None}
_NOT_GPT_OSS = {"attention_sinks": False, "swiglu_limit": None, "swiglu_alpha": None}


# ---- what each architecture can express ---------------------------------------------------------
def _fixed_options(arch: str) -> dict[str, Any]:
    """The options an architecture hard-wires (the rest are free within check_family's rules)."""
    if arch in GEMMA:
        return {"hidden_act": "gelu_pytorch_tanh", "norm_style": "gemma", "sandwich_norms": True,
                "qk_norm": arch == "Gemma3ForCausalLM", "embed_scale": True, "fused_projections": False,
                "partial_rotary_factor": 1.0, "qk_norm_whole": False, "clip_qkv": None, **_DENSE,
                **_NOT_GPT_OSS, **_NOT_DEEPSEEK}
    base = {"hidden_act": "silu", "norm_style": "llama", "sandwich_norms": False,
            "qk_norm": arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            "embed_scale": False, "query_pre_attn_scalar": None, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "rope_local_theta": None,
            "fused_projections": arch == "Phi3ForCausalLM", "qk_norm_whole": arch == "OlmoeForCausalLM"}
    if arch != "Phi3ForCausalLM":
        base["partial_rotary_factor"] = 1.0
    if arch != "OlmoeForCausalLM":
        base["clip_qkv"] = None
    if arch not in MOE:
        base.update(_DENSE)
    else:
        base["moe_router"] = {"MixtralForCausalLM": "softmax_topk_fp32", GPT_OSS: "topk_softmax",
                              DEEPSEEK: "sigmoid_group_topk"}.get(arch, "softmax_topk")
    if arch != DEEPSEEK:
        base.update(_NOT_DEEPSEEK)
    if arch == "MixtralForCausalLM":
        base["norm_topk_prob"] = True  # Mixtral always renormalises its top-k
    # gpt-oss: a sink logit per head, a softmax over k values (nothing to renormalise), norms
    # scaled in fp32 (transformers keeps their weights in fp32)
    base.update({"attention_sinks": True, "norm_topk_prob": False, "norm_style": "fp32_scale"}
                if arch == GPT_OSS else _NOT_GPT_OSS)
    return base


def check_family(cfg: ModelConfig) -> None:
    """Refuse a combination the architecture's transformers class cannot express: it would
    save a checkpoint that loads with silently different weights or math."""
    arch = cfg.architecture
    for name, want in _fixed_options(arch).items():
        if getattr(cfg, name) != want:
            raise ConfigError(f"{arch} cannot have {name} = {getattr(cfg, name)!r} (it is {want!r})")
    biases = (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias)
    both = {(False, False, False), (True, True, False)}
    allowed = {"LlamaForCausalLM": {(False, False, False), (True, True, False),
                                    (False, False, True), (True, True, True)},
               "Qwen2ForCausalLM": {(True, False, False)},
               "Qwen3ForCausalLM": both, "Gemma2ForCausalLM": both, "Gemma3ForCausalLM": both,
               "Qwen3MoeForCausalLM": both, "OlmoeForCausalLM": both, GPT_OSS: both, DEEPSEEK: both,
               }.get(arch, {(False, False, False)})
    if biases not in allowed:
        raise ConfigError(f"{arch} cannot have (attention_bias, o_proj_bias, mlp_bias)"
                          f" = {biases}; allowed: {sorted(allowed)}")
    per_layer = arch in GEMMA or arch in ("Qwen3ForCausalLM", GPT_OSS)
    if cfg.layer_types is not None and not per_layer:
        raise ConfigError(f"{arch} has no per-layer attention kinds (layer_types)")
    if per_layer and cfg.sliding_window is not None and cfg.layer_types is None:
        raise ConfigError(f"{arch} takes its sliding window per layer: give layer_types")
    if cfg.sliding_window is not None and arch in ("LlamaForCausalLM", "Qwen2ForCausalLM",
                                                   "OlmoeForCausalLM", DEEPSEEK):
        raise ConfigError(f"sliding_window is not supported for {arch}")
    if cfg.rope_local_theta is not None and arch != "Gemma3ForCausalLM":
        raise ConfigError(f"rope_local_theta (a RoPE base for sliding layers) is Gemma 3's only")
    if arch == "OlmoeForCausalLM" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ConfigError(f"{arch}'s q/k norms span hidden_size: head_dim must be hidden_size / "
                          f"num_attention_heads = {cfg.hidden_size // cfg.num_attention_heads}, "
                          f"got {cfg.head_dim}")
    if arch in MOE and cfg.num_experts == 0:
        raise ConfigError(f"{arch} needs num_experts > 0 (every layer is a mixture of experts)")
    if arch == DEEPSEEK and not cfg.kv_lora_rank:
        raise ConfigError(f"{arch}'s attention is latent: kv_lora_rank must be > 0")
    if arch in MOE and arch not in ("Qwen3MoeForCausalLM", DEEPSEEK) and cfg.moe_intermediate_size != cfg.intermediate_size:
        raise ConfigError(f"{arch}'s experts are intermediate_size wide: moe_intermediate_size "
                          f"{cfg.moe_intermediate_size} != intermediate_size {cfg.intermediate_size}")
    if arch == GPT_OSS and (cfg.swiglu_limit is None or cfg.swiglu_alpha is None):
        raise ConfigError(f"{arch}'s experts need swiglu_limit and swiglu_alpha (numbers > 0)")


def moe_names(arch: str) -> tuple[str, tuple[str, str, str]]:
    """(the MoE module's name in a layer, each expert's (gate, up, down) projection names);
    gpt-oss's experts are `gate_up_proj` (gate and up interleaved) and `down_proj` instead."""
    return MOE_NAMES.get(arch, ("mlp", ("gate_proj", "up_proj", "down_proj")))


def router_module(arch: str) -> str:
    """The MoE router's module name inside the MoE module: `gate`, gpt-oss's `router`."""
    return "router" if arch == GPT_OSS else "gate"


# ---- config.json -> ModelConfig fields --------------------------------------------------------
def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"'architectures' must be a list, got {archs!r}")
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    model_type = hf.get("model_type", "")
    arch = archs[0] if archs else by_type.get(model_type, "") if isinstance(model_type, str) else ""
    if not isinstance(arch, str):
        raise ConfigError(f"'architectures' must list names, got {archs!r}")
    if arch == "Gemma3ForConditionalGeneration":
        raise ConfigError("Gemma3ForConditionalGeneration (Gemma 3 with its vision tower: the 4B, 12B "
                          "and 27B checkpoints) is not supported; use a text-only Gemma3ForCausalLM "
                          "checkpoint (gemma-3-1b / 270m) or a GGUF of the text model")
    if arch not in ARCHITECTURES:
        shown = arch or f"model_type {hf.get('model_type')!r}"
        raise ConfigError(f"architecture {shown} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def _refuse_unsupported(hf: Mapping[str, Any], arch: str) -> None:
    """Options transformers honours that the decoder does not implement: one line each."""
    for key in ("resid_pdrop", "embd_pdrop", "attention_dropout"):
        value = hf.get(key) or 0.0
        if value != 0.0:
            raise ConfigError(f"{key} = {value!r}: dropout is not implemented; set it to 0 "
                              f"(the released checkpoints do)")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention (an embedding model) is not supported")
    if arch in GEMMA:
        act, want = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh", ("gelu_pytorch_tanh",)
    else:  # gpt-oss's experts ignore hidden_act: their clamped SwiGLU is fixed
        act, want = hf.get("hidden_act", "silu"), ("silu", "swish")
    if act not in want and arch != GPT_OSS:
        raise ConfigError(f"hidden_act {act!r} is not supported for {arch} (it needs {want[0]!r})")
    if arch in MOE:
        _refuse_unsupported_moe(hf, arch)
    quant = hf.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if arch == GPT_OSS and quant is not None and method != "mxfp4":
        raise ConfigError(f"quantization_config {str(method)[:60]!r} is not supported for {arch} "
                          f"(only its published MXFP4 experts, dequantized on load)")
    if arch == DEEPSEEK and quant is not None:
        raise ConfigError(f"quantization_config {str(method)[:60]!r} is not supported for {arch}: "
                          f"convert the weights to bf16 first (DeepSeek's FP8 release: its fp8_cast_bf16.py)")


def _refuse_unsupported_moe(hf: Mapping[str, Any], arch: str) -> None:
    """What an MoE config.json may ask for that is not built (training's router options,
    Qwen3-MoE's dense layers between sparse ones), and spellings that disagree."""
    if hf.get("output_router_logits") and arch == DEEPSEEK:
        raise ConfigError("output_router_logits = true: transformers' DeepSeek-V3 has no auxiliary "
                          "loss (its balance is the routers' correction bias); set it to false")
    jitter = hf.get("router_jitter_noise") or 0.0
    if jitter != 0.0:
        raise ConfigError(f"router_jitter_noise = {jitter!r}: the router's training noise is not "
                          f"implemented; set it to 0")
    keys = _expert_keys(arch)
    given = {k: hf[k] for k in keys if hf.get(k) is not None}
    for key, value in given.items():
        if type(value) is not int or value < 1:
            raise ConfigError(f"{key} must be a positive integer for {arch} (0 would make every layer "
                              f"a dense MLP: not supported), got {value!r}")
    if len(given) == 2 and given[keys[0]] != given[keys[1]]:
        raise ConfigError(f"{keys[0]} {given[keys[0]]!r} and {keys[1]} {given[keys[1]]!r} disagree "
                          f"(one attribute in transformers)")
    if arch == DEEPSEEK:
        _refuse_unsupported_deepseek(hf)
    if arch == "Qwen3MoeForCausalLM":
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ConfigError(f"Qwen3-MoE with dense MLP layers between the sparse ones "
                              f"(decoder_sparse_step {step!r}, mlp_only_layers {str(dense)[:80]}) is "
                              f"not supported: every layer must be sparse (the released models are)")


def _expert_keys(arch: str) -> tuple[str, str]:
    """The expert count's two spellings in a config.json (one attribute in transformers)."""
    return ("n_routed_experts", "num_local_experts") if arch == DEEPSEEK else _EXPERT_KEYS


# keys of DeepSeek's own config.json that transformers ignores, and the only values it computes
_DEEPSEEK_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _refuse_unsupported_deepseek(hf: Mapping[str, Any]) -> None:
    for key, want in _DEEPSEEK_FIXED.items():
        if hf.get(key, want) != want:
            raise ConfigError(f"{key} = {hf[key]!r} is not supported: DeepSeek-V3's routing is "
                              f"{', '.join(f'{k} {v!r}' for k, v in _DEEPSEEK_FIXED.items())}")
    for key in (*_DEEPSEEK_KEYS, "num_experts_per_tok"):  # transformers' modules fail on a null
        if key in hf and hf[key] is None:
            raise ConfigError(f"{key} is null; DeepSeek-V3 needs a number there (only q_lora_rank may be null)")


def _deepseek_fields(hf: Mapping[str, Any], d: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's latent attention and routing keys (head_dim is qk_rope_head_dim, as
    transformers sets it; a null q_lora_rank means a plain q_proj; a null norm_topk_prob or
    rope_interleave is false there)."""
    fields = {k: d[k] for k in _DEEPSEEK_KEYS}
    fields.update(q_lora_rank=hf["q_lora_rank"] if "q_lora_rank" in hf else d["q_lora_rank"],
                  head_dim=d["qk_rope_head_dim"], moe_intermediate_size=d["moe_intermediate_size"])
    for key in ("norm_topk_prob", "rope_interleave"):
        fields[key] = bool(hf[key]) if key in hf else d[key]
    return fields


def _moe_fields(hf: Mapping[str, Any], d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The MoE options of an MoE architecture's config.json (either spelling of the expert
    count), with transformers' defaults for what it leaves out."""
    if arch not in MOE:
        return {}
    given = [hf[k] for k in _expert_keys(arch) if hf.get(k) is not None]
    fields: dict[str, Any] = dict(
        num_experts=given[0] if given else d["num_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=(d.get("moe_intermediate_size") if arch == "Qwen3MoeForCausalLM"
                               else d["intermediate_size"]),
        router_aux_loss_coef=d.get("router_aux_loss_coef"), output_router_logits=bool(hf.get("output_router_logits")))
    if arch not in ("MixtralForCausalLM", GPT_OSS):
        fields["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
    if arch == DEEPSEEK:
        fields.update(_deepseek_fields(hf, d))
    if arch == "OlmoeForCausalLM":
        fields["clip_qkv"] = d.get("clip_qkv")
    if arch == GPT_OSS:  # a null here is no default: transformers refuses or breaks on it
        fields.update({k: hf[k] if k in hf else d[k] for k in ("swiglu_alpha", "swiglu_limit", "sliding_window")})
    return fields


def config_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a Hugging Face config.json dict."""
    arch = _architecture(hf)
    _refuse_unsupported(hf, arch)
    d = dict(_DEFAULTS[arch])
    d.update({k: v for k, v in hf.items() if v is not None or k in ("final_logit_softcapping",
                                                                    "attn_logit_softcapping")})
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if d.get(key) is None:
            raise ConfigError(f"missing required key {key!r}")
    heads = d["num_attention_heads"]
    rope = _rope_from_hf(d, arch)
    attention_bias = bool(d.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or 0, rms_norm_eps=d["rms_norm_eps"],
        max_position_embeddings=d["max_position_embeddings"],
        attention_bias=attention_bias if arch != "Qwen2ForCausalLM" else True,
        o_proj_bias=attention_bias if arch not in ("Qwen2ForCausalLM", "MistralForCausalLM",
                                                   "Phi3ForCausalLM") else False,
        mlp_bias=bool(d.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(d, arch), architecture=arch,
        initializer_range=d.get("initializer_range", 0.02),
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"), dtype=d.get("dtype") or d.get("torch_dtype"), **rope)
    for name, want in _fixed_options(arch).items():
        if name in fields and fields[name] != want:
            raise ConfigError(f"{name} = {fields[name]!r} is not supported for {arch}")
        fields[name] = want
    fields.update(_moe_fields(hf, d, arch))
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        fields["attention_bias"] = False
    if arch in GEMMA:
        fields.update(query_pre_attn_scalar=d["query_pre_attn_scalar"],
                      attn_logit_softcapping=d.get("attn_logit_softcapping"),
                      final_logit_softcapping=d.get("final_logit_softcapping"))
    layer_types = _layer_types(d, arch, fields["num_hidden_layers"])
    if arch == "Qwen3ForCausalLM" and layer_types is not None and SLIDING not in layer_types:
        layer_types, fields["sliding_window"] = None, None  # every layer full: Qwen3's usual case
    fields["layer_types"] = layer_types
    return fields


def _sliding_window(d: Mapping[str, Any], arch: str) -> int | None:
    if arch == "Qwen2ForCausalLM":
        # Qwen2 applies its window only when use_sliding_window is set, and then per layer
        # (layers >= max_window_layers): per-layer windows are not implemented for Qwen2.
        layer_types = d.get("layer_types") or []
        if d.get("use_sliding_window") or SLIDING in layer_types:
            raise ConfigError("Qwen2 use_sliding_window/sliding_attention layers are not supported; "
                              "set use_sliding_window to false (the released Qwen2 models do)")
        return None
    if arch in ("LlamaForCausalLM", "OlmoeForCausalLM"):  # OLMoE's mask is causal only
        return None
    if arch == "Qwen3MoeForCausalLM":  # every layer, when use_sliding_window
        return d.get("sliding_window") if d.get("use_sliding_window") else None
    if arch == "Qwen3ForCausalLM" and not d.get("use_sliding_window") and SLIDING not in (d.get("layer_types") or []):
        return None
    return d.get("sliding_window")


def _layer_types(d: Mapping[str, Any], arch: str, layers: int) -> tuple[str, ...] | None:
    """Per-layer attention kinds as transformers derives them when the config omits them."""
    given = d.get("layer_types")
    if arch not in GEMMA and arch not in ("Qwen3ForCausalLM", GPT_OSS):
        if given and any(t != FULL for t in given):
            raise ConfigError(f"layer_types with sliding layers are not supported for {arch}")
        return None
    if given is not None:
        if not isinstance(given, list) or len(given) != layers:
            raise ConfigError(f"layer_types must list {layers} entries, got {given!r}")
        return tuple(given)
    if arch in ("Gemma2ForCausalLM", GPT_OSS):
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(layers))
    if arch == "Gemma3ForCausalLM":
        pattern = d.get("sliding_window_pattern", 6)
        if type(pattern) is not int or pattern < 1:
            raise ConfigError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    # Qwen3: sliding from max_window_layers on, only with use_sliding_window
    start = d.get("max_window_layers", 28)
    return tuple(SLIDING if d.get("use_sliding_window") and i >= start else FULL for i in range(layers))


def _rope_from_hf(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, rope_local_theta and partial_rotary_factor from either spelling."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or (_GPT_OSS_ROPE if arch == GPT_OSS else {})
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    local_theta = None
    if params and set(params) <= {FULL, SLIDING}:  # per layer kind (transformers 5, Gemma 3)
        if arch != "Gemma3ForCausalLM":
            raise ConfigError(f"per-layer-type rope_parameters are not supported for {arch}")
        local = dict(params.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"sliding layers' rope_type {local.get('rope_type')!r} is not supported "
                              f"(only default RoPE with its own base)")
        local_theta = local.get("rope_theta", d.get("rope_local_base_freq"))
        params = dict(params.get(FULL) or {})
    elif params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported")
    elif arch == "Gemma3ForCausalLM":
        local_theta = d.get("rope_local_base_freq")
    params = dict(params)
    theta = params.pop("rope_theta", d.get("rope_theta"))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": None, "partial_rotary_factor": partial}
    if arch == "Gemma3ForCausalLM":
        out["rope_local_theta"] = local_theta
    if rope_type == "su":  # Phi-3's early name for LongRoPE
        rope_type = "longrope"
    if rope_type == "default":
        return out
    scaling = {"rope_type": rope_type, **params}
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers falls back to the top-level key, then to max_position_embeddings
        scaling.setdefault("original_max_position_embeddings",
                           d.get("original_max_position_embeddings") or d.get("max_position_embeddings", 2048))
    if rope_type == "longrope":
        scaling = {k: v for k, v in scaling.items() if v is not None or k in ("rope_type",)}
    out["rope_scaling"] = scaling
    return out


# ---- ModelConfig -> config.json -----------------------------------------------------------------
def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """A config.json dict that transformers loads as this architecture, with every option
    written out (never left to a default that a later transformers might change)."""
    arch = cfg.architecture
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling:
        rope_parameters = {**cfg.rope_scaling, "rope_theta": float(cfg.rope_theta)}
    if cfg.partial_rotary_factor != 1.0:
        rope_parameters["partial_rotary_factor"] = cfg.partial_rotary_factor
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope_parameters,
        # Older readers (transformers 4.x) look only at these two.
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id,
        "attention_dropout": 0.0, "use_cache": True,
    }
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                "OlmoeForCausalLM", GPT_OSS, DEEPSEEK) or arch in GEMMA:
        out["attention_bias"] = cfg.attention_bias
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = cfg.mlp_bias
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        out["sliding_window"] = cfg.sliding_window
    if arch in MOE:
        _moe_to_hf(cfg, out)
    if arch == "Qwen2ForCausalLM":
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_hidden_layers)
    if arch == "Qwen3ForCausalLM":
        sliding = cfg.layer_types is not None and SLIDING in cfg.layer_types
        out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
                   layer_types=list(cfg.layer_types or [FULL] * cfg.num_hidden_layers),
                   max_window_layers=(cfg.layer_types.index(SLIDING) if sliding else cfg.num_hidden_layers))
    if arch in GEMMA:
        _gemma_to_hf(cfg, out)
    if arch == "Phi3ForCausalLM":
        out.update(resid_pdrop=0.0, embd_pdrop=0.0,
                   partial_rotary_factor=cfg.partial_rotary_factor,
                   original_max_position_embeddings=(cfg.rope_scaling or {}).get(
                       "original_max_position_embeddings", cfg.max_position_embeddings))
    if dtype or cfg.dtype:
        out["dtype"] = dtype or cfg.dtype
    return out


def _gemma_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
    del out["hidden_act"]
    out.update(hidden_activation=cfg.hidden_act, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
               sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types or ()),
               attn_logit_softcapping=cfg.attn_logit_softcapping,
               final_logit_softcapping=cfg.final_logit_softcapping)
    if cfg.architecture == "Gemma3ForCausalLM":
        full = out["rope_parameters"]
        local = {"rope_type": "default", "rope_theta": float(cfg.rope_local_theta or 10000.0)}
        out["rope_parameters"] = {FULL: full, SLIDING: local}
        out["rope_local_base_freq"] = local["rope_theta"]
        out["use_bidirectional_attention"] = False


def _moe_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
    """The MoE keys as transformers 5 writes them (Qwen3-MoE's expert count under both names:
    transformers 5 writes num_local_experts, 4.x reads num_experts)."""
    arch = cfg.architecture
    out.update(num_experts_per_tok=cfg.num_experts_per_tok, output_router_logits=cfg.output_router_logits)
    if arch == DEEPSEEK:  # no aux-loss coefficient: its balance is the correction bias
        out.update({k: getattr(cfg, k) for k in (*_DEEPSEEK_KEYS, "q_lora_rank", "rope_interleave",
                                                 "moe_intermediate_size", "norm_topk_prob")})
        out["n_routed_experts"] = cfg.num_experts
        return
    coef = cfg.router_aux_loss_coef
    out["router_aux_loss_coef"] = _DEFAULTS[arch]["router_aux_loss_coef"] if coef is None else coef
    if arch == "Qwen3MoeForCausalLM":
        out.update(num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[],
                   use_sliding_window=cfg.sliding_window is not None,
                   sliding_window=cfg.sliding_window)
    elif arch == "OlmoeForCausalLM":
        out.update(num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob, clip_qkv=cfg.clip_qkv)
    elif arch == GPT_OSS:
        out.update(num_local_experts=cfg.num_experts, swiglu_alpha=cfg.swiglu_alpha,
                   swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window,
                   layer_types=list(cfg.layer_types or [FULL] * cfg.num_hidden_layers))
    else:  # Mixtral
        out.update(num_local_experts=cfg.num_experts, router_jitter_noise=0.0)
