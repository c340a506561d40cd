"""Streamed training of mixtures of experts: each routed expert its own file run, read only once
the router has chosen it.

`RoutedStreamer` is the BlockStreamer of training's nvme-tier layers (offload/stream/train.py)
where each layer's weights are several swap files, one per *weight unit*: the dense runs
(attention, norms, router, shared experts) and each routed expert (`weight_units`). A fetch
reads the dense units and the experts `want(i, ...)` named for block i -- none in forward, the
experts the forward routed to in backward (TrainingStreamer records them). Once the block is
bound, `read_routed(i, units)` reads the units the MoE module is about to run that the slot
does not hold yet, on the calling thread (the forward's, or autograd's in a recompute), before
any of them computes (SparseMoE.before_experts). The slot's other expert regions hold whatever
an earlier block left there: nothing reads them (no token reaches an unrouted expert; its
parameters get no gradient), and the step writes back only the units it stepped.

Each unit's file carries its own CRC (the store records it at each write), checked on every
read. Only on the CPU device, the files in the compute dtype (reads go straight into the slot);
elsewhere training streams whole layers.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from nvme.io import IOEngine
from offload.memory.layout import StreamError
from offload.stream.slots import BlockState
from offload.stream.streamer import BlockStreamer


def weight_units(numel: int, experts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """A block's [lo, hi) weight units: cut at every expert's bounds (element offsets)."""
    cuts = sorted({c for lo, hi in experts for c in (lo, hi) if 0 < c < numel})
    bounds = [0] + cuts + [numel]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def unit_names(base: str, units: list[tuple[int, int]]) -> list[str]:
    """The swap names of a block's weight units (`base`: the block's weights' name): that one
    name, or one per unit (zero-padded: the files sort in block order, as the streamer lays a
    block's runs out by file)."""
    return [base] if len(units) == 1 else [f"{base}.u{k:05d}" for k in range(len(units))]


class Handles:
    """Several store handles waited for as one."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


def write_units(store, names: list[str], units: list[tuple[int, int]], flat16: torch.Tensor,
                which: list[int] | None = None) -> Handles:
    """Write-behind of a block's weight units `which` (default all) from its flat 16-bit
    weights, each its own swap file (`names`: unit_names)."""
    ks = range(len(units)) if which is None else which
    return Handles([store.write(names[k], flat16[units[k][0]:units[k][1]]) for k in ks])


class RoutedStreamer(BlockStreamer):
    """A BlockStreamer whose blocks' runs listed in `lazy` (per block, run indices: the routed
    experts' units) are read only on demand. `run_crc32(i, k)`: the CRC run k of block i must
    have (None: not checked)."""

    def __init__(self, *args, lazy: Sequence[set[int]], run_crc32: Callable[[int, int], int | None],
                 **kw):
        super().__init__(*args, **kw)
        if self.cuda:
            raise StreamError("per-expert weight units stream on the CPU device only")
        self.lazy = [set(s) for s in lazy]
        self.run_crc32 = run_crc32
        self.wanted: dict[int, frozenset[int]] = {}  # lazy runs the next fetch of i reads
        self.present: dict[int, set[int]] = {}  # lazy runs block i's slot holds (from fetch on)
        self.routed_reads = 0  # lazy runs read by read_routed (report)

    def runs_of(self, i: int) -> list[tuple[int, int]]:
        """Block i's runs as (first, end) byte offsets of its stored layout."""
        return [(r.buf_offset, r.buf_offset + r.nbytes) for r in self._runs[i]]

    def want(self, i: int, runs: set[int]) -> None:
        """The lazy runs the next fetch of block i reads with its dense ones."""
        self.wanted[i] = frozenset(runs & self.lazy[i])

    def fetch(self, i: int) -> None:
        # set before the job is submitted, read by it on the stage thread; not changed until
        # the block is fetched again, which waits for this job first (wait / release_all)
        if self.state[i] is BlockState.ABSENT:
            self.present[i] = set(self.wanted.get(i, frozenset()))
        super().fetch(i)

    def _read_runs(self, i: int, dst: torch.Tensor) -> None:
        """Stage thread (a fetch): the dense runs and the wanted lazy ones into `dst`, each
        checked against its file's CRC. The job counts the whole block as moved: the runs
        left out are taken off here."""
        take = [k for k in range(len(self._runs[i]))
                if k not in self.lazy[i] or k in self.present.get(i, ())]
        self._read(i, take, dst)
        skipped = sum(r.nbytes for k, r in enumerate(self._runs[i]) if k not in take)
        with self._lock:
            self.stats.moved_bytes["disk"] -= skipped

    def read_routed(self, i: int, runs: Sequence[int]) -> None:
        """Block i is bound: read the lazy runs in `runs` its slot does not hold yet (the
        experts about to run), on this thread, before they compute."""
        todo = [k for k in runs if k in self.lazy[i] and k not in self.present.setdefault(i, set())]
        if not todo:
            return
        t0 = time.perf_counter()
        self._read(i, todo, self.bound_flat(i).view(torch.uint8))
        self.present[i].update(todo)
        self.routed_reads += len(todo)
        with self._lock:
            self.stats.moved_bytes["disk"] += sum(self._runs[i][k].nbytes for k in todo)
            self.stats.wait_s += time.perf_counter() - t0

    def _read(self, i: int, take: list[int], dst: torch.Tensor) -> None:
        runs = self._runs[i]
        want = {k: self.run_crc32(i, k) for k in take}
        handles = [self.io.submit_read(runs[k].path, runs[k].offset,
                                       dst[runs[k].buf_offset:runs[k].buf_offset + runs[k].nbytes],
                                       checksum=want[k] is not None) for k in take]
        IOEngine.wait_all(handles)
        for k, h in zip(take, handles):
            if want[k] is not None and h.crc32 != want[k]:
                r = runs[k]
                raise StreamError(f"checksum mismatch in streamed weights of block {i}: {r.path}, "
                                  f"{r.nbytes} bytes at offset {r.offset}: recorded crc32 "
                                  f"{want[k]:08x}, read back {h.crc32:08x}; the file is corrupt")
