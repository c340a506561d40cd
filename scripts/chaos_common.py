"""What both chaos campaigns share (scripts/chaos.py's kills, scripts/chaos_damage.py's swap
damage): the fine-tuning command, its environment, and the comparison of two finished runs."""

from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finetune_args(output: str, steps: int, save_every: int, seed: int, extra: list[str]) -> list[str]:
    return ["--offload", "nvme", "--output", output, "--steps", str(steps), "--save-every",
            str(save_every), "--seed", str(seed), "--no-progress"] + extra


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def compare_runs(ref: str, got: str) -> list[str]:
    """Differences between two finished runs' results (empty: bit-identical)."""
    problems: list[str] = []

    def files(d: str) -> list[str]:
        return sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".json"))) \
            if os.path.isdir(d) else []

    for sub in ("checkpoint/engine", "checkpoint/model", "model"):
        a, b = os.path.join(ref, sub), os.path.join(got, sub)
        if files(a) != files(b) or not files(a):
            problems.append(f"{sub}: files differ: {files(a)} vs {files(b)}")
            continue
        for name in files(a):
            with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
                if fa.read() != fb.read():
                    problems.append(f"{sub}/{name}: bytes differ")
    ta, tb = (json.load(open(os.path.join(d, "checkpoint", "trainer_state.json"))) for d in (ref, got))
    for key in sorted(set(ta) | set(tb)):
        if key != "args" and ta.get(key) != tb.get(key):
            problems.append(f"trainer_state.json: {key!r} differs")
    rows_ref = _metric_rows(ref)
    rows_got = _metric_rows(got)
    if sorted(rows_ref) != sorted(rows_got):
        problems.append(f"metrics.jsonl: steps {sorted(rows_ref)} vs {sorted(rows_got)}")
    for step, seen in rows_got.items():
        want = rows_ref.get(step, [None])[0]
        for row in seen:
            if row != want:
                problems.append(f"metrics.jsonl step {step}: {row} (logged {len(seen)}x) vs "
                                f"reference {want}")
                break
    return problems


def _metric_rows(out: str) -> dict[int, list[dict]]:
    rows: dict[int, list[dict]] = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            # timing fields differ by nature; everything computed must not
            key = {k: r.get(k) for k in ("loss", "lr", "grad_norm", "eval_loss", "applied",
                                         "loss_scale")}
            rows.setdefault(int(r["step"]), []).append(key)
    return rows
