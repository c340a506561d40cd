"""Training step time side by side, one process, same model and data, with each mode's time
split (forward, backward, gradient offload wait, CPU step, IO wait, weight upload), the blocks
stepped during backward (overlap) and bytes per link. Medians over --steps timed updates after
one warm-up. Modes: offload none / cpu / nvme (clipping on: the step waits for every gradient),
the same without clipping (the CPU step overlapped with backward), and weights streamed from
host RAM / NVMe (ZeRO-Infinity) with and without the overlapped step, the speculative step
with clipping (overlapped; an update that clips rolled back and stepped again), and the one-step
delayed update with clipping (the whole step hidden behind the next forward and backward).

    python scripts/bench_train.py                       # ~100M Llama ("small"), fp32, CPU
    python scripts/bench_train.py --model tiny --steps 3 --modes cpu nvme

The NVMe goal (issue 4): nvme step time <= 1.15x cpu when the optimizer state's IO time
(24 bytes/param at the disk's bandwidth) is below forward + backward. The script prints that
IO estimate from the bytes moved and the engine's own timings so the condition is visible.

Two reference rows on the same model, data and clipping (fp32): "torch", the plain PyTorch loop
(backward, clip_grad_norm_, AdamW(fused=True)), and "deepspeed", DeepSpeed ZeRO-2 with
offload_optimizer cpu (DeepSpeedCPUAdam; one process, gloo, DS_ACCELERATOR=cpu) where deepspeed
is importable. --rounds N repeats the modes N times, rotated, in one process; --fresh runs every
(mode, round) in a fresh process instead, as a user's run starts:

    python scripts/bench_train.py --modes torch none cpu deepspeed --rounds 3 --fresh
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import offload  # noqa: E402
from offload.config import OffloadConfig, format_bytes  # noqa: E402
from offload.models import build_model, num_params, preset  # noqa: E402
from offload.memory.tiers import cpu_model  # noqa: E402

# overlap_wait: what the update waited for steps run on the step thread (the overlapped
# blocks, or the previous update's delayed step); their own cpu_step / upload time is hidden
SPLIT = ("forward_s", "backward_s", "grad_wait_s", "cpu_step_s", "io_wait_s", "upload_s",
         "overlap_wait_s")


# name -> engine options. "clip" rows clip gradients (the step must wait for every gradient);
# the others do not, so each block is stepped as soon as its gradients land (overlap).
MODES = {
    "none": dict(offload="none", grad_clip=1.0),
    "cpu": dict(offload="cpu", grad_clip=1.0),
    "nvme": dict(offload="nvme", grad_clip=1.0),
    "cpu+overlap": dict(offload="cpu", grad_clip=0.0),
    "nvme+overlap": dict(offload="nvme", grad_clip=0.0),
    "stream-cpu": dict(offload="nvme", offload_params="cpu", grad_clip=0.0,
                       activation_checkpointing=True),
    "stream-nvme": dict(offload="nvme", offload_params="nvme", grad_clip=0.0,
                        activation_checkpointing=True),
    "stream-nvme-noov": dict(offload="nvme", offload_params="nvme", grad_clip=0.0,
                             activation_checkpointing=True, overlap_step=False),
    # one-step delayed update: the whole CPU step runs during the next forward and backward,
    # clipping included (compare with the "cpu" / "nvme" rows, which clip after backward)
    # every swap read verified against its CRC-32 (the default) vs not (issue 13's 5% budget)
    "nvme-unverified": dict(offload="nvme", grad_clip=1.0, verify_checksums=False),
    "nvme+overlap-unverified": dict(offload="nvme", grad_clip=0.0, verify_checksums=False),
    # the speculative step (offload/train/speculative.py): clipping on as in "cpu" / "nvme",
    # yet each block stepped as its gradients land; an update that clips is rolled back and
    # stepped again (the "rolled back" line says how many did)
    "cpu+speculative": dict(offload="cpu", grad_clip=1.0, speculative_step=True),
    "nvme+speculative": dict(offload="nvme", grad_clip=1.0, speculative_step=True),
    "cpu+delayed": dict(offload="cpu", grad_clip=1.0, delayed_update=True),
    "nvme+delayed": dict(offload="nvme", grad_clip=1.0, delayed_update=True),
}
# references, not engine modes: the plain loop and DeepSpeed's CPU offload (see the docstring)
BASELINES = ("torch", "deepspeed")
GRAD_CLIP = 1.0  # the references clip as the "clip" rows do


def timed_updates(model, engine, ids: torch.Tensor, steps: int,
                  sync=lambda: None) -> tuple[list[float], list]:
    """One warm-up update, then `steps` timed ones, each over ids [accum, batch, seq + 1] (one
    micro-batch per row, next-token loss): (seconds per update, their StepReports). `sync`
    waits for the device (CUDA), so an update's time includes its device work."""
    step_s, reports = [], []
    for i in range(steps + 1):  # the first update is warm-up
        sync()
        t0 = time.perf_counter()
        for k in range(ids.shape[0]):  # engine.step() applies the update on the last micro-batch
            logits = model(ids[k, :, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     ids[k, :, 1:].reshape(-1))
            del logits
            engine.backward(loss)
            engine.step()
        sync()
        if i:
            step_s.append(time.perf_counter() - t0)
            reports.append(engine.last_report)
    return step_s, reports


def reference_updates(forward_backward, optimizer_step, ids: torch.Tensor,
                      steps: int) -> tuple[list[float], dict[str, float]]:
    """timed_updates for a loop that is not ours: (seconds per update, median forward /
    backward / step seconds), one warm-up then `steps` timed updates."""
    step_s: list[float] = []
    split: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "cpu_step_s": []}
    for i in range(steps + 1):
        t0 = time.perf_counter()
        fwd = bwd = 0.0
        for k in range(ids.shape[0]):
            f, b = forward_backward(ids[k])
            fwd, bwd = fwd + f, bwd + b
        t1 = time.perf_counter()
        optimizer_step()
        t2 = time.perf_counter()
        if i:
            step_s.append(t2 - t0)
            for key, v in (("forward_s", fwd), ("backward_s", bwd), ("cpu_step_s", t2 - t1)):
                split[key].append(v)
    return step_s, {k: statistics.median(v) for k, v in split.items()}


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def run_torch(args) -> dict:
    """The plain PyTorch loop on the same model and data: the row every engine mode answers to."""
    cfg_model = preset(args.model)
    model = build_model(cfg_model, device="cpu", source=args.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def forward_backward(rows):
        t0 = time.perf_counter()
        loss = _loss(model(rows[:, :-1]), rows)
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg_model.vocab_size, (1, args.batch_size, args.seq_len + 1), generator=g)
    step_s, split = reference_updates(forward_backward, optimizer_step, ids, args.steps)
    return _reference_row("torch", step_s, split, params)


