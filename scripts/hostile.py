"""Hostile-input campaign: random variants of the classes that once ended in exit 0 with a wrong
result (issue 33), tried again on every change. Each trial must end the way the guarantee says:
refused in one line (exit 2), or a result equal to the honest one.

    python scripts/hostile.py                          # every class, 3 trials each (~3 minutes)
    python scripts/hostile.py --classes ranks --trials 6 --seed 4 --workdir /tmp/hostile

Classes:
  cache-damage   N random bytes (1..4096) overwritten at a random place of a random block of a
                 cached int8 conversion; run from a random tier (nvme, cpu, device): exit 2,
                 one line naming the block file and its failed checksum.
  stale-cache    the source checkpoint replaced by other weights of the same size and mtime:
                 the run converts anew (says so) and gives the tokens of a fresh conversion.
  ranks          two gloo ranks started by hand, rank 1 with one flag changed at random (--lr,
                 --seed, --steps, --zero-stage, --output, --batch-size, --seq-len): both exit 2
                 within 30 s with one line naming that flag and both values.
  config         a random --config (flat or DeepSpeed, some values "auto") with random flags
                 over it: the banner's config line shows, per value, flag > file > the runner's
                 default ("auto": the runner's), resolved here independently.

Each trial's command output goes to WORKDIR/logs/; the table at the end lists every trial.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from chaos_common import REPO, run_env

CLASSES = ("cache-damage", "stale-cache", "ranks", "config")
RUNNER_DEFAULTS = {"lr": 0.003, "grad_clip": 1.0, "weight_decay": 0.0, "dtype": "fp32", "offload": "cpu"}


def run(args: list[str], log: str, timeout: float = 300, env: dict | None = None,
        cwd: str = REPO) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env or run_env(), capture_output=True,
                          text=True, timeout=timeout)
    with open(log, "w") as f:
        f.write(f"$ {' '.join(args)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done


def last_error(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if "error:" in ln]
    return lines[-1] if lines else ""


def infer(model: str, offload_dir: str, log: str, *extra: str) -> subprocess.CompletedProcess:
    return run(["-m", "runners.infer", "--model", model, "--offload-dir", offload_dir, "--quantize",
                "int8", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--ignore-eos",
                "--probe-seconds", "0", *extra], log)


# ---- the classes ------------------------------------------------------------------------------
def cache_damage(rng: random.Random, work: str, logs: str) -> tuple[bool, str]:
    from nvme.format import read_header
    ok = infer("tiny", work, os.path.join(logs, "convert.log"))
    if ok.returncode:
        return False, f"the honest run failed: {last_error(ok.stderr)}"
    blocks = sorted(os.path.join(d, f) for d, _, fs in os.walk(work) for f in fs
                    if f.startswith("block_") and f.endswith(".safetensors"))
    victim = rng.choice(blocks)
    infos, _ = read_header(victim)
    t = rng.choice([i for i in infos.values() if i.nbytes])
    n = rng.randint(1, min(4096, t.nbytes))
    at = t.offset + rng.randrange(t.nbytes - n + 1)
    with open(victim, "r+b") as f:
        f.seek(at)
        old = f.read(n)
        new = bytes(b ^ rng.randint(1, 255) for b in old)  # every byte changed
        f.seek(at)
        f.write(new)
    tier = rng.choice(["nvme", "cpu", "device"])
    got = infer("tiny", work, os.path.join(logs, "damaged.log"), "--weights", tier)
    line = last_error(got.stderr)
    passed = got.returncode == 2 and os.path.basename(victim) in line and "fails its checksum" in line
    return passed, f"{n} bytes at {at} of {os.path.basename(victim)}, tier {tier}: rc {got.returncode} {line[:160]}"


def stale_cache(rng: random.Random, work: str, logs: str) -> tuple[bool, str]:
    import torch

    from offload.models import CheckpointReader, preset, save_pretrained
    src = os.path.join(work, "src")
    seeded = run(["-m", "runners.infer", "--model", "tiny", "--offload-dir", work, "--prompt-ids", "1",
                  "--max-new-tokens", "1", "--probe-seconds", "0"], os.path.join(logs, "seed.log"))
    if seeded.returncode:
        return False, f"could not write the source: {last_error(seeded.stderr)}"
    shutil.copytree(os.path.join(work, "tiny-seed0-fp32"), src)
    first = infer(src, work, os.path.join(logs, "first.log"), "--output-json", os.path.join(work, "a.json"))
    path = os.path.join(src, "model.safetensors")
    st = os.stat(path)
    scale = rng.uniform(0.5, 1.5)
    with CheckpointReader(src) as r:
        scaled = [(n, r.read(n) * scale) for n in r.locations]
    save_pretrained(scaled, src, config=preset("tiny"), dtype=torch.float32)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    same = os.stat(path).st_size == st.st_size
    again = infer(src, work, os.path.join(logs, "again.log"), "--output-json", os.path.join(work, "b.json"))
    fresh = infer(src, os.path.join(work, "fresh"), os.path.join(logs, "fresh.log"),
                  "--output-json", os.path.join(work, "c.json"))
    if first.returncode or again.returncode or fresh.returncode:
        return False, "a run failed: " + last_error(again.stderr or fresh.stderr)
    tokens = [json.load(open(os.path.join(work, f)))["generated_ids"] for f in ("b.json", "c.json")]
    converted = "blocks to int8" in again.stderr
    return converted and tokens[0] == tokens[1], (f"scale {scale:.3f}, same size {same}: converted "
                                                  f"again {converted}, tokens as fresh {tokens[0] == tokens[1]}")


RANK_FLAGS = {"--lr": ("1e-4", "3e-4"), "--seed": ("0", "7"), "--steps": ("6", "9"),
              "--zero-stage": ("1", "2"), "--batch-size": ("4", "8"), "--seq-len": ("32", "48")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(rng: random.Random, work: str, logs: str) -> tuple[bool, str]:
    flag = rng.choice([*RANK_FLAGS, "--output"])
    base = {"--steps": "6", "--batch-size": "4", "--seq-len": "32", "--lr": "1e-4", "--seed": "0",
            "--zero-stage": "1", "--output": os.path.join(work, "out")}
    per_rank = [dict(base), dict(base)]
    if flag == "--output":
        per_rank[1]["--output"] = os.path.join(work, "other")
    else:
        per_rank[0][flag], per_rank[1][flag] = RANK_FLAGS[flag]
    port, procs, t0 = free_port(), [], time.monotonic()
    for r in (0, 1):
        env = dict(run_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [x for kv in per_rank[r].items() for x in kv] + ["--eval-every", "0", "--no-progress"]
        procs.append(subprocess.Popen([sys.executable, "-m", "runners.finetune", *argv], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    results = []
    for r, p in enumerate(procs):
        try:
            err = p.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return False, f"{flag}: hung"
        with open(os.path.join(logs, f"rank{r}.log"), "w") as f:
            f.write(err)
        results.append((p.returncode, last_error(err)))
    took = time.monotonic() - t0
    passed = took < 30 and all(rc == 2 and flag in line and "disagree" in line for rc, line in results)
    return passed, f"{flag} differs: {took:.1f} s, " + "; ".join(f"rc {rc} {line[:100]}" for rc, line in results)


def config(rng: random.Random, work: str, logs: str) -> tuple[bool, str]:
    deepspeed = rng.random() < 0.5
    file_values, expect, flags = {}, dict(RUNNER_DEFAULTS), []
    for key in ("lr", "grad_clip", "weight_decay"):
        if rng.random() < 0.5:
            auto = deepspeed and rng.random() < 0.5
            value = round(rng.uniform(0.0001, 0.9), 4)
            file_values[key] = "auto" if auto else value
            expect[key] = RUNNER_DEFAULTS[key] if auto else value
    for key, flag in (("lr", "--lr"), ("grad_clip", "--grad-clip")):
        if rng.random() < 0.3:
            value = round(rng.uniform(0.0001, 0.9), 4)
            flags += [flag, str(value)]
            expect[key] = value
    if deepspeed:
        body = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
        if "grad_clip" in file_values:
            body["gradient_clipping"] = file_values["grad_clip"]
        params = {k: file_values[k] for k in ("lr", "weight_decay") if k in file_values}
        if params:
            body["optimizer"] = {"type": "AdamW", "params": params}
    else:
        body = dict(file_values)
    path = os.path.join(work, "c.json")
    with open(path, "w") as f:
        json.dump(body, f)
    done = run(["-m", "runners.finetune", "--config", path, "--dry-run", *flags], os.path.join(logs, "config.log"))
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("  config ")), "")
    wrong = [f"{k} {v}" for k, v in expect.items()
             if f" {k} {float(v) if k != 'dtype' and k != 'offload' else v} (" not in line]
    return done.returncode == 0 and not wrong, (f"{'DeepSpeed' if deepspeed else 'flat'} {body} "
                                                f"flags {flags}: " + (f"wrong {wrong}" if wrong else "as resolved"))


TRIALS = {"cache-damage": cache_damage, "stale-cache": stale_cache, "ranks": ranks, "config": config}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    p.add_argument("--trials", type=int, default=3, help="per class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed")
    a = p.parse_args(argv)
    sys.path.insert(0, REPO)
    root = a.workdir or tempfile.mkdtemp(prefix="hostile-")
    rows, failed = [], 0
    for cls in a.classes:
        for k in range(a.trials):
            rng = random.Random(f"{a.seed}/{cls}/{k}")
            work = os.path.join(root, f"{cls}-{k}")
            logs = os.path.join(root, "logs", f"{cls}-{k}")
            os.makedirs(work, exist_ok=True)
            os.makedirs(logs, exist_ok=True)
            t0 = time.monotonic()
            passed, what = TRIALS[cls](rng, work, logs)
            failed += not passed
            rows.append(f"| {cls} | {k} | {'pass' if passed else 'FAIL'} | {time.monotonic() - t0:.1f} | {what} |")
            print(rows[-1], flush=True)
    print("\n| class | trial | result | s | what |\n|---|---|---|---|---|\n" + "\n".join(rows))
    print(f"{len(rows) - failed} of {len(rows)} trials as guaranteed; logs in {os.path.join(root, 'logs')}")
    if a.workdir is None and not failed:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
