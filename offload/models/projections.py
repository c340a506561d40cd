"""The projections of the decoder: the few-row inference kernel, the frozen CPU projection and the head.

`project(layer, x)` is what every block calls instead of `layer(x)`: the same math as nn.Linear,
with a faster kernel for few rows in inference, a slice-at-a-time product for weights mapped
from their swap file, and an fp32 input gradient for frozen 16-bit CPU weights. The vocabulary
head (`VocabHead`) makes its weight gradient contiguous so tied embeddings sum into it in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from offload.memory import mapped
from offload.models import kernels

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
