"""The decoder of every family (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3; with moe.py's
mixture-of-experts MLP, Qwen3-MoE, OLMoE, Mixtral and gpt-oss; with mla.py's latent attention,
DeepSeek-V3) whose names mirror Hugging Face exactly.

Module and parameter names are the checkpoint names (`model.embed_tokens`, `model.layers[i]...`,
`model.norm`, `lm_head`), so `state_dict()` needs no renaming. The decoder layers live in one
`nn.ModuleList` (`model.model.layers`): the training engine and the block streamer find it as
"the biggest ModuleList", hook each block to fetch and release its weights, and may replace the
block's parameters by views into flat buffers. That is why a block's forward uses only its own
parameters and plain tensor arguments (hidden states, rotary cos/sin, the attention mask, its
KV-cache slice) and keeps no reference to any parameter outside `forward`. Rotary cos/sin and
the mask are computed once per forward at the model level and shared by every block.

Models are built on the meta device (no memory) and materialised one block at a time from a
checkpoint or from a seed; random init depends only on (seed, parameter name), so one block
materialised alone gets exactly the weights it would get when the whole model is built.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from offload.models.attention import attend
from offload.models.decode_step import fused_forward
from offload.models.config import ModelConfig, block_prefix
from offload.models.families import moe_names
from offload.models.mla import LatentAttention
from offload.models.moe import SparseMoE
from offload.models.projections import (FROZEN_GRAD_CHUNK_BYTES, VocabHead, _FrozenProjectionCPU,  # noqa: F401
                                        _HeadProjection, head_projection, project)
from offload.models.rope import FULL, SLIDING, Rotary, apply_rotary, rope_frequencies  # noqa: F401

# enable_gqa lets SDPA attend grouped K/V heads without materialising repeated copies.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# ---- blocks ---------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm in each family's order of operations (all normalise in fp32: bf16 squares
    lose too much). "llama": cast back, then scale by w (bf16 results then match Llama's
    reference); "gemma": scale by (1 + w) in fp32, then cast (Gemma's reference);
    "fp32_scale": scale by w in fp32, then cast (gpt-oss, whose norms transformers keeps in fp32)."""

    def __init__(self, size: int, eps: float, style: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if style == "gemma" else torch.ones(size))
        self.eps, self.offset, self.fp32_scale = eps, style == "gemma", style == "fp32_scale"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if self.fp32_scale:
            return (self.weight.float() * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with the families' options: fused qkv (Phi-3), q/k norms per
    head before RoPE (Qwen3, Gemma 3), a query scale from query_pre_attn_scalar and tanh
    soft-capping of the scores (Gemma 2), attention sinks (gpt-oss). Parameter names are
    transformers'."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        if cfg.fused_projections:
            self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
            self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
            self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:  # per head, or over the whole projection (OLMoE: qk_norm_whole)
            q_width, k_width = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_whole else (cfg.head_dim,) * 2
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, cfg.norm_style)
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, cfg.norm_style)
        self.norm_whole, self.clip = cfg.qk_norm_whole, cfg.clip_qkv
        # None: SDPA's default 1/sqrt(head_dim)
        self.scale = None if cfg.query_pre_attn_scalar is None else float(cfg.query_pre_attn_scalar) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        # gpt-oss: a learned logit per head joins each query's softmax (its weight is dropped)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads)) if cfg.attention_sinks else None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, nh, D], k and v [B, T, kvh, D]."""
        B, T, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = project(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = project(self.q_proj, x), project(self.k_proj, x), project(self.v_proj, x)
        if self.norm_whole:  # OLMoE: over the whole projection, then the clamp
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.norm_whole:  # over each head's dimensions, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, kv: tuple[torch.Tensor, torch.Tensor] | None,
                kv_start: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # [B, heads, T, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:  # write this step's keys/values, attend over everything so far
            k_cache, v_cache = kv  # [B, kvh, max_len, D]
            end = kv_start + T
            k_cache[:, :, kv_start:end] = k
            v_cache[:, :, kv_start:end] = v
            # [B, kvh, S, D]; a cache kept in another dtype or on the host is brought over
            k = k_cache[:, :, :end].to(device=q.device, dtype=q.dtype)
            v = v_cache[:, :, :end].to(device=q.device, dtype=q.dtype)
        groups = self.num_heads // self.num_kv_heads
        if self.softcap is not None:
            out = softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        elif self.sinks is not None:
            out = sink_attention(q, k, v, mask, self.scale, self.sinks)
        else:
            if groups > 1 and not _SDPA_GQA:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            # No mask means: no padding, no window, and either a fresh sequence (causal, T == S)
            # or a single query that sees every cached key. On the CPU torch's fused kernel only
            # where it was checked on this machine (models/attention.py).
            out = attend(q, k, v, mask, is_causal=mask is None and T > 1,
                         enable_gqa=groups > 1 and _SDPA_GQA, scale=self.scale)  # [B, nh, T, D]
        return project(self.o_proj, out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float | None, cap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped, cap * tanh(scores / cap), before the mask and
    softmax (Gemma 2), which no fused kernel does: the composite, softmax in fp32 as the
    reference. q [B, nh, T, D], k/v [B, kvh, S, D], mask bool [B, 1, T, S] or None (causal when
    T > 1, everything for a single query)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [B, nh, T, S]
    scores = torch.tanh(scores / cap) * cap
    T, S = scores.shape[-2:]
    if mask is None and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink (gpt-oss): each head's learned logit `sinks` [nh] joins the scores
    of every query as one more column of the softmax, whose probability is then dropped, so a
    query may attend to nothing. transformers' eager order (its only CPU path, 5.24): scores,
    mask, the sink column, minus the row's largest, softmax in the scores' dtype. No fused kernel
    takes a sink: the composite, [B, nh, T, S] scores at once. Shapes as softcapped_attention."""
    B, groups = q.shape[0], q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [B, nh, T, S]
    T, S = scores.shape[-2:]
    if mask is None and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:  # -inf: exp gives the same 0 as transformers' additive dtype minimum
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(B, -1, T, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return probs.to(v.dtype) @ v


class MLP(nn.Module):
    """act(gate(x)) * up(x) -> down: SwiGLU (silu) or GeGLU (tanh GELU, Gemma); gate and up
    fused in one gate_up_proj for Phi-3 (its first half is the gate)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        if cfg.fused_projections:
            self.gate_up_proj = nn.Linear(h, 2 * f, bias=cfg.mlp_bias)
        else:
            self.gate_proj = nn.Linear(h, f, bias=cfg.mlp_bias)
            self.up_proj = nn.Linear(h, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = project(self.gate_up_proj, x).chunk(2, dim=-1)
        else:
            gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return project(self.down_proj, act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int | None = None):
        """Decoder layer `layer` (None: any MoE layer of an MoE model, the only kind most have)."""
        super().__init__()
        self.self_attn = LatentAttention(cfg, RMSNorm) if cfg.mla else Attention(cfg)
        # the MLP, or the mixture of experts in its place (moe.py; Mixtral's `block_sparse_moe`);
        # DeepSeek-V3's first first_k_dense_replace layers keep the dense MLP
        moe = cfg.num_experts > 0 and (layer is None or cfg.moe_layer(layer))
        self.ffn_name = moe_names(cfg.architecture)[0] if moe else "mlp"
        self.add_module(self.ffn_name, SparseMoE(cfg) if moe else MLP(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        # Llama: the norm before the MLP; Gemma: the norm of the attention's output
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, kv_start: int = 0) -> torch.Tensor:
        """hidden [B, T, H]; cos/sin [B, T, R]; mask None or bool [B, 1, T, S] (True = attend);
        kv: this layer's (keys, values) cache buffers [B, kvh, max_len, D], filled up to kv_start."""
        if hidden.shape[1] == 1:  # one new token: the quantized block in one C call where it applies
            out = fused_forward(self, hidden, cos, sin, mask, kv, kv_start)
            if out is not None:
                return out
        mlp = self._modules[self.ffn_name]
        if self.sandwich:
            attn = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, kv, kv_start)
            hidden = hidden + self.post_attention_layernorm(attn)
            return hidden + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(hidden)))
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, kv, kv_start)
        return hidden + mlp(self.post_attention_layernorm(hidden))


