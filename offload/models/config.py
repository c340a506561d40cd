"""Model configuration for every supported family, parameter shapes and counts.

`ModelConfig` is the one typed description every other part of the system plans from: the
planner sizes buffers from `parameter_shapes`, the checkpoint reader checks tensors against it,
and `llama.py` builds modules from it. One decoder serves every family; the fields below are
the options a family switches on (Qwen3's q/k norms, Gemma's (1 + w) norms around attention
and MLP, soft-capping, per-layer sliding windows and RoPE bases, GeGLU, the embedding scale;
Phi-3's fused projections, partial rotation and LongRoPE; OLMoE's whole-projection q/k norms and
q/k/v clipping; the mixtures of experts' router and experts, moe.py; gpt-oss's attention sinks
and clamped SwiGLU experts; DeepSeek-V3's latent attention, mla.py, its group-limited sigmoid
router, shared experts and dense first layers -- layers of two kinds, so the per-layer shapes
take the layer). Reading and writing Hugging Face
`config.json` per family lives in `families.py`; presets in `presets.py`.

Anything a config asks for that the decoder does not do is refused here in one line naming
the key, never ignored: a checkpoint that loads with one option silently skipped (Qwen3's q/k
norms) produces fluent-looking garbage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

# the per-family rules and config.json spellings (families.py imports nothing from here)
from offload.models.families import (ARCHITECTURES, GPT_OSS, ROUTERS, ConfigError, check_family,
                                     config_fields_from_hf, config_to_hf, moe_names, router_module)

# RoPE variants and the keys each requires. "longrope" switches between two static sets by the
# forward's largest position (rope.py); "dynamic" rescales with the running length: refused.
ROPE_TYPES: dict[str, tuple[str, ...]] = {  # rope_type -> keys it requires
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_ROPE_OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "linear": (), "llama3": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "attention_factor"),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; GeGLU with tanh-approximated GELU (Gemma)
# w * norm(x).to(dtype)  |  (norm(x) * (1 + w)).to(dtype)  |  (w * norm(x)).to(dtype) (gpt-oss)
NORM_STYLES = ("llama", "gemma", "fp32_scale")
LAYER_KINDS = ("full_attention", "sliding_attention")


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
    # None for plain RoPE, else {"rope_type": "linear"|"llama3"|"yarn"|"longrope", ...its
    # parameters} (never containing rope_theta, which lives in its own field).
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # bias on q_proj, k_proj, v_proj (Qwen2: True)
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias puts one there too)
    mlp_bias: bool = False  # bias on gate/up/down_proj (Llama's mlp_bias)
    tie_word_embeddings: bool = False
    # keys older than this many positions are masked: on every layer (Mistral, Phi-3) or on the
    # layers layer_types marks "sliding_attention" (Gemma 2/3, Qwen3 with use_sliding_window)
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    initializer_range: float = 0.02  # std of the normal init of weight matrices
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype name ("bfloat16"), informational
    # ---- family options (defaults: the Llama block) --------------------------------------
    hidden_act: str = "silu"  # one of ACTIVATIONS
    norm_style: str = "llama"  # one of NORM_STYLES
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP as well
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size) in the compute dtype
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    layer_types: tuple[str, ...] | None = field(default=None, hash=False)  # per layer, LAYER_KINDS
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' RoPE base (no scaling)
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj
    partial_rotary_factor: float = 1.0  # the fraction of each head's dimensions that rotates
    # OLMoE: q_norm / k_norm span the whole q_proj / k_proj output ([q_size], [kv_size]), not a head
    qk_norm_whole: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip] after the q/k norms
    # ---- mixture of experts (Qwen3-MoE, OLMoE, Mixtral; 0 experts: the dense MLP) ----------
    num_experts: int = 0  # experts per layer, each a gated MLP moe_intermediate_size wide
    num_experts_per_tok: int = 0  # top-k: the experts each token runs
    moe_intermediate_size: int = 0  # an expert's width (0: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_router: str = "softmax_topk"  # one of ROUTERS (families.py)
    # training's load-balancing loss (transformers' load_balancing_loss_func, added x coef to the
    # loss when output_router_logits: offload/models/router_loss.py); DeepSeek-V3 refuses it
    router_aux_loss_coef: float | None = None
    output_router_logits: bool = False
    # ---- gpt-oss ----------------------------------------------------------------------------
    attention_sinks: bool = False  # a learned logit per head (`self_attn.sinks`) joins each softmax
    # gpt-oss's experts (not None): clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g = gate
    # clamped to <= limit, up to [-limit, limit]; with biases, gate and up interleaved in one
    # `gate_up_proj`, weights stored [in, out] as its checkpoints store them (moe.py)
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    # ---- DeepSeek-V3 (Kimi-K2, Moonlight): multi-head latent attention (mla.py) and its MoE ----
    kv_lora_rank: int = 0  # > 0: MLA, keys and values expanded from a kv_lora_rank-wide latent
    q_lora_rank: int | None = None  # MLA's queries through a q_lora_rank-wide latent (None: q_proj)
    qk_nope_head_dim: int = 0  # MLA: each head's query/key dimensions that do not rotate
    qk_rope_head_dim: int = 0  # MLA: those that do (= head_dim, what RoPE rotates)
    v_head_dim: int = 0  # MLA: each head's value width
    rope_interleave: bool = False  # RoPE pairs (2i, 2i + 1), DeepSeek's layout, not (i, i + R/2)
    first_k_dense_replace: int = 0  # the first k layers have the dense MLP, the rest experts
    n_shared_experts: int = 0  # a SwiGLU of moe_intermediate_size x n added to the routed experts
    n_group: int = 1  # moe_router "sigmoid_group_topk": experts in n_group groups, ...
    topk_group: int = 1  # ... the topk_group best groups' experts eligible
    routed_scaling_factor: float = 1.0  # the routing weights' factor
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers stored after the last: not built

    def __post_init__(self) -> None:
        if (self.head_dim == 0 and type(self.num_attention_heads) is int
                and self.num_attention_heads > 0 and type(self.hidden_size) is int):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.moe_intermediate_size == 0 and type(self.num_experts) is int and self.num_experts > 0:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
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
        self._validate_family_options()
        _check_rope_scaling(self)

    def _validate_family_options(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.norm_style not in NORM_STYLES:
            raise ConfigError(f"norm_style {self.norm_style!r} is not one of {NORM_STYLES}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta", "swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise ConfigError(f"{name} must be null or a finite number > 0, got {value!r}")
        if self.layer_types is not None:
            if (not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_hidden_layers
                    or any(t not in LAYER_KINDS for t in self.layer_types)):
                raise ConfigError(f"layer_types must list one of {LAYER_KINDS} for each of the "
                                  f"{self.num_hidden_layers} layers, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is null")
        factor = self.partial_rotary_factor
        if not (_is_number(factor) and 0 < factor <= 1) or int(self.head_dim * factor) % 2:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1] and rotate an even number of "
                              f"dimensions of head_dim {self.head_dim}, got {factor!r}")
        if self.clip_qkv is not None and not (_is_number(self.clip_qkv) and self.clip_qkv > 0):
            raise ConfigError(f"clip_qkv must be null or a finite number > 0, got {self.clip_qkv!r}")
        if self.qk_norm_whole and not self.qk_norm:
            raise ConfigError("qk_norm_whole (norms over the whole q/k projections) needs qk_norm")
        self._validate_moe()
        self._validate_mla()
        if type(self.num_nextn_predict_layers) is not int or self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers must be an integer >= 0, got "
                              f"{self.num_nextn_predict_layers!r}")
        check_family(self)

    def _validate_moe(self) -> None:
        experts, k, width = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size
        if self.moe_router not in ROUTERS:
            raise ConfigError(f"moe_router {self.moe_router!r} is not one of {ROUTERS}")
        if self.router_aux_loss_coef is not None and not (_is_number(self.router_aux_loss_coef)
                                                          and self.router_aux_loss_coef >= 0):
            raise ConfigError(f"router_aux_loss_coef must be null or a finite number >= 0, got "
                              f"{self.router_aux_loss_coef!r}")
        if type(experts) is not int or experts < 0:
            raise ConfigError(f"num_experts must be an integer >= 0 (0: a dense MLP), got {experts!r}")
        if experts == 0:
            if k != 0 or width != 0 or self.norm_topk_prob or self.first_k_dense_replace or self.n_shared_experts:
                raise ConfigError("num_experts_per_tok, moe_intermediate_size, norm_topk_prob, "
                                  "first_k_dense_replace and n_shared_experts are for mixture-of-experts "
                                  "layers (num_experts > 0)")
            return
        if type(k) is not int or not 1 <= k <= experts:
            raise ConfigError(f"num_experts_per_tok must be an integer in [1, num_experts = "
                              f"{experts}], got {k!r}")
        if type(width) is not int or width <= 0:
            raise ConfigError(f"moe_intermediate_size must be a positive integer, got {width!r}")
        if self.fused_projections or self.hidden_act != "silu" or self.mlp_bias:
            raise ConfigError("experts are SwiGLU MLPs without bias or fused projections")
        dense, shared = self.first_k_dense_replace, self.n_shared_experts
        if type(dense) is not int or not 0 <= dense < self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace must be an integer in [0, num_hidden_layers = "
                              f"{self.num_hidden_layers}) (the layers before it dense), got {dense!r}")
        if type(shared) is not int or shared < 0:
            raise ConfigError(f"n_shared_experts must be an integer >= 0, got {shared!r}")
        if self.moe_router == "sigmoid_group_topk":
            self._validate_groups()

    def _validate_groups(self) -> None:
        """DeepSeek-V3's routing: the experts in n_group equal groups of at least 2 (a group
        scores as its top-2), topk_group of them kept, top-k drawn from their experts."""
        E, groups, keep, k = self.num_experts, self.n_group, self.topk_group, self.num_experts_per_tok
        if type(groups) is not int or groups < 1 or E % groups or E // groups < 2:
            raise ConfigError(f"n_group must divide the {E} routed experts into groups of at least 2, "
                              f"got {groups!r}")
        if type(keep) is not int or not 1 <= keep <= groups or k > keep * (E // groups):
            raise ConfigError(f"topk_group must be an integer in [1, n_group = {groups}] whose groups hold "
                              f"num_experts_per_tok = {k} experts, got {keep!r}")
        if not (_is_number(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ConfigError(f"routed_scaling_factor must be a finite number > 0, got "
                              f"{self.routed_scaling_factor!r}")

    def _validate_mla(self) -> None:
        """Multi-head latent attention (DeepSeek-V3): every width positive, RoPE over the
        qk_rope_head_dim dimensions (head_dim), one key/value head per query head."""
        if not self.kv_lora_rank:
            if self.rope_interleave:
                raise ConfigError("rope_interleave is for multi-head latent attention (kv_lora_rank > 0)")
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name} must be a positive integer for latent attention, got {value!r}")
        if self.q_lora_rank is not None and (type(self.q_lora_rank) is not int or self.q_lora_rank <= 0):
            raise ConfigError(f"q_lora_rank must be null or a positive integer, got {self.q_lora_rank!r}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ConfigError(f"latent attention rotates qk_rope_head_dim = {self.qk_rope_head_dim} "
                              f"dimensions: head_dim must equal it, got {self.head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"latent attention expands one key and value per head: num_key_value_heads "
                              f"must be num_attention_heads = {self.num_attention_heads}, got "
                              f"{self.num_key_value_heads}")

    def moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the mixture of experts (DeepSeek-V3's first
        first_k_dense_replace layers have the dense MLP)."""
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.moe_layer(i)]

    @property
    def mtp_layer_indices(self) -> range:
        """Where a checkpoint stores DeepSeek's multi-token-prediction layers (after the last
        decoder layer): read past, as transformers reads past them."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    @property
    def mla(self) -> bool:  # multi-head latent attention (mla.py)
        return self.kv_lora_rank > 0

    def layer_kind(self, layer: int) -> str:
        """"sliding_attention" or "full_attention" for decoder layer `layer`."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "sliding_attention" if self.sliding_window is not None else "full_attention"

    # ---- derived sizes ----------------------------------------------------------------------
    @property
    def q_size(self) -> int:  # width of q_proj's output (MLA: every head's query, nope and rope)
        if self.mla:
            return self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # width of k_proj's (and v_proj's) output (MLA: o_proj's input)
        if self.mla:
            return self.num_attention_heads * self.v_head_dim
        return self.num_key_value_heads * self.head_dim

    def kv_cache_widths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """What a layer's KV cache holds per position: ((heads, width) of the keys, of the
        values). MLA caches what transformers caches, the normalised latent (1, kv_lora_rank)
        and the rotated shared key (1, qk_rope_head_dim); keys and values are expanded from
        them at every step."""
        if self.mla:
            return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)
        return (self.num_key_value_heads, self.head_dim), (self.num_key_value_heads, self.head_dim)

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
        return cls(**config_fields_from_hf(hf))

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """A config.json dict that transformers loads as this architecture."""
        return config_to_hf(self, dtype)


