"""The quantized matmul: quant_linear computes x @ W^T for a weight W in the group-wise format
of offload/quant/format.py, never through a dense copy of W. Kernels, measured side by side on this
project's 2-core AMD EPYC (Zen 3, AVX2, no AVX-512) by scripts/bench_quant.py (docs/BENCHMARKS.md;
ms for the 1B Llama shapes 2048x2048 / 8192x2048 / 2048x8192, cold weights):
- "chunked" (default): rows of W are dequantized a chunk at a time into a reused float32 buffer
  that stays in cache and multiplied there (W_chunk @ x^T: MKL runs it 2x faster than x @ W^T
  for 4-32 rows). For int4 the chunk holds each row's low nibbles, then its high ones, and x's
  columns are permuted to match (no interleaving copy); the mins term becomes one small product,
  (x summed per group) @ mins^T; per-channel int8 scales multiply the output instead of W.
  fp32 x, 1 row: int8/channel 1.66/6.02/6.37 vs dense fp32 F.linear 1.30/5.56/4.76, int8/g32
  1.5-1.9x dense, int4/g32 2.3-2.9x: one core's product from cache plus the dequantization
  cannot beat one core's product from memory here. From 4 rows on it is faster (MKL's dense
  x @ W^T is slow for few rows): 4 rows int8/ch 2.85/7.27/8.57 vs 3.39/17.85/17.41; 256 rows
  on a par (16.8/82.9/76.0 vs 15.9/84.3/73.6). Tried and dropped: W's rows split over both
  cores, each thread dequantizing and multiplying its part (no faster, up to 1.3x slower).
- "fused": torch's `_weight_int8pack_mm` reads the int8 weight itself: per-channel int8, and fast
  only with bf16 x (its fp32 and fp16 paths are scalar, 13.6 ms at 1 row). bf16 x, 1 row:
  0.66/2.05/1.69 vs dense bf16 0.83/2.66/2.93 and chunked 2.07/6.23/6.62; it grows linearly
  with rows and is slower than chunked beyond ~16 (FUSED_ROWS_MAX). It is given unit scales
  and ours multiply its bf16 output in fp32 (our fp16 scales rounded to bf16 would move each
  channel's weights by up to 2^-9): within bf16 rounding of x @ W^T, not bit-equal.
  It segfaults unless in_features % 8 == 0 (torch 2.13, AVX2), and on AVX-512 it is wrong or
  segfaults for every in_features % 16 == 8 as well: it runs only for (in, out) shapes that
  passed FUSED_PROBE on this machine, in a child process (offload/kernel_trust.py).
- torch's `_weight_int4pack_mm_for_cpu` with bf16 x is as fast (0.45/1.60/1.73 at 1 row) but
  takes a CPU-specific blocked layout: converting our rows costs 14-80 ms per call, so it pays
  only for weights converted once and kept, which streamed weights are not. Its dequantization
  is (q - 8) * scale + zero with bf16 scale and zero (zero = min + 8 scale): not our values
  exactly either. Measured by the benchmark, not used here.
- "dense": F.linear(x, dequantize(...)), the reference; 2.5-9x slower (a fresh fp32 copy of W).
- "c": for 1-64 rows on the CPU, a C loop that reads each code byte once and multiplies it into
  up to 8 rows at a time (offload/quant/cpu.py): the decode case, where the chunked kernel's
  passes over every element cost more than the dense product does (int4/g64, 2 threads: 1 row
  3.2-3.3 ms vs 17-19 chunked and 4.4-4.6 dense fp32; 8 rows 5.8-5.9 vs 28-32 and 13-18, for
  the 1B shapes). Taken whenever it applies and was built; from 9 rows to 64 its register-
  blocked loop, timed against the chunked kernel per shape (below).
$OFFLOAD_QUANT_KERNEL=dense|chunked|fused|c forces a kernel (fused and c only where they apply).

`activations="int8"` (opt-in: `--activations int8`; it changes the math, so the tokens may
change): the C loop quantizes x per 32 columns and multiplies in 8-bit integer dot products
(offload/csrc/quant_a8.c, offload/quant/README.md), where this CPU takes them (AVX2, groups of a
multiple of 32); reported as kernel "c-a8". The other kernels keep x in floating point.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn.functional as F

from offload import kernel_trust
from offload.quant import cpu as quant_cpu
from offload.quant.format import QuantError, QuantSpec, check_parts, dequantize

FUSED_ROWS_MAX = 16  # fused vs chunked, bf16 x, 1B shapes: 16 rows 2.7/10.6/9.0 vs 3.5/12.6/11.0 ms; 32: slower
CPU_CHUNK_BYTES = 4 << 20  # float32 chunk, <= MANY_ROWS rows: 1 row 1.5x faster than 1 or 16 MiB
CPU_CHUNK_BYTES_MANY_ROWS = 16 << 20  # wider chunks for the GEMM: 256 rows -15% to +3% vs 4 MiB
MANY_ROWS = 32
CUDA_CHUNK_BYTES = 64 << 20  # a few kernel launches per weight, a bounded transient
KERNELS = ("dense", "chunked", "fused", "c")


def _override() -> str | None:
    value = os.environ.get("OFFLOAD_QUANT_KERNEL", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in KERNELS:
        raise QuantError(f"OFFLOAD_QUANT_KERNEL={value!r}: use dense, chunked, fused, c or auto")
    return value


FUSED_PROBE = "offload.quant.matmul:check_int8pack"  # kernel_trust's check of the fused kernel


def fused_applies(spec: QuantSpec, in_features: int, x2d: torch.Tensor, out_features: int) -> bool:
    """torch's int8pack kernel computes this product: per-channel int8, bf16 x on the CPU, at most
    FUSED_ROWS_MAX rows, in_features % 8 == 0 (other widths crash it on every CPU measured), and
    the weight's (in, out) shape passed check_int8pack on this machine."""
    return (x2d.device.type == "cpu" and x2d.dtype == torch.bfloat16 and _fused_format(spec, in_features)
            and x2d.shape[0] <= FUSED_ROWS_MAX
            and kernel_trust.trusted(FUSED_PROBE, (in_features, out_features)))


