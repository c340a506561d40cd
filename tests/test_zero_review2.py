"""The second CUDA desk review's findings whose mechanism shows across gloo processes on the CPU
(../shared/reviews/cuda-desk-review-2.md): P3, a rank that waits while rank 0 works alone for
longer than the default group's timeout; P6, collectives issued in one order on every rank when
a parameter is used on one rank only. Each case is one launch of 2 ranks of
tests/ranks_review2.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import free_port  # noqa: E402
from ranks_review2 import CLIPS, OPT, ROWS, Branchy, unused_data  # noqa: E402


def launch(case: str, tmp_path, world: int = 2, timeout_s: float = 90,
           env: dict | None = None) -> list[dict]:
    """`world` gloo ranks of tests/ranks_review2.py CASE; every rank's json."""
    port = free_port()
    procs = []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "ranks_review2.py"),
                                       case, str(tmp_path)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-3000:]}"
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]


def test_P3_long_work_barriers_outlive_the_default_timeout(tmp_path):
    """The default group's timeout shortened to 2 s ($OFFLOAD_DIST_TIMEOUT_S): rank 0 works
    alone for 2.8 s before the runner's long-work barrier and inside a stage-0 save_state (its
    block writes), and rank 1 waits for it in both -- before the fix those waits were barriers
    of the default group and rank 1 died in them, as the control barrier still does."""
    seen = launch("slow", tmp_path, env={"OFFLOAD_DIST_TIMEOUT_S": "2"})
    for r, s in enumerate(seen):
        assert s["runner"] == "survived" and s["save_state"] == "survived", (r, s)
    assert seen[1]["default_barrier"].startswith("failed"), seen[1]
    assert os.path.isfile(tmp_path / "state" / "engine_state.json")


def _unused_reference(clip: float) -> dict[str, torch.Tensor]:
    """One process: each rank's rows through its own branch, the mean of the two losses, plain
    AdamW (the unused branch of layer 0 has no gradient anywhere: not stepped)."""
    torch.manual_seed(0)
    model = Branchy(0)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    per = ROWS // 2
    for x, y in unused_data():
        total = 0
        for r in range(2):
            model.rank = r
            rows = slice(r * per, (r + 1) * per)
            total = total + nn.functional.mse_loss(model(x[rows]), y[rows]) / 2
        total.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_P6_a_parameter_used_on_one_rank_only(tmp_path):
    """Layer 1's branch runs on rank 1 only: rank 0's in-order issue stalls at that block, so
    its reductions were issued at the step after the agreement on missing gradients, while rank
    1 had issued them during backward -- gloo paired a flags all-reduce with a block's (an error
    or wrong numbers). Stages 0 and 1, the step after backward and the overlapped one: every
    rank's masters equal plain AdamW on the mean of both ranks' losses."""
    seen = launch("unused", tmp_path)
    for stage in (0, 1):
        for clip in CLIPS:
            want = _unused_reference(clip)
            for r, s in enumerate(seen[:1]):
                got = s[f"stage{stage}-clip{clip}"]
                for n, t in want.items():
                    assert torch.allclose(torch.tensor(got[n]), t, rtol=1e-5, atol=1e-6), \
                        (stage, clip, r, n)