def _check_rope_scaling(cfg: ModelConfig) -> None:
    scaling = cfg.rope_scaling
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: default, "
                          f"{', '.join(ROPE_TYPES)}; 'dynamic' changes with sequence length)")
    missing = [k for k in ROPE_TYPES[rope_type] if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} is missing {missing}")
    unknown = set(scaling) - {"rope_type", *ROPE_TYPES[rope_type], *_ROPE_OPTIONAL_KEYS[rope_type]}
    if unknown:
        raise ConfigError(f"rope_scaling of type {rope_type!r} has unsupported keys {sorted(unknown)}")
    if rope_type == "longrope":
        _check_longrope(cfg, scaling)
        return
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


def _check_longrope(cfg: ModelConfig, scaling: Mapping[str, Any]) -> None:
    """LongRoPE's two factor lists hold one positive number per rotated dimension pair."""
    pairs = int(cfg.head_dim * cfg.partial_rotary_factor) // 2
    for key in ("short_factor", "long_factor"):
        value = scaling[key]
        if (not isinstance(value, (list, tuple)) or len(value) != pairs
                or not all(_is_number(v) and v > 0 for v in value)):
            raise ConfigError(f"rope_scaling longrope {key} must list {pairs} positive numbers "
                              f"(head_dim * partial_rotary_factor / 2), got "
                              f"{len(value) if isinstance(value, (list, tuple)) else value!r}")
    original = scaling["original_max_position_embeddings"]
    if type(original) is not int or original <= 1:
        raise ConfigError(f"rope_scaling original_max_position_embeddings must be an integer > 1, "
                          f"got {original!r}")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and not (_is_number(value) and value > 0):
            raise ConfigError(f"rope_scaling longrope {key} must be null or a number > 0, got {value!r}")


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


