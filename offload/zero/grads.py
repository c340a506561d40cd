"""ZeRO stage 2's gradient landing: each rank keeps only its shard of every block's gradient.

During backward a block's gradients still land whole (autograd makes them whole), in a
block-sized buffer taken for that micro-batch. As soon as every gradient of the block has
landed in this micro-batch the buffer is reduce-scattered (asynchronously, while backward goes
on with earlier layers): this rank receives the sum over ranks of its own shard, adds it into
the block's persistent shard buffer (S elements; copies it on the window's first micro-batch)
and frees the whole buffer. So between micro-batches and until the step a rank holds 1/N of the
gradients, as the ZeRO paper's 2Φ + 14Φ/N counts; the whole-block buffers in flight are
bounded (IN_FLIGHT reductions, plus the block landing now and a block whose gradients arrive
at both ends of backward, such as a tied embedding) and counted as "buffers".

Collectives are issued in the step order on every rank: a block is issued once it and every
block before it in that order have completed (the others wait for it); at the end of each
backward every block not issued yet is issued in order, with zeros where it got no gradient on
this rank -- every rank takes part in every block's reduction, whatever its data did.

Threads: `buffer` and `block_landed` run on the thread that lands gradients (autograd's on the
CPU, the landing worker on CUDA); `end_micro`, `finish_window` and the stepper's reads on the
main thread after the landing has been waited for -- never at the same time.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from offload.memory.tiers import MemoryAccount, PlanBytes, host_zeros, no_pinning
from offload.zero.group import InOrder, Reductions

IN_FLIGHT = 2  # reduce-scatters outstanding before the landing thread waits for the oldest


class ShardedLanding(Reductions):
    kind = "sharded"

    def __init__(self, numels: list[int], padded: list[int], dtype: torch.dtype,
                 device: torch.device, tier: str, pin: bool, account: MemoryAccount, zero,
                 order: list[int], slot_counts: list[int], sets: int = 1):
        """`numels` / `padded`: each block's elements and buffer length (offload/zero/group.py);
        `order`: the step order (the same on every rank); `slot_counts`: parameters per block;
        `sets`: 2 for the delayed update (its job steps from one set of shards while the next
        window lands in the other: swap_sets)."""
        self.numels, self.padded = numels, padded
        self.dtype, self.device, self.tier, self.pin = dtype, device, tier, pin
        super().__init__(zero)
        self.account, self.order = account, order
        self.slot_counts = slot_counts
        self.ranges = [zero.shards(n).range(zero.rank) for n in numels]
        self.shards = [self._zeros(p // zero.world) for p in padded]  # [S] each
        self.other = [self._zeros(p // zero.world) for p in padded] if sets == 2 else None
        for t in self.shards + (self.other or []):
            account.add(tier, "grads", t.nbytes)
        self.landing: list[torch.Tensor | None] = [None] * len(numels)  # whole, this micro-batch
        self.landed_now = [0] * len(numels)  # slots landed in this micro-batch
        self.blocks = InOrder(order, self._issue)  # reductions in step order on every rank
        # self.works: (block, output [S], work, whole buffer, of the window's last micro-batch)
        self.written: set[int] = set()  # shards holding a sum of this window
        self.last_micro = False  # reductions issued now are the window's last for their block

    @staticmethod
    def plan_bytes(padded: list[int], itemsize: int, tier: str, world: int,
                   pin: Callable[[int], int] = no_pinning, sets: int = 1) -> PlanBytes:
        """The shards (`sets` of them), and the whole-block buffers that can be held at once:
        IN_FLIGHT being reduced, the one landing, one open across backward (a tied embedding's)."""
        shards = sets * sum(pin(p // world * itemsize) for p in padded)
        return {(tier, "grads"): shards,
                (tier, "buffers"): (IN_FLIGHT + 2) * pin(max(padded) * itemsize)}

    def _zeros(self, numel: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_zeros(numel, self.dtype, self.pin)
        return torch.zeros(numel, dtype=self.dtype, device=self.device)

    # -- the storage interface (offload/grads/storage.py) --------------------------------------
    def buffer(self, bi: int) -> torch.Tensor:
        """Block bi's whole buffer for this micro-batch (zeroed when taken: slots that get no
        gradient in it must add nothing to the reduction)."""
        t = self.landing[bi]
        if t is None:
            t = self.landing[bi] = self._zeros(self.padded[bi])
            self.account.add(self.tier, "buffers", t.nbytes)
        return t

    def release(self, bi: int) -> None:
        """Block bi has been stepped: its shard stays for the next window."""

    def swap_sets(self) -> list[torch.Tensor]:
        """The delayed update (after finish_window): the averaged shards just completed, each
        over its [lo, hi); the next window sums into the other set."""
        assert self.other is not None, "swap_sets needs sets=2"
        filled, self.shards, self.other = self.shards, self.other, self.shards
        return [t[:hi - lo] for t, (lo, hi) in zip(filled, self.ranges)]

    def owned(self, bi: int) -> torch.Tensor:
        """This rank's averaged gradient of block bi over its [lo, hi) (after finish_window)."""
        lo, hi = self.ranges[bi]
        return self.shards[bi][:hi - lo]

    # -- reduction --------------------------------------------------------------------------
    def block_landed(self, bi: int) -> None:
        """One more gradient of block bi landed in this micro-batch; when it was the last,
        the block (and any after it in order that were waiting) is reduced."""
        self.landed_now[bi] += 1
        if self.landed_now[bi] == self.slot_counts[bi]:
            self.blocks.complete(bi)

    def begin_micro(self, last: bool) -> None:
        self.last_micro = last

    def _issue(self, bi: int, complete: bool) -> None:
        whole = self.buffer(bi)
        self.landing[bi] = None
        out = torch.empty(self.padded[bi] // self.zero.world, dtype=self.dtype, device=self.device)
        self.works.append((bi, out, self.zero.reduce_scatter_async(out, whole), whole,
                           self.last_micro))
        self._issued(bi, complete)
        if len(self.works) > IN_FLIGHT:  # bound the whole buffers in flight: wait for the oldest
            t0 = time.perf_counter()
            with self._lock:
                while len(self.works) > IN_FLIGHT:
                    self._complete_oldest()
            self.zero.comm.wait_s += time.perf_counter() - t0

    def _finalize(self, item) -> None:
        """Called with the lock held (Reductions): this rank's summed shard into its block's
        window sum; after the window's last micro-batch, the mean over ranks -- final."""
        bi, out, _, whole, last = item
        if bi in self.written:
            self.shards[bi].add_(out)
        else:
            self.shards[bi].copy_(out)
            self.written.add(bi)
        self.account.sub(self.tier, "buffers", whole.nbytes)
        if last:
            self.shards[bi].div_(self.zero.world)
            self.final.add(bi)

    def end_micro(self) -> None:
        """After a backward (its landing waited for): every block not reduced yet is, in
        order -- zeros for gradients this rank did not get."""
        self.blocks.flush()
        self.landed_now = [0] * len(self.numels)

    def finish_window(self) -> None:
        """At the step: every reduction complete (each block's mean is final once its last
        micro-batch's reduction is folded in); a block no rank reduced into in this window is
        zero."""
        self.complete_all()
        for bi, shard in enumerate(self.shards):
            if bi not in self.final:
                if bi in self.written:
                    shard.div_(self.zero.world)
                else:
                    shard.zero_()
        self.written.clear()
