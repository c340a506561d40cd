"""One gloo rank of tests/test_zero_review2.py: the cases of the second CUDA desk review whose
mechanism shows across processes on the CPU (P3: a slow rank 0 in long work, P6: parameters
unused on one rank only). Run as N processes with torchrun's environment:
    python tests/ranks_review2.py CASE OUT_DIR
Each rank writes OUT_DIR/rank-R.json with what it saw (rank 0's also holds the masters)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402

SLOW_S = 2.8  # rank 0's long work; the default group's timeout is set to 2 s by the test
OPT = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ROWS, CLIPS = 4, (0.5, 0.0)  # clipping: the step after backward; none: the overlapped step


def unused_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g))
            for _ in range(3)]


class Branchy(nn.Module):
    """Two layers; layer 1's `extra` is used on rank 1 only (MoE routing, LayerDrop)."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.rank = rank
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(16, 16), "extra": nn.Linear(16, 16)})
                                    for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer["fc"](h))
            if i == 1 and self.rank == 1:
                h = h + layer["extra"](h)
        return self.head(h)


def unused_on_one_rank(rank: int, world: int) -> dict:
    """P6: 3 updates at stages 0 and 1, the step after backward and the overlapped one."""
    out = {}
    per = ROWS // world
    # tests/test_cuda_ranks.py runs the same on 2 GPUs (NCCL), one per rank
    device = (f"cuda:{os.environ['LOCAL_RANK']}" if os.environ.get("OFFLOAD_TEST_DEVICE") == "cuda"
              else "cpu")
    for stage in (0, 1):
        for clip in CLIPS:
            model = Branchy(rank)
            engine = offload.initialize(model, dict(OPT, dtype="fp32", device=device,
                                                    offload="cpu", zero_stage=stage,
                                                    grad_clip=clip, exact_optimizer=True))
            for x, y in unused_data():
                rows = slice(rank * per, (rank + 1) * per)
                loss = nn.functional.mse_loss(model(x[rows].to(device)), y[rows].to(device))
                engine.backward(loss)
                engine.step()
            out[f"stage{stage}-clip{clip}"] = {k: v.cpu().tolist()
                                               for k, v in engine.master_params().items()}
            engine.close()
    return out


def slow_rank0(rank: int, world: int, out_dir: str) -> dict:
    """P3: rank 0 writes a stage-0 checkpoint slowly and waits alone before a runner barrier;
    the others wait in long-work barriers that outlive the default group's (shortened) timeout."""
    import offload.train.state as state
    from runners.ranks import Ranks
    ranks = Ranks.from_env()
    ranks.connect(torch.device("cpu"))
    seen = {}
    if rank == 0:  # rank 0 works alone, longer than the default group's timeout
        time.sleep(SLOW_S)
    ranks.long_barrier()
    seen["runner"] = "survived"
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = offload.initialize(model, dict(dtype="fp32", device="cpu", offload="cpu",
                                            zero_stage=0, lr=1e-2))
    engine.backward(model(torch.ones(2, 4)).sum())
    engine.step()
    if rank == 0:
        write = state._write_checked

        def slow_write(*a, **k):
            time.sleep(SLOW_S)
            return write(*a, **k)
        state._write_checked = slow_write
    engine.save_state(os.path.join(out_dir, "state"))
    seen["save_state"] = "survived"
    engine.close()
    # the control: the same wait on the default group (what every barrier was) times out
    if rank == 0:
        time.sleep(SLOW_S)
    try:
        ranks.barrier()
        seen["default_barrier"] = "survived"
    except RuntimeError as e:
        seen["default_barrier"] = f"failed: {str(e).splitlines()[0][:200]}"
    return seen


def main() -> None:
    case, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if case == "unused":
        result = unused_on_one_rank(rank, world)
    else:
        result = slow_rank0(rank, world, out_dir)
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    if case == "unused":
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
