"""What converting a GGUF file's K-quant (and Q5_0) tensors once into the project's own int8/int4
format costs, on the real Gemma 3 270M Q4_K_M file: the default path of `--quantize` for those
types (offload/models/gguf.py; no kernel computes on K-blocks as stored).

For every tensor of the types asked (default Q4_K, Q6_K, Q5_0: the file's block tensors besides
its Q8_0 ones, which int8 takes as they are):
  (a) error: the file's values (gguf.quants.dequantize, float32) quantized by
      offload.quant.format.quantize into int8 group 32 (its default), int4 group 32 and int4
      group 64 (its default), dequantized again and compared with the file's values: the largest
      |difference| and the relative RMS (||difference|| / ||file's values||, over all the type's
      tensors together; the worst single tensor's in brackets);
  (b) time: gguf.quants.dequantize per MB of stored blocks, and offload's quantize (int4 group
      64) per MB of float32 input, for the same tensors (medians of --repeats runs per tensor,
      summed);
  (c) the other way, computing from the blocks as stored: one batch-1 decode product with the
      largest tensor of each type, its K-blocks dequantized by the package at every call (what
      "as stored" costs without a kernel of our own), against the same product on the blocks
      converted once (int8 g32, int4 g64: offload's CPU kernels) and on fp32 weights.
The CPU model (`lscpu`'s "Model name") and the threads are printed with the table.

    python scripts/bench_kquant.py                  # fetches the file once (scripts/fetch_gemma3.py)
    python scripts/bench_kquant.py --file X.gguf --types Q4_K,Q6_K --repeats 5
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload.models.gguf import GGUFReader  # noqa: E402
from offload.quant.format import QuantSpec, dequantize, quantize  # noqa: E402

SPECS = {"int8 g32": QuantSpec(8, 32), "int4 g32": QuantSpec(4, 32), "int4 g64": QuantSpec(4, 64)}
MB = 1 << 20


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no lscpu)"


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_type(reader: GGUFReader, kind: str, repeats: int) -> dict:
    import gguf
    tensors = [t for t in reader._reader.tensors if t.tensor_type.name == kind and len(t.shape) == 2]
    if not tensors:
        return {}
    err = {name: {"max": 0.0, "sq": 0.0, "worst": 0.0} for name in SPECS}
    ref_sq, stored, values, t_deq, t_q = 0.0, 0, 0, 0.0, 0.0
    for t in tensors:
        data = np.asarray(t.data)
        t_deq += timed(lambda: gguf.quants.dequantize(data, t.tensor_type), repeats)
        w = torch.from_numpy(reader.read_raw(t.name))
        stored, values = stored + data.nbytes, values + w.numel()
        w_sq = float(w.double().pow(2).sum())
        ref_sq += w_sq
        t_q += timed(lambda: quantize(w, SPECS["int4 g64"]), repeats)
        for name, spec in SPECS.items():
            parts = quantize(w, spec)
            diff = (dequantize(parts, spec, w.shape[1], torch.float32) - w).double()
            e = err[name]
            d_sq = float(diff.pow(2).sum())
            e["max"] = max(e["max"], float(diff.abs().max()))
            e["sq"] += d_sq
            e["worst"] = max(e["worst"], math.sqrt(d_sq / w_sq) if w_sq else 0.0)
    return {"tensors": len(tensors), "stored_mb": stored / MB, "values": values, "seconds": t_deq + t_q,
            "deq_ms_per_mb": 1e3 * t_deq / (stored / MB), "quant_ms_per_mb": 1e3 * t_q / (4 * values / MB),
            "err": {n: (e["max"], math.sqrt(e["sq"] / ref_sq), e["worst"]) for n, e in err.items()}}


def bench_product(reader: GGUFReader, kind: str, repeats: int) -> list[str] | None:
    """One batch-1 product [1, in] @ W^T per way of holding W (medians of `repeats` x 20 calls)."""
    import gguf

    from offload.quant.matmul import quant_linear
    tensors = [t for t in reader._reader.tensors if t.tensor_type.name == kind and len(t.shape) == 2]
    if not tensors:
        return None
    t = max(tensors, key=lambda t: int(t.n_elements))
    data = np.asarray(t.data)
    w = torch.from_numpy(reader.read_raw(t.name))
    x = torch.randn(1, w.shape[1])
    converted = {name: quantize(w, SPECS[name]) for name in ("int8 g32", "int4 g64")}

    def as_stored():
        return torch.nn.functional.linear(x, torch.from_numpy(
            gguf.quants.dequantize(data, t.tensor_type).reshape(w.shape)))

    def product(name):
        return lambda: quant_linear(x, converted[name], SPECS[name], w.shape[1])
    ways = [as_stored, product("int8 g32"), product("int4 g64"), lambda: torch.nn.functional.linear(x, w)]
    with torch.inference_mode():
        ms = [1e3 * timed(lambda f=f: [f() for _ in range(20)], repeats) / 20 for f in ways]
    return [kind, f"{t.name} {list(w.shape)}"] + [f"{v:.3f}" for v in ms] + [f"{ms[0] / ms[1]:.0f}x"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="a GGUF file (default: the Gemma 3 270M Q4_K_M, fetched once)")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q5_0")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    path = args.file
    if path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from fetch_gemma3 import fetch
        path = fetch(quiet=True)
    reader = GGUFReader(path, model_config=False)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"# {os.path.basename(path)} | CPU: {cpu_model()} ({os.cpu_count()} cores, load average {load}) "
          f"| torch threads {torch.get_num_threads()} | gguf dequantize: numpy, one thread")
    print("| type | tensors | stored MB | dequantize ms/MB | quantize (int4 g64) ms/MB fp32 | "
          + " | ".join(f"{n} max abs | {n} rel RMS (worst)" for n in SPECS) + " |")
    print("|---" * (5 + 2 * len(SPECS)) + "|")
    total = 0.0
    for kind in args.types.split(","):
        r = bench_type(reader, kind.strip(), args.repeats)
        total += r.get("seconds", 0.0)
        if not r:
            print(f"| {kind} | 0 | - | - | - |" + " - | - |" * len(SPECS))
            continue
        cells = " | ".join(f"{mx:.2e} | {rms:.2e} ({worst:.2e})" for mx, rms, worst in r["err"].values())
        print(f"| {kind} | {r['tensors']} | {r['stored_mb']:.1f} | {r['deq_ms_per_mb']:.1f} | "
              f"{r['quant_ms_per_mb']:.1f} | {cells} |")
    print(f"# converting all these tensors once (dequantize + quantize int4 g64): {total:.2f} s")
    print("\n| type | tensor [out, in] | as stored: dequantize + product ms | int8 g32 ms | "
          "int4 g64 ms | fp32 ms | as stored / int8 |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        row = bench_product(reader, kind.strip(), args.repeats)
        if row:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
