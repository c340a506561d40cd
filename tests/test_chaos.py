"""The crash campaign (scripts/chaos.py), short: a tiny NVMe-offloaded run SIGKILLed in the CPU
step, in a swap write, in a checkpoint file write and between the two renames of a checkpoint
swap, resumed after each kill, ends bit-identical to the run that was never killed."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import chaos  # noqa: E402
import chaos_damage  # noqa: E402

EXTRA = ["--batch-size", "8", "--seq-len", "16", "--eval-every", "0", "--warmup-steps", "2"]


def test_killed_and_resumed_run_is_identical_to_the_uninterrupted_one(tmp_path):
    phases = ["cpu-step", "swap-write", "checkpoint", "checkpoint-rename"]
    camp = chaos.run_campaign(str(tmp_path), kills=len(phases), steps=8, save_every=2, seed=0,
                              extra=EXTRA, rng_seed=3, phases=phases, launch_timeout=300,
                              echo=lambda *a: None)
    report = chaos.table(camp) + "\n" + "\n".join(camp.problems)
    assert camp.problems == [], report
    assert camp.kills == len(phases), report
    killed = [x for x in camp.launches if x.outcome == "killed"]
    assert [x.plan.split(":")[0] for x in killed] == phases, report
    # each kill landed in the phase it was aimed at (the child says where it died)
    for x, want in zip(killed, ["CPU AdamW step", "swap write", "checkpoint file write",
                                "checkpoint directory swap"]):
        assert want in x.killed_in, report
    assert camp.launches[-1].outcome == "completed"
    assert all(x.resume_ok for x in camp.resumes if x.outcome != "killed" or x.resume_ok), report
    # the comparison is not vacuous: one flipped bit in a master, one changed loss, are found
    ref, got = os.path.join(str(tmp_path), "reference"), os.path.join(str(tmp_path), "chaos")
    block = os.path.join(got, "checkpoint", "engine", "block-00001.safetensors")
    raw = bytearray(open(block, "rb").read())
    raw[-5] ^= 1
    open(block, "wb").write(bytes(raw))
    with open(os.path.join(got, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows[-1]["loss"] += 1e-12
    with open(os.path.join(got, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    diffs = chaos.compare_runs(ref, got)
    assert any("block-00001.safetensors: bytes differ" in d for d in diffs), diffs
    assert any(f"metrics.jsonl step {rows[-1]['step']}" in d for d in diffs), diffs


def test_damaged_swap_files_never_give_a_different_model(tmp_path):
    """chaos.py --damage, short: each run stops with a swap error or ends identical."""
    rows, problems = chaos_damage.run_damage_campaign(str(tmp_path), runs=2, steps=10, save_every=2, seed=0,
                                               extra=EXTRA, rng_seed=0, echo=lambda *a: None)
    assert problems == [], problems
    assert len(rows) == 2 and all(r["rc"] != 0 or r["outcome"].startswith("finished, identical")
                                  for r in rows), rows
    # the damage helper really changes what a read would see
    path = tmp_path / "f.safetensors"
    path.write_bytes((16).to_bytes(8, "little") + b"{}" + b" " * 14 + bytes(64))
    before = path.read_bytes()
    import random
    assert "NaN" in chaos_damage.damage_file(str(path), "nan", random.Random(0))
    assert path.read_bytes() != before
