"""The fine-tuning runner as one of several data-parallel ranks (torchrun): who prints, who
writes the run directory, which rows of the global batch are this rank's, and what every rank
must agree on before acting (a stop request, a failure).

    torchrun --nproc_per_node 2 -m runners.finetune --zero-stage 2 --offload cpu

Every rank runs the same command on the same global batch order; rank r trains on rows
[r * B/N, (r+1) * B/N) of each global batch of B. Rank 0 prints the banner, progress and
report, writes metrics, checkpoints' shared files and the exported model; every rank writes its
own optimizer-state shards. In one process (no torchrun) all of this is the identity.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from offload.zero.group import any_rank, ensure_process_group, env_world

def peer_lost(output: str) -> str:
    return (f"a peer rank stopped answering (it failed, was killed, or the network dropped); "
            f"this rank stops too — the last checkpoint is intact: relaunch the job with "
            f"--resume {output}")


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        rank, world, local = env_world()
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} WORLD_SIZE={world}: not a valid rank of that world; "
                             f"launch with torchrun")
        return cls(rank, world, local)

    @property
    def main(self) -> bool:
        """This process prints and writes the shared files."""
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1

    def connect(self, device: torch.device) -> None:
        """Join the process group (gloo on the CPU, NCCL on CUDA); other ranks' stdout is
        silenced (rank 0 speaks for the job), their errors keep a `rank N:` prefix."""
        if not self.many:
            return
        ensure_process_group(device)
        self.device = device
        if not self.main:
            sys.stdout = open(os.devnull, "w")

    # -- agreement ----------------------------------------------------------------------------
    def barrier(self) -> None:
        if self.many:
            import torch.distributed as dist
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is on any (a stop request every rank must act on at
        the same update, or the ranks' collectives would no longer pair up)."""
        return any_rank(flag, self.device) if self.many else flag

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a 0-d tensor over ranks (each rank's loss is its own rows' mean)."""
        if not self.many:
            return value
        import torch.distributed as dist
        out = value.detach().clone()
        dist.all_reduce(out)
        return out / self.world

    def total(self, value: float) -> float:
        """The sum of a number over ranks (one small all-reduce, float64: token counts)."""
        if not self.many:
            return value
        import torch.distributed as dist
        out = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(out)
        return float(out.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small, picklable), on every rank."""
        if not self.many:
            return [obj]
        import torch.distributed as dist
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    # -- the batch ------------------------------------------------------------------------------
    def rows(self, batch: list[int]) -> list[int]:
        """This rank's part of a global batch (the caller checked it divides evenly)."""
        per = len(batch) // self.world
        return batch[self.rank * per:(self.rank + 1) * per]

    def close(self) -> None:
        if self.many:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def is_peer_lost(e: BaseException) -> bool:
    """A collective failed because another rank is gone (gloo: connection closed or reset;
    NCCL: a remote error or the watchdog's timeout)."""
    import torch.distributed as dist
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Gloo",
                            "gloo", "NCCL", "Timed out", "timed out", "Broken pipe"))
