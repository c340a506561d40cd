"""Which CPU kernel computes a projection of few rows: chosen by measuring both on this machine.

A projection y = x @ W^T (x [rows, in], W [out, in]) is what nn.Linear and `transformers` run
(F.linear). For a handful of rows -- batched decode is exactly [B, 1] tokens -- the same product
computed as (W @ x^T)^T walks W in the order it is stored, and which of the two is faster
depends on the CPU and its BLAS: on this project's 2-core AMD EPYC the transposed form was
1.3-2.5x faster for 2-7 rows and 1.0-1.6x for 8-32 (docs/benchmarks/infer.md), while on a
2-core Intel Xeon with AVX-512 it was ~2x *slower* at 2 rows (issue 16). No fixed row threshold
holds on both, so the first time a (out, in, rows) shape is projected in inference, both forms
are timed on that very weight and input, alternately, and the faster is kept for the process
-- if a second measurement at the shape's RECHECK_AT_USE-th use agrees.

One row (batch-1 decode) is a matrix-vector product, which this BLAS runs on one core however
many it has: measured, 17.7 ms for a [32768, 2048] fp32 weight with 1 or 2 threads, where two
threads read the same bytes in 12.9 ms. So for one row the candidates are F.linear and "split":
W's rows cut into one part per thread, each part's product run on its own thread (the BLAS
call releases the GIL) into its slice of the output -- 1.3-1.5x faster for weights of a few MB
and up, slower for small ones (thread hand-off), hence measured like the rest; offered only
when idle OpenMP threads sleep (`idle_threads_sleep`).

The measurement reads at most PROBE_BYTES of the weight (its first rows): for a weight larger
than that, both forms stream it from memory at a cost per row that does not depend on how many
rows there are, so the slice ranks them as the whole would -- ~50 ms once per shape rather than
seconds for a 1 GB vocabulary head. F.linear is kept unless the transposed form takes at most
MIN_RATIO of its time: ties (one row, noise) go to the kernel `transformers` itself runs.

Only fp32 on the CPU in torch.inference_mode (generation): training and checkpointed forwards
always run nn.Linear, so their results stay bit-identical to plain PyTorch's. The override
$OFFLOAD_FEW_ROWS_KERNEL=linear|transposed|split skips the measurement (tests, reproducing a run).
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn.functional as F

from offload.quant.cpu import helper_pool

SMALL_ROWS_MAX = 32  # beyond this, x @ W^T is the efficient GEMM on every machine measured
PROBE_BYTES = 64 << 20  # weight bytes read per timed call: beyond any L3 cache of these CPUs
MIN_RATIO = 0.95  # transposed must take <= 95% of F.linear's time to be chosen
PROBE_REPEATS = 3  # timed calls of each form, alternating; the fastest of each is compared
EVICT_BYTES = 64 << 20  # read before each timed call: twice the largest L3 of the CPUs measured
MIN_MEASURED_BYTES = 1 << 20  # smaller weights keep F.linear unmeasured
# A shape is measured again at its RECHECK_AT_USE-th use, inside the run: a choice made while
# something else held a core (a start-up under load; measured: a 2-thread product of a few rows
# stalls 5-15 ms when the other core is busy) is kept only if the second measurement agrees,
# else F.linear, the kernel transformers runs. So a noisy start cannot pin a slower kernel.
RECHECK_AT_USE = 64

_choice: dict[tuple[int, int, int], str] = {}  # (out, in, rows) -> kernel name
_timings: dict[tuple[int, int, int], dict[str, float]] = {}  # -> {kernel: best seconds}
_uses: dict[tuple[int, int, int], int] = {}  # -> calls so far, until the recheck
_lock = threading.Lock()  # held while a shape is measured


def override() -> str | None:
    value = os.environ.get("OFFLOAD_FEW_ROWS_KERNEL", "").strip().lower()
    if value in ("", "measure"):
        return None
    if value not in ("linear", "transposed", "split"):
        raise ValueError(f"OFFLOAD_FEW_ROWS_KERNEL={value!r}: use linear, transposed, split or measure")
    return value


def candidates(rows: int) -> tuple[str, ...]:
    """The kernels measured for `rows` rows; the first is F.linear, the default."""
    if rows == 1:
        return ("linear", "split") if torch.get_num_threads() > 1 and idle_threads_sleep() else ("linear",)
    return ("linear", "transposed") if rows <= SMALL_ROWS_MAX else ("linear",)


def idle_threads_sleep() -> bool:
    """OpenMP was started with OMP_WAIT_POLICY=PASSIVE (runners/infer.py sets it before torch is
    imported). Otherwise the threads of the caller's last parallel region spin for a while after
    it, on the cores the split kernel's helpers need: measured back to back the split form still
    wins, but inside a decode step, between other operators, it lost (0.376 against 0.36 s per
    1B step; 0.26 s with idle threads asleep). The runtime reads the variable once, at start."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def kernel_for(weight: torch.Tensor, x2d: torch.Tensor) -> str:
    """The kernel to project x2d [rows, in] by weight [out, in] with on this machine (measured on
    first use of the shape, then cached): "linear", "transposed" or "split"."""
    rows = x2d.shape[0]
    forced = override()
    if forced is not None:  # where the named kernel is no candidate (split: one row), F.linear
        return forced if forced in candidates(rows) else "linear"
    if weight.numel() * weight.element_size() < MIN_MEASURED_BYTES:
        return "linear"  # microseconds either way: not worth a measurement
    key = (weight.shape[0], weight.shape[1], rows)
    hit = _choice.get(key)
    if hit is None or key in _uses:
        with _lock:  # one measurement per shape at a time, even with several generating threads
            hit = _choice.get(key)
            if hit is None:
                hit = _choice[key] = _measured_choice(key, weight, x2d)
                _uses[key] = 1
            elif key in _uses:
                _uses[key] += 1
                if _uses[key] >= RECHECK_AT_USE:  # the second opinion (see RECHECK_AT_USE)
                    del _uses[key]
                    if _measured_choice(key, weight, x2d) != hit:
                        hit = _choice[key] = "linear"
    return hit


