"""What a GGUF file's architecture means in Hugging Face terms, independent of ModelConfig:
- `hf_config`: the config.json dict transformers' own GGUF loader builds for the file (its
  `GGUF_CONFIG_MAPPING` keys, plus the family's keys it leaves to the config class's defaults,
  written out from the metadata or from what llama.cpp hard-wires for that architecture);
- `hf_name`: the tensor names, which depend on the architecture (llama.cpp's `ffn_norm` is Llama's
  `post_attention_layernorm` but Gemma's `pre_feedforward_layernorm`; Gemma's
  `post_attention_layernorm` is llama.cpp's `post_attention_norm`);
- `fix_values`: what llama.cpp's converter did to the values, undone (Llama/Mistral q/k rows
  interleaved per head; Gemma RMSNorm weights stored as w + 1, given back as w in float32);
- `expected_shapes`: every tensor the config implies, for the check made before anything is
  built when no ModelConfig is asked for;
- mixtures of experts (`moe_architecture`, `expert_shape`, `expert_parts`): llama.cpp stores a
  layer's experts as 3-D tensors `ffn_{gate,up,down}_exps` ([experts, rows, cols] in torch
  order) and the router as `ffn_gate_inp`; each expert's matrix is given its Hugging Face name
  (`mlp.experts.E.gate_proj`, Mixtral's `block_sparse_moe.experts.E.w1`), what is not built is
  refused in one line.

| GGUF arch | transformers class | notes |
|-----------|--------------------|-------|
| llama, mistral | LlamaForCausalLM, MistralForCausalLM | q/k rows un-interleaved |
| qwen2 | Qwen2ForCausalLM | q/k/v bias |
| qwen3 | Qwen3ForCausalLM | head_dim from key_length; q_norm/k_norm |
| gemma2 | Gemma2ForCausalLM | norms - 1; soft-capping from metadata; sliding window on even layers |
| gemma3 | Gemma3ForCausalLM (model_type gemma3_text) | norms - 1; q_norm/k_norm; 5 of 6 layers sliding with their own RoPE base |
| phi3 | Phi3ForCausalLM | fused qkv_proj and gate_up_proj; rope_factors_long/short -> LongRoPE |
| qwen3moe | Qwen3MoeForCausalLM | qwen3's attention (no window); experts of expert_feed_forward_length; top-k renormalised |
| olmoe | OlmoeForCausalLM | q/k norms over the whole projection; clamp_kqv -> clip_qkv; top-k not renormalised |
| llama + expert tensors | MixtralForCausalLM | q/k rows un-interleaved; experts of feed_forward_length; top-k renormalised |

What llama.cpp hard-wires for these graphs is taken as it is: softmax routing over every
expert, top-k renormalised for qwen3moe and llama (Mixtral), not for olmoe, no sliding window.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Collection

import numpy as np

from offload.models.families import MOE, moe_names
from offload.models.hf import CheckpointError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM"}
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}  # the rest: the GGUF architecture's own name
GEMMA = ("gemma2", "gemma3")
ROWS_INTERLEAVED = ("llama", "mistral")  # llama.cpp's converter permutes only these q/k rows
SLIDING, FULL = "sliding_attention", "full_attention"

_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA_BLOCK = {**_ATTN, **_MLP, "ffn_norm": "post_attention_layernorm"}
_MOE_BLOCK = {**_ATTN, **_QK_NORM, "ffn_norm": "post_attention_layernorm"}  # + the router, experts
_GEMMA_BLOCK = {**_ATTN, **_MLP, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gguf block name -> our name inside model.layers.N, per architecture
BLOCK_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA_BLOCK, "mistral": _LLAMA_BLOCK, "qwen2": _LLAMA_BLOCK,
    "qwen3": {**_LLAMA_BLOCK, **_QK_NORM},
    "gemma2": _GEMMA_BLOCK, "gemma3": {**_GEMMA_BLOCK, **_QK_NORM},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    "qwen3moe": _MOE_BLOCK, "olmoe": _MOE_BLOCK,
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# tensors read into the config, not parameters
CONSUMED = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
_DEFAULTS = {  # transformers' config-class defaults for keys a file may leave out
    "gemma2": {"rope.freq_base": 10000.0, "attention.sliding_window": 4096, "context_length": 8192,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 10000.0,
               "attention.sliding_window": 4096, "context_length": 131072},
}
# llama.cpp scales a 27B Gemma's queries by 1/sqrt(hidden / heads), every other one's by
# 1/sqrt(head_dim) (src/llama-model.cpp: the model type, known from its layer count)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp hard-wires it when the file states none


class GGUFError(CheckpointError):
    """A GGUF file cannot be used; the message names the file (and tensor) and what to do."""


Meta = Callable[..., Any]  # meta(key, default=None) -> the decoded metadata value


def hf_name(arch: str, name: str, moe: str | None = None) -> str | None:
    """Our (Hugging Face) name of gguf tensor `name`, or None when it is not a parameter we know
    (`moe`: the file's MoE class, moe_architecture; its router is named here, its 3-D expert
    tensors hold several of our tensors: expert_parts)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    block = BLOCK_NAMES.get(arch, {})
    if m and moe and m.group(2) == ROUTER:
        return f"model.layers.{int(m.group(1))}.{moe_names(moe)[0]}.gate.{m.group(3)}"
    if m and m.group(2) in block:
        return f"model.layers.{int(m.group(1))}.{block[m.group(2)]}.{m.group(3)}"
    return None