# ---- KV cache -------------------------------------------------------------------------------
def kv_cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes a KVCache of this shape takes, computed without allocating (for the planner)."""
    element_bytes = torch.empty((), dtype=dtype, device="meta").element_size()
    per_position = sum(heads * width for heads, width in cfg.kv_cache_widths())
    return cfg.num_hidden_layers * batch_size * max_len * per_position * element_bytes


class KVCache:
    """Preallocated keys and values, per layer [B, kv_heads, max_len, head_dim], plus the number
    of positions filled so far (`length`, the same for every row: left padding is masked). MLA
    (DeepSeek-V3) keeps its latent [B, 1, max_len, kv_lora_rank] and rotated shared key
    [B, 1, max_len, qk_rope_head_dim] in their place (config.kv_cache_widths)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        (kh, kw), (vh, vw) = cfg.kv_cache_widths()
        # Zeros, not empty: a NaN left in an unused slot would survive a 0 attention weight.
        self.keys = [torch.zeros((batch_size, kh, max_len, kw), device=device, dtype=dtype)
                     for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros((batch_size, vh, max_len, vw), device=device, dtype=dtype)
                       for _ in range(cfg.num_hidden_layers)]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]

    def reset(self) -> None:
        self.length = 0

    def written(self, i: int, start: int, end: int) -> None:
        """Layer i wrote positions [start, end): they are where they belong already (the
        offloaded cache, offload/infer/kv_cache.py, copies them to the host here)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def attention_mask_for(batch_size: int, num_new: int, start: int, attention_mask: torch.Tensor | None,
                       sliding_window: int | None, device: torch.device,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The boolean mask [B, 1, T, S] (True = may attend) for T new queries at positions
    start..start+T-1 over S = start + T keys, or None when SDPA's own causal flag (or no mask,
    for a single query) is exact. document_ids [B, T] (packed training rows, no cache): a query
    sees only keys of its own document."""
    total = start + num_new
    windowed = sliding_window is not None and total > sliding_window
    if attention_mask is None and document_ids is None and not windowed and (start == 0 or num_new == 1):
        return None
    q_pos = torch.arange(start, total, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(total, device=device)[None, :]  # [1, S]
    allowed = k_pos <= q_pos  # causal [T, S]
    if windowed:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    allowed = allowed[None, None].expand(batch_size, 1, num_new, total)  # [B, 1, T, S]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        # A left-pad query may see no key at all, which makes SDPA return NaN; let every query
        # see itself. Real tokens already do, so their outputs are unchanged.
        allowed = allowed | (k_pos == q_pos)
    if document_ids is not None:  # block-diagonal: packed documents do not see each other
        allowed = allowed & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return allowed


# ---- the model ------------------------------------------------------------------------------
class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # nn.Embedding's own init (normal_) on a meta tensor runs through torch's Python refs,
        # which import torch._dynamo (seconds): pass the weight in and init only real storage
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)  # on the current default device
        # transformers' padding_idx: the pad token's row gets no gradient (a config's -1: none)
        pad = cfg.pad_token_id
        pad = pad if pad is not None and 0 <= pad < cfg.vocab_size else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad,
                                         _weight=weight)
        if weight.device.type != "meta":
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.layer_kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
        self.rotary = Rotary(cfg, FULL)
        # per layer kind; only Gemma 3's sliding layers rotate differently (their own base)
        self.rotaries = {kind: self.rotary if kind == FULL or cfg.rope_local_theta is None
                         else Rotary(cfg, kind) for kind in sorted(set(self.layer_kinds))}

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden states [B, T, H]."""
        B, T = input_ids.shape
        if document_ids is not None and (kv_cache is not None or tuple(document_ids.shape) != (B, T)):
            raise ValueError(f"document_ids must be [batch, tokens] = [{B}, {T}] and is for packed "
                             f"training rows (no KV cache); got {list(document_ids.shape)}")
        start = kv_cache.length if kv_cache is not None else 0
        total = start + T
        if kv_cache is not None and (kv_cache.batch_size != B or total > kv_cache.max_len):
            raise ValueError(f"KV cache holds batch {kv_cache.batch_size} x {kv_cache.max_len} positions; "
                             f"got batch {B} needing {total} positions")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, total):
            raise ValueError(f"attention_mask must be [batch, past + new] = [{B}, {total}], "
                             f"got {list(attention_mask.shape)}")
        if position_ids is None:
            if attention_mask is not None:  # left padding: real tokens count from 0
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
            else:
                position_ids = torch.arange(start, total, device=input_ids.device).expand(B, T)
        hidden = self.embed_tokens(input_ids)  # [B, T, H]
        if self.config.embed_scale:  # Gemma: sqrt(hidden) rounded to fp32, then to the dtype
            hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5).to(hidden.dtype)
        rotations = {kind: rotary(position_ids, hidden.dtype)  # (cos, sin) [B, T, R] per kind
                     for kind, rotary in self.rotaries.items()}
        masks = {kind: attention_mask_for(B, T, start, attention_mask,
                                          self.config.sliding_window if kind == SLIDING else None,
                                          input_ids.device, document_ids)
                 for kind in self.rotaries}
        for i, layer in enumerate(self.layers):
            kind = self.layer_kinds[i]
            kv = kv_cache.layer(i) if kv_cache is not None else None
            hidden = layer(hidden, *rotations[kind], masks[kind], kv, start)
            if kv_cache is not None:
                kv_cache.written(i, start, total)  # an offloaded cache copies them back to the host
        if kv_cache is not None:
            kv_cache.length = total
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = VocabHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                last_only: bool = False, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] ([B, 1, V] with last_only, which skips the vocab
        matmul for every prompt position but the last during prefill).

        position_ids [B, T]: defaults to counting from the cache length, or from each row's
        first real token when an attention_mask [B, past + T] of 1/0 (left padding) is given.
        kv_cache: read for past positions, written for the new ones, its length advanced.
        document_ids [B, T]: packed training rows; tokens attend only within their document
        (give position_ids restarting at each document with it)."""
        hidden = self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            kv_cache=kv_cache, document_ids=document_ids)
        if last_only:
            hidden = hidden[:, -1:]
        logits = self.lm_head(hidden)  # head_projection (VocabHead)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers


