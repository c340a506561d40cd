"""Two versions of offload/csrc/quant_gemv.c, side by side in one process: is a change faster?

The source at a git ref (default HEAD) and the working tree's are each built with the flags
offload/quant/cpu.py uses (-march=native first), loaded with ctypes, checked against x @
dequantize(W)^T in float64, then timed alternately -- one call of each per round, the order
flipping every round, each call on one of several copies of its weight so that the weight comes
from memory as in a decode step -- and the medians printed per shape with their ratio. One
thread (the kernel's own loop; cpu.py hands these shapes to one thread). The first line gives
the CPU model and its vector flags: the working tree's kernel may take another branch elsewhere.

    python scripts/bench_kernel_ab.py                          # SmolLM2 int4 g32 shapes, 1 row
    python scripts/bench_kernel_ab.py --before 5776eda --bits 8 --shapes 576x576 --rounds 400
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import cbuild  # noqa: E402
from offload.quant import cpu as quant_cpu  # noqa: E402
from offload.quant.format import QuantSpec, dequantize, quantize  # noqa: E402

SOURCE = "offload/csrc/quant_gemv.c"
COPIES_BYTES = 64 << 20  # weight copies per shape: this much goes through the cache between uses


def cpu_line() -> str:
    info = cbuild.cpu_identity()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split()
    vec = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx"))]
    return f"CPU: {model}; {' '.join(vec)}"


def build(source: Path, name: str, out_dir: Path) -> quant_cpu._Lib:
    compiler = cbuild.find_compiler()
    assert compiler, "no C compiler"
    path = out_dir / f"{name}.so"
    cbuild.compile_c(compiler, source, quant_cpu._FLAGS + ["-march=native"], path)
    lib = quant_cpu._Lib(path)
    why = quant_cpu._self_check(lib)
    assert why is None, f"{name}: {why}"
    return lib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD", help="git ref of the older source")
    ap.add_argument("--after", default=str(ROOT / SOURCE), help="the newer source file (default: the working tree's)")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--shapes", default="576x576,1536x576,576x1536,192x576",
                    help="out x in, comma-separated (SmolLM2-135M's projections)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    print(cpu_line())
    spec = QuantSpec(args.bits, args.group)
    with tempfile.TemporaryDirectory() as tmp:
        old_src = Path(tmp) / "before.c"
        old_src.write_text(subprocess.check_output(["git", "-C", str(ROOT), "show", f"{args.before}:{SOURCE}"], text=True))
        for name in quant_cpu._INCLUDED:  # the files quant_gemv.c includes, as they were at the ref
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:offload/csrc/{name}"],
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                (Path(tmp) / name).write_text(shown.stdout)
        libs = {"before": build(old_src, "before", Path(tmp)), "after": build(Path(args.after), "after", Path(tmp))}
        gen = torch.Generator().manual_seed(0)
        print(f"int{args.bits} g{args.group}, {args.rows} row(s), 1 thread, {args.rounds} rounds, medians (us)")
        print(f"{'shape':>10} {'before':>9} {'after':>9} {'after/before':>13}  max rel err (after)")
        for shape in args.shapes.split(","):
            out_f, in_f = map(int, shape.split("x"))
            w = torch.randn(out_f, in_f, generator=gen)
            parts = quantize(w, spec)
            x = torch.randn(args.rows, in_f, generator=gen)
            want = x.double() @ dequantize(parts, spec, in_f, torch.float64).T
            bound = x.double().abs() @ dequantize(parts, spec, in_f, torch.float64).abs().T
            got = {k: quant_cpu._run(lib, x, parts, spec, in_f, threads=1) for k, lib in libs.items()}
            err = ((got["after"].double() - want).abs() / bound).max().item()
            nbytes = sum(t.numel() * t.element_size() for t in parts.values())
            copies = [{k: v.clone() for k, v in parts.items()} for _ in range(max(1, COPIES_BYTES // nbytes))]
            times: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for k in order:
                    p = copies[(2 * r + (k == "after")) % len(copies)]
                    t0 = time.perf_counter()
                    quant_cpu._run(libs[k], x, p, spec, in_f, threads=1)
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            print(f"{shape:>10} {med['before']:9.1f} {med['after']:9.1f} {med['after'] / med['before']:13.3f}  {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
