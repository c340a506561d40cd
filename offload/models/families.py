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
}


class ConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message says which field and why."""


GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
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
}
_OPTIONS = ("hidden_act", "norm_style", "sandwich_norms", "qk_norm", "embed_scale",
            "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
            "layer_types", "rope_local_theta", "fused_projections", "partial_rotary_factor")


# ---- what each architecture can express ---------------------------------------------------------
def _fixed_options(arch: str) -> dict[str, Any]:
    """The options an architecture hard-wires (the rest are free within check_family's rules)."""
    if arch in GEMMA:
        return {"hidden_act": "gelu_pytorch_tanh", "norm_style": "gemma", "sandwich_norms": True,
                "qk_norm": arch == "Gemma3ForCausalLM", "embed_scale": True, "fused_projections": False,
                "partial_rotary_factor": 1.0}
    base = {"hidden_act": "silu", "norm_style": "llama", "sandwich_norms": False,
            "qk_norm": arch == "Qwen3ForCausalLM", "embed_scale": False,
            "query_pre_attn_scalar": None, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "rope_local_theta": None,
            "fused_projections": arch == "Phi3ForCausalLM"}
    if arch != "Phi3ForCausalLM":
        base["partial_rotary_factor"] = 1.0
    return base


def check_family(cfg: ModelConfig) -> None:
    """Refuse a combination the architecture's transformers class cannot express: it would
    save a checkpoint that loads with silently different weights or math."""
    arch = cfg.architecture
    for name, want in _fixed_options(arch).items():
        if getattr(cfg, name) != want:
            raise ConfigError(f"{arch} cannot have {name} = {getattr(cfg, name)!r} (it is {want!r})")
    biases = (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias)
    allowed = {"LlamaForCausalLM": {(False, False, False), (True, True, False),
                                    (False, False, True), (True, True, True)},
               "Qwen2ForCausalLM": {(True, False, False)},
               "Qwen3ForCausalLM": {(False, False, False), (True, True, False)},
               "Gemma2ForCausalLM": {(False, False, False), (True, True, False)},
               "Gemma3ForCausalLM": {(False, False, False), (True, True, False)},
               }.get(arch, {(False, False, False)})
    if biases not in allowed:
        raise ConfigError(f"{arch} cannot have (attention_bias, o_proj_bias, mlp_bias)"
                          f" = {biases}; allowed: {sorted(allowed)}")
    per_layer = arch in GEMMA or arch == "Qwen3ForCausalLM"
    if cfg.layer_types is not None and not per_layer:
        raise ConfigError(f"{arch} has no per-layer attention kinds (layer_types)")
    if per_layer and cfg.sliding_window is not None and cfg.layer_types is None:
        raise ConfigError(f"{arch} takes its sliding window per layer: give layer_types")
    if cfg.sliding_window is not None and arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        raise ConfigError(f"sliding_window is not supported for {arch}")
    if cfg.rope_local_theta is not None and arch != "Gemma3ForCausalLM":
        raise ConfigError(f"rope_local_theta (a RoPE base for sliding layers) is Gemma 3's only")


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
    else:
        act, want = hf.get("hidden_act", "silu"), ("silu", "swish")
    if act not in want:
        raise ConfigError(f"hidden_act {act!r} is not supported for {arch} (it needs {want[0]!r})")


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
    if arch == "LlamaForCausalLM":
        return None
    if arch == "Qwen3ForCausalLM" and not d.get("use_sliding_window") and SLIDING not in (d.get("layer_types") or []):
        return None
    return d.get("sliding_window")


def _layer_types(d: Mapping[str, Any], arch: str, layers: int) -> tuple[str, ...] | None:
    """Per-layer attention kinds as transformers derives them when the config omits them."""
    given = d.get("layer_types")
    if arch not in GEMMA and arch != "Qwen3ForCausalLM":
        if given and any(t != FULL for t in given):
            raise ConfigError(f"layer_types with sliding layers are not supported for {arch}")
        return None
    if given is not None:
        if not isinstance(given, list) or len(given) != layers:
            raise ConfigError(f"layer_types must list {layers} entries, got {given!r}")
        return tuple(given)
    if arch == "Gemma2ForCausalLM":
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
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
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
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") or arch in GEMMA:
        out["attention_bias"] = cfg.attention_bias
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = cfg.mlp_bias
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        out["sliding_window"] = cfg.sliding_window
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
