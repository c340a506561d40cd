"""Benchmark the kernels of offload.quant.matmul.quant_linear against dense F.linear on this CPU.

For each weight shape (out x in), number of rows and activation dtype (fp32, bf16), every kernel
runs round-robin, one call of each per round, each call on one of several copies of its weight
so that 64 MiB of other weights went through the cache since that copy's last use (as in a
decode step: the weight comes from memory, the kernel's scratch stays warm); medians of
--repeats rounds. Kernels:
  dense32 / dense16   F.linear(x, W) with the dense weight in fp32 / bf16 (x cast to match, so
                      dense16 answers in bf16): the baselines quantized decode is held to
  dense32T            (W @ x^T)^T, fp32: the transposed form models/kernels.py measures and
                      picks for 2-32 rows where this BLAS runs it faster
  <spec> deq          (a) F.linear(x, dequantize(parts)): a full dense fp32 copy every call
  <spec> chunk        (b) quant_linear's chunked kernel (dequantize a few MB of rows, multiply)
  <spec> fused        (c) torch.ops.aten._weight_int8pack_mm (per-channel int8; bf16 x only:
                      its fp32 path is scalar, see --fused-fp32)
  <spec> c            offload/quant/cpu.py's C loop (1-64 rows; from 9 its register-blocked loop)
  <spec> c8           the same library's 8-row tiles, for 9+ rows (what the blocked loop replaced)
  int4 pack+mm        (c) torch.ops.aten._weight_int4pack_mm_for_cpu, bf16 x, our packed rows
                      converted (_convert_weight_to_int4pack_for_cpu) in every call
  int4 prepacked      the same product with the conversion done once beforehand
  default             the kernel quant_linear picks (kernel_for) for each spec; its time is
                      that kernel's column
Every kernel's result is first checked against x @ dequantize(parts)^T computed in float64:
"max err" is the largest |y - ref| / (|x| @ |W|^T), ~1e-7 for fp32 paths, ~1e-3 for bf16 ones.
The last line says how much CPU time other processes (or the hypervisor: steal) took during the
run: on a shared 2-core machine a busy neighbour slows some columns more than others.

    python scripts/bench_quant.py                       # 1B Llama + SmolLM2-135M shapes, rows 1,4,32,256
    python scripts/bench_quant.py --shapes 2048x8192 --rows 32,64,128 --repeats 7
    python scripts/bench_quant.py --chunks 1,4,16       # chunked kernel with chunk sizes in MiB
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as runners/infer.py sets it before torch

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, TypeVar  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload.quant import cpu as quant_cpu  # noqa: E402
from offload.quant import matmul as quant  # noqa: E402
from offload.quant.matmul import kernel_for, quant_linear  # noqa: E402
from offload.quant.format import QuantSpec, dequantize, quantize  # noqa: E402
from offload.memory.tiers import cpu_model  # noqa: E402

LLAMA_1B = ["2048x2048", "8192x2048", "2048x8192"]  # q/o, gate/up, down (out x in)
SMOLLM2_135M = ["576x576", "1536x576", "576x1536"]
SPECS = {"int8/ch": QuantSpec(8, 0), "int8/g32": QuantSpec(8, 32), "int4/g32": QuantSpec(4, 32),
         "int4/g64": QuantSpec(4, 64)}
RULE = (quant.CPU_CHUNK_BYTES, quant.CPU_CHUNK_BYTES_MANY_ROWS)
COLD_BYTES = 64 << 20  # twice the L3 of this CPU
T = TypeVar("T")


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU-seconds of the whole machine, of this process), or None without /proc/stat:
    their difference over the run is what other processes took from it."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    own = os.times()
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def side_by_side(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """{name: median ms}: one untimed call each, then `repeats` rounds of one call each."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def rotating(make: Callable[[], T], nbytes: int) -> Callable[[], T]:
    """A function returning one of ceil(COLD_BYTES / nbytes) copies of make(), in turn: each
    call reads a weight that COLD_BYTES of other weights went through since its last use, as
    in a decode step, while the kernel's own scratch stays as warm as it is there."""
    copies = [make() for _ in range(max(1, -(-COLD_BYTES // max(1, nbytes))))]
    state = [0]

    def next_copy() -> T:
        state[0] = (state[0] + 1) % len(copies)
        return copies[state[0]]
    return next_copy


def nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


def int4pack_fns(parts: dict, spec: QuantSpec, in_f: int, x: torch.Tensor) -> dict[str, Callable]:
    """torch's int4 CPU kernel on our parts: zero point = min + 8 * scale (its dequant is
    (q - 8) * scale + zero), scales and zeros in bf16 -- not the same weight values exactly."""
    out_f = parts["qweight"].shape[0]
    if x.dtype != torch.bfloat16 or out_f % 16 or spec.group_size not in (32, 64, 128, 256) or in_f % spec.group_size:
        return {}
    s, m = parts["scales"].float(), parts["mins"].float()
    sz = torch.stack((s, m + 8 * s), -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [groups, out, 2]

    def convert(b: torch.Tensor) -> torch.Tensor:
        q = torch.stack((b & 15, b >> 4), -1).view(out_f, in_f).int()  # [out, in] int32
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    raw = rotating(lambda: parts["qweight"].clone(), nbytes(parts))
    packed = rotating(lambda: convert(parts["qweight"]), nbytes(parts))
    return {"int4 pack+mm": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, convert(raw()), spec.group_size, sz),
            "int4 prepacked": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed(), spec.group_size, sz)}


def run_case(out_f: int, in_f: int, rows: int, act: torch.dtype, repeats: int, chunks: list[int],
             specs: dict[str, QuantSpec], fused_fp32: bool) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f) * 0.02
    x = torch.randn(rows, in_f).to(act)
    w32 = rotating(w.clone, w.numel() * 4)
    w16 = rotating(w.bfloat16, w.numel() * 2)
    fns: dict[str, Callable] = {"dense32": lambda: F.linear(x.float(), w32()), "dense16": lambda: F.linear(x.bfloat16(), w16()),
                                # (W @ x^T)^T: what models/kernels.py picks for 2-32 rows where faster
                                "dense32T": lambda: (w32() @ x.float().reshape(-1, in_f).T).T}
    refs: dict[str, torch.Tensor] = {}
    picks: dict[str, str] = {}
    for label, spec in specs.items():
        parts = quantize(w, spec)
        deq = dequantize(parts, spec, in_f, torch.float64)
        cold = rotating(lambda p=parts: {k: v.clone() for k, v in p.items()}, nbytes(parts))
        fns[f"{label} deq"], refs[f"{label} deq"] = lambda c=cold, s=spec: quant_linear(x, c(), s, in_f, kernel="dense"), deq
        for mib in chunks:
            def chunked(c=cold, s=spec, mib=mib):
                quant.CPU_CHUNK_BYTES, quant.CPU_CHUNK_BYTES_MANY_ROWS = (mib << 20, mib << 20) if mib else RULE
                return quant_linear(x, c(), s, in_f, kernel="chunked")
            name = f"{label} chunk" + (f"@{mib}M" if mib else "")
            fns[name], refs[name] = chunked, deq

        if quant.fused_applies(spec, in_f, x.reshape(-1, in_f), out_f):  # checked on this CPU
            fns[f"{label} fused"] = lambda c=cold, s=spec: quant_linear(x, c(), s, in_f, kernel="fused")
            refs[f"{label} fused"] = deq
        elif fused_fp32 and spec.bits == 8 and spec.group_size == 0 and rows == 1 and in_f % 16 == 0:
            def fused(c=cold):  # fp32 x: torch's scalar path, timed directly (never chosen)
                p = c()
                ones = torch.ones(out_f, dtype=x.dtype)
                return torch.ops.aten._weight_int8pack_mm(x, p["qweight"], ones) * p["scales"].view(-1).to(x.dtype)
            fns[f"{label} fused"], refs[f"{label} fused"] = fused, deq
        if quant_cpu.applies(spec, in_f, x.reshape(-1, in_f)):  # the C few-row loop
            fns[f"{label} c"] = lambda c=cold, s=spec: quant_linear(x, c(), s, in_f, kernel="c")
            refs[f"{label} c"] = deq
            if x.reshape(-1, in_f).shape[0] >= quant_cpu.BLOCKED_ROWS_MIN:  # c runs its blocked loop
                fns[f"{label} c8"] = lambda c=cold, s=spec: quant_cpu._run(  # ...against its 8-row tiles
                    quant_cpu.library(), x.reshape(-1, in_f), c(), s, in_f, torch.get_num_threads(), blocked=False)
                refs[f"{label} c8"] = deq
        if spec.bits == 4:
            for name, f in int4pack_fns(parts, spec, in_f, x).items():
                fns[name], refs[name] = f, deq
        def auto(c=cold, s=spec):  # what inference runs: the kernel quant_linear chooses
            with torch.inference_mode():
                return quant_linear(x, c(), s, in_f)
        fns[f"{label} auto"], refs[f"{label} auto"] = auto, deq
        auto()  # the choice (measured at 9-16 rows) is made here, outside the timed calls
        picks[label] = kernel_for(spec, in_f, x.reshape(-1, in_f), parts)
    errs = {}
    xd = x.double()
    scale = xd.abs() @ w.double().abs().T  # [rows, out]: bound of the rounding of any of the sums
    for name, f in fns.items():
        ref = refs.get(name)
        if ref is not None:
            errs[name] = float(((f().double() - xd @ ref.T).abs() / scale.clamp_min(1e-30)).max())
    try:
        times = side_by_side(fns, repeats)
    finally:
        quant.CPU_CHUNK_BYTES, quant.CPU_CHUNK_BYTES_MANY_ROWS = RULE
    return times, errs, picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(LLAMA_1B + SMOLLM2_135M), help="OUTxIN,... (default: 1B Llama, SmolLM2-135M)")
    ap.add_argument("--rows", default="1,4,32,256")
    ap.add_argument("--acts", default="fp32,bf16")
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", default="0", help="chunk sizes in MiB for the chunked kernel (0: quant's own rule)")
    ap.add_argument("--fused-fp32", action="store_true", help="also time int8pack with fp32 x at 1 row (slow)")
    args = ap.parse_args()
    acts = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"chunk rule: {quant.CPU_CHUNK_BYTES >> 20} MiB for <= {quant.MANY_ROWS} rows, "
          f"{quant.CPU_CHUNK_BYTES_MANY_ROWS >> 20} MiB beyond; fused rows <= {quant.FUSED_ROWS_MAX}")
    print("median ms per call (max err = max |y - ref| / (|x| @ |W|^T) against float64)\n")
    specs = {k: SPECS[k] for k in args.specs.split(",")}
    start, t0 = cpu_seconds(), time.perf_counter()
    chunks = [int(c) for c in args.chunks.split(",")]
    for shape in args.shapes.split(","):
        out_f, in_f = (int(v) for v in shape.split("x"))
        for act_name in args.acts.split(","):
            results, worst = [], {}
            for rows in (int(r) for r in args.rows.split(",")):
                times, errs, picks = run_case(out_f, in_f, rows, acts[act_name], args.repeats, chunks, specs,
                                              args.fused_fp32)
                results.append((rows, times, picks))
                for k, v in errs.items():
                    worst[k] = max(worst.get(k, 0.0), v)
            columns = list(dict.fromkeys(k for _, times, _ in results for k in times))
            print(f"### {out_f}x{in_f} (out x in), x {act_name}")
            print("| rows | " + " | ".join(columns) + " | default |")
            print("|---:|" + "---:|" * len(columns) + "---|")
            for rows, times, picks in results:
                cells = [f"{times[c]:.2f}" if c in times else "-" for c in columns]
                pick = ", ".join(f"{k} {v}" for k, v in picks.items())
                print(f"| {rows} | " + " | ".join(cells) + f" | {pick} |")
            print("max err: " + ", ".join(f"{k} {v:.0e}" for k, v in worst.items()) + "\n", flush=True)
    end = cpu_seconds()
    if start is not None and end is not None:
        others = (end[0] - start[0]) - (end[1] - start[1])
        print(f"other processes used {others:.1f} CPU-s of the {time.perf_counter() - t0:.0f} s run "
              f"({torch.get_num_threads()} cores): numbers taken beside them are slower")


if __name__ == "__main__":
    main()