# ---- building and materialising ---------------------------------------------------------------
class TensorSource(Protocol):
    """Anything that fills named tensors in place (CheckpointReader does)."""

    def read_tensors_into(self, tensors: Mapping[str, torch.Tensor]) -> None: ...


Source = TensorSource | int  # a checkpoint, or a random seed


def build_model(cfg: ModelConfig, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32,
                *, source: Source = 0) -> LlamaForCausalLM:
    """The model on `device`. On meta (the default) nothing is allocated: a 70B shape is
    described and counted in a few MB. On a real device every part is materialised from
    `source` (a checkpoint or a seed), one block at a time."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to(dtype=dtype)  # meta -> meta: only changes the recorded dtype
    if torch.device(device).type != "meta":
        materialize_non_block(model, device, dtype, source)
        for i in range(cfg.num_hidden_layers):
            materialize_block(model, i, device, dtype, source)
    return model


INIT_CHUNK = 1 << 22  # values per draw in init_parameter_ (a multiple of 16: see there)


def param_seed(seed: int, name: str) -> int:
    """A generator seed for one named tensor: each tensor's random values depend on the run's
    seed and its own name only, not on which other tensors were drawn before it."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def norm_init_value(cfg: ModelConfig) -> float:
    """What a fresh norm weight holds: 1 (Llama scales by w), 0 (Gemma scales by 1 + w)."""
    return 0.0 if cfg.norm_style == "gemma" else 1.0