def _fused_format(spec: QuantSpec, in_features: int) -> bool:
    """Weights torch's int8pack kernel can take at all: per-channel int8, in_features % 8 == 0."""
    return spec.bits == 8 and spec.groups(in_features) == 1 and in_features % 8 == 0


def check_kernels(weights, x_dtype: torch.dtype, device: torch.device | str) -> None:
    """Check, in one child process, every (in, out) shape of `weights` [(spec, in_features,
    out_features)] the fused kernel could take with x in `x_dtype` on `device` (a model's load
    calls this: its first token then waits for no check). Results are kept (kernel_trust)."""
    if torch.device(device).type != "cpu" or x_dtype != torch.bfloat16:
        return
    cases = {(i, o) for spec, i, o in weights if _fused_format(spec, i)}
    if cases:
        kernel_trust.check(FUSED_PROBE, sorted(cases))


FUSED_PROBE_COLUMNS = 192  # output columns compared with float64 per row count: both edges + a stride


def check_int8pack(case: tuple[int, int]) -> str | None:
    """kernel_trust's probe (run in a child): `_weight_int8pack_mm` for a weight of
    (in_features, out_features) = `case`, at every row count the fused kernel is given (1 to
    FUSED_ROWS_MAX), against float64; None if every output compared is within bf16 rounding.
    The kernel runs on the whole shape (its tails are where it broke), the reference on the
    first and last FUSED_PROBE_COLUMNS / 3 output columns and a stride through the rest."""
    in_f, out_f = case
    gen = torch.Generator().manual_seed(in_f * 7919 + out_f)
    w = torch.randint(-127, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_f, generator=gen) * 0.02 + 1e-3  # applied as quant_linear does
    ones = torch.ones(out_f, dtype=torch.bfloat16)
    edge = FUSED_PROBE_COLUMNS // 3
    cols = torch.cat((torch.arange(min(edge, out_f)), torch.arange(max(0, out_f - edge), out_f),
                      torch.linspace(0, out_f - 1, edge).long())).unique()
    w_ref = w[cols].double() * scales[cols].double()[:, None]  # [cols, in]
    for rows in range(1, FUSED_ROWS_MAX + 1):
        x = torch.randn(rows, in_f, generator=gen).bfloat16()
        y = torch.ops.aten._weight_int8pack_mm(x, w, ones).float() * scales
        if y.shape != (rows, out_f):
            return f"rows {rows}: output shape {tuple(y.shape)}, expected {(rows, out_f)}"
        ref = x.double() @ w_ref.T
        bound = x.double().abs() @ w_ref.abs().T
        err = ((y[:, cols].double() - ref).abs() / bound.clamp_min(1e-30)).max().item()
        if not err <= 2 ** -6:  # bf16 x and output: a few 2^-8 roundings
            return f"rows {rows}: relative error {err:.3g} against float64"
    return None