def run_deepspeed(args) -> dict | None:
    """DeepSpeed ZeRO-2, offload_optimizer cpu, on the same model and data (None: not installed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        return None
    with socket.socket() as sock:  # a free port for the one-process gloo group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg_model = preset(args.model)
    model = build_model(cfg_model, device="cpu", source=args.seed)
    ds_config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
                 "gradient_clipping": GRAD_CLIP,
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    def forward_backward(rows):
        t0 = time.perf_counter()
        loss = _loss(engine(rows[:, :-1]), rows)
        t1 = time.perf_counter()
        engine.backward(loss)
        return t1 - t0, time.perf_counter() - t1

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg_model.vocab_size, (1, args.batch_size, args.seq_len + 1), generator=g)
    step_s, split = reference_updates(forward_backward, engine.step, ids, args.steps)
    return _reference_row("deepspeed", step_s, split, list(model.parameters()))


def _reference_row(mode: str, step_s: list[float], split: dict[str, float], params) -> dict:
    return {"mode": mode, "step_s": statistics.median(step_s), "overlapped": 0,
            **{k: split.get(k, 0.0) for k in SPLIT}, "bytes": {},
            "params": sum(p.numel() for p in params)}


def run_mode(mode: str, args, swap_root: str) -> dict | None:
    if mode == "torch":
        return run_torch(args)
    if mode == "deepspeed":
        return run_deepspeed(args)
    cfg_model = preset(args.model)
    model = build_model(cfg_model, device="meta")
    opts = dict(MODES[mode])
    if args.activation_checkpointing:
        opts["activation_checkpointing"] = True
    opts.setdefault("verify_checksums", not args.no_verify)
    cfg = OffloadConfig(nvme_dir=os.path.join(swap_root, mode), dtype=args.dtype, device="cpu",
                        lr=1e-4, buffer_count=args.buffer_count, **opts)
    from offload.models import seeded_init

    # seeded init straight into the engine, block by block
    engine = offload.initialize(model, cfg, source=seeded_init(args.seed, cfg_model.initializer_range))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg_model.vocab_size, (1, args.batch_size, args.seq_len + 1), generator=g)
    step_s, reports = timed_updates(model, engine, ids, args.steps)
    out = {"mode": mode, "step_s": statistics.median(step_s),
           "overlapped": reports[-1].overlapped_blocks,
           **{k: statistics.median(getattr(r, k) for r in reports) for k in SPLIT},
           "bytes": reports[-1].bytes, "params": sum(b.numel for b in engine.blocks),
           "rolled_back": sum(r.rolled_back for r in reports)}
    engine.close()
    del engine, model
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset (default small, ~100M params)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed updates per mode (median reported)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES) + list(BASELINES))
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--no-verify", action="store_true", help="skip swap checksum verification")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--swap-dir", default=None, help="where NVMe swap files go (default: a temp dir "
                    "under the current directory, i.e. on its disk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the modes, rotated")
    ap.add_argument("--fresh", action="store_true", help="each mode and round in a fresh process")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if args.dtype != "fp32" and any(m in BASELINES for m in args.modes):
        ap.error("the torch / deepspeed reference rows are fp32 (the engine's mixed precision "
                 "has no plain-loop twin): use --dtype fp32")
    print(f"model {args.model}: {num_params(preset(args.model)) / 1e6:.1f}M params, {args.dtype}, "
          f"batch {args.batch_size} x {args.seq_len}, {torch.get_num_threads()} threads, "
          f"median of {args.steps} updates, {args.rounds} round(s)"
          f"{' in fresh processes' if args.fresh else ''}; CPU: {cpu_model()}")
    rows = _rounds(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    _print_rows(rows, args)


def _rounds(args) -> list[dict]:
    """Every mode `args.rounds` times, the order rotated each round (against drift); in this
    process, or each (mode, round) in a child process of its own (--fresh)."""
    rows: list[dict] = []
    missing: set[str] = set()
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
        for mode in order:
            if mode in missing:
                continue
            row = _fresh_row(mode, args) if args.fresh else _row_here(mode, args)
            if row is None:
                print(f"note: {mode}: not installed here, row skipped (pip install deepspeed)")
                missing.add(mode)
                continue
            rows.append({**row, "round": r})
    return rows


def _row_here(mode: str, args) -> dict | None:
    swap_root = tempfile.mkdtemp(prefix="bench-train-", dir=args.swap_dir or ".")
    try:
        return run_mode(mode, args, swap_root)
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)


def _fresh_row(mode: str, args) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        argv = [sys.executable, os.path.abspath(__file__), "--modes", mode, "--json", out,
                "--model", args.model, "--dtype", args.dtype, "--batch-size", str(args.batch_size),
                "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                "--buffer-count", str(args.buffer_count), "--seed", str(args.seed)]
        argv += ["--no-verify"] if args.no_verify else []
        argv += ["--activation-checkpointing"] if args.activation_checkpointing else []
        argv += ["--swap-dir", args.swap_dir] if args.swap_dir else []
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            got = json.load(f)
    return got[0] if got else None


def _median_rows(rows: list[dict]) -> list[dict]:
    """One row per mode: the median over its rounds of every number, with the step-time spread."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in mine) for k in ("step_s", *SPLIT)}
        out.append({**mine[-1], **med, "spread": (min(r["step_s"] for r in mine),
                                                  max(r["step_s"] for r in mine))})
    return out


