"""Model configuration for the Llama family (Llama 2/3, Mistral, Qwen2), presets, parameter counts.

`ModelConfig` is the one typed description every other part of the system plans from: the
planner sizes buffers from `parameter_shapes`, the checkpoint reader checks tensors against it,
and `llama.py` builds modules from it. It reads and writes Hugging Face `config.json` dicts.

RoPE in config.json comes in two spellings. Real hub checkpoints (written by transformers 4.x)
carry a top-level `rope_theta` plus an optional `rope_scaling` dict; transformers 5 writes one
`rope_parameters` dict that holds `rope_theta` and `rope_type` together. transformers 5.23 reads
both (a non-null `rope_scaling` wins over `rope_parameters`; `rope_theta` inside the dict wins
over the top-level one). We read both with the same priority and write `rope_parameters` (what
5.23 writes) plus `rope_theta`/`rope_scaling`, so a 4.x reader also gets the scaling right.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

# architecture name in config.json -> model_type transformers expects next to it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# RoPE variants whose frequencies are static (computed once from the config). "dynamic" and
# "longrope" change their frequencies with the running sequence length and are refused.
ROPE_TYPES: dict[str, tuple[str, ...]] = {  # rope_type -> keys it requires
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_ROPE_OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "linear": (), "llama3": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}


class ConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message says which field and why."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads (resolved in __post_init__)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": "linear"|"llama3"|"yarn", ...its parameters}
    # (never containing rope_theta, which lives in its own field).
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # bias on q_proj, k_proj, v_proj (Qwen2: True)
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias puts one there too)
    mlp_bias: bool = False  # bias on gate/up/down_proj (Llama's mlp_bias)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral: keys older than this many positions are masked
    architecture: str = "LlamaForCausalLM"
    initializer_range: float = 0.02  # std of the normal init of weight matrices
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype name ("bfloat16"), informational

    def __post_init__(self) -> None:
        if (self.head_dim == 0 and type(self.num_attention_heads) is int
                and self.num_attention_heads > 0 and type(self.hidden_size) is int):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (_is_number(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1):
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not (_is_number(self.rope_theta) and self.rope_theta > 1):
            raise ConfigError(f"rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if not (_is_number(self.initializer_range) and self.initializer_range >= 0):
            raise ConfigError(f"initializer_range must be a finite number >= 0, got "
                              f"{self.initializer_range!r}")
        # token ids: any integer (a few released configs say pad_token_id -1 for "none")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                raise ConfigError(f"{name} must be a token id (an integer) or null, got {value!r}")
        eos = self.eos_token_id
        if eos is not None and type(eos) is not int and not (
                isinstance(eos, tuple) and all(type(e) is int for e in eos)):
            raise ConfigError(f"eos_token_id must be a token id, a list of them or null, got {eos!r}")
        if not isinstance(self.architecture, str) or self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        if self.sliding_window is not None and (type(self.sliding_window) is not int
                                                or self.sliding_window <= 0):
            raise ConfigError(f"sliding_window must be None or a positive integer, got {self.sliding_window!r}")
        # Each architecture hard-wires its biases; a combination transformers cannot express
        # would save a checkpoint that loads with silently different weights.
        biases = (self.attention_bias, self.o_proj_bias, self.mlp_bias)
        allowed = {"LlamaForCausalLM": {(False, False, False), (True, True, False),
                                        (False, False, True), (True, True, True)},
                   "MistralForCausalLM": {(False, False, False)},
                   "Qwen2ForCausalLM": {(True, False, False)}}[self.architecture]
        if biases not in allowed:
            raise ConfigError(f"{self.architecture} cannot have (attention_bias, o_proj_bias, mlp_bias)"
                              f" = {biases}; allowed: {sorted(allowed)}")
        if self.sliding_window is not None and self.architecture != "MistralForCausalLM":
            raise ConfigError(f"sliding_window is only supported for MistralForCausalLM, not {self.architecture}")
        _check_rope_scaling(self.rope_scaling)

    # ---- derived sizes ----------------------------------------------------------------------
    @property
    def q_size(self) -> int:  # width of q_proj's output
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # width of k_proj's (and v_proj's) output
        return self.num_key_value_heads * self.head_dim

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        if "num_attention_heads" in changes or "hidden_size" in changes:
            changes.setdefault("head_dim", 0)
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json -----------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config.json dict. Errors name `source` and the offending key."""
        if not isinstance(hf, Mapping):
            raise ConfigError(f"{source}: must be a JSON object, got {type(hf).__name__}")
        try:
            return cls._from_hf(hf)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except (TypeError, ValueError, ArithmeticError) as e:  # a value of a type no check expected
            raise ConfigError(f"{source}: malformed value ({str(e)[:200]})") from None

    @classmethod
    def _from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            raise ConfigError(f"'architectures' must be a list, got {archs!r}")
        by_type = {t: a for a, t in ARCHITECTURES.items()}
        model_type = hf.get("model_type", "")
        arch = archs[0] if archs else by_type.get(model_type, "") if isinstance(model_type, str) else ""
        if not isinstance(arch, str):
            raise ConfigError(f"'architectures' must list names, got {archs!r}")
        if arch not in ARCHITECTURES:
            shown = arch or f"model_type {hf.get('model_type')!r}"
            raise ConfigError(f"architecture {shown} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {act!r} is not supported (the SwiGLU MLP needs 'silu')")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ConfigError(f"missing required key {key!r}")
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(hf)
        sliding = hf.get("sliding_window")
        if arch == "Qwen2ForCausalLM":
            # Qwen2 applies its window only when use_sliding_window is set, and then per layer
            # (layers >= max_window_layers): per-layer windows are not implemented.
            layer_types = hf.get("layer_types") or []
            if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
                raise ConfigError("Qwen2 use_sliding_window/sliding_attention layers are not supported; "
                                  "set use_sliding_window to false (the released Qwen2 models do)")
            sliding = None
        elif arch == "LlamaForCausalLM":
            sliding = None
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            attention_bias=True if arch == "Qwen2ForCausalLM" else
            (attention_bias if arch == "LlamaForCausalLM" else False),
            o_proj_bias=attention_bias if arch == "LlamaForCausalLM" else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=sliding, architecture=arch,
            initializer_range=hf.get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """A config.json dict that transformers loads as this architecture."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": float(self.rope_theta)}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope_parameters,
            # Older readers (transformers 4.x) look only at these two.
            "rope_theta": float(self.rope_theta),
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos, "pad_token_id": self.pad_token_id,
            "attention_dropout": 0.0, "use_cache": True,
        }
        if self.architecture == "LlamaForCausalLM":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        if self.architecture == "MistralForCausalLM":
            out["sliding_window"] = self.sliding_window
        if self.architecture == "Qwen2ForCausalLM":
            out.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=self.num_hidden_layers)
        if dtype or self.dtype:
            out["dtype"] = dtype or self.dtype
        return out


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either config.json spelling."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported")
    params = dict(params)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return theta, None
    scaling = {"rope_type": rope_type, **params}
    if rope_type in ("llama3", "yarn"):
        # transformers falls back to max_position_embeddings when the original length is absent.
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return theta, scaling


def _check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: default, "
                          f"{', '.join(ROPE_TYPES)}; 'dynamic' and 'longrope' change with sequence length)")
    missing = [k for k in ROPE_TYPES[rope_type] if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} is missing {missing}")
    unknown = set(scaling) - {"rope_type", *ROPE_TYPES[rope_type], *_ROPE_OPTIONAL_KEYS[rope_type]}
    if unknown:
        raise ConfigError(f"rope_scaling of type {rope_type!r} has unsupported keys {sorted(unknown)}")
    factor = scaling["factor"]
    if not _is_number(factor) or factor < 1:
        raise ConfigError(f"rope_scaling factor must be a finite number >= 1, got {factor!r}")
    for key in sorted(set(scaling) - {"rope_type", "factor", "truncate"}):
        value, positive = scaling[key], key in ROPE_TYPES[rope_type]  # required ones divide
        if value is not None and not (_is_number(value) and (value > 0 if positive else value >= 0)):
            raise ConfigError(f"rope_scaling {key} must be a finite number "
                              f"{'> 0' if positive else '>= 0'}, got {value!r}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError("rope_scaling llama3 needs high_freq_factor > low_freq_factor")


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


# ---- parameter shapes and counts ------------------------------------------------------------
def block_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names (relative to one decoder layer) and shapes of a block's parameters, in module order."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, (out_f, in_f, bias) in {
        "self_attn.q_proj": (cfg.q_size, h, cfg.attention_bias),
        "self_attn.k_proj": (cfg.kv_size, h, cfg.attention_bias),
        "self_attn.v_proj": (cfg.kv_size, h, cfg.attention_bias),
        "self_attn.o_proj": (h, cfg.q_size, cfg.o_proj_bias),
        "mlp.gate_proj": (f, h, cfg.mlp_bias),
        "mlp.up_proj": (f, h, cfg.mlp_bias),
        "mlp.down_proj": (h, f, cfg.mlp_bias),
    }.items():
        shapes[f"{proj}.weight"] = (out_f, in_f)
        if bias:
            shapes[f"{proj}.bias"] = (out_f,)
    shapes["input_layernorm.weight"] = (h,)
    shapes["post_attention_layernorm.weight"] = (h,)
    return shapes


def block_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every distinct parameter (checkpoint name -> shape) in state_dict order. A tied lm_head
    is the embedding itself, so it is not listed (and not stored in HF checkpoints)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    block = block_parameter_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        shapes.update({block_prefix(i) + k: v for k, v in block.items()})
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def num_params(cfg: ModelConfig) -> int:
    """Distinct parameter count (tied embeddings counted once), computed without building."""
    return sum(math.prod(s) for s in parameter_shapes(cfg).values())


def num_block_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in block_parameter_shapes(cfg).values())


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