def kernel_for(spec: QuantSpec, in_features: int, x2d: torch.Tensor,
               parts: dict[str, torch.Tensor] | None = None, activations: str = "fp32") -> str:
    """The kernel quant_linear runs for x2d [rows, in] and the weight's `parts`: fused where it
    applies (which needs `parts`: its shape is checked), the C loop where it applies, chunked
    otherwise (or what $OFFLOAD_QUANT_KERNEL forces). From C_MEASURED_FROM_ROWS rows on, given the weight's
    `parts`, the C loop and the chunked kernel are timed on it once per shape (`_c_or_chunked`)."""
    forced = _override()
    fused = parts is not None and fused_applies(spec, in_features, x2d, parts["qweight"].shape[0])
    if forced == "dense":
        return "dense"
    if forced == "fused" or (forced is None and fused):
        return "fused" if fused else "chunked"
    if forced in (None, "c") and quant_cpu.applies(spec, in_features, x2d):
        rows = x2d.shape[0]
        if forced == "c" or (rows < C_MEASURED_FROM_ROWS or parts is None) and rows <= quant_cpu.ROWS_MAX[spec.bits]:
            return "c"
        return "chunked" if parts is None else _c_or_chunked(parts, spec, in_features, x2d, activations)
    return "chunked"


# At 1-8 rows the C loop won on every shape measured. From 9 rows it runs its register-blocked
# loop, which on the 1B shapes at 16-64 rows was faster than the chunked kernel with idle
# OpenMP threads asleep (as runners/infer.py sets them) and slower beside spinning ones, where
# the chunked kernel's BLAS call holds both cores (docs/BENCHMARKS.md). So from 9 rows on both
# are timed on the weight itself, the first time a shape meets a row count, and the faster is
# kept (up to quant_cpu.ROWS_MEASURED_MAX rows; beyond, the chunked kernel).
C_MEASURED_FROM_ROWS = 9
C_PROBE_BYTES = 16 << 20  # packed weight bytes (its first rows) a timed call reads at most
C_PROBE_REPEATS = 3  # timed calls of each kernel, alternating, after one untimed; fastest kept
C_EVICT_BYTES = 64 << 20  # read before each timed call: decode reads every weight from memory
_c_choice: dict[tuple, str] = {}  # (bits, group, out, in, rows, activations) -> "c" | "chunked"
_c_timings: dict[tuple, dict[str, float]] = {}
_c_lock = threading.Lock()


