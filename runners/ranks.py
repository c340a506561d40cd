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

import datetime
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from offload.zero.group import any_rank, ensure_process_group, env_world, long_work_group
from runners.common import RunnerError

# the start-up agreement: every rank is there within seconds of the others (they run the same
# command); a rank that is not is lost or stuck, and the job must say so long before the
# timeout of real work (offload/zero/group.py dist_timeouts)
AGREE_TIMEOUT_S = 20.0

def peer_lost(output: str) -> str:
    return (f"a peer rank stopped answering (it failed, was killed, or the network dropped); "
            f"this rank stops too — the last checkpoint is intact: relaunch the job with "
            f"--resume {output}")


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0
    agree_s: float = 0.0  # seconds spent in start-up agreements (reported)
    _agree_group: Any = field(default=None, repr=False)
    _long_group: Any = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> "Ranks":
        rank, world, local = env_world()
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} WORLD_SIZE={world}: not a valid rank of that world; "
                             f"launch with torchrun")
        return cls(rank, world, local)

    def gpu(self, flag: int | None) -> int | None:
        """The GPU index this process trains on (None: the CPU) given --gpu: under torchrun
        cuda:LOCAL_RANK whenever a GPU is visible, --gpu given or not (review 2 P15: the
        documented torchrun command trained on the CPUs of a GPU node); CUDA_VISIBLE_DEVICES=""
        keeps the ranks on the CPU. In one process, --gpu as given."""
        if not self.many:
            return flag
        return self.local if flag is not None or torch.cuda.is_available() else None

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
        import torch.distributed as dist
        # a gloo group of its own for the start-up agreements: a short timeout of its own,
        # and objects pickled on the CPU whatever the main backend (made here, where every
        # rank is, since making a group is itself collective)
        self._agree_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=AGREE_TIMEOUT_S))
        self._long_group = long_work_group()  # and one for waits on one rank's long work
        if not self.main:
            sys.stdout = open(os.devnull, "w")

    # -- agreement ----------------------------------------------------------------------------
    def agree(self, what: str, settings: Mapping[str, Any]) -> None:
        """Every rank's `settings` ({name: value}) must be equal: one small all-gather at start-up
        (its own AGREE_TIMEOUT_S), then every rank raises the same one line naming each setting
        that differs and the ranks' values, before any of them acts on its own."""
        if not self.many:
            return
        import torch.distributed as dist
        t0 = time.perf_counter()
        mine = {k: _plain(v) for k, v in settings.items()}
        got: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(got, mine, group=self._agree_group)
        except RuntimeError as e:
            raise RunnerError(
                f"the ranks did not all reach the start-up check of {what} within "
                f"{AGREE_TIMEOUT_S:g} s (a rank failed or is stuck before it; see its own error "
                f"line): {str(e).splitlines()[0][:120]}") from None
        self.agree_s += time.perf_counter() - t0
        differ = [k for k in mine if any(g.get(k) != mine[k] for g in got)]
        differ += [k for g in got for k in g if k not in mine and k not in differ]
        if differ:
            parts = []
            for k in differ[:4]:
                values = ", ".join(f"rank {r}: {str(g.get(k, '(absent)'))[:60]}"
                                   for r, g in enumerate(got))
                parts.append(f"{k} ({values})")
            more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
            raise RunnerError(f"the ranks disagree on {what}: {'; '.join(parts)}{more}; every "
                              f"rank of a job must run the same command on the same data and "
                              f"model (one torchrun command line)")

    def barrier(self) -> None:
        if self.many:
            import torch.distributed as dist
            dist.barrier()

    def long_barrier(self) -> None:
        """A barrier where the ranks wait while one works alone (the QLoRA conversion, rank 0
        preparing the run directory, the export and --merge): the long timeout
        ($OFFLOAD_DIST_LONG_TIMEOUT_S), not the default group's (review 2 P3)."""
        if self.many:
            import torch.distributed as dist
            dist.barrier(group=self._long_group)

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


def _plain(value: Any) -> Any:
    """A setting as compared and shown: numbers, strings, None and booleans as they are,
    anything else as its repr."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


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
