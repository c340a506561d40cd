"""The GPU proof kit's tests, part 3: the findings of the second CUDA desk review
(../shared/reviews/cuda-desk-review-2.md; ids P1-P18 in the test names) that only a GPU shows.
Their CPU halves are in test_cuda_review2_cpu.py; the set-up (markers, determinism, helpers) is
test_cuda.py's. Without a GPU every test here is skipped with the reason.

ZeRO stage 3 on one GPU: NCCL needs a device per rank, so P1 and P2 run on a stand-in group of
2 held by one process (tests/loopback_pg.py: rank 0, its peer a mirror of it), which reaches
every stage-3 line of rank 0. The same paths across real ranks are gpu_check.py's 2-GPU phase.
"""

from __future__ import annotations

import pytest
import torch

from offload.gpu import COMPUTE_DELAY_ENV

# pytestmark (the cuda marker, skipped without a GPU) and the autouse determinism fixture apply
# here as they do there
from tests.test_cuda import _deterministic, pytestmark  # noqa: F401
from tests.test_cuda import DEV, cuda_only
from tests.test_engine import max_rel_diff
from tests.loopback_pg import loopback_run
from tests.zero_ranks import batches, lm_loss, make_model


def _stage3(tmp_path, offload: str, **kw) -> dict:
    return {**dict(dtype="bf16", device=str(DEV), offload=offload, offload_params="none",
                   zero_stage=3, lr=1e-3, grad_clip=1.0, nvme_dir=str(tmp_path / f"swap-{offload}")),
            **kw}


def _data(n: int = 3):
    return [b.to(DEV) for b in batches(128, n, 4, 32)]


@cuda_only
def test_P1_zero3_cpu_optimizer_writes_a_device_home_through_the_ring(tmp_path):
    """ZeRO-3, optimizer in host RAM / NVMe, the layers' shards on the device, bf16: the CPU
    kernel steps into a pinned ring slot and the H2D stream sends it home (before the fix it was
    handed the device home as out16 and raised at the first step); the masters follow the
    device optimizer's run of the same stand-in."""
    want, want_losses = loopback_run(_stage3(tmp_path, "none"), lambda: make_model("tiny"),
                                     _data(), lm_loss)
    for offload in ("cpu", "nvme"):
        got, losses = loopback_run(_stage3(tmp_path, offload), lambda: make_model("tiny"),
                                   _data(), lm_loss)
        assert max_rel_diff(got, want) <= 1e-3, offload
        assert losses[0] == want_losses[0], offload


@cuda_only
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["after-backward", "overlapped"])
def test_P2_zero3_fetch_waits_for_a_late_step(clip, tmp_path, monkeypatch):
    """ZeRO-3 fully on the device: with a GPU sleep before every block's optimizer kernels on
    the compute stream, the next forward's sharded fetch (copy stream) must still copy the
    updated home -- the losses and masters equal the undelayed run bit for bit. Before the fix
    the copy was ordered only after the slot's last reader and read the old shard."""
    cfg = _stage3(tmp_path, "none", grad_clip=clip)
    want, want_losses = loopback_run(cfg, lambda: make_model("tiny"), _data(4), lm_loss)
    monkeypatch.setenv(COMPUTE_DELAY_ENV, "200000000")  # ~0.1 s per block on a 2 GHz GPU
    got, losses = loopback_run(cfg, lambda: make_model("tiny"), _data(4), lm_loss)
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)


@cuda_only
def test_P11_training_batches_reach_the_device_without_a_sync():
    """The fine-tuning loop's micro-batches go up pinned and non-blocking (review 2 P11): a copy
    from pageable memory synchronises with the compute stream, which sync-debug mode "error"
    turns into an exception (before the fix: part.to(device))."""
    from offload.data.formats import Batch
    from runners.common import batch_to_device
    ids = torch.randint(0, 100, (4, 33))
    batch = Batch(ids, ids[:, 1:] > 10, torch.arange(32).repeat(4, 1), None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = batch_to_device(batch, DEV)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(moved.ids.cpu(), batch.ids) and torch.equal(moved.mask.cpu(), batch.mask)
    assert torch.equal(moved.position_ids.cpu(), batch.position_ids) and moved.document_ids is None
