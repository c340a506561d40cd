"""The CPU AdamW step over one block's flat fp32 state, in as few passes over memory as possible.

The step is memory bound: per parameter it does ~15 flops but must move
    grad in (2 B at 16 bit) + master, exp_avg, exp_avg_sq read and written (24 B) + out16 written (2 B)
    = 28 B/param,
and a 2-core CPU streams ~40-55 GB/s, i.e. ~1.5-2 Gparam/s at best. So the only lever is bytes.

The obvious torch composition costs ~40% more traffic than that floor:
    grad.float()            reads 2 B, writes a 4 B fp32 temporary            ( 6 B)
    fused AdamW             reads the 4 B temporary + 24 B of state            (28 B)
    out16.copy_(master)     reads master again (4 B), writes 2 B               ( 6 B)  -> 40 B/param.

Two implementations remove the extra 12 B; both use all torch.get_num_threads() cores:

* "c" (preferred): a ~100-line C loop (offload/csrc/cpu_adamw.c), built once per machine with the
  system C compiler and loaded with ctypes. Each element is loaded once, updated in registers and
  stored once: exactly 28 B/param. Plain C + ctypes instead of a torch C++ extension because it
  compiles in under a second with no torch headers, needs no ninja, and the binary does not depend
  on the torch/Python ABI, so copying the project to another machine (Python 3.12, torch 2.11 + CUDA)
  only triggers a rebuild keyed on that machine's compiler and CPU. ctypes drops the GIL for the call.
* "torch" (fallback when no compiler works): the block is cut into chunks small enough that a chunk
  of all the buffers stays in L3 (512 Ki params: 10 MiB with the scratch); per chunk, grad is upcast
  into a reused fp32 scratch, torch._fused_adamw_ runs on the chunk views, and out16 is copied from
  the still-cache-hot master. DRAM traffic is again ~28 B/param; the upcast and copy-out only touch
  cache. Each torch op parallelises internally (OpenMP) over the chunk. The price is ~3 OpenMP
  regions per chunk: on an idle machine that is nearly free, but when other processes compete for
  the cores every region's barrier can wait out a scheduler time slice, and this path slows down far
  more than the C kernel (whose threads claim chunks and never wait for each other mid-step).

Exactness versus torch.optim.AdamW (default single-tensor path): the "c" kernel repeats its ops in
the same order and rounding (see the C file's header), so exp_avg and exp_avg_sq come out
bit-identical on this x86 build; master differs by about one rounding of the *update* (1e-7 of
max|master| after 20 steps) only because torch's CPU sqrt (MKL VML on x86 builds) is not correctly
rounded while C's sqrtf is: with a correctly rounded sqrt in the reference, all three buffers match
bit for bit. The "torch" path has the same master difference and, from the fused kernel's operation
order, 1-ulp differences on a handful of exp_avg_sq elements. Both are far inside 1e-6.

grad_scale: the reference unscales/clips by multiplying the fp32 grads by an fp32 factor
(torch.nn.utils.clip_grad_norm_ does grads.mul_(clip_coef) with a float32 tensor), so here
g = float32(grad) * float32(grad_scale): one fp32 multiply, the same floats as that route when the
engine folds a single fp32 factor. (Folding loss-scale and clip into one product rounds once instead
of twice; that is the engine's choice, not a difference in this step.)
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from offload import cbuild, kernel_trust
from offload.cbuild import find_compiler

__all__ = ["cpu_adamw_step", "adamw_coefficients", "AdamWCoefficients", "kernel_available",
           "kernel_status", "active_implementation", "find_compiler", "BYTES_PER_PARAM_16BIT"]

Impl = Literal["auto", "c", "torch"]

# Minimum DRAM traffic of one step with 16-bit grad and 16-bit out: 2 + 3*(4+4) + 2.
BYTES_PER_PARAM_16BIT = 28

# Params per chunk of the torch fallback: 512 Ki * (3*4 B state + 4 B scratch + 2+2 B) = 10 MiB,
# small enough to stay in a shared L3 (32 MiB here, more on servers) while the three ops pass over
# it, large enough that the ~30 us of Python + dispatch per chunk is negligible and that the
# OpenMP regions (3 per chunk) are few. Measured on the 2-core dev box, 100M params, idle machine:
# 128 Ki -> 1.46 Gparam/s, 256 Ki -> 1.50, 512 Ki -> 1.75, 1 Mi -> 1.78, 2 Mi -> 1.57.
TORCH_CHUNK_PARAMS = 1 << 19

# The C kernel starts a pthread per extra core per call (~50 us each on the dev VM), so a thread
# only pays off with enough work: single-threaded the kernel does ~3.7 Gparam/s on cache-resident
# data, and 2 threads beat 1 from ~1 Mi params up. Below this many params per thread, use fewer.
C_MIN_PARAMS_PER_THREAD = 1 << 19

_DTYPE_CODE: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_adamw.c"
_BASE_CFLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-pthread",
                # No FMAs beyond the fmaf() calls the source spells out: they are what keeps the
                # result equal to ATen's op-by-op rounding.
                "-ffp-contract=off",
                # These two change no value, they only let loops vectorise: -fno-math-errno for
                # sqrtf; -fno-trapping-math so GCC may evaluate the subnormal arm of the fp16
                # upcast unconditionally (without it every fp16-grad loop stayed scalar: 0.2 vs
                # 1.8 Gparam/s). torch builds its own kernels with both.
                "-fno-math-errno", "-fno-trapping-math"]


@dataclass(frozen=True)
class AdamWCoefficients:
    """The scalars of one AdamW step, computed in double exactly as torch's single-tensor path does
    (Python floats), then handed to the kernels, which round them to float like ATen's Scalar."""

    step: int               # the raw hyper-parameters, for the torch path's fused kernel
    lr: float
    beta1: float
    weight_decay: float
    grad_scale: float
    decay: float            # 1 - lr * weight_decay
    apply_decay: bool       # torch skips the multiply when weight_decay == 0
    lerp_weight: float      # 1 - beta1
    beta2: float
    one_minus_beta2: float
    bc2_sqrt: float         # (1 - beta2**step) ** 0.5
    eps: float
    neg_step_size: float    # -lr / (1 - beta1**step)


