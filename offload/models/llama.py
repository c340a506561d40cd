"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) whose names mirror Hugging Face exactly.

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

from offload.memory import mapped
from offload.models import kernels
from offload.models.attention import attend
from offload.models.config import ModelConfig, block_prefix

# enable_gqa lets SDPA attend grouped K/V heads without materialising repeated copies.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# ---- rotary embeddings ----------------------------------------------------------------------
def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32 on CPU, attention_scaling applied to cos/sin) for the config's
    RoPE variant. Always computed on CPU in fp32 from the config alone, so a model built on meta
    gets real frequencies and every device sees bit-identical ones."""
    with torch.device("cpu"):  # even when called under a `with torch.device("meta")` build
        return _rope_frequencies(cfg)


def _rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    dim, theta = cfg.head_dim, float(cfg.rope_theta)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # [dim/2]
    inv_freq = 1.0 / (theta ** exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    if kind == "linear":  # position interpolation: positions divided by factor
        return inv_freq / factor, 1.0
    if kind == "llama3":
        # Long wavelengths (beyond the original context / low_freq_factor) are slowed by
        # `factor`, short ones (below original / high_freq_factor) kept, the band between
        # blended linearly in 1/wavelength.
        original = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        return _yarn_frequencies(cfg, inv_freq, factor)
    raise ValueError(f"unsupported rope_type {kind!r}")  # ModelConfig.validate refuses it first


def _yarn_frequencies(cfg: ModelConfig, inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between, and scale the
    attention logits (through cos/sin) by a temperature that depends on the factor."""
    s, dim, theta = cfg.rope_scaling or {}, cfg.head_dim, float(cfg.rope_theta)
    original = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention)


class Rotary:
    """Rotary cos/sin from positions. Not an nn.Module and holds no buffers: inv_freq is derived
    from the config and cached per device, so meta building, `.to()` and parameter swapping
    never have to know about it."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq_cpu, self.attention_scaling = rope_frequencies(cfg)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, T, head_dim] in `dtype` (angles in fp32)."""
        device = position_ids.device
        inv_freq = self._by_device.get(device)
        if inv_freq is None:
            inv_freq = self._by_device[device] = self.inv_freq_cpu.to(device)
        angles = position_ids[..., None].float() * inv_freq  # [B, T, head_dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, head_dim]: halves rotate together
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by cos/sin [B, T, D]; pairs are (i, i + D/2) as in HF weights."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---- projections ----------------------------------------------------------------------------
# For few rows (batched decode is [B, 1] tokens) the same product computed as (W @ x^T)^T can be
# much faster than x @ W^T on one CPU and much slower on another, and one row (batch-1 decode)
# runs on one core unless split: offload/models/kernels.py measures the candidates on this
# machine, per shape, the first time it meets one in inference. Training
# never takes it, checkpointed forwards included: its results stay bit-identical to nn.Linear's.
def project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x [..., in] -> [..., out]; the same math, a faster kernel for few rows."""
    if not isinstance(layer, nn.Linear):  # a quantized projection brings its own kernel
        return layer(x)
    if x.device.type == "cpu" and not layer.weight.requires_grad and (
            mapped.is_mapped(layer.weight)  # read a slice at a time, forward and backward
            or (torch.is_grad_enabled() and x.requires_grad
                and x.dtype in (torch.bfloat16, torch.float16))):
        return _FrozenProjectionCPU.apply(x, layer.weight, layer.bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # inference mode, not merely no-grad: activation checkpointing runs training forwards under
    # no_grad, and those must compute exactly what the recompute and plain PyTorch compute
    if (0 < rows <= kernels.SMALL_ROWS_MAX and x.device.type == "cpu" and x.dtype == torch.float32
            and torch.is_inference_mode_enabled()):
        w = layer.weight  # [out, in]
        x2d = x.reshape(rows, -1)  # [rows, in]
        kernel = kernels.kernel_for(w, x2d)
        if kernel != "linear":
            y = kernels.run(kernel, w, x2d)  # [rows, out]
            if layer.bias is not None:
                y = y + layer.bias
            return y.reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, layer.weight, layer.bias)  # nn.Linear's forward (a VocabHead's calls here)


FROZEN_GRAD_CHUNK_BYTES = 64 << 20  # fp32 rows of a frozen weight per step of its input gradient


class _FrozenProjectionCPU(torch.autograd.Function):
    """x @ W^T (+ b) with a frozen W on the CPU (a LoRA base, a frozen head), whose input
    gradient grad @ W is taken in fp32 and rounded once. torch's CPU bf16 product of that layout
    ([rows, out] @ [out, in]) is pathologically slow without native bf16 instructions: 13.3 s
    for [32, 14336] @ [14336, 4096] against 0.23 s through fp32, one thread, AMD EPYC, torch
    2.13 -- an 8B LoRA update took over half an hour in it. The forward is F.linear as before;
    the gradient is the exact product rounded once instead of bf16 GEMM rounding.
    A W mapped from its swap file (offload/memory/mapped.py) is read FROZEN_GRAD_CHUNK_BYTES of fp32
    rows at a time in the forward too, each slice's pages handed back after its product, so
    the whole of it is never in the resident set."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        if not mapped.is_mapped(weight):
            return F.linear(x, weight, bias)  # [..., out]
        out_f = weight.shape[0]
        y = x.new_empty(*x.shape[:-1], out_f)  # [..., out]
        for a, b in _row_slices(weight):
            y[..., a:b] = F.linear(x, weight[a:b], None if bias is None else bias[a:b])
            mapped.release_pages(weight[a:b])
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        out_f, in_f = weight.shape
        # fp32 copies of at most FROZEN_GRAD_CHUNK_BYTES of W at a time: the whole of an 8B
        # model's head in fp32 would be a 2 GiB temporary
        g = grad.reshape(-1, out_f)  # [n, out]
        acc = torch.zeros(g.shape[0], in_f, dtype=torch.float32)  # [n, in]
        for a, b in _row_slices(weight):
            acc.addmm_(g[:, a:b].float(), weight[a:b].float())
            mapped.release_pages(weight[a:b])
        return acc.to(grad.dtype).view(*grad.shape[:-1], in_f), None, None


