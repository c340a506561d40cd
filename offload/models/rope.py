"""Rotary position embeddings for every family: the variants, per-layer bases, partial rotation.

What the families need (each checked against transformers' modeling_rope_utils.py):
- plain RoPE, "linear" (position interpolation), "llama3" (banded), "yarn": static frequencies,
  computed once from the config;
- "longrope" (Phi-3 128k, Phi-4-mini): two sets of per-dimension factors; a forward whose
  largest position + 1 exceeds `original_max_position_embeddings` uses the long set, any other
  the short one (transformers picks per forward the same way), and cos/sin are scaled by
  sqrt(1 + ln(factor) / ln(original)) unless the config gives `attention_factor`;
- Gemma 3: sliding-window layers rotate with their own base (`rope_local_theta`, 10k) and no
  scaling, global layers with `rope_theta` (1M) and the config's scaling;
- partial rotation (`partial_rotary_factor` < 1, Phi-4-mini): only the first
  head_dim * factor dimensions of each head rotate, the rest pass through.

Frequencies are always computed on the CPU in fp32 from the config alone, so a model built on
meta gets real frequencies and every device sees bit-identical ones.
"""

from __future__ import annotations

import math

import torch

from offload.models.config import ModelConfig

FULL, SLIDING = "full_attention", "sliding_attention"  # the layer kinds of config.layer_types


def rotary_dim(cfg: ModelConfig) -> int:
    """How many dimensions of each head rotate (the rest pass through unchanged)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_frequencies(cfg: ModelConfig, layer_kind: str = FULL, *,
                     long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] fp32 on CPU, attention_scaling applied to cos/sin) for the
    layers of `layer_kind`; `long` picks LongRoPE's long factors."""
    with torch.device("cpu"):  # even when called under a `with torch.device("meta")` build
        if layer_kind == SLIDING and cfg.rope_local_theta is not None:
            return _base_frequencies(rotary_dim(cfg), float(cfg.rope_local_theta)), 1.0
        return _rope_frequencies(cfg, long)


def _base_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _rope_frequencies(cfg: ModelConfig, long: bool) -> tuple[torch.Tensor, float]:
    dim, theta = rotary_dim(cfg), float(cfg.rope_theta)
    inv_freq = _base_frequencies(dim, theta)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "longrope":
        return _longrope_frequencies(cfg, long)
    factor = float(scaling["factor"])
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


def _longrope_frequencies(cfg: ModelConfig, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE: inv_freq divided per dimension by the short or the long factors."""
    s, dim, theta = cfg.rope_scaling or {}, rotary_dim(cfg), float(cfg.rope_theta)
    original = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:  # Phi-3 gives the ratio of its context lengths instead
        factor = cfg.max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta ** shape), float(attention)


def _yarn_frequencies(cfg: ModelConfig, inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between, and scale the
    attention logits (through cos/sin) by a temperature that depends on the factor."""
    s, dim, theta = cfg.rope_scaling or {}, rotary_dim(cfg), float(cfg.rope_theta)
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
    """Rotary cos/sin from positions for the layers of one kind. Not an nn.Module and holds no
    buffers: inv_freq is derived from the config and cached per device, so meta building,
    `.to()` and parameter swapping never have to know about it."""

    def __init__(self, cfg: ModelConfig, layer_kind: str = FULL):
        self.inv_freq_cpu, self.attention_scaling = rope_frequencies(cfg, layer_kind)
        self.long: tuple[torch.Tensor, float] | None = None  # LongRoPE's other set
        self.switch_after: int | None = None  # positions beyond this use `long`
        scaling = cfg.rope_scaling
        if layer_kind == FULL or cfg.rope_local_theta is None:
            if scaling is not None and scaling["rope_type"] == "longrope":
                self.long = rope_frequencies(cfg, layer_kind, long=True)
                self.switch_after = int(scaling["original_max_position_embeddings"])
        self._by_device: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, T, rotary_dim] in `dtype` (angles in fp32)."""
        device = position_ids.device
        use_long = (self.long is not None and position_ids.numel() > 0
                    and int(position_ids.max()) + 1 > self.switch_after)  # one sync, LongRoPE only
        inv_cpu, scale = self.long if use_long else (self.inv_freq_cpu, self.attention_scaling)
        inv_freq = self._by_device.get((device, use_long))
        if inv_freq is None:
            inv_freq = self._by_device[(device, use_long)] = inv_cpu.to(device)
        angles = position_ids[..., None].float() * inv_freq  # [B, T, rotary_dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, rotary_dim]: halves rotate together
        cos, sin = angles.cos() * scale, angles.sin() * scale
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by cos/sin [B, T, R] (R <= D: the first R dimensions rotate,
    the rest pass through); pairs are (i, i + R/2) as in Hugging Face weights."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, R]
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    xr, rest = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    return torch.cat((xr * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)