def _measured_choice(key: tuple[int, int, int], weight: torch.Tensor, x2d: torch.Tensor) -> str:
    """The kernel that measured fastest for this shape by the margin, else F.linear."""
    names = candidates(x2d.shape[0])
    times = measure(weight, x2d, names) if len(names) > 1 else {"linear": 0.0}
    _timings[key] = times
    best = min(times, key=times.get)
    return best if times[best] <= MIN_RATIO * times["linear"] else "linear"


def run(kernel: str, weight: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """x2d [rows, in] @ weight^T -> [rows, out] (no bias) with the named kernel."""
    if kernel == "transposed":
        return (weight @ x2d.T).T  # walks W in the order it is stored
    if kernel == "split":
        return _split(weight, x2d)
    return F.linear(x2d, weight)


def _part(x2d: torch.Tensor, weight_rows: torch.Tensor, out: torch.Tensor) -> None:
    # inference mode is per thread: the caller's does not reach a helper thread, and the
    # output (an inference tensor when the caller is in inference mode) is written under it
    with torch.inference_mode(torch.is_inference(out)):
        torch.mm(x2d, weight_rows.T, out=out)


def _split(weight: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """One part of W's rows per thread, each part's product on its own thread into its slice
    of the output: every output element is the dot product F.linear computes."""
    n = torch.get_num_threads()
    if n < 2:
        return F.linear(x2d, weight)
    pool = helper_pool(n)  # threads - 1 helpers, shared with the quantized kernel
    out_f = weight.shape[0]
    out = torch.empty(x2d.shape[0], out_f, dtype=x2d.dtype, device=x2d.device)  # [rows, out]
    step = -(-out_f // n)  # rows of W per part
    bounds = [(a, min(a + step, out_f)) for a in range(0, out_f, step)]
    futures = [pool.submit(_part, x2d, weight[a:b], out[:, a:b]) for a, b in bounds[1:]]
    a, b = bounds[0]
    torch.mm(x2d, weight[a:b].T, out=out[:, a:b])  # this thread's part, beside the helpers'
    for f in futures:
        f.result()
    return out


def measure(weight: torch.Tensor, x2d: torch.Tensor,
            names: tuple[str, ...] = ("linear", "transposed")) -> dict[str, float]:
    """{kernel: seconds}, the fastest of PROBE_REPEATS alternating calls each, on the first
    rows of `weight` (at most PROBE_BYTES), after one untimed call each."""
    rows_w = max(1, min(weight.shape[0], PROBE_BYTES // max(1, weight.shape[1] * weight.element_size())))
    w = weight[:rows_w]  # [rows_w, in], contiguous: the first rows of a row-major weight
    # Before each timed call the caches are filled with other bytes, as in a decode step,
    # where every weight comes from memory (the model is far larger than any cache) and other
    # operators ran in between. Timed back to back, a weight of a few MB sits in the L3 cache
    # and the ranking can come out the other way.
    evict = torch.empty(EVICT_BYTES // 4, dtype=torch.float32).fill_(1.0)
    best = {name: float("inf") for name in names}
    for k in range(PROBE_REPEATS + 1):
        for name in names:
            evict.sum()
            t0 = time.perf_counter()
            run(name, w, x2d)
            if k:  # the first round is warm-up (first-touch, thread start)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def scratch_bytes(device: torch.device, dtype: torch.dtype) -> int:
    """Transient bytes a measurement allocates (the eviction buffer) for a model computing in
    `dtype` on `device`: what the inference planner adds to the workspace so that the first
    forward's measurements fit the budget it accepted."""
    measured = device.type == "cpu" and dtype == torch.float32 and override() is None
    return EVICT_BYTES if measured else 0


def choices() -> dict[tuple[int, int, int], dict]:
    """What was measured and chosen so far: {(out, in, rows): {"kernel": name, "seconds":
    {kernel: best seconds}}} (for reports and tests)."""
    return {k: {"kernel": v, "seconds": dict(_timings[k])} for k, v in _choice.items()
            if k in _timings and len(_timings[k]) > 1}


def reset() -> None:
    """Forget every measurement (tests)."""
    with _lock:
        _choice.clear()
        _timings.clear()
        _uses.clear()
