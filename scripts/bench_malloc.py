"""The plain PyTorch training loop in a fresh process under three glibc allocation regimes: step
seconds and minor page faults per step, side by side, medians over rotated rounds.

  default   glibc's own dynamic mmap threshold (what a plain PyTorch script gets)
  fixed     mmap threshold fixed at 1 MiB for the whole process (what offload did before
            2026-11-25: every activation >= 1 MiB became a fresh mapping, zeroed page by page)
  offload   the regime offload leaves after set-up (tiers.large_frees_to_os: 1 MiB while the
            model is built, then half the smallest block, capped at 32 MiB)

    python scripts/bench_malloc.py                  # small (~100M) Llama, fp32, batch 4 x 256
    python scripts/bench_malloc.py --model tiny --rounds 2 --steps 2

The model, data, clipping and fused AdamW are bench_train.py's "torch" row. Results and the
finding: docs/BENCHMARKS.md, "Engine overhead in a fresh process: glibc's mmap threshold".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

REGIMES = ("default", "fixed", "offload")
_M_MMAP_THRESHOLD = -3


def one_run(regime: str, model_name: str, steps: int, batch: int, seq: int) -> dict:
    """In this (fresh) process: set the regime, build the model, time `steps` updates after one
    warm-up. Returns {"step_s", "faults_per_step"} (medians)."""
    import torch

    from offload.memory import tiers
    from offload.models import build_model, preset

    cfg = preset(model_name)
    if regime == "fixed":
        if not ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20):
            raise SystemExit("mallopt failed: not glibc?")
        model = build_model(cfg, device="cpu", source=0)
    elif regime == "offload":
        layer = build_model(cfg, device="meta").model.layers[0]
        smallest = sum(p.numel() * 4 for p in layer.parameters())  # fp32 bytes of one layer
        with tiers.large_frees_to_os(smallest):
            model = build_model(cfg, device="cpu", source=0)
    else:
        model = build_model(cfg, device="cpu", source=0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    times, faults = [], []
    for i in range(steps + 1):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first update is warm-up
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"step_s": statistics.median(times), "faults_per_step": statistics.median(faults)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=3, help="timed updates per run (median)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per regime, rotated")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: the child run
    args = ap.parse_args()
    from offload.memory.tiers import cpu_model
    if args.one:
        print(json.dumps(one_run(args.one, args.model, args.steps, args.batch_size, args.seq_len)))
        return
    print(f"model {args.model}, fp32, batch {args.batch_size} x {args.seq_len}, plain loop, "
          f"{args.rounds} round(s) in fresh processes, median of {args.steps} updates each; "
          f"CPU: {cpu_model()}")
    rows: dict[str, list[dict]] = {r: [] for r in args.regimes}
    for k in range(args.rounds):
        order = args.regimes[k % len(args.regimes):] + args.regimes[:k % len(args.regimes)]
        for regime in order:
            out = subprocess.run([sys.executable, __file__, "--one", regime, "--model", args.model,
                                  "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                                  "--seq-len", str(args.seq_len)],
                                 capture_output=True, text=True, check=True)
            rows[regime].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["step_s"] for r in rows[args.regimes[0]])
    print(f"{'regime':10} {'step s':>8} {'range':>15} {'faults/step':>12} {'vs ' + args.regimes[0]:>12}")
    for regime, runs in rows.items():
        s = [r["step_s"] for r in runs]
        print(f"{regime:10} {statistics.median(s):8.3f} {min(s):7.3f}-{max(s):<7.3f} "
              f"{statistics.median(r['faults_per_step'] for r in runs):12.0f} "
              f"{statistics.median(s) / base:12.3f}")


if __name__ == "__main__":
    main()
