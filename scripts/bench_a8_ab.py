"""int8 activations against fp32 activations, side by side in one process: the C loop of
offload/quant/cpu.py with `activations="int8"` (offload/csrc/quant_a8.c) and without.

The library is loaded as the package builds it (-march=native, self-checked), and each shape's
two products are timed alternately -- one call of each per round, the order flipping every
round, each call on one of several copies of its weight so that the weight comes from memory as
in a decode step -- one thread, medians per shape and their ratio; with the relative error of
each against x @ dequantize(W)^T in float64 (the int8 one's is x's rounding). The first line
gives the CPU model and its vector flags. On a shared machine only the ratios mean anything.

    python scripts/bench_a8_ab.py                                # SmolLM2 and 1B shapes, 1 row
    python scripts/bench_a8_ab.py --rows 29 --rounds 50          # a prompt's rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload.quant import cpu as quant_cpu  # noqa: E402
from offload.quant.format import QuantSpec, dequantize, quantize  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_kernel_ab import COPIES_BYTES, cpu_line  # noqa: E402

# (label, bits, group, out x in): SmolLM2-135M's projections (its GGUF's Q4_1 / Q8_0 groups of
# 32), its int8 head, and the 1B preset's projections at the int4 default group of 64
SHAPES = [("smollm2", 4, 32, s) for s in ("576x576", "1536x576", "576x1536", "192x576")] + \
         [("smollm2", 8, 32, s) for s in ("576x576", "1536x576", "576x1536", "49152x576")] + \
         [("1b", 4, 64, s) for s in ("2048x2048", "8192x2048", "2048x8192")] + \
         [("1b", 8, 32, s) for s in ("2048x2048", "8192x2048")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--only", default="", help="labels to keep, comma-separated (smollm2, 1b)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(cpu_line())
    print(f"load average before: {os.getloadavg()}")
    lib = quant_cpu.library()
    if lib is None:
        raise SystemExit(f"the C kernel was not built: {quant_cpu.status()}")
    gen = torch.Generator().manual_seed(0)
    print(f"{args.rows} row(s), 1 thread, {args.rounds} rounds, medians (us)")
    print(f"{'model':>8} {'kernel':>8} {'shape':>10} {'fp32 x':>9} {'int8 x':>9} {'int8/fp32':>10}  "
          f"rel err fp32 / int8")
    keep = {s for s in args.only.split(",") if s}
    for label, bits, group, shape in SHAPES:
        if keep and label not in keep:
            continue
        spec = QuantSpec(bits, group)
        out_f, in_f = map(int, shape.split("x"))
        parts = quantize(torch.randn(out_f, in_f, generator=gen), spec)
        if not quant_cpu.a8_takes(lib, spec, in_f):
            print(f"{label:>8} int{bits} g{group} {shape}: int8 activations not taken on this CPU")
            continue
        x = torch.randn(args.rows, in_f, generator=gen)
        deq = dequantize(parts, spec, in_f, torch.float64)
        want, bound = x.double() @ deq.T, x.double().abs() @ deq.abs().T
        err = {a: ((quant_cpu._run(lib, x, parts, spec, in_f, 1, activations=a).double() - want).abs()
                   / bound).max().item() for a in ("fp32", "int8")}
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        copies = [{k: v.clone() for k, v in parts.items()} for _ in range(max(1, COPIES_BYTES // nbytes))]
        rounds = max(10, args.rounds * 1_000_000 // max(1_000_000, out_f * in_f * args.rows))
        times: dict[str, list[float]] = {"fp32": [], "int8": []}
        for r in range(rounds):
            for i, a in enumerate(("fp32", "int8") if r % 2 == 0 else ("int8", "fp32")):
                p = copies[(2 * r + i) % len(copies)]
                t0 = time.perf_counter()
                quant_cpu._run(lib, x, p, spec, in_f, 1, activations=a)
                times[a].append(time.perf_counter() - t0)
        med = {a: statistics.median(v) * 1e6 for a, v in times.items()}
        print(f"{label:>8} {f'int{bits} g{group}':>8} {shape:>10} {med['fp32']:9.1f} {med['int8']:9.1f} "
              f"{med['int8'] / med['fp32']:10.3f}  {err['fp32']:.1e} / {err['int8']:.1e}")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