def _print_rows(all_rows: list[dict], args) -> None:
    rows = _median_rows(all_rows)
    head = (f"{'mode':<17} {'step s':>8} " + " ".join(f"{k[:-2]:>10}" for k in SPLIT)
            + f" {'overlap':>7} {'vs cpu':>7}")
    print(head)
    base = next((r["step_s"] for r in rows if r["mode"] == "cpu"), None)
    for r in rows:
        ratio = f"{r['step_s'] / base:7.3f}" if base else "      -"
        print(f"{r['mode']:<17} {r['step_s']:8.3f} " + " ".join(f"{r[k]:10.3f}" for k in SPLIT)
              + f" {r['overlapped']:7d} {ratio}"
              + (f"  (rounds {r['spread'][0]:.3f}-{r['spread'][1]:.3f})" if args.rounds > 1 else ""))
    for r in rows:
        moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in r["bytes"].items() if v)
        if moved:
            print(f"  {r['mode']:<17} bytes per update: {moved}")
    # verification's cost: a mode listed several times (--modes nvme nvme-unverified nvme
    # nvme-unverified: interleaved against drift) counts with the median of its rows
    def median_step(mode: str) -> float | None:
        got = [r["step_s"] for r in rows if r["mode"] == mode]
        return statistics.median(got) if got else None

    for mode in ("cpu", "nvme"):  # both clipped: the speculative step against the step after
        spec, after = median_step(mode + "+speculative"), median_step(mode)
        if spec and after:
            back = next(r["rolled_back"] for r in rows if r["mode"] == mode + "+speculative")
            print(f"{mode}+speculative / {mode} (both clipped) step time {spec / after:.3f}; "
                  f"{back} of {args.steps} timed updates rolled back")
    for mode in ("nvme", "nvme+overlap"):
        on, off = median_step(mode), median_step(mode + "-unverified")
        if on and off:
            print(f"{mode}: verified / unverified swap reads step time {on / off:.3f} "
                  f"(goal <= 1.05)")
    step = {r["mode"]: r["step_s"] for r in rows}
    for mine, ref, goal in (("none", "torch", 1.05), ("cpu", "deepspeed", 1.0),
                            ("nvme+overlap", "cpu", 1.15)):
        if mine in step and ref in step:
            print(f"{mine} / {ref} step time: {step[mine] / step[ref]:.3f} (goal <= {goal})")
    nv = next((r for r in rows if r["mode"] == "nvme"), None)
    if nv is not None and base:
        compute = nv["forward_s"] + nv["backward_s"]
        print(f"nvme/cpu step time: {nv['step_s'] / base:.3f} (goal <= 1.15 when state IO < "
              f"forward+backward = {compute:.3f} s; IO the step waited for: {nv['io_wait_s']:.3f} s)")


if __name__ == "__main__":
    main()