# ---- parameter shapes and counts ------------------------------------------------------------
def block_parameter_shapes(cfg: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """Names (relative to one decoder layer) and shapes of decoder layer `layer`'s parameters,
    in the order llama.py registers them (the order flat buffers lay them out in). `layer` may
    be left out where every layer is alike; DeepSeek-V3's first first_k_dense_replace layers
    have the dense MLP, the rest the experts: there it must be given."""
    if layer is None:
        if cfg.first_k_dense_replace:
            raise ConfigError("this config's layers differ (first_k_dense_replace dense layers, then "
                              "mixtures of experts): name the layer")
        layer = cfg.num_hidden_layers - 1
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.attention_sinks:  # a parameter of the attention module itself: listed before its children's
        shapes["self_attn.sinks"] = (cfg.num_attention_heads,)
    shapes.update(_mla_shapes(cfg) if cfg.mla else _attention_shapes(cfg))
    shapes.update(_moe_shapes(cfg) if cfg.moe_layer(layer) else _linear_shapes(_dense_mlp(cfg)))
    norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for norm in norms:
        shapes[f"{norm}.weight"] = (cfg.hidden_size,)
    return shapes


def _linear_shapes(projections: dict[str, tuple[int, int, bool]]) -> dict[str, tuple[int, ...]]:
    """{projection: (out, in, bias)} -> its weights' (and biases') shapes."""
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, (out_f, in_f, bias) in projections.items():
        shapes[f"{proj}.weight"] = (out_f, in_f)
        if bias:
            shapes[f"{proj}.bias"] = (out_f,)
    return shapes


def _attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    attn: dict[str, tuple[int, int, bool]] = (
        {"self_attn.qkv_proj": (cfg.q_size + 2 * cfg.kv_size, h, cfg.attention_bias)}
        if cfg.fused_projections else
        {"self_attn.q_proj": (cfg.q_size, h, cfg.attention_bias),
         "self_attn.k_proj": (cfg.kv_size, h, cfg.attention_bias),
         "self_attn.v_proj": (cfg.kv_size, h, cfg.attention_bias)})
    attn["self_attn.o_proj"] = (h, cfg.q_size, cfg.o_proj_bias)
    shapes = _linear_shapes(attn)
    if cfg.qk_norm:  # per head, or over the whole projection (OLMoE)
        shapes["self_attn.q_norm.weight"] = (cfg.q_size if cfg.qk_norm_whole else d,)
        shapes["self_attn.k_norm.weight"] = (cfg.kv_size if cfg.qk_norm_whole else d,)
    return shapes


def _mla_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's parameters (mla.py's order, transformers' names)."""
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank is None:
        shapes.update(_linear_shapes({"self_attn.q_proj": (cfg.q_size, h, False)}))
    else:
        shapes.update(_linear_shapes({"self_attn.q_a_proj": (cfg.q_lora_rank, h, bias)}))
        shapes["self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes.update(_linear_shapes({"self_attn.q_b_proj": (cfg.q_size, cfg.q_lora_rank, False)}))
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    shapes.update(_linear_shapes({"self_attn.kv_a_proj_with_mqa": (latent, h, bias)}))
    shapes["self_attn.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    kv_b = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    shapes.update(_linear_shapes({"self_attn.kv_b_proj": (kv_b, cfg.kv_lora_rank, False),
                                  "self_attn.o_proj": (h, cfg.kv_size, cfg.o_proj_bias)}))
    return shapes


