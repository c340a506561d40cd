"""One benchmark, two versions of the code, side by side in one run: is a change slower?

A refactor must not cost speed; a single before-run and a single after-run on this noisy 2-core
VM (it drifts by +-25% over minutes) cannot say so. This script runs scripts/bench_train.py or
scripts/bench_infer.py from two git refs -- the older one checked out into a temporary worktree,
the newer one the working tree as it is -- alternately, in fresh processes, `--rounds` times
(the order flips every round), and prints per row the median of each side, their ratio, and
each side's range over the rounds. A row is slower "beyond the spread" when the after-median is
outside the before-rounds' range by more than that range's own width.

    python scripts/bench_before_after.py --before 8a82868 --rounds 3 train --model tiny --steps 3
    python scripts/bench_before_after.py --before 8a82868 --rounds 3 infer --parts ram,quant \\
        --batches 1,4 --quant-batches 1,4 --quant-tiers cpu --preset 125M --dir /tmp/b125

Each side imports its own `offload` (PYTHONPATH is set to its checkout), and writes the
benchmark's own --json rows; the line printed first says which commits and which CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = {"train": "bench_train.py", "infer": "bench_infer.py"}


def rows_of(kind: str, got) -> dict[str, tuple[float, str]]:
    """{row key: (value, unit)} from a benchmark's --json output."""
    if kind == "train":  # a list of rows, one per mode and round: seconds per update
        out: dict[str, list[float]] = {}
        for r in got:
            out.setdefault(r["mode"], []).append(r["step_s"])
        return {k: (statistics.median(v), "s/update") for k, v in out.items()}
    rows = {f"{r['engine']} {r['tier']} batch {r['batch']}": (r["decode_tok_s"], "tok/s")
            for r in got["rows"]}
    rows.update({f"{r['variant']} {r['tier']} batch {r['batch']}": (r["decode_tok_s"], "tok/s")
                 for r in got["quant_rows"]})
    return rows


def run_side(kind: str, root: str, argv: list[str], out: str) -> dict[str, tuple[float, str]]:
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, os.path.join(root, "scripts", BENCH[kind]), *argv, "--json", out]
    subprocess.run(cmd, check=True, cwd=root, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(out) as f:
        return rows_of(kind, json.load(f))


def git(*args: str) -> str:
    return subprocess.check_output(["git", "-C", ROOT, *args], text=True).strip()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def compare(runs: dict[str, list[dict[str, tuple[float, str]]]]) -> list[str]:
    """One line per row: before and after medians, ratio, ranges, and the verdict."""
    lines = [f"{'row':<28} {'before':>10} {'after':>10} {'after/before':>12}  ranges (before | after)"]
    keys = [k for k in runs["before"][0] if all(k in r for side in runs.values() for r in side)]
    for key in keys:
        unit = runs["before"][0][key][1]
        vals = {side: [r[key][0] for r in rs] for side, rs in runs.items()}
        med = {side: statistics.median(v) for side, v in vals.items()}
        lo, hi = min(vals["before"]), max(vals["before"])
        width = hi - lo
        # slower: more seconds per update, or fewer tokens per second
        slower = (med["after"] > hi + width) if unit == "s/update" else (med["after"] < lo - width)
        lines.append(f"{key:<28} {med['before']:10.4g} {med['after']:10.4g} "
                     f"{med['after'] / med['before']:12.3f}  {lo:.4g}-{hi:.4g} | "
                     f"{min(vals['after']):.4g}-{max(vals['after']):.4g} {unit}"
                     + ("  SLOWER beyond the spread" if slower else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the older git ref")
    ap.add_argument("--rounds", type=int, default=3, help="runs per side, alternating")
    ap.add_argument("kind", choices=sorted(BENCH), help="which benchmark")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    a = ap.parse_args()
    before = git("rev-parse", "--short", a.before)
    dirty = " (+ uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    print(f"{BENCH[a.kind]} {' '.join(a.args)}: before {before}, after "
          f"{git('rev-parse', '--short', 'HEAD')}{dirty}; {a.rounds} rounds, fresh processes; "
          f"CPU: {cpu_model()}, {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="before-after-") as tmp:
        tree = os.path.join(tmp, "before")
        git("worktree", "add", "--detach", tree, a.before)
        try:
            runs: dict[str, list] = {"before": [], "after": []}
            for r in range(a.rounds):
                for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    root = tree if side == "before" else ROOT
                    runs[side].append(run_side(a.kind, root, a.args, os.path.join(tmp, "out.json")))
                    print(f"  round {r + 1} {side} done", flush=True)
        finally:
            git("worktree", "remove", "--force", tree)
    print("\n".join(compare(runs)))


if __name__ == "__main__":
    main()