def adamw_coefficients(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, grad_scale: float = 1.0) -> AdamWCoefficients:
    if step < 1:
        raise ValueError(f"step is the 1-based count after increment; got {step}")
    # torch keeps `step` in a float32 tensor and reads it back with .item(): a Python float.
    step_f = float(step)
    bias_correction1 = 1 - beta1 ** step_f
    bias_correction2 = 1 - beta2 ** step_f
    return AdamWCoefficients(
        step=int(step), lr=float(lr), beta1=float(beta1), weight_decay=float(weight_decay),
        grad_scale=float(grad_scale), decay=1 - lr * weight_decay, apply_decay=weight_decay != 0,
        lerp_weight=1 - beta1, beta2=float(beta2), one_minus_beta2=1 - beta2,
        bc2_sqrt=bias_correction2 ** 0.5, eps=float(eps), neg_step_size=-(lr / bias_correction1))


# ----------------------------------------------------------------------------------------------
# Building and loading the C kernel
# ----------------------------------------------------------------------------------------------

_kernel_lock = threading.Lock()
_kernel_state: dict[str, object] = {}   # "fn": ctypes function or None once tried; "why": str


class _Kernel:
    """The loaded C library's two entry points: the one-pass update and its two phases."""

    def __init__(self, lib) -> None:
        f32, i32, i64, ptr = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        coeffs = [f32, f32, i32, f32, f32, f32, f32, f32, f32]
        self.full = lib.offload_cpu_adamw
        self.full.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, i32, i64,  # buffers, dtypes, numel
                              *coeffs, i32, i64]                      # threads, min params/thread
        self.full.restype = ctypes.c_int
        self.phase = lib.offload_cpu_adamw_phase
        self.phase.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i32, ptr, i32, i64, *coeffs, i32, i64]
        self.phase.restype = ctypes.c_int


def _bind(lib_path: Path) -> _Kernel:
    return _Kernel(ctypes.CDLL(str(lib_path)))


