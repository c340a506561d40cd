"""The GPU proof kit's 2-GPU phase (scripts/gpu_check.py `ranks`): ZeRO across 2 NCCL ranks, one
GPU each, started with torchrun's environment (tests/zero_ranks.py, tests/ranks_review2.py), and
the findings of the second CUDA desk review that only real ranks show (P1, P2 and P6 under NCCL,
P8: each rank's threads on its own GPU). Skipped with the reason on fewer than 2 GPUs; one GPU
runs P1 and P2 on a stand-in group instead (tests/test_cuda_review2.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_engine import max_rel_diff  # noqa: E402
from test_zero import (ACCUM, OPT, ROWS, SEQ, UPDATES, check_plan, fp32_configs,  # noqa: E402
                       launch_ranks, reference)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 GPUs (NCCL: one per rank); this machine has "
                                        f"{torch.cuda.device_count()}")]
# fp32 on the GPU against one process on the CPU: kernels round differently, Adam turns that
# into visible differences of the masters (the CPU's own self-difference is ~2e-6)
GPU_TOLERANCE = 1e-4
CONFIGS = [(0, "none", "none"), (1, "cpu", "none"), (2, "nvme", "none"), (3, "none", "none"),
           (3, "cpu", "none"), (3, "cpu", "cpu")]


def test_zero_stages_across_two_nccl_ranks(tmp_path):
    """Every stage with the optimizer on the device, in host RAM or on NVMe, the layers of stage
    3 on the device (P1's combination among them) or in host RAM: the masters follow one-process
    AdamW, each rank's plan holds, and each rank and its step thread compute on their own GPU
    (P8)."""
    configs = [dict(c, device="cuda") for c in fp32_configs(CONFIGS, str(tmp_path / "swap"))]
    results = launch_ranks(dict(model="tiny", updates=UPDATES, rows=ROWS, seq=SEQ,
                                configs=configs), 2, tmp_path)
    ref, _, _ = reference("tiny")
    for c, res in zip(CONFIGS, results):
        assert max_rel_diff(res["masters"], ref) <= GPU_TOLERANCE, c
        check_plan(res["plan"], res["peaks"], c)
        assert res["current_device"] == [0, 0], (c, res["current_device"])  # rank 0: cuda:0


def test_P1_P2_zero3_bf16_across_two_nccl_ranks(tmp_path):
    """bf16 at stage 3, layers on the device: the CPU optimizer steps them through the upload ring
    (P1: it was handed the device home and raised), and with a GPU sleep before every device
    optimizer step the next fetches still copy the new shards (P2): losses and masters equal the
    undelayed run's bit for bit."""
    base = dict(OPT, lr=1e-3, dtype="bf16", device="cuda", grad_clip=0.5, grad_accum_steps=ACCUM,
                zero_stage=3, offload_params="none", nvme_dir=str(tmp_path / "swap"), updates=4)
    configs = [dict(base, offload="cpu"), dict(base, offload="none"),
               dict(base, offload="none", compute_delay=200_000_000)]
    cpu, none, delayed = launch_ranks(dict(model="tiny", updates=4, rows=ROWS, seq=SEQ,
                                           configs=configs), 2, tmp_path)
    assert max_rel_diff(cpu["masters"], none["masters"]) <= 1e-3
    assert delayed["losses"] == none["losses"]
    assert all(torch.equal(delayed["masters"][k], none["masters"][k]) for k in none["masters"])


def test_P6_a_parameter_used_on_one_rank_only_under_nccl(tmp_path):
    """tests/test_zero_review2.py's P6 case on 2 GPUs: a branch used by rank 1 only, stages 0-1;
    the ranks' collectives pair up (before the fix: an NCCL hang or garbage)."""
    from test_zero_review2 import _unused_reference, launch
    seen = launch("unused", tmp_path, env={"OFFLOAD_TEST_DEVICE": "cuda"}, timeout_s=300)
    from ranks_review2 import CLIPS
    for stage in (0, 1):
        for clip in CLIPS:
            want = _unused_reference(clip)
            got = seen[0][f"stage{stage}-clip{clip}"]
            for n, t in want.items():
                assert torch.allclose(torch.tensor(got[n]), t, rtol=1e-4, atol=1e-5), (stage, clip, n)
