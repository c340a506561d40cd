"""Scaled dot-product attention on the CPU, through torch's fused kernel only where it was checked.

F.scaled_dot_product_attention picks its CPU backend itself: a fused, blocked ("flash") kernel
compiled per instruction set (AVX2, AVX-512, with AMX tiles for bf16 where present), or the math
composite (batched matmuls and a softmax, the reference). Issue 31 found torch's int8 product
wrong on AVX-512 where it was right on AVX2; the fused attention kernel is the same kind of code,
so it gets the same treatment (offload/kernel_trust.py): each attention shape class met on the CPU
-- (head_dim, dtype, grouped-query, mask kind) -- is checked once per machine in a child process
against float64, forward and backward, at query/key lengths that cross the kernel's blocks; a
class that fails runs the math backend instead. On CUDA torch's choice stands (checked by the GPU
proof, scripts/gpu_check.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from offload import kernel_trust

SDPA_PROBE = "offload.models.attention:check_sdpa"
# (queries, keys) per mask kind: one query (decode), short, and past the fused kernel's query
# and key blocks (32-256 queries, 512 keys in torch 2.4-2.13)
_LENGTHS = {"causal": [(7, 7), (33, 33), (300, 300), (600, 600)],
            "none": [(1, 1), (1, 37), (1, 600)],
            "mask": [(1, 37), (7, 7), (40, 600)]}
_FORWARD_TOL = {torch.float32: 1e-4, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -8}
_BACKWARD_TOL = {torch.float32: 1e-4, torch.bfloat16: 2 ** -4, torch.float16: 2 ** -6}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, enable_gqa: bool, scale: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention(q [B, nh, T, D], k/v [B, kvh, S, D], mask bool [B, 1, T, S]
    or None, scale None = 1/sqrt(D)), with the math backend on a CPU where the fused kernel
    failed this class's check (the scale is one multiply inside the same kernel, so a class is
    checked at the default scale), and for values of another width than the queries' (MLA)."""
    extra: dict = {"enable_gqa": True} if enable_gqa else {}
    if scale is not None:
        extra["scale"] = scale
    if q.device.type == "cpu" and v.shape[-1] != q.shape[-1]:  # MLA: no class of this kind is checked
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **extra)
    if q.device.type == "cpu":
        kind = "mask" if mask is not None else "causal" if is_causal else "none"
        shape_class = (q.shape[-1], str(q.dtype).removeprefix("torch."), enable_gqa)
        if not kernel_trust.known(SDPA_PROBE, shape_class + (kind,)):  # all kinds in one child
            kernel_trust.check(SDPA_PROBE, [shape_class + (k,) for k in _LENGTHS])
        if not kernel_trust.trusted(SDPA_PROBE, shape_class + (kind,)):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **extra)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **extra)


def _reference(q, k, v, mask, is_causal):
    """Attention in float64 from the same (rounded) inputs, k and v repeated per query group."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, nh, T, S]
    if is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def check_sdpa(case: tuple) -> str | None:
    """kernel_trust's probe (run in a child): torch's SDPA as torch picks it on this CPU, for
    `case` = (head_dim, dtype name, grouped-query, "causal" | "none" | "mask"), forward and
    backward against float64 autograd at every length pair of _LENGTHS[kind]."""
    head_dim, dtype_name, gqa, kind = case
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads = 4, (2 if gqa else 4)
    for T, S in _LENGTHS[kind]:
        def rnd(h, n):
            return torch.randn(2, h, n, head_dim, generator=gen).to(dtype).requires_grad_()
        q, k, v = rnd(heads, T), rnd(kv_heads, S), rnd(kv_heads, S)
        mask = None
        if kind == "mask":  # random, with each query's last key allowed (no empty row)
            mask = torch.rand(2, 1, T, S, generator=gen) < 0.7
            mask[..., -1] = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kind == "causal",
                                             **({"enable_gqa": True} if gqa else {}))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = _reference(q64, k64, v64, mask, kind == "causal")
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        if not err <= _FORWARD_TOL[dtype]:
            return f"T {T} S {S}: forward relative error {err:.3g} against float64"
        grad = torch.randn(out.shape, generator=gen).to(dtype)
        out.backward(grad)
        ref.backward(grad.double())
        # against the largest reference gradient: with one key the gradient of q is exactly 0
        scale = max(t.grad.abs().max().item() for t in (q64, k64, v64))
        for name, mine, want in (("q", q.grad, q64.grad), ("k", k.grad, k64.grad), ("v", v.grad, v64.grad)):
            err = (mine.double() - want).abs().max().item() / scale
            if not err <= _BACKWARD_TOL[dtype]:
                return f"T {T} S {S}: grad of {name} relative error {err:.3g} against float64"
    return None
