"""Multi-head latent attention (MLA): DeepSeek-V3's attention (also Kimi-K2's and Moonlight's),
computed as transformers computes it (`DeepseekV3Attention`, 5.24).

Queries: `q_proj`, or through a low-rank latent, q_a_proj -> q_a_layernorm -> q_b_proj (when
`q_lora_rank` is set); each head's query is qk_nope_head_dim dimensions that do not rotate,
then qk_rope_head_dim that do. Keys and values: `kv_a_proj_with_mqa` makes, per position, a
kv_lora_rank-wide latent and one qk_rope_head_dim-wide rotated key shared by every head; the
latent goes through `kv_a_layernorm` and `kv_b_proj` expands it into each head's non-rotating
key part and its value (v_head_dim wide). RoPE turns the rotating parts only: pairs (i, i + R/2)
as every other family, or DeepSeek's interleaved pairs (2i, 2i + 1) when `rope_interleave`
(transformers computes those on the even and odd slices and writes the result de-interleaved;
so do we). With YaRN, `mscale_all_dim` also scales the softmax: qk_head_dim^-1/2 times
(0.1 mscale_all_dim ln(factor) + 1)^2, and cos/sin carry mscale / mscale_all_dim (rope.py).

The KV cache holds what transformers' cache holds: the normalised latent [B, 1, S, kv_lora_rank]
(the cache's "keys") and the rotated shared key [B, 1, S, qk_rope_head_dim] ("values"), 576
values per position and layer for DeepSeek-V3 instead of 128 x (192 + 128) expanded ones; every
step expands the cached positions again through kv_b_proj, as transformers does (no weight
absorption). The two norms inside use eps 1e-6 whatever rms_norm_eps says: transformers builds
them with its RMSNorm's default.

Attention itself is torch's SDPA with the scale above; on the CPU, where the value width differs
from the query's (no shape class of that kind is checked: models/attention.py), its math backend.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from offload.models.attention import attend
from offload.models.config import ModelConfig
from offload.models.projections import project

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used by q_a / kv_a_layernorm


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under a RoPE scaling that gives
    mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    all_dim = scaling.get("mscale_all_dim") or 0
    factor = float(scaling.get("factor") or 1.0)
    if all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, R] whose pairs are (2i, 2i + 1), each turned by the angle of frequency i
    (cos/sin [B, T, R], halves repeated): [x_even cos - x_odd sin, x_odd cos + x_even sin],
    the rotated pairs written de-interleaved, as transformers writes them."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, R] with pairs (i, i + R/2): x cos + rotate_half(x) sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LatentAttention(nn.Module):
    """MLA with transformers' parameter names (`self_attn.q_a_proj`, ..., `o_proj`). `norm`
    makes an RMSNorm(width, eps) (llama.py's; passed in, it lives with the decoder)."""

    def __init__(self, cfg: ModelConfig, norm: Callable[[int, float], nn.Module]):
        super().__init__()
        h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.heads, self.rank = heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, cfg.q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=cfg.o_proj_bias)
        self.scale = softmax_scale(cfg)
        self.rotate = rotate_interleaved if cfg.rope_interleave else rotate_half_pairs

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (q_pass [B, heads, T, nope], q_rot [B, heads, T, rope])."""
        B, T, _ = x.shape
        if hasattr(self, "q_proj"):
            q = project(self.q_proj, x)
        else:
            q = project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, x)))
        q = q.reshape(B, T, self.heads, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        return q_pass, q_rot

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (normalised latent [B, 1, T, rank], shared key part [B, 1, T, rope])."""
        B, T, _ = x.shape
        latent, k_rot = torch.split(project(self.kv_a_proj_with_mqa, x), [self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        return latent.reshape(B, 1, T, self.rank), k_rot.reshape(B, 1, T, self.rope)

    def expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent [B, 1, S, rank] and shared rotated key [B, 1, S, rope] -> keys
        [B, heads, S, nope + rope] and values [B, heads, S, v_dim] (transformers' expand_kv)."""
        B, _, S, _ = latent.shape
        kv = project(self.kv_b_proj, latent).reshape(B, S, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        keys = kv.new_empty(B, self.heads, S, self.nope + self.rope)
        keys[..., :self.nope].copy_(k_nope)
        keys[..., self.nope:].copy_(k_rot.expand(-1, self.heads, -1, -1))
        return keys, values

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, kv: tuple[torch.Tensor, torch.Tensor] | None,
                kv_start: int) -> torch.Tensor:
        """x [B, T, H]; cos/sin [B, T, rope]; mask None or bool [B, 1, T, S]; kv: this layer's
        cache (latent [B, 1, max_len, rank], rotated key [B, 1, max_len, rope]), filled up to
        kv_start. Returns [B, T, H]."""
        B, T, _ = x.shape
        q_pass, q_rot = self._queries(x)
        latent, k_rot = self._latent(x)
        q_rot, k_rot = self.rotate(q_rot, cos, sin), self.rotate(k_rot, cos, sin)
        if kv is not None:  # write this step's latents, attend over everything so far
            latent_cache, rot_cache = kv
            end = kv_start + T
            latent_cache[:, :, kv_start:end] = latent
            rot_cache[:, :, kv_start:end] = k_rot
            latent = latent_cache[:, :, :end].to(device=x.device, dtype=x.dtype)
            k_rot = rot_cache[:, :, :end].to(device=x.device, dtype=x.dtype)
        q = torch.cat((q_pass, q_rot), dim=-1)  # [B, heads, T, nope + rope]
        keys, values = self.expand(latent, k_rot)
        out = attend(q, keys, values, mask, is_causal=mask is None and T > 1, enable_gqa=False,
                     scale=self.scale)  # [B, heads, T, v_dim]
        return project(self.o_proj, out.transpose(1, 2).reshape(B, T, self.heads * self.v_dim))