def fix_values(arch: str, hf: dict[str, Any], gguf_name: str, name: str, w: np.ndarray) -> np.ndarray:
    """Tensor `name` (gguf `gguf_name`) as Hugging Face stores it, from llama.cpp's float32 values."""
    if arch in GEMMA and gguf_name.endswith("norm.weight"):
        return w - np.float32(1)  # llama.cpp's converter stored 1 + w (Gemma's RMSNorm scale)
    return unpermute_rows(arch, hf, name, w)


def unpermute_rows(arch: str, hf: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows of each head as interleaved (even, odd) rotary pairs;
    Hugging Face stores the two halves one after the other. w [heads*head_dim, ...]."""
    if arch not in ROWS_INTERLEAVED:
        return w
    if re.search(r"self_attn\.q_proj\.(weight|bias)$", name):
        heads = hf["num_attention_heads"]
    elif re.search(r"self_attn\.k_proj\.(weight|bias)$", name):
        heads = hf["num_key_value_heads"]
    else:
        return w
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- mixtures of experts --------------------------------------------------------------------------
# the MoE class of each architecture that has one (llama: Mixtral, a llama file with expert tensors)
MOE_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                     "llama": "MixtralForCausalLM"}
ROUTER = "ffn_gate_inp"
# a 3-D expert tensor's kind -> the projections (0 gate, 1 up, 2 down) its rows hold, in order:
# llama.cpp's converter can fuse each expert's gate and up rows (`--fuse-gate-up-exps`), gate first
EXPERT_KINDS = {"ffn_gate_exps": (0,), "ffn_up_exps": (1,), "ffn_down_exps": (2,), "ffn_gate_up_exps": (0, 1)}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")


def _expert_kind(name: str) -> str | None:
    m = _BLOCK_TENSOR.fullmatch(name)
    return m.group(2) if m and m.group(2) in EXPERT_KINDS and m.group(3) == "weight" else None


def _not_built(path: str, name: str, kind: str) -> str | None:
    """Why block tensor `name` (of `kind`) of an MoE file cannot be converted, or None."""
    if "shexp" in kind or "chexp" in kind:
        return (f"{path}: tensor {name} is a shared expert (Qwen2-MoE / DeepSeek style), which is "
                f"not built; supported MoE files: qwen3moe, olmoe and Mixtral (llama)")
    if re.fullmatch(r"ffn_(gate|up|down)\.\d+", kind):
        return (f"{path}: tensor {name} is one expert stored on its own (the old llama.cpp layout of "
                f"Mixtral files), which is not supported; convert the model again with a current "
                f"llama.cpp (experts stacked in ffn_gate_exps / ffn_up_exps / ffn_down_exps)")
    if kind == ROUTER and name.endswith(".bias") or kind == "exp_probs_b" or \
            ("exp" in kind and kind not in EXPERT_KINDS and kind != ROUTER):
        return (f"{path}: tensor {name} (an expert or router tensor these MoE graphs do not have) is "
                f"not supported; supported MoE files: qwen3moe, olmoe and Mixtral (llama)")
    return None


def moe_architecture(arch: str, tensor_names: Collection[str], path: str) -> str | None:
    """The transformers MoE class of a file of `arch` holding `tensor_names` (None: a dense
    model); an expert layout that is not built is refused in one line naming a tensor."""
    blocks: dict[int, dict[str, str]] = {}  # block -> kind -> one of its tensors' names
    for name in tensor_names:
        m = _BLOCK_TENSOR.fullmatch(name)
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = name
    kinds = {k for found in blocks.values() for k in found}
    if arch not in ("qwen3moe", "olmoe") and not kinds & {ROUTER, *EXPERT_KINDS} and \
            not any(re.fullmatch(r"ffn_(gate|up|down)\.\d+|.*(shexp|chexp).*", k) for k in kinds):
        return None  # dense
    for found in blocks.values():
        for kind, name in found.items():
            why = _not_built(path, name, kind)
            if why:
                raise GGUFError(why)
    if arch not in MOE_ARCHITECTURES:
        raise GGUFError(f"{path}: a {arch} file with expert tensors is not supported (MoE files: "
                        f"{', '.join(k + ' (Mixtral)' if k == 'llama' else k for k in MOE_ARCHITECTURES)})")
    for block, found in sorted(blocks.items()):
        dense = [k for k in _DENSE_MLP if k in found]
        if dense:
            raise GGUFError(f"{path}: block {block} has a dense MLP ({found[dense[0]]}) in an MoE "
                            f"file: dense layers between the sparse ones are not supported (every "
                            f"layer must have experts)")
    return MOE_ARCHITECTURES[arch]


def expert_shape(hf: dict[str, Any], name: str) -> tuple[int, int, int] | None:
    """The [experts, rows, cols] shape (torch order) `hf` implies for gguf expert tensor `name`;
    None when `name` is no 3-D expert tensor."""
    kind = _expert_kind(name)
    if kind is None:
        return None
    experts = hf.get("num_experts") or hf["num_local_experts"]
    h, width = hf["hidden_size"], hf.get("moe_intermediate_size") or hf["intermediate_size"]
    return (experts, h, width) if kind == "ffn_down_exps" else (experts, len(EXPERT_KINDS[kind]) * width, h)


def expert_parts(moe: str, name: str, shape: tuple[int, int, int]) -> list[tuple[str, int, int, int]]:
    """Our tensors inside gguf expert tensor `name` of (checked) `shape` [experts, rows, cols]:
    [(our name, expert, first row, rows)], expert by expert."""
    kind = _expert_kind(name)
    module, projections = moe_names(moe)
    block = int(_BLOCK_TENSOR.fullmatch(name).group(1))
    held = EXPERT_KINDS[kind]
    rows = shape[1] // len(held)
    return [(f"model.layers.{block}.{module}.experts.{e}.{projections[p]}.weight", e, i * rows, rows)
            for e in range(shape[0]) for i, p in enumerate(held)]


def is_expert_tensor(name: str) -> bool:
    return _expert_kind(name) is not None


_MOE_KEYS = {  # metadata that, other than this, changes the math of a graph these files have
    "expert_shared_count": ((None, 0), "shared experts"),
    "leading_dense_block_count": ((None, 0), "dense layers before the sparse ones"),
    "expert_gating_func": ((None, 0, 1), "routing other than softmax"),  # 1: softmax
    "expert_weights_scale": ((None, 0.0, 1.0), "scaled routing weights"),
}


def _moe(arch: str, moe: str, a: Meta, hf: dict[str, Any], path: str) -> None:
    """The MoE keys of `hf`, from the metadata and what llama.cpp's graph of `arch` hard-wires
    (softmax over every expert; top-k renormalised except for olmoe; no sliding window)."""
    experts = _positive_int(path, f"{arch}.expert_count", a("expert_count"))
    used = _positive_int(path, f"{arch}.expert_used_count", a("expert_used_count"))
    if used > experts:
        raise GGUFError(f"{path}: metadata {arch}.expert_used_count = {used} is more than its "
                        f"{experts} experts ({arch}.expert_count); the file is damaged")
    for key, (fine, what) in _MOE_KEYS.items():
        if a(key) not in fine:
            raise GGUFError(f"{path}: metadata {arch}.{key} = {a(key)!r} ({what}) is not supported "
                            f"(not part of qwen3moe, olmoe or Mixtral)")
    hf["num_experts_per_tok"] = used
    if moe == "Qwen3MoeForCausalLM":  # llama.cpp's width when the key is absent: n_ff / experts used
        width = a("expert_feed_forward_length") or hf["intermediate_size"] // used
        hf.update(num_experts=experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  moe_intermediate_size=_positive_int(path, f"{arch}.expert_feed_forward_length", width))
    elif moe == "OlmoeForCausalLM":
        hf.update(num_experts=experts, norm_topk_prob=False, clip_qkv=a("attention.clamp_kqv"))
    else:  # Mixtral: a llama file with experts, each feed_forward_length wide
        hf.update(architectures=[moe], model_type="mixtral", num_local_experts=experts)


# ---- config --------------------------------------------------------------------------------------
def _positive_int(path: str, key: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise GGUFError(f"{path}: metadata {key} = {value!r} is not a positive integer; the file is "
                        f"damaged or not a model")
    return value


def hf_config(arch: str, meta: Meta, tensor_names: Collection[str], layers: int, vocab: int,
              read: Callable[[str], np.ndarray], path: str) -> dict[str, Any]:
    """The Hugging Face config dict of a GGUF file of `arch` (`layers` blocks present, `vocab`
    tokens); `read(gguf_name)` gives a tensor's float32 values (Phi-3's rope factors)."""
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    defaults = _DEFAULTS.get(arch, {})

    def a(key: str, default: Any = None) -> Any:
        return meta(f"{arch}.{key}", defaults.get(key, default))

    hidden = _positive_int(path, f"{arch}.embedding_length", a("embedding_length"))
    heads = _positive_int(path, f"{arch}.attention.head_count", a("attention.head_count"))
    kv = _positive_int(path, f"{arch}.attention.head_count_kv", a("attention.head_count_kv", heads))
    _positive_int(path, f"{arch}.feed_forward_length", a("feed_forward_length"))
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6 if arch in GEMMA else 1e-5),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta("tokenizer.ggml.padding_token_id"),
    }
    head_dim = a("attention.key_length") or a("rope.dimension_count") or hidden // heads
    if arch in GEMMA or arch in ("qwen3", "qwen3moe"):
        hf["head_dim"] = _positive_int(path, f"{arch}.attention.key_length", head_dim)
    elif arch != "phi3" and head_dim != hidden // heads:
        hf["head_dim"] = _positive_int(path, f"{arch}.attention.key_length", head_dim)
    biased = ("llama", "qwen3", "qwen3moe", "olmoe", *GEMMA)  # q, k, v (and o) biases together
    if any(n.endswith(".attn_q.bias") for n in tensor_names) and arch in biased:
        hf["attention_bias"] = True
    _rope_scaling(arch, a, hf, path)
    moe = moe_architecture(arch, tensor_names, path)
    if moe:
        _moe(arch, moe, a, hf, path)
    if arch in GEMMA:
        _gemma(arch, a, hf, path)
    elif arch == "phi3":
        _phi3(a, hf, tensor_names, read, path)
    elif arch == "mistral" and a("attention.sliding_window"):
        hf["sliding_window"] = a("attention.sliding_window")
    elif arch in ("qwen3", "qwen3moe"):  # llama.cpp's qwen3moe graph has no window either
        hf["use_sliding_window"] = False
    keep_none = ("attn_logit_softcapping", "final_logit_softcapping")
    return {k: v for k, v in hf.items() if v is not None or k in keep_none}


def _rope_scaling(arch: str, a: Meta, hf: dict[str, Any], path: str) -> None:
    scaling = a("rope.scaling.type")
    if scaling in (None, "none") or (arch == "phi3" and scaling in ("longrope", "su")):
        return  # Phi-3's LongRoPE: its factor tensors (_phi3)
    if scaling != "linear":
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} in GGUF metadata is not supported "
                        f"(linear is)")
    hf["rope_scaling"] = {"rope_type": "linear", "factor": a("rope.scaling.factor")}


def _gemma(arch: str, a: Meta, hf: dict[str, Any], path: str) -> None:
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    scalar = hf["head_dim"]
    if a("attention.scale"):  # a file that states its query scale
        scalar = round(1.0 / float(a("attention.scale")) ** 2)
    elif layers == _GEMMA_27B_LAYERS[arch]:
        scalar = hf["hidden_size"] // heads
    hf.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
              sliding_window=a("attention.sliding_window"), attention_bias=hf.get("attention_bias", False))
    if arch == "gemma2":
        hf["layer_types"] = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
        hf["attn_logit_softcapping"] = a("attn_logit_softcapping")
        hf["final_logit_softcapping"] = a("final_logit_softcapping")
        return
    pattern = a("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list) and len(pattern) == layers:  # per layer: true where the window applies
        hf["layer_types"] = [SLIDING if bool(p) else FULL for p in pattern]
    elif type(pattern) is int and pattern >= 1:
        hf["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        hf["sliding_window_pattern"] = pattern
    else:
        raise GGUFError(f"{path}: metadata {arch}.attention.sliding_window_pattern = {str(pattern)[:80]} is "
                        f"neither a period >= 1 nor one flag for each of the {layers} layers")
    hf.update(rope_local_base_freq=a("rope.freq_base_swa"), attn_logit_softcapping=None,
              final_logit_softcapping=None)


def _phi3(a: Meta, hf: dict[str, Any], tensor_names: Collection[str],
          read: Callable[[str], np.ndarray], path: str) -> None:
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    rotary = a("rope.dimension_count")
    if rotary and rotary != head_dim:
        hf["partial_rotary_factor"] = rotary / head_dim
    window = a("attention.sliding_window")
    hf["sliding_window"] = window or None  # llama.cpp's converter writes 0 for none
    hf["original_max_position_embeddings"] = a("rope.scaling.original_context_length",
                                               hf["max_position_embeddings"])
    long_name, short_name = CONSUMED["phi3"]
    present = [n for n in (long_name, short_name) if n in tensor_names]
    if not present:
        if a("rope.scaling.type") in ("longrope", "su"):
            raise GGUFError(f"{path}: RoPE scaling {a('rope.scaling.type')!r} without its "
                            f"{long_name} and {short_name} tensors (a damaged file?)")
        return
    if len(present) != 2:
        raise GGUFError(f"{path}: holds {present[0]} without its pair; LongRoPE needs both "
                        f"{long_name} and {short_name} (a damaged file?)")
    hf["rope_scaling"] = {"rope_type": "longrope",
                          "long_factor": [float(v) for v in read(long_name).reshape(-1)],
                          "short_factor": [float(v) for v in read(short_name).reshape(-1)]}


# ---- the tensors a config implies -----------------------------------------------------------------
def expected_shapes(arch: str, hf: dict[str, Any], present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """Our name -> shape of every parameter `hf` implies (projection biases: those `present`)."""
    h, f = hf["hidden_size"], hf["intermediate_size"]
    hd = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    if arch == "phi3":
        block = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
                 "mlp.gate_up_proj": (2 * f, h), "mlp.down_proj": (h, f)}
    else:
        block = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h),
                 "mlp.down_proj": (h, f)}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (hf["vocab_size"], h)}
    norms = {"input_layernorm": (h,), "post_attention_layernorm": (h,)}
    if arch in GEMMA:
        norms.update(pre_feedforward_layernorm=(h,), post_feedforward_layernorm=(h,))
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        norms.update({"self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,)})
    elif arch == "olmoe":  # over the whole q / k projection
        norms.update({"self_attn.q_norm": (q,), "self_attn.k_norm": (kv,)})
    moe = hf["architectures"][0] if hf["architectures"][0] in MOE else None
    if moe:  # the router, then each expert's gate, up and down
        module, (gate, up, down) = moe_names(moe)
        experts, width = expert_shape(hf, "blk.0.ffn_down_exps.weight")[::2]
        block = {k: v for k, v in block.items() if not k.startswith("mlp.")}
        block[f"{module}.gate"] = (experts, h)
        for e in range(experts):
            block.update({f"{module}.experts.{e}.{gate}": (width, h), f"{module}.experts.{e}.{up}": (width, h),
                          f"{module}.experts.{e}.{down}": (h, width)})
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, shape in block.items():
            shapes[f"{p}{proj}.weight"] = shape
            if f"{p}{proj}.bias" in present:
                shapes[f"{p}{proj}.bias"] = shape[:1]
        shapes.update({f"{p}{n}.weight": s for n, s in norms.items()})
    shapes["model.norm.weight"] = (h,)
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (hf["vocab_size"], h)
    return shapes


__all__ = ["ARCHITECTURES", "BLOCK_NAMES", "CONSUMED", "EXPERT_KINDS", "GGUFError", "MOE_ARCHITECTURES",
           "TOP_NAMES", "expected_shapes", "expert_parts", "expert_shape", "fix_values", "hf_config", "hf_name",
           "is_expert_tensor", "moe_architecture", "unpermute_rows"]
