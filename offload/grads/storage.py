"""Where gradients land: the buffers, one regime per step path (offload/grads/landing.py moves them in).

  PerBlock  one landing buffer per block for the whole run: the plain step after backward,
            accumulation (micro-batches add into it), offload="none" (on the device);
  Double    two full sets (the delayed update: a job steps from one set while the next
            backward lands in the other; `swap_sets` switches them);
  Adopted   no buffers at all: where a gradient is made in host memory already (the CPU device),
            nothing is summed and every gradient is held until the step after backward, the
            tensor autograd made is kept as it is, one per parameter, and stepped from directly
            -- the copy into a flat buffer (and its bytes) would buy nothing;
  Pooled    the overlapped step without accumulation: each layer's gradients are consumed by
            its step as soon as they are complete, so a few block-sized buffers, taken when a
            layer's first gradient lands and given back after its step, replace one buffer per
            layer -- host memory for gradients no longer grows with the model. Other blocks
            (embeddings, head: complete only at the very end of backward) keep their own.

Each regime has `plan_bytes(...)` beside its constructor: the bytes it will allocate, per
(tier, kind), from the block sizes alone -- the training planner sums these (train_plan.py) and
the account (tiers.MemoryAccount) records the same numbers as the buffers are made.

Threads: `buffer(bi)` is called by whichever thread lands block bi's gradients (autograd's, or
the CUDA landing worker) and, once they are final, by the thread that steps the block;
`release(bi)` by the stepping thread only. A block's entry is written by the lander before the
block's gradients are final and by the stepper after, never by both at once; the pool itself
is a thread-safe queue.
"""

from __future__ import annotations

import queue
import time
from typing import Callable

import torch

from offload.memory.tiers import MemoryAccount, PlanBytes, host_empty, host_zeros, no_pinning

POOL_TIMEOUT_S = 600.0


class PerBlock:
    """One landing buffer per block, made at start-up, zeroed."""
    kind = "per_block"

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device, tier: str,
                 pin: bool, account: MemoryAccount):
        """`tier`: the account's name for where `device` is ("device": kept where gradients are
        made, offload="none" -- also when that device is the CPU)."""
        self.numels, self.dtype, self.pin, self.account = numels, dtype, pin, account
        self.tier = tier
        self.landing: list[torch.Tensor | None] = [self._zeros(n, device) for n in numels]
        for t in self.landing:
            account.add(self.tier, "grads", t.numel() * t.element_size())

    @staticmethod
    def plan_bytes(numels: list[int], itemsize: int, tier: str,
                   pin: Callable[[int], int] = no_pinning) -> PlanBytes:
        """`pin`: what a pinned host buffer of that many bytes really takes (tiers.pinned_bytes)."""
        return {(tier, "grads"): sum(pin(n * itemsize) for n in numels)}

    def _zeros(self, numel: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return host_zeros(numel, self.dtype, self.pin)
        return torch.zeros(numel, dtype=self.dtype, device=device)

    def buffer(self, bi: int) -> torch.Tensor:
        return self.landing[bi]  # type: ignore[return-value]

    def release(self, bi: int) -> None:
        """Block bi has been stepped (its buffer stays: the next window lands in it)."""


class Double(PerBlock):
    """Two sets of per-block host buffers; the delayed update steps from one while the next
    backward lands in the other."""
    kind = "double"

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device, tier: str,
                 pin: bool, account: MemoryAccount):
        assert tier == "host", "the delayed update lands gradients in host memory"
        super().__init__(numels, dtype, device, tier, pin, account)
        self.other = [host_zeros(n, dtype, pin) for n in numels]
        for t in self.other:
            account.add("host", "grads", t.numel() * t.element_size())

    @staticmethod
    def plan_bytes(numels: list[int], itemsize: int, tier: str,
                   pin: Callable[[int], int] = no_pinning) -> PlanBytes:
        return {(tier, "grads"): 2 * sum(pin(n * itemsize) for n in numels)}

    def swap_sets(self) -> list[torch.Tensor]:
        """Land in the other set from now on; returns the set just filled."""
        filled, self.landing, self.other = self.landing, self.other, self.landing
        return filled  # type: ignore[return-value]


