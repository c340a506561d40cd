"""The swap-damage campaign of scripts/chaos.py (`chaos.py --damage N`): N fresh runs, each of
which gets one of its optimizer-state swap files damaged at a random moment while it trains (one
byte flipped, a NaN written over one fp32 value, or the file truncated). Every run must either
stop with a one-line swap error and a non-zero exit, its last checkpoint intact and finite, or
finish bit-identical to the undamaged reference: a damaged read must never be used."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import time

from chaos_common import REPO, compare_runs, finetune_args, run_env

DAMAGES = ("byte", "nan", "truncate")


def damage_file(path: str, kind: str, rng: random.Random) -> str:
    """Damage one swap file in place (the running store may replace it at any moment: then the
    damage lands on the old, unlinked version and is never read)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
        if kind == "truncate":
            cut = rng.randrange(0, size)
            f.truncate(cut)
            return f"truncated to {cut} of {size} bytes"
        if size < data_start + 4:
            return "no data to damage"
        if kind == "byte":
            pos = rng.randrange(data_start, size)
            f.seek(pos)
            old = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([old ^ (1 << rng.randrange(8))]))  # one bit of one byte
            return f"flipped a bit at byte {pos}"
        pos = data_start + 4 * rng.randrange((size - data_start) // 4)
        f.seek(pos)
        f.write(struct.pack("<f", float("nan")))
        return f"NaN at byte {pos}"


SWAP_ERRORS = ("checksum mismatch", "swap read", "truncated")


def checkpoint_intact(out: str) -> str | None:
    """None if the run's last checkpoint (if any) is complete and finite; else what is wrong."""
    sys.path.insert(0, REPO)
    import torch

    from nvme.format import SafetensorsFile
    from offload.train.checkpoint import CheckpointNotFound, find_checkpoint

    try:
        ckpt = find_checkpoint(out)
    except CheckpointNotFound:
        return None  # stopped before its first save: nothing to keep
    engine_dir = os.path.join(ckpt, "engine")
    for name in sorted(os.listdir(engine_dir)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(engine_dir, name)) as f:
                for key in f.tensors:
                    if not bool(torch.isfinite(f.read(key)).all()):
                        return f"{ckpt}: {name} {key} holds inf/nan"
    return None


def run_damage_campaign(workdir: str, runs: int, steps: int, save_every: int, seed: int,
                        extra: list[str], rng_seed: int, echo=print) -> tuple[list[dict], list[str]]:
    """Reference run, then `runs` runs that each get one swap file damaged mid-run."""
    rng = random.Random(rng_seed)
    ref = os.path.join(workdir, "reference")
    shutil.rmtree(ref, ignore_errors=True)
    base = [sys.executable, "-m", "runners.finetune"]
    t0 = time.perf_counter()
    r = subprocess.run(base + finetune_args(ref, steps, save_every, seed, extra), env=run_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    ref_s = time.perf_counter() - t0
    if r.returncode != 0:
        return [], [f"reference run failed (rc {r.returncode}): {r.stderr[-2000:]}"]
    echo(f"reference: {steps} updates in {ref_s:.1f} s")
    rows, problems = [], []
    for i in range(runs):
        out = os.path.join(workdir, f"damage-{i:03d}")
        shutil.rmtree(out, ignore_errors=True)
        kind = DAMAGES[i % len(DAMAGES)]
        delay = rng.uniform(0.3, 0.85) * ref_s
        t = time.perf_counter()
        proc = subprocess.Popen(base + finetune_args(out, steps, save_every, seed, extra),
                                env=run_env(), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        what = "the run ended before the damage"
        while proc.poll() is None and time.perf_counter() - t < delay:
            time.sleep(0.05)
        swap = os.path.join(out, "swap")
        if proc.poll() is None and os.path.isdir(swap):
            files = sorted(f for f in os.listdir(swap) if f.endswith(".safetensors"))
            for _ in range(5):  # a file may be renamed away under us: pick another
                victim = rng.choice(files) if files else None
                try:
                    what = f"{victim}: {damage_file(os.path.join(swap, victim), kind, rng)}"
                    break
                except (FileNotFoundError, TypeError):
                    continue
        stdout, stderr = proc.communicate(timeout=600)
        last = (stderr.strip().splitlines() or [""])[-1]
        row = {"run": i, "damage": kind, "at_s": round(delay, 1), "what": what, "rc": proc.returncode}
        if proc.returncode == 0:
            diff = compare_runs(ref, out)
            row["outcome"] = "finished, identical to the reference" if not diff else "DIFFERENT"
            if diff:
                problems.append(f"run {i} ({what}) exited 0 with a different result: {diff[:3]}")
        else:
            row["outcome"] = f"stopped: {last[:160]}"
            if not any(m in last for m in SWAP_ERRORS):
                problems.append(f"run {i} ({what}) failed without a swap error: {last}")
            bad = checkpoint_intact(out)
            if bad:
                problems.append(f"run {i}: the last checkpoint is damaged: {bad}")
        rows.append(row)
        echo(f"run {i:3d}: {kind:<8} at {delay:5.1f} s  {what:<60} -> rc {proc.returncode}: "
             f"{row['outcome'][:100]}")
        shutil.rmtree(out, ignore_errors=True)
    return rows, problems


def damage_table(rows: list[dict]) -> str:
    lines = ["| # | damage | at (s) | what | exit | outcome |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['damage']} | {r['at_s']} | {r['what']} | {r['rc']} | "
                     f"{r['outcome']} |")
    stopped = sum(1 for r in rows if r["rc"] != 0)
    same = sum(1 for r in rows if r["outcome"].startswith("finished, identical"))
    lines.append(f"\n{len(rows)} damaged runs: {stopped} stopped with a swap error, {same} "
                 f"finished identical to the reference (the damaged file was replaced before it "
                 f"was read), {len(rows) - stopped - same} other")
    return "\n".join(lines)