def _c_or_chunked(parts: dict[str, torch.Tensor], spec: QuantSpec, in_features: int,
                  x2d: torch.Tensor, activations: str = "fp32") -> str:
    qw = parts["qweight"]
    key = (spec.bits, spec.group_size, qw.shape[0], in_features, x2d.shape[0], activations)
    hit = _c_choice.get(key)
    if hit is not None:
        return hit
    with _c_lock:  # one measurement per shape, even with several generating threads
        hit = _c_choice.get(key)
        if hit is None:
            row_bytes = max(1, sum(t[0].numel() * t.element_size() for t in parts.values()
                                   if t is not None))
            n = max(1, min(qw.shape[0], C_PROBE_BYTES // row_bytes))
            probe = {k: (t[:n] if t is not None else None) for k, t in parts.items()}
            qw_, sc_, mn_ = check_parts(probe, spec, in_features)
            x = x2d.float()
            run = {"c": lambda: quant_cpu.rows_product(x2d, probe, spec, in_features, activations),
                   "chunked": lambda: _chunked(x, qw_, sc_, mn_, spec, in_features)}
            evict = torch.empty(C_EVICT_BYTES // 4, dtype=torch.float32).fill_(1.0)
            best = {name: float("inf") for name in run}
            for k in range(C_PROBE_REPEATS + 1):
                for name, fn in run.items():
                    evict.sum()
                    t0 = time.perf_counter()
                    fn()
                    if k:  # the first round is warm-up
                        best[name] = min(best[name], time.perf_counter() - t0)
            _c_timings[key] = best
            # ties go to the C loop, the kernel of every other few-row case
            hit = _c_choice[key] = "chunked" if best["chunked"] < 0.95 * best["c"] else "c"
    return hit


def c_choices() -> dict[tuple, dict]:
    """What was measured and chosen so far: {(bits, group, out, in, rows, activations): {"kernel": name,
    "seconds": {kernel: best seconds}}} (reports, tests)."""
    return {k: {"kernel": v, "seconds": dict(_c_timings[k])} for k, v in _c_choice.items()}


def reset_choices() -> None:
    """Forget every measurement (tests)."""
    with _c_lock:
        _c_choice.clear()
        _c_timings.clear()


_tls = threading.local()  # per-thread CPU scratch: reused, so no page faults on every call


def _scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of >= numel elements. On the CPU it is kept per thread (at most one chunk,
    CPU_CHUNK_BYTES_MANY_ROWS, + the int4 nibbles): a fresh multi-MB allocation is returned to
    the OS on free and page-faults again on every call."""
    if device.type != "cpu":  # the CUDA caching allocator already reuses blocks
        return torch.empty(numel, dtype=dtype, device=device)
    bufs = _tls.__dict__.setdefault("bufs", {})
    t = bufs.get((name, dtype))
    if t is None or t.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written inside and outside the mode
            t = bufs[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return t[:numel]


def chunk_rows(out_features: int, in_features: int, spec: QuantSpec, rows: int, device: torch.device,
               dtype: torch.dtype) -> int:
    """Weight rows dequantized per chunk by the chunked kernel."""
    if device.type == "cpu":
        budget = CPU_CHUNK_BYTES if rows <= MANY_ROWS else CPU_CHUNK_BYTES_MANY_ROWS
    else:
        budget = CUDA_CHUNK_BYTES
    per_row = spec.padded_in(in_features) * torch.finfo(dtype).bits // 8
    return max(1, min(out_features, budget // per_row))


def workspace_bytes(out_features: int, in_features: int, spec: QuantSpec, rows: int,
                    device: torch.device, dtype: torch.dtype) -> int:
    """Transient bytes quant_linear allocates beyond x and its result (for the planner): the
    chunk, the int4 nibble scratch, padded/permuted x and the transposed output -- or, where
    the C loop may run instead, its copies of x (fp32, padded, permuted, packed) and output."""
    cdt = torch.float32 if device.type == "cpu" else dtype
    size = torch.finfo(cdt).bits // 8
    p = spec.padded_in(in_features)
    c = chunk_rows(out_features, in_features, spec, rows, device, cdt)
    nibbles = c * p if spec.bits == 4 else 0
    chunked = c * p * size + nibbles + 2 * rows * p * size + 2 * rows * out_features * size
    if device.type != "cpu" or rows > quant_cpu.ROWS_MEASURED_MAX:
        return chunked
    padded_rows = -(-rows // quant_cpu.TILE_X_ROWS) * quant_cpu.TILE_X_ROWS
    return max(chunked, 4 * padded_rows * p * size + rows * out_features * size)  # size: fp32 here


def _chunked(x2d: torch.Tensor, qw: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None,
             spec: QuantSpec, in_features: int) -> torch.Tensor:
    """x2d [rows, in] (compute dtype) @ W^T -> [rows, out], W dequantized chunk by chunk into
    this thread's scratch."""
    rows, out_f, cdt, dev = x2d.shape[0], qw.shape[0], x2d.dtype, x2d.device
    ng, p = spec.groups(in_features), spec.padded_in(in_features)
    g = p // ng
    xp = F.pad(x2d, (0, p - in_features)) if p > in_features else x2d  # [rows, p], zeros in pad
    if spec.bits == 4:
        xsum = xp.reshape(rows, ng, g).float().sum(-1)  # [rows, groups]: the mins' factor
        xp = torch.cat((xp[:, 0::2], xp[:, 1::2]), 1)  # [rows, p]: the chunk's column order
    c = chunk_rows(out_f, in_features, spec, rows, dev, cdt)
    buf = _scratch("chunk", c * p, cdt, dev).view(c, p)
    nib = _scratch("nibbles", c * p, torch.uint8, dev).view(c, 2, p // 2) if spec.bits == 4 else None
    y_t = torch.empty(out_f, rows, dtype=cdt, device=dev)  # [out, rows]: chunks write whole rows
    for a in range(0, out_f, c):
        b = min(out_f, a + c)
        w = buf[: b - a]  # [n, p]
        if spec.bits == 8:
            w.copy_(qw[a:b])
            if ng > 1:
                w.view(b - a, ng, g).mul_(sc[a:b].float().unsqueeze(-1))
        else:
            t = nib[: b - a]  # [n, 2, p // 2]
            torch.bitwise_and(qw[a:b], 15, out=t[:, 0])
            torch.bitwise_right_shift(qw[a:b], 4, out=t[:, 1])
            wv = w.view(b - a, 2, ng, g // 2)  # [n, low|high, groups, g / 2]
            wv.copy_(t.view(b - a, 2, ng, g // 2))
            wv.mul_(sc[a:b].float()[:, None, :, None])
        torch.mm(w, xp.T, out=y_t[a:b])  # [n, rows]
    if ng == 1 and spec.bits == 8:
        y_t.mul_(sc.float())  # [out, 1]: (x . q) * scale
    if mn is not None:
        y_t.add_(mn.float() @ xsum.T)  # [out, groups] @ [groups, rows]: sum over groups of min * sum(x)
    return y_t.T


_ran: dict[str, int] = {}  # kernel -> quant_linear calls it computed (the run's report)


def kernels_run() -> dict[str, int]:
    """{kernel: calls} of quant_linear in this process so far (the run's report says which ran)."""
    return dict(_ran)


class _DenseProduct(torch.autograd.Function):
    """x @ W^T for training, W dequantized in forward and again in backward: autograd keeps
    the quantized parts (views of the streamer's slot: its pack hooks re-point them) and never
    the dense W. F.linear on the dequantized W would save W for x's gradient, a dense 16-bit
    copy of every projection from its forward to its backward -- unplanned (review 2 P4; as
    bitsandbytes' QLoRA product). The weight is frozen: only x gets a gradient."""

    @staticmethod
    def forward(ctx, x2d, qw, sc, mn, spec: QuantSpec, in_features: int):
        ctx.spec, ctx.in_features = spec, in_features
        ctx.save_for_backward(qw, sc, mn)
        return F.linear(x2d, dequantize(_parts(qw, sc, mn), spec, in_features, x2d.dtype))

    @staticmethod
    def backward(ctx, grad):
        qw, sc, mn = ctx.saved_tensors
        w = dequantize(_parts(qw, sc, mn), ctx.spec, ctx.in_features, grad.dtype)
        return grad.mm(w), None, None, None, None, None


def _parts(qw: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {"qweight": qw, "scales": sc, **({"mins": mn} if mn is not None else {})}


def quant_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], spec: QuantSpec, in_features: int,
                 bias: torch.Tensor | None = None, *, kernel: str | None = None,
                 checked: bool = False, activations: str = "fp32") -> torch.Tensor:
    """x [..., in] (float32 / bfloat16 / float16, CPU or CUDA) @ W^T (+ bias) -> [..., out] in x's
    dtype, W the dequantized weight; never a dense copy of W (except kernel="dense").
    On the CPU the chunked kernel computes in float32 (bf16 GEMMs of 32-256 rows ran 2-7x slower
    than float32 here: no AVX-512 BF16), on CUDA in x's dtype. `kernel` overrides kernel_for.
    `checked`: the parts are known to fit spec and in_features (a QuantLinear's, made to its
    shapes): their check is skipped, ~8 us of a decode step's ~50-150 us projection.
    `activations` "int8": the C loop quantizes x per 32 columns (module docstring)."""
    if checked:
        qw, sc, mn = parts["qweight"], parts["scales"], parts.get("mins")
    else:
        qw, sc, mn = check_parts(parts, spec, in_features)
    if x.shape[-1] != in_features or not x.is_floating_point():
        raise QuantError(f"x is {x.dtype} {tuple(x.shape)}: quant_linear needs float [..., {in_features}]")
    if x.device != qw.device:
        raise QuantError(f"x is on {x.device}, the quantized weight on {qw.device}: move one of them")
    out_f = qw.shape[0]
    x2d = x.reshape(-1, in_features)
    if kernel is None:
        # Outside inference mode (training, its checkpointed no-grad forwards and their
        # recompute, evaluation) always the dense product: autograd cannot go through the
        # chunks' out= products, and a checkpointed forward must compute exactly what its
        # recompute does (the fast kernels round differently), as models.llama.project does
        kernel = (kernel_for(spec, in_features, x2d, parts, activations)
                  if torch.is_inference_mode_enabled() else "dense")
    elif kernel not in KERNELS or (kernel == "fused" and not fused_applies(spec, in_features, x2d, out_f)) or (
            kernel == "c" and not quant_cpu.applies(spec, in_features, x2d)):
        raise QuantError(f"kernel={kernel!r}: use dense or chunked (fused: per-channel int8, bf16 x "
                         f"on the CPU, at most {FUSED_ROWS_MAX} rows, a shape checked on this CPU "
                         f"(kernel_trust.verdicts()); c: the CPU, at most "
                         f"{quant_cpu.ROWS_MEASURED_MAX} rows, built)")
    cdt = torch.float32 if x.device.type == "cpu" else x.dtype
    name = "c-a8" if kernel == "c" and activations == "int8" and quant_cpu.takes_a8(spec, in_features) else kernel
    _ran[name] = _ran.get(name, 0) + 1
    if x2d.shape[0] == 0:
        y = x2d.new_zeros(0, out_f)
    elif kernel == "fused":
        # unit scales, ours applied to the output in fp32: the kernel takes scales in x's dtype,
        # and our fp16 scales rounded to bf16 moved every channel's weights by up to 2^-9
        ones = torch.ones(out_f, dtype=x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2d.contiguous(), qw.contiguous(), ones).float()
        y.mul_(sc.reshape(1, -1).float())
    elif kernel == "dense" and torch.is_grad_enabled() and x2d.requires_grad:
        y = _DenseProduct.apply(x2d.to(cdt), qw, sc, mn, spec, in_features)
    elif kernel == "dense":
        y = F.linear(x2d.to(cdt), dequantize(parts, spec, in_features, cdt))
    elif kernel == "c":
        y = quant_cpu.rows_product(x2d, parts, spec, in_features, activations)
    else:
        y = _chunked(x2d.to(cdt), qw, sc, mn, spec, in_features)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).contiguous().view(*x.shape[:-1], out_f)