def init_parameter_(name: str, out: torch.Tensor, seed: int, std: float, norm_value: float = 1.0) -> None:
    """Deterministic init of one parameter from (seed, checkpoint name): norms 1, biases 0
    (DeepSeek-V3's router score-correction bias too), matrices N(0, std). Drawn on CPU in fp32
    so the values do not depend on device or dtype."""
    if name.endswith("norm.weight"):
        out.fill_(norm_value)
    elif name.endswith((".bias", "e_score_correction_bias")):
        out.zero_()
    else:
        # drawn INIT_CHUNK values at a time into an fp32 temporary: one draw of a whole 8B
        # embedding made a 2 GB temporary. The same generator drawn in chunks that are
        # multiples of 16 (torch's normal_ fills 16 at a time) gives the same values as one
        # draw (tests/test_models.py::test_chunked_init_draws_the_same_values).
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
        flat = out.view(-1)
        for start in range(0, flat.numel(), INIT_CHUNK):
            part = flat[start:start + INIT_CHUNK]
            part.copy_(torch.empty(part.numel(), dtype=torch.float32).normal_(0.0, std, generator=gen))


def seeded_init(seed: int, std: float, norm_value: float = 1.0) -> Callable[[Mapping[str, torch.Tensor]], None]:
    """A source for `offload.initialize(model, cfg, source=...)` (or anything filling named
    tensors in place) that gives every parameter init_parameter_'s deterministic values."""
    def fill(tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            init_parameter_(name, t, seed, std, norm_value)
    return fill


def _materialize(model: nn.Module, named: Iterable[tuple[str, nn.Parameter]], device: torch.device | str,
                 dtype: torch.dtype, source: Source) -> None:
    fresh: dict[str, torch.Tensor] = {}
    for name, meta in named:
        fresh[name] = torch.empty(meta.shape, dtype=dtype, device=device)
    if isinstance(source, int):
        std = model.config.initializer_range  # type: ignore[union-attr]
        for name, t in fresh.items():
            init_parameter_(name, t, source, std, norm_init_value(model.config))  # type: ignore[arg-type]
    else:
        source.read_tensors_into(fresh)
    old = dict(model.named_parameters())
    for name, t in fresh.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(t, requires_grad=old[name].requires_grad))