def _row_slices(weight: torch.Tensor) -> list[tuple[int, int]]:
    """[a, b) row ranges of `weight` [out, in] of at most FROZEN_GRAD_CHUNK_BYTES in fp32."""
    out_f, in_f = weight.shape
    rows = max(1, FROZEN_GRAD_CHUNK_BYTES // (4 * max(1, in_f)))
    return [(a, min(out_f, a + rows)) for a in range(0, out_f, rows)]


class _HeadProjection(torch.autograd.Function):
    """x @ W^T for the vocabulary head in training, whose weight gradient is made as a fresh
    contiguous [V, H] tensor (grad^T @ x). nn.Linear's is a transposed view of an [H, V]
    product, which autograd cannot sum into in place: with tied embeddings it then holds the
    head's gradient, the embedding's and their sum at once — three vocab x hidden tensors
    (2.2 GiB for a 3B Llama in bf16) where two suffice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)  # [..., V]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None  # [..., H]
        grad_w = None
        if ctx.needs_input_grad[1]:
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            grad_w = g2.t() @ x2  # [V, H], contiguous
        return grad_x, grad_w


def head_projection(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The vocabulary head: `project` in inference, the in-place-summable gradient in training."""
    if torch.is_grad_enabled() and layer.bias is None and layer.weight.requires_grad:
        return _HeadProjection.apply(x, layer.weight)
    return project(layer, x)


class VocabHead(nn.Linear):
    """The lm_head: an nn.Linear (same parameters, same checkpoint names) whose forward is
    head_projection, so that module hooks see every use of its weight (ZeRO stage 3 gathers a
    module's parameters around its forward: offload/zero/rest.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_projection(self, x)


# ---- blocks ---------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 squares lose too much), cast back, then scale: the same
        # order of operations as the reference, so bf16 results match too.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, kv: tuple[torch.Tensor, torch.Tensor] | None,
                kv_start: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = project(self.q_proj, x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, D]
        k = project(self.k_proj, x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, D]
        v = project(self.v_proj, x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
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
        if groups > 1 and not _SDPA_GQA:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # No mask means: no padding, no window, and either a fresh sequence (causal, T == S) or
        # a single query that sees every cached key. On the CPU torch's fused kernel only where
        # it was checked on this machine (models/attention.py).
        out = attend(q, k, v, mask, is_causal=mask is None and T > 1,
                     enable_gqa=groups > 1 and _SDPA_GQA)  # [B, nh, T, D]
        return project(self.o_proj, out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # SwiGLU
        return project(self.down_proj, F.silu(project(self.gate_proj, x)) * project(self.up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, kv_start: int = 0) -> torch.Tensor:
        """hidden [B, T, H]; cos/sin [B, T, D]; mask None or bool [B, 1, T, S] (True = attend);
        kv: this layer's (keys, values) cache buffers [B, kvh, max_len, D], filled up to kv_start."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, kv, kv_start)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ---- KV cache -------------------------------------------------------------------------------
def kv_cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes a KVCache of this shape takes, computed without allocating (for the planner)."""
    element_bytes = torch.empty((), dtype=dtype, device="meta").element_size()
    return 2 * cfg.num_hidden_layers * batch_size * cfg.num_key_value_heads * max_len * cfg.head_dim * element_bytes


class KVCache:
    """Preallocated keys and values, per layer [B, kv_heads, max_len, head_dim], plus the number
    of positions filled so far (`length`, the same for every row: left padding is masked)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        # Zeros, not empty: a NaN left in an unused slot would survive a 0 attention weight.
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        if weight.device.type != "meta":
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

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
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, T, D]
        mask = attention_mask_for(B, T, start, attention_mask, self.config.sliding_window,
                                  input_ids.device, document_ids)
        for i, layer in enumerate(self.layers):
            kv = kv_cache.layer(i) if kv_cache is not None else None
            hidden = layer(hidden, cos, sin, mask, kv, start)
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
        return self.lm_head(hidden)  # head_projection (VocabHead)

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


def init_parameter_(name: str, out: torch.Tensor, seed: int, std: float) -> None:
    """Deterministic init of one parameter from (seed, checkpoint name): norms 1, biases 0,
    matrices N(0, std). Drawn on CPU in fp32 so the values do not depend on device or dtype."""
    if name.endswith("norm.weight"):
        out.fill_(1.0)
    elif name.endswith(".bias"):
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


def seeded_init(seed: int, std: float) -> Callable[[Mapping[str, torch.Tensor]], None]:
    """A source for `offload.initialize(model, cfg, source=...)` (or anything filling named
    tensors in place) that gives every parameter init_parameter_'s deterministic values."""
    def fill(tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            init_parameter_(name, t, seed, std)
    return fill


def _materialize(model: nn.Module, named: Iterable[tuple[str, nn.Parameter]], device: torch.device | str,
                 dtype: torch.dtype, source: Source) -> None:
    fresh: dict[str, torch.Tensor] = {}
    for name, meta in named:
        fresh[name] = torch.empty(meta.shape, dtype=dtype, device=device)
    if isinstance(source, int):
        std = model.config.initializer_range  # type: ignore[union-attr]
        for name, t in fresh.items():
            init_parameter_(name, t, source, std)
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
