"""Benchmark the CPU AdamW step against torch's optimizers and this machine's memory bandwidth.

One run, one set of buffers, all threads (torch.get_num_threads()):
  (a)  offload.optim.adamw.cpu_adamw_step, C kernel: 16-bit grad in -> fp32 master/moments -> 16-bit out
  (a') the same call on its torch fallback path (chunked torch._fused_adamw_)
  (ax) the same call with exact=True (C passes around torch's own sqrt: bit-identical to AdamW)
  (b)  the naive composition: grad.float() into an fp32 buffer, torch.optim.AdamW(fused=True),
       out16.copy_(master) -- three separate passes over memory
  (b0) torch.optim.AdamW(fused=True) alone, fp32 grad already there (not a full step; reference)
  (c)  as (b) but with torch.optim.AdamW's default (single-tensor) step
  copy / triad: torch copy_ and a = b + s*c on large fp32 arrays; the floor uses triad.
  rmw: a += s*b, the read-modify-write pattern of the optimizer state (see below).

A full step must move 28 B/param (2 B grad + 3 x 4 B read + 3 x 4 B written + 2 B out16), so
"GB/s eff." is 28 B x params / time for every row and the floor is 28 B x params / triad GB/s.
Bandwidths use STREAM's counting (bytes the code asks for). Triad's output is write-only, so the
CPU also reads each destination line before writing it (write-allocate): 16 B really move per 12 B
counted. The AdamW step's state is read-modify-write and only out16 (2 of 28 B) is write-only, so
it can beat the triad "floor"; the rmw row (a += s*b, 12 B, no write-allocate) is the tighter
yardstick for it and is reported as a second fraction.
Methods run round-robin, one repeat of each per round, so a burst of load from other processes on
a shared machine hits all of them rather than one; the table reports medians.

    python scripts/bench_adam.py                 # 200M params, 5 repeats
    python scripts/bench_adam.py --params 50e6 --repeats 9 --dtype fp16
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload.optim.adamw import BYTES_PER_PARAM_16BIT, active_implementation, cpu_adamw_step  # noqa: E402

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
BANDWIDTH_ELEMS = 64 * 2**20   # 256 MiB per fp32 array: 8x a 32 MiB L3, so DRAM is what's timed


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU-seconds of the whole machine incl. steal, CPU-seconds of this process), or None
    where /proc/stat does not exist. Their difference over the run is what others used."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
    busy_ticks = sum(fields[:8]) - fields[3] - fields[4]
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy_ticks / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def _torch_optimizer(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     grad32: torch.Tensor, fused: bool) -> torch.optim.Optimizer:
    """A real torch.optim.AdamW over our own buffers (Parameter shares master's storage; the
    state is injected), so every method reads and writes the same memory."""
    param = torch.nn.Parameter(master)
    param.grad = grad32
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=fused,
                            foreach=None if fused else False)
    opt.state[param] = {"step": torch.tensor(0.0, dtype=torch.float32), "exp_avg": exp_avg,
                        "exp_avg_sq": exp_avg_sq}
    return opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=float, default=200e6, help="parameters per step (default 200e6)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per method (default 5)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="grad and out16 dtype (default bf16)")
    ap.add_argument("--skip-default", action="store_true",
                    help="skip (c), the slow single-tensor torch.optim.AdamW")
    args = ap.parse_args()
    n = int(args.params)
    dtype16 = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    threads = torch.get_num_threads()
    impl = active_implementation()  # builds the C kernel now, outside the timed region

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen).mul_(1e-3)
    exp_avg_sq = torch.rand(n, generator=gen).mul_(1e-6)
    grad16 = torch.randn(n, generator=gen).mul_(1e-3).to(dtype16)
    out16 = torch.empty(n, dtype=dtype16)
    grad32 = torch.empty(n, dtype=torch.float32)
    bw_a, bw_b, bw_c = (torch.rand(BANDWIDTH_ELEMS, generator=gen) for _ in range(3))

    step_counter = [0]

    def ours(which: str, exact: bool = False) -> Callable[[], None]:
        def run() -> None:
            step_counter[0] += 1
            cpu_adamw_step(master, exp_avg, exp_avg_sq, grad16, step=step_counter[0], out16=out16,
                           impl=which, exact=exact, **HYPER)
        return run

    fused_opt = _torch_optimizer(master, exp_avg, exp_avg_sq, grad32, fused=True)
    default_opt = _torch_optimizer(master, exp_avg, exp_avg_sq, grad32, fused=False)

    def naive(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            grad32.copy_(grad16)      # pass 1: upcast
            opt.step()                # pass 2: the optimizer
            out16.copy_(master)       # pass 3: copy-out
        return run

    grad32.copy_(grad16)
    methods: dict[str, tuple[Callable[[], None], float]] = {
        # name: (callable, bytes per element it is credited with for the bandwidth rows)
        "copy": (lambda: bw_a.copy_(bw_b), 8.0),
        "triad": (lambda: torch.add(bw_b, bw_c, alpha=1.5, out=bw_a), 12.0),
        "rmw": (lambda: bw_a.add_(bw_b, alpha=0.5), 12.0),
        f"(a) cpu_adamw_step [{impl}]": (ours(impl), 0.0),
        "(a') cpu_adamw_step [torch fallback]": (ours("torch"), 0.0),
        "(ax) cpu_adamw_step [c, exact=True]": (ours("c", exact=True), 0.0),
        "(b) upcast + AdamW(fused=True) + copy-out": (naive(fused_opt), 0.0),
        "(b0) AdamW(fused=True) alone, fp32 grad": (fused_opt.step, 0.0),
    }
    if impl == "torch":   # no C kernel here: (a) already is the torch path, and no exact mode
        del methods["(a') cpu_adamw_step [torch fallback]"], methods["(ax) cpu_adamw_step [c, exact=True]"]
    if not args.skip_default:
        methods["(c) upcast + AdamW default + copy-out"] = (naive(default_opt), 0.0)

    load_before = os.getloadavg()
    cpu_before, wall_before = _cpu_seconds(), time.perf_counter()
    for fn, _ in methods.values():   # warm-up: page faults, lazy init, kernel build
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, (fn, _) in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()
    cpu_after, wall_s = _cpu_seconds(), time.perf_counter() - wall_before
    others_share = None
    if cpu_before is not None and cpu_after is not None:
        others_s = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
        others_share = max(0.0, others_s) / (wall_s * (os.cpu_count() or 1))

    gbs = {name: methods[name][1] * BANDWIDTH_ELEMS / statistics.median(times[name]) / 1e9
           for name in ("copy", "triad", "rmw")}
    floor_s = BYTES_PER_PARAM_16BIT * n / (gbs["triad"] * 1e9)
    rmw_floor_s = BYTES_PER_PARAM_16BIT * n / (gbs["rmw"] * 1e9)
    base_name = "(b) upcast + AdamW(fused=True) + copy-out"
    base_s, base_min_s = statistics.median(times[base_name]), min(times[base_name])

    print(f"# CPU AdamW step, {n / 1e6:.0f}M params, {args.dtype} grad/out, {threads} threads, "
          f"median of {args.repeats}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, Python {platform.python_version()}; load average before/after "
          f"{load_before[0]:.2f}/{load_after[0]:.2f}; CPU used by other processes during the "
          f"timed rounds: {'n/a' if others_share is None else f'{100 * others_share:.0f}%'}")
    print(f"# bandwidth (torch, {BANDWIDTH_ELEMS * 4 >> 20} MiB fp32 arrays, median): "
          f"copy {gbs['copy']:.1f} GB/s (8 B/elem), triad {gbs['triad']:.1f} GB/s (12 B/elem), "
          f"rmw {gbs['rmw']:.1f} GB/s (12 B/elem)")
    print(f"# floor = {BYTES_PER_PARAM_16BIT} B/param x {n / 1e6:.0f}M / triad = {floor_s * 1e3:.1f} ms"
          f"; rmw floor = {rmw_floor_s * 1e3:.1f} ms")
    print()
    print("| method | ms/step (median) | ms (min) | Gparam/s | GB/s eff. (28 B/param) "
          "| vs (b) | vs (b), min/min | fraction of floor (triad) | fraction of rmw floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in methods:
        if name in gbs:
            continue
        med, best = statistics.median(times[name]), min(times[name])
        print(f"| {name} | {med * 1e3:.1f} | {best * 1e3:.1f} | {n / med / 1e9:.2f} | "
              f"{BYTES_PER_PARAM_16BIT * n / med / 1e9:.1f} | {base_s / med:.2f}x | "
              f"{base_min_s / best:.2f}x | {floor_s / med:.2f} | {rmw_floor_s / med:.2f} |")
    print()
    ours = times[f"(a) cpu_adamw_step [{impl}]"]
    speedup, fraction = base_s / statistics.median(ours), floor_s / statistics.median(ours)
    print(f"goals (medians): >= 1.30x (b): {speedup:.2f}x {'MET' if speedup >= 1.3 else 'NOT MET'}"
          f" (min/min {base_min_s / min(ours):.2f}x); >= 0.85 of triad floor: {fraction:.2f} "
          f"{'MET' if fraction >= 0.85 else 'NOT MET'}")
    if others_share is None or others_share > 0.05:
        print("note: other processes used the CPUs during the run (or that could not be measured);"
              " the OpenMP-based torch rows suffer more from that than the C kernel, so rerun on a"
              " quiet machine before trusting the ratios")


if __name__ == "__main__":
    main()