def _dense_mlp(cfg: ModelConfig, prefix: str = "mlp", width: int | None = None) -> dict[str, tuple[int, int, bool]]:
    h, f = cfg.hidden_size, cfg.intermediate_size if width is None else width
    mlp: dict[str, tuple[int, int, bool]] = (
        {f"{prefix}.gate_up_proj": (2 * f, h, cfg.mlp_bias)} if cfg.fused_projections else
        {f"{prefix}.gate_proj": (f, h, cfg.mlp_bias), f"{prefix}.up_proj": (f, h, cfg.mlp_bias)})
    mlp[f"{prefix}.down_proj"] = (h, f, cfg.mlp_bias)
    return mlp


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """An MoE layer's: the router (DeepSeek-V3's with its score-correction bias; gpt-oss's with
    a bias), each expert's gate, up, down (gpt-oss's [in, out] with biases), DeepSeek-V3's
    shared experts -- moe.py's order."""
    module, (gate, up, down) = moe_names(cfg.architecture)
    h, e_f, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    router = f"{module}.{router_module(cfg.architecture)}"
    shapes: dict[str, tuple[int, ...]] = {f"{router}.weight": (E, h)}
    if cfg.swiglu_limit is not None:
        shapes[f"{router}.bias"] = (E,)
    if cfg.moe_router == "sigmoid_group_topk":
        shapes[f"{router}.e_score_correction_bias"] = (E,)
    for e in range(E):
        prefix = f"{module}.experts.{e}."
        if cfg.swiglu_limit is not None:  # gpt-oss: weights [in, out], biases
            shapes.update({prefix + "gate_up_proj.weight": (h, 2 * e_f), prefix + "gate_up_proj.bias": (2 * e_f,),
                           prefix + "down_proj.weight": (e_f, h), prefix + "down_proj.bias": (h,)})
        else:
            shapes.update({prefix + gate + ".weight": (e_f, h), prefix + up + ".weight": (e_f, h),
                           prefix + down + ".weight": (h, e_f)})
    if cfg.n_shared_experts:
        shapes.update(_linear_shapes(_dense_mlp(cfg, f"{module}.shared_experts", e_f * cfg.n_shared_experts)))
    return shapes