def _self_check(fn) -> str | None:
    """Run a few steps of the freshly loaded kernel against the torch path on odd-sized data.
    Guards against a compiler that ignores -ffp-contract or miscompiles the conversions."""
    gen = torch.Generator().manual_seed(1234)
    n = 4099
    for grad_dtype, out_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                  (torch.float16, torch.bfloat16)):
        bufs = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
        ref = [b.clone() for b in bufs]
        out, ref_out = torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)
        for step in (1, 2, 3):
            grad = torch.randn(n, generator=gen).to(grad_dtype)
            c = adamw_coefficients(step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                                   weight_decay=0.1, grad_scale=0.5)
            _step_c(fn, *bufs, grad, out, c)
            _step_torch(*ref, grad, ref_out, c)
        for mine, theirs in zip(bufs, ref):
            rel = ((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
            if not rel <= 1e-6:
                return f"self-check: relative difference {rel:.3g} vs torch for {grad_dtype}"
        if not torch.equal(out, bufs[0].to(out_dtype)):
            return f"self-check: out16 != master.to({out_dtype})"
    return None


def _build_kernel(arch_flag_sets: list[list[str]] | None = None,
                  cache: Path | None = None) -> tuple[object | None, str]:
    """Compile (or reuse from the on-disk cache) and self-check the kernel: (ctypes fn, why).
    The arguments exist for tests (e.g. to build the portable, no-arch-flags variant)."""
    return cbuild.build("cpu_adamw", _SOURCE, _BASE_CFLAGS, _bind, _self_check, arch_flag_sets, cache,
                        verify=lambda path: kernel_trust.verdict(LIBRARY_PROBE, (str(path),)))


LIBRARY_PROBE = "offload.optim.adamw:check_library"  # the self-check, run in a child first


def check_library(case: tuple[str]) -> str | None:
    """kernel_trust's probe: load the built library at `case[0]` and self-check it (a child)."""
    return _self_check(_bind(Path(case[0])))


def _load_kernel():
    """The ctypes function, or None (reason in _kernel_state["why"]). Built at most once per
    process; the .so is cached on disk per (source, compiler, flags, CPU identity)."""
    with _kernel_lock:
        if "fn" in _kernel_state:
            return _kernel_state["fn"]
        try:
            fn, why = _build_kernel()
        except OSError as exc:   # e.g. no writable directory at all: never fail the step for it
            fn, why = None, f"cannot build: {exc}"
        _kernel_state["fn"], _kernel_state["why"] = fn, why
        if fn is None and os.environ.get("OFFLOAD_ADAM_IMPL", "auto") != "torch":
            warnings.warn(f"offload.optim: C AdamW kernel unavailable ({why}); using the chunked "
                          f"torch path (slower, see docs/benchmarks/adam.md)", RuntimeWarning,
                          stacklevel=2)
        return fn


def kernel_available() -> bool:
    """Build (or load from cache) the C kernel now; True if it is usable. Call once at startup to
    keep the first optimizer step from paying the ~1 s compile."""
    return _load_kernel() is not None


def kernel_status() -> str:
    """Why the C kernel is or is not in use (the .so path, or the build/self-check error)."""
    _load_kernel()
    return str(_kernel_state["why"])


def active_implementation(impl: Impl = "auto") -> str:
    """'c' or 'torch': what cpu_adamw_step(impl=impl) would run. $OFFLOAD_ADAM_IMPL overrides auto."""
    if impl == "auto":
        impl = os.environ.get("OFFLOAD_ADAM_IMPL", "auto")  # type: ignore[assignment]
    if impl == "torch":
        return "torch"
    if impl == "c":
        if _load_kernel() is None:
            raise RuntimeError(f"C AdamW kernel requested but unavailable: {_kernel_state['why']}")
        return "c"
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'c' or 'torch', got {impl!r}")
    return "c" if _load_kernel() is not None else "torch"


# ----------------------------------------------------------------------------------------------
# The two implementations
# ----------------------------------------------------------------------------------------------

def _step_c(fn: _Kernel, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            grad: torch.Tensor, out16: torch.Tensor | None, c: AdamWCoefficients,
            exact: bool = False) -> None:
    coeffs = (c.grad_scale, c.decay, int(c.apply_decay), c.lerp_weight, c.beta2,
              c.one_minus_beta2, c.bc2_sqrt, c.eps, c.neg_step_size, torch.get_num_threads(),
              C_MIN_PARAMS_PER_THREAD)
    gd, od = _DTYPE_CODE[grad.dtype], 0 if out16 is None else _DTYPE_CODE[out16.dtype]
    if not exact:
        rc = fn.full(master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                     gd, None if out16 is None else out16.data_ptr(), od, master.numel(), *coeffs)
        if rc != 0:
            raise RuntimeError(f"offload_cpu_adamw returned {rc}")
        return
    # Exact mode: torch's CPU sqrt (MKL VML, not correctly rounded) is the one op C cannot
    # reproduce, so each cache-sized piece runs C phase 1, torch.sqrt, C phase 2 — the extra
    # passes hit cache, not DRAM, and the result is bit-identical to torch.optim.AdamW.
    n = master.numel()
    scratch = _fp32_scratch(min(n, EXACT_CHUNK_PARAMS), "sqrt")
    gsize, osize = grad.element_size(), 0 if out16 is None else out16.element_size()
    for begin in range(0, n, EXACT_CHUNK_PARAMS):
        k = min(n, begin + EXACT_CHUNK_PARAMS) - begin
        ptrs = (master.data_ptr() + 4 * begin, exp_avg.data_ptr() + 4 * begin,
                exp_avg_sq.data_ptr() + 4 * begin)
        g_ptr = grad.data_ptr() + gsize * begin
        o_ptr = None if out16 is None else out16.data_ptr() + osize * begin
        rc = fn.phase(1, *ptrs, None, g_ptr, gd, None, 0, k, *coeffs)
        sq = scratch[:k]
        torch.sqrt(exp_avg_sq[begin:begin + k], out=sq)
        rc |= fn.phase(2, *ptrs, sq.data_ptr(), g_ptr, gd, o_ptr, od, k, *coeffs)
        if rc != 0:
            raise RuntimeError(f"offload_cpu_adamw_phase returned {rc}")


# Params per exact-mode piece: 5 fp32 streams (master, 2 moments, sqrt scratch, grad) of 512 Ki
# elements = 10 MiB stay in the shared L3 across the three calls.
EXACT_CHUNK_PARAMS = 1 << 19


_scratch = threading.local()   # per calling thread, so concurrent steps never share a scratch


def _fp32_scratch(n: int, purpose: str = "grad") -> torch.Tensor:
    """A reused fp32 buffer of >= n elements, one per calling thread and purpose."""
    buf = getattr(_scratch, purpose, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.float32)
        setattr(_scratch, purpose, buf)
    return buf[:n]


def _step_torch(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                grad: torch.Tensor, out16: torch.Tensor | None, c: AdamWCoefficients) -> None:
    n = master.numel()
    # The fused kernel reads the step from a tensor; it never increments it (the optimizer does).
    step_t = torch.tensor(float(c.step), dtype=torch.float32)
    needs_upcast = grad.dtype != torch.float32 or c.grad_scale != 1.0
    scratch = _fp32_scratch(min(n, TORCH_CHUNK_PARAMS)) if needs_upcast else None
    for begin in range(0, n, TORCH_CHUNK_PARAMS):
        end = min(n, begin + TORCH_CHUNK_PARAMS)
        g = grad[begin:end]
        if scratch is not None:
            g32 = scratch[: end - begin]
            if grad.dtype == torch.float32:
                torch.mul(g, c.grad_scale, out=g32)
            else:
                g32.copy_(g)                    # exact upcast first: bf16*scale would round to bf16
                if c.grad_scale != 1.0:
                    g32.mul_(c.grad_scale)
            g = g32
        p = master[begin:end]
        torch._fused_adamw_([p], [g], [exp_avg[begin:end]], [exp_avg_sq[begin:end]], [],
                            [step_t], lr=c.lr, beta1=c.beta1, beta2=c.beta2,
                            weight_decay=c.weight_decay, eps=c.eps, amsgrad=False, maximize=False)
        if out16 is not None:
            out16[begin:end].copy_(p)           # master chunk is still in cache


# ----------------------------------------------------------------------------------------------
# The public step
# ----------------------------------------------------------------------------------------------

def _check_buffers(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   grad: torch.Tensor, out16: torch.Tensor | None) -> None:
    n = master.numel()
    named = [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)]
    if out16 is not None:
        named.append(("out16", out16))
    for name, t in named:
        if t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"{name}: expected a 1-D contiguous CPU tensor of {n} elements, got "
                             f"shape {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")
    for name, t in named[:3]:
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if grad.dtype not in _DTYPE_CODE:
        raise TypeError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if out16 is not None and out16.dtype not in _OUT_DTYPES:
        raise TypeError(f"out16 must be bfloat16 or float16, got {out16.dtype}")
    # The kernels read grad while writing state; overlapping buffers would read updated values.
    ptrs = {t.data_ptr() for _, t in named}
    if n > 0 and len(ptrs) != len(named):
        raise ValueError("master, exp_avg, exp_avg_sq, grad and out16 must be distinct buffers")