class Pooled:
    """`pool_buffers` buffers of the largest pooled block, shared by the pooled blocks (the
    layers); the other blocks keep one each -- made at start-up when gradients come from a GPU
    (pinned memory is slow to allocate), or when their first gradient lands and freed after
    their step when they come from the CPU (autograd's own transients for the same block -- a
    tied embedding's two dense gradients and their sum -- peak just before, and would
    otherwise sit on top of a buffer held since start-up)."""
    kind = "pooled"

    def __init__(self, numels: list[int], dtype: torch.dtype, pin: bool, account: MemoryAccount,
                 *, pool_buffers: int, pooled_blocks: set[int], lazy_rest: bool,
                 incomplete: Callable[[int], bool], names: list[str]):
        assert pool_buffers > 0 and pooled_blocks
        self.numels, self.dtype, self.pin, self.account = numels, dtype, pin, account
        self.names = names  # for messages
        self.pooled_blocks = set(pooled_blocks)
        # `incomplete(bi)`: block bi still waits for some gradient (see _take)
        self.incomplete = incomplete
        largest = max(numels[i] for i in self.pooled_blocks)
        self.pool: queue.Queue = queue.Queue()
        for _ in range(pool_buffers):
            buf = host_zeros(largest, dtype, pin)
            account.add("host", "grads", buf.nbytes)
            self.pool.put(buf)
        rest = set(range(len(numels))) - self.pooled_blocks
        self.lazy = rest if lazy_rest else set()  # made at first landing, freed after the step
        self.extra: set[int] = set()  # the same, made when the pool cannot serve (_take)
        self.landing: list[torch.Tensor | None] = [
            host_zeros(n, dtype, pin) if i in rest and i not in self.lazy else None
            for i, n in enumerate(numels)]
        for t in self.landing:
            if t is not None:
                account.add("host", "grads", t.nbytes)
        self.base: list[torch.Tensor | None] = [None] * len(numels)  # pool buffer held by block

    @staticmethod
    def plan_bytes(numels: list[int], itemsize: int, pool_buffers: int, pooled_blocks: set[int],
                   pin: Callable[[int], int] = no_pinning) -> PlanBytes:
        largest = max(numels[i] for i in pooled_blocks)
        own = sum(pin(n * itemsize) for i, n in enumerate(numels) if i not in pooled_blocks)
        return {("host", "grads"): pool_buffers * pin(largest * itemsize) + own}

    def buffer(self, bi: int) -> torch.Tensor:
        """Block bi's landing buffer: taken from the pool (or made) on first use."""
        t = self.landing[bi]
        if t is not None:
            return t
        if bi not in self.lazy:
            base = self._take(bi)  # a wait here shows in the backward's time
            if base is not None:
                self.base[bi] = base
                t = self.landing[bi] = base[:self.numels[bi]]
                return t
            self.extra.add(bi)  # see _take: a buffer of its own, freed after its step
        # every slot is overwritten by its gradient or zeroed by finish_window before use
        t = self.landing[bi] = host_empty(self.numels[bi], self.dtype, self.pin)
        self.account.add("host", "grads", t.numel() * t.element_size())
        return t

    def _take(self, bi: int) -> torch.Tensor | None:
        """A pool buffer; None when every pool buffer is held by a block still waiting for
        gradients (one that got no gradient for some parameter completes only at step()):
        waiting would never end, so the caller makes a buffer of its own instead."""
        deadline = time.perf_counter() + POOL_TIMEOUT_S
        while True:
            try:
                return self.pool.get(timeout=0.02)
            except queue.Empty:
                held = [i for i, b in enumerate(self.base) if b is not None]
                if held and all(self.incomplete(i) for i in held):
                    return None
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"gradient landing pool exhausted for {POOL_TIMEOUT_S} s "
                                       f"(block {self.names[bi]}); the step thread is not "
                                       f"returning buffers") from None

    def release(self, bi: int) -> None:
        """Block bi has been stepped: its buffer goes back to the pool (or is freed, for one
        made lazily or outside the pool)."""
        if (bi in self.lazy or bi in self.extra) and self.landing[bi] is not None:
            self.extra.discard(bi)
            t, self.landing[bi] = self.landing[bi], None
            self.account.sub("host", "grads", t.numel() * t.element_size())
        elif bi in self.pooled_blocks and self.base[bi] is not None:
            base, self.base[bi], self.landing[bi] = self.base[bi], None, None
            self.pool.put(base)


class Adopted:
    """Each parameter's final gradient, the very tensor autograd made, kept until its block is
    stepped: `slot(bi, name)`, 1-D. The account counts what is held (after backward: all of it,
    the bytes PerBlock would hold in its buffers, without their copy)."""
    kind = "adopted"

    def __init__(self, numels: list[int], tier: str, account: MemoryAccount):
        self.tier, self.account = tier, account
        self.held: list[dict[str, torch.Tensor]] = [{} for _ in numels]
        self.landing: list[torch.Tensor | None] = [None] * len(numels)  # no flat buffers

    @staticmethod
    def plan_bytes(numels: list[int], itemsize: int, tier: str) -> PlanBytes:
        return {(tier, "grads"): sum(numels) * itemsize}

    def adopt(self, bi: int, name: str, grad: torch.Tensor) -> None:
        """Keep `grad` (any shape; made contiguous) as slot `name`'s gradient of block bi."""
        flat = grad.contiguous().view(-1)
        old = self.held[bi].pop(name, None)
        if old is not None:
            self.account.sub(self.tier, "grads", old.nbytes)
        self.held[bi][name] = flat
        self.account.add(self.tier, "grads", flat.nbytes)

    def slot(self, bi: int, name: str) -> torch.Tensor:
        return self.held[bi][name]

    def buffer(self, bi: int) -> torch.Tensor:
        raise AssertionError("adopted gradients have no flat buffer: step them slot by slot")

    def release(self, bi: int) -> None:
        """Block bi has been stepped: its gradients go (autograd's memory, freed now)."""
        for t in self.held[bi].values():
            self.account.sub(self.tier, "grads", t.nbytes)
        self.held[bi] = {}


GradStorage = PerBlock | Pooled | Adopted