def router_name(cfg: ModelConfig) -> str | None:
    """The MoE router's weight (relative to a layer), or None for a dense model."""
    if not cfg.num_experts:
        return None
    return f"{moe_names(cfg.architecture)[0]}.{router_module(cfg.architecture)}.weight"


def input_major(cfg: ModelConfig, name: str) -> bool:
    """Whether weight `name` is stored [in, out] (gpt-oss's experts, as its checkpoints hold
    them) rather than nn.Linear's [out, in]: int8/int4 conversion quantizes its transpose."""
    return cfg.swiglu_limit is not None and ".experts." in name and name.endswith(".weight")


def projection_names(cfg: ModelConfig, layer: int | None = None) -> tuple[str, ...]:
    """Layer `layer`'s projections (relative names, no ".weight"; see block_parameter_shapes
    for `layer`): every matrix but the MoE router (which stays dense: a few KB, and its
    rounding would change which experts run), in module order -- what int8/int4 conversion
    quantizes. Mixtral's experts are w1/w3/w2."""
    router = router_name(cfg)
    return tuple(n[:-len(".weight")] for n, shape in block_parameter_shapes(cfg, layer).items()
                 if n.endswith(".weight") and len(shape) == 2 and n != router)


def block_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every distinct parameter (checkpoint name -> shape) in state_dict order. A tied lm_head
    is the embedding itself, so it is not listed (and not stored in HF checkpoints)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({block_prefix(i) + k: v for k, v in block_parameter_shapes(cfg, i).items()})
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def num_params(cfg: ModelConfig) -> int:
    """Distinct parameter count (tied embeddings counted once), computed without building."""
    return sum(math.prod(s) for s in parameter_shapes(cfg).values())


def num_block_params(cfg: ModelConfig, layer: int | None = None) -> int:
    return sum(math.prod(s) for s in block_parameter_shapes(cfg, layer).values())


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one expert (gate, up and down projections, gpt-oss's biases); 0 for a
    dense model."""
    if not cfg.num_experts:
        return 0
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    return 3 * h * f + (2 * f + h if cfg.swiglu_limit is not None else 0)


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters a token runs through: all of them but the experts it is not routed to
    (num_experts - num_experts_per_tok per layer); the router, embeddings and head count as
    active, as the published "active" figures count them (Mixtral 8x7B: 12.9B of 46.7B;
    DeepSeek-V3's shared experts and dense layers are active: 37.55B of 671.03B, "37B") --
    but for gpt-oss, whose model card counts the unembedding and not the embedding table (a
    lookup): 3.61B of 20.91B, 5.13B of 116.83B."""
    idle = len(cfg.moe_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * expert_params(cfg)
    lookup = cfg.vocab_size * cfg.hidden_size if cfg.architecture == GPT_OSS and not cfg.tie_word_embeddings else 0
    return num_params(cfg) - idle - lookup