def cpu_adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   grad: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, grad_scale: float = 1.0,
                   out16: torch.Tensor | None = None, impl: Impl = "auto",
                   exact: bool = False) -> None:
    """In place. g = grad.float() * grad_scale (grad_scale folds loss-scale unscaling and the clip
    coefficient); then exactly torch.optim.AdamW's math (default, non-fused, non-foreach
    single-tensor path, amsgrad=False, maximize=False) with `step` = the 1-based step count after
    increment; if out16 is given, out16 = master cast to out16.dtype (round-to-nearest-even, as
    Tensor.to does). All tensors 1-D contiguous CPU, same numel.

    exact (C kernel): False — one pass, C's correctly rounded sqrtf; True — bit-identical to
    torch.optim.AdamW on this machine: torch's CPU sqrt (MKL VML, not correctly rounded) is
    applied between two C passes per cache-sized piece (1.7-2.6x slower; for reproducibility checks).
    impl: "auto" (C kernel if it builds, else torch; $OFFLOAD_ADAM_IMPL=c|torch overrides),
    "c" (raise if the kernel is unavailable) or "torch" (chunked torch._fused_adamw_ path).
    Releases the GIL for the bulk of the work on either path, so the engine may run it on a
    background thread while the main thread keeps the device busy."""
    _check_buffers(master, exp_avg, exp_avg_sq, grad, out16)
    coeffs = adamw_coefficients(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, grad_scale=grad_scale)
    if master.numel() == 0:
        return
    if active_implementation(impl) == "c":
        _step_c(_load_kernel(), master, exp_avg, exp_avg_sq, grad, out16, coeffs, exact)
    else:
        _step_torch(master, exp_avg, exp_avg_sq, grad, out16, coeffs)