def block_parameters(model: LlamaForCausalLM, layer: int) -> list[tuple[str, nn.Parameter]]:
    """(checkpoint name, parameter) for every parameter of decoder layer `layer`."""
    prefix = block_prefix(layer)
    return [(prefix + n, p) for n, p in model.model.layers[layer].named_parameters()]


def non_block_parameters(model: LlamaForCausalLM) -> list[tuple[str, nn.Parameter]]:
    """Embeddings, final norm and an untied lm_head (a tied one is the embedding)."""
    return [(n, p) for n, p in model.named_parameters() if not n.startswith("model.layers.")]


def materialize_block(model: LlamaForCausalLM, layer: int, device: torch.device | str,
                      dtype: torch.dtype, source: Source) -> None:
    """Give decoder layer `layer` real storage on `device` in `dtype`, filled from `source`."""
    _materialize(model, block_parameters(model, layer), device, dtype, source)


def materialize_non_block(model: LlamaForCausalLM, device: torch.device | str, dtype: torch.dtype,
                          source: Source) -> None:
    """The same for embed_tokens, norm and lm_head; a tied lm_head is re-tied to the new embedding."""
    _materialize(model, non_block_parameters(model), device, dtype, source)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def release_block(model: LlamaForCausalLM, layer: int) -> None:
    """Send layer `layer` back to meta, freeing its storage (streaming loads and tests)."""
    for name, p in block_parameters(model, layer):
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad))
