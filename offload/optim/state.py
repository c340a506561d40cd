"""Where the optimizer state (fp32 master, exp_avg, exp_avg_sq per block) lives between steps.

`ResidentState` keeps every block's state in memory: on the device for offload="none", in
host RAM (pinned with CUDA) for offload="cpu". `NvmeState` keeps it in swap files and moves
it through a fixed ring of `buffer_count` staging sets, so host memory for optimizer state is
bounded by buffer_count x largest block, whatever the model size.

Both expose the same pipeline protocol, which the engine drives block by block:

    begin_step(order)          # the order the step will consume blocks in
    m, a, s = acquire(i)       # wait until block i's state is in memory
    ... step block i ...
    release(i, modified=True)  # write-behind; the staging set is reused after the write
    end_step(next_order)       # writes durable, manifest committed; start reading for next step

and, outside a step, `hold(i)`: block i's state to change in place (the lazy replay of experts'
zero steps, offload/train/replay.py), without a release -- NvmeState keeps it in RAM of its own
until the step acquires it, so a replayed expert's state is read once per update, not twice.

For NVMe the reads for the next step are submitted at the end of this one, in the order the
next step will consume them, so they run while the next forward and backward compute — the
step then starts with its first `buffer_count` blocks already in memory (DeepSpeed only starts
reading inside the step).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

import torch

from offload.memory.blocks import Block
from offload.memory.tiers import LinkCounter, MemoryAccount, PlanBytes, host_zeros, started_worker

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


def whole_blocks(blocks: list[Block]) -> list[tuple[int, int]]:
    """Every block's full range: the state of one process (or of ZeRO stage 0)."""
    return [(0, b.numel) for b in blocks]


class ResidentState:
    """`ranges`: per block, the [lo, hi) of its elements whose state this process keeps (its
    ZeRO shard, offload/zero/group.py); units, reads and loads are in those block offsets."""

    def __init__(self, blocks: list[Block], tier: str, device: torch.device, pin: bool,
                 account: MemoryAccount, ranges: list[tuple[int, int]] | None = None):
        self.blocks = blocks
        self.ranges = ranges or whole_blocks(blocks)
        self.tier = tier  # "device" (offload none) or "host"
        self.state: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(blocks)
        self._device, self._pin, self._account = device, pin, account
        self.io_wait_s = 0.0

    @staticmethod
    def plan_bytes(numels: list[int], tier: str) -> PlanBytes:
        """fp32 master + exp_avg + exp_avg_sq of every block, on `tier` (never pinned)."""
        n = sum(numels)
        return {(tier, "masters"): n * 4, (tier, "moments"): n * 8}

    def _alloc(self, numel: int) -> torch.Tensor:
        if self.tier == "device":
            return torch.zeros(numel, dtype=torch.float32, device=self._device)
        return host_zeros(numel, torch.float32, self._pin)

    def init_block(self, bi: int, master_fp32: torch.Tensor) -> None:
        """`master_fp32`: the whole block's flat fp32 values; this state keeps its range."""
        lo, hi = self.ranges[bi]
        master, m, v = self._alloc(hi - lo), self._alloc(hi - lo), self._alloc(hi - lo)
        master.copy_(master_fp32[lo:hi])
        self.state[bi] = (master, m, v)
        self._account.add(self.tier, "masters", master.nbytes)
        self._account.add(self.tier, "moments", m.nbytes + v.nbytes)

    def units_of(self, bi: int) -> list[tuple[int, int, int]]:
        """(unit, first element, end element) of block bi: resident state is one unit a block."""
        return [(bi, *self.ranges[bi])]

    def begin_step(self, order: list[int]) -> None:
        pass

    def acquire(self, bi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.state[bi]
        assert state is not None, f"block {bi} was never initialised"
        return state

    def release(self, bi: int, modified: bool) -> None:
        pass

    def hold(self, bi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's state itself (NvmeState.hold: a copy kept in RAM until the step)."""
        return self.acquire(bi)

    def end_step(self, next_order: list[int], step: int) -> None:
        pass

    def read(self, bi: int, kind: str) -> torch.Tensor:
        """A CPU copy of one state tensor of block bi."""
        return self.acquire(bi)[STATE_KINDS.index(kind)].detach().to("cpu", copy=True)

    def load(self, bi: int, kind: str, values: torch.Tensor) -> None:
        self.acquire(bi)[STATE_KINDS.index(kind)].copy_(values)

    def close(self) -> None:
        pass


def split_units(numel: int, max_params: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most max_params elements, as equal as possible (one when it fits)."""
    parts = max(1, -(-numel // max_params))
    bounds = [numel * k // parts for k in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def split_at(first: int, end: int, cuts: list[int], max_params: int) -> list[tuple[int, int]]:
    """[lo, hi) units of the range [first, end): broken at every cut inside it (an expert's
    boundary: each expert its own unit, offload/train/experts.py), then each piece by
    split_units; empty when the range is."""
    bounds = [first] + [c for c in sorted(set(cuts)) if first < c < end] + [end]
    return [(a + lo, a + hi) for a, b in zip(bounds[:-1], bounds[1:]) if b > a
            for lo, hi in split_units(b - a, max_params)]


class NvmeState:
    """Optimizer state in swap files, moved through `buffer_count` staging sets.

    A block larger than `sub_group_params` is split into sub-groups (DeepSpeed's
    sub_group_size), each its own swap files and its own pass through a staging set: staging
    memory is bounded by the sub-group size, not by the largest block (a 70B model's
    embedding is 0.5B parameters). `cuts`: per block, element offsets where a unit must end
    (mixture-of-experts layers: each expert its own unit, so an expert without tokens is
    neither read nor written). The pipeline below works on these units."""

    def __init__(self, blocks: list[Block], store, buffer_count: int, account: MemoryAccount,
                 read_link: LinkCounter, write_link: LinkCounter, prefetch: bool = True,
                 sub_group_params: int = 1 << 25, ranges: list[tuple[int, int]] | None = None,
                 cuts: list[list[int]] | None = None, hold_cap_bytes: int = 0,
                 versions: bool = False):
        from nvme import aligned_empty  # page-aligned: O_DIRECT reads/writes go straight in

        self.blocks = blocks
        self.ranges = ranges or whole_blocks(blocks)
        self.store = store
        self.prefetch = prefetch
        self.read_link, self.write_link = read_link, write_link
        self.unit_names: list[str] = []  # swap-name prefix of each unit
        self.unit_numel: list[int] = []
        self.block_units: list[list[tuple[int, int, int]]] = []
        for bi, (b, (first, end)) in enumerate(zip(blocks, self.ranges)):
            # a rank whose shard of a small block is empty keeps no files for it
            parts = split_at(first, end, cuts[bi] if cuts else [], sub_group_params)
            units = []
            for k, (lo, hi) in enumerate(parts):
                units.append((len(self.unit_names), lo, hi))
                self.unit_names.append(b.name if len(parts) == 1 else f"{b.name}.part{k}")
                self.unit_numel.append(hi - lo)
            self.block_units.append(units)
        max_numel = max(self.unit_numel, default=1)
        # buffer_count sets of (master, exp_avg, exp_avg_sq), each sized for the largest unit
        self.sets = [tuple(aligned_empty(max_numel, torch.float32) for _ in STATE_KINDS)
                     for _ in range(buffer_count)]
        account.add("host", "buffers", sum(t.nbytes for s in self.sets for t in s))
        for lo, hi in self.ranges:
            account.add("nvme", "masters", (hi - lo) * 4)
            account.add("nvme", "moments", (hi - lo) * 8)
            if versions:
                account.add("nvme", "rollback", (hi - lo) * 12)
        # `versions` (the speculative step, offload/train/speculative.py): each unit's files
        # exist in two versions, `gen[u]` the committed one. From write_beside() on, writes go
        # to the other version; end_step makes what was written committed, discard_written()
        # forgets it -- the committed files were never touched, so rolling a unit back is
        # reading it again. Other writes (outside a speculative update: initialisation, a
        # lazy expert replay during forward, a load) replace the committed version in place.
        self.versions = versions
        self.gen = [0] * len(self.unit_names)
        self.beside = False  # writes go beside the committed files (between write_beside and
        # end_step / discard_written)
        self.written: set[int] = set()  # units written beside this update
        self.free: deque[int] = deque(range(buffer_count))
        # with experts, read-ahead leaves one set unused: a unit acquired out of order (an
        # expert's place in the order is known only once routed) is read into it, instead of
        # displacing a read-ahead that would then be read a second time
        self.spare_sets = 1 if cuts and any(cuts) else 0
        self.writing: dict[int, list] = {}  # set -> pending write handles
        self.reading: dict[int, tuple[int, list]] = {}  # unit -> (set, pending read handles)
        self.queue: deque[int] = deque()  # units still to be read, in consumption order
        self.io_wait_s = 0.0
        self._tail_thread = started_worker("offload-swap-tail")
        self._tail: Future | None = None  # the previous step's end (see end_step)
        # hold(): units changed outside a step, in RAM of their own until the step acquires
        # and releases them (written then); at most hold_cap_bytes (host "buffers" while held)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.hold_cap_bytes = hold_cap_bytes
        self._account = account

    @staticmethod
    def plan_bytes(numels: list[int], buffer_count: int, sub_group_params: int) -> PlanBytes:
        """The state in swap files, and buffer_count staging sets sized for the largest unit
        (sub-group) in host RAM."""
        n = sum(numels)
        return {("nvme", "masters"): n * 4, ("nvme", "moments"): n * 8,
                ("host", "buffers"): NvmeState.staging_bytes(numels, buffer_count, sub_group_params)}

    @staticmethod
    def staging_bytes(numels: list[int], buffer_count: int, sub_group_params: int) -> int:
        """buffer_count staging sets (master, exp_avg, exp_avg_sq) of the largest unit."""
        largest_unit = max(1, max(hi - lo for b in numels for lo, hi in split_units(b, sub_group_params)))
        return buffer_count * len(STATE_KINDS) * largest_unit * 4

    def units_of(self, bi: int) -> list[tuple[int, int, int]]:
        return self.block_units[bi]

    def name(self, u: int, kind: str, gen: int | None = None) -> str:
        """Unit u's swap name for `kind`: its committed version (default) or version `gen`."""
        gen = self.gen[u] if gen is None else gen
        return f"{self.unit_names[u]}.{kind}" + (".v1" if gen else "")

    def write_beside(self) -> None:
        """This update's writes go beside the committed files until end_step or
        discard_written (versions only)."""
        assert self.versions, "write_beside needs NvmeState(versions=True)"
        self._join()
        self.beside = True

    def discard_written(self) -> None:
        """Forget the writes made beside the committed files: every unit reads its committed
        files again, and later writes replace them in place. Staged read-aheads hold committed
        data and stay."""
        self._join()
        self.written.clear()
        self.beside = False

    @staticmethod
    def rollback_bytes(numels: list[int]) -> PlanBytes:
        """The second version of every unit's files (versions=True)."""
        return {("nvme", "rollback"): sum(numels) * 12}

    def _views(self, si: int, u: int) -> tuple[torch.Tensor, ...]:
        n = self.unit_numel[u]
        return tuple(t[:n] for t in self.sets[si])

    # -- initialisation ---------------------------------------------------------------------
    def init_block(self, bi: int, master_fp32: torch.Tensor) -> None:
        self._join()
        for u, lo, hi in self.block_units[bi]:
            si = self._take_set(block=True)
            master, m, v = self._views(si, u)
            master.copy_(master_fp32[lo:hi])
            m.zero_()
            v.zero_()
            self._write(si, u)

    # -- pipeline ---------------------------------------------------------------------------
    def _take_set(self, block: bool) -> int | None:
        """A staging set with no IO in flight: a free one, or the one whose writes finish
        first (waiting for them only when `block`)."""
        if self.free:
            return self.free.popleft()
        for si, handles in self.writing.items():
            if all(h.done() for h in handles):
                self._finish_writes(si)
                return si
        if not block or not self.writing:
            return None
        si = next(iter(self.writing))  # oldest write first (dicts keep insertion order)
        t0 = time.perf_counter()
        self._finish_writes(si)
        self.io_wait_s += time.perf_counter() - t0
        return si

    def _finish_writes(self, si: int) -> None:
        for h in self.writing.pop(si):
            h.wait()

    def _pump(self, block: bool = False) -> None:
        """Submit reads for queued blocks while staging sets are available (read-ahead, but
        for the first when `block`: at most all sets but spare_sets staged at once)."""
        while self.queue:
            if not block and len(self.reading) >= len(self.sets) - self.spare_sets:
                return
            si = self._take_set(block=block)
            if si is None:
                return
            u = self.queue.popleft()
            if u in self.held:  # newer than its files: copied, nothing read (kept until release)
                for view, kept in zip(self._views(si, u), self.held[u]):
                    view.copy_(kept)
                self.reading[u] = (si, [])
                continue
            handles = [self.store.read_into(self.name(u, kind), view)
                       for kind, view in zip(STATE_KINDS, self._views(si, u))]
            self.read_link.add(self.unit_numel[u] * 12)
            self.reading[u] = (si, handles)
            block = False  # only the read the caller is waiting for may block

    def begin_step(self, order: list[int]) -> None:
        self._join()
        pending = set(self.reading)
        self.queue = deque(u for u in order if u not in pending)
        self._pump()

    def acquire(self, u: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._join()
        if u not in self.reading:
            if u in self.queue:  # it must be next: reads are issued in consumption order
                self.queue.remove(u)
            self.queue.appendleft(u)
            if not self.free and not self.writing:
                # Out of order (an overlapped step takes blocks as their gradients complete,
                # and a block with no gradient this time, or a missing one, changes that
                # order): every set holds a read-ahead of a later unit. Give one back.
                self._evict_read_ahead(keep=u)
            self._pump(block=True)
        si, handles = self.reading[u]
        t0 = time.perf_counter()
        for h in handles:
            h.wait()
        self.io_wait_s += time.perf_counter() - t0
        self._current = (u, si)
        return self._views(si, u)  # type: ignore[return-value]

    def _evict_read_ahead(self, keep: int) -> None:
        """Free the staging set of the most recently issued read-ahead (its unit goes back in
        the queue, right after `keep`, and is read again when its turn comes)."""
        victim = next(v for v in reversed(self.reading) if v != keep)
        si, handles = self.reading.pop(victim)
        for h in handles:
            h.wait()  # the buffer may be reused only when the read into it is over
        self.free.append(si)
        self.queue.insert(1, victim)

    def _write(self, si: int, u: int) -> None:
        gen = None
        if self.beside:  # beside the committed version, never over it
            gen = 1 - self.gen[u]
            self.written.add(u)
        self.writing[si] = [self.store.write(self.name(u, kind, gen), view)
                            for kind, view in zip(STATE_KINDS, self._views(si, u))]
        self.write_link.add(self.unit_numel[u] * 12)

    def release(self, u: int, modified: bool) -> None:
        si, _ = self.reading.pop(u)
        kept = self.held.pop(u, None)
        if kept is not None:  # its files are older than what the step was given
            self._account.sub("host", "buffers", sum(t.nbytes for t in kept))
        if modified or kept is not None:
            self._write(si, u)  # write-behind: the set is reused once these complete
        else:
            self.free.append(si)
        self._pump()

    def hold(self, u: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Unit u's state in RAM of its own, to be changed in place and kept there until a
        step acquires and releases it (then written; also at the end of a step that did not,
        and before any direct read): read once from its files unless already held. None where
        holding it would pass hold_cap_bytes, or its read-ahead is in flight (the caller then
        acquires and releases it as usual). Outside a step, on the thread that steps."""
        from nvme import aligned_empty  # page-aligned: O_DIRECT reads straight in

        self._join()
        if u in self.held:
            return self.held[u]
        n = self.unit_numel[u]
        held_bytes = sum(t.nbytes for kept in self.held.values() for t in kept)
        if u in self.reading or u in self.queue or held_bytes + 12 * n > self.hold_cap_bytes:
            return None
        kept = tuple(aligned_empty(n, torch.float32) for _ in STATE_KINDS)
        t0 = time.perf_counter()
        for kind, t in zip(STATE_KINDS, kept):
            self.store.read_into(self.name(u, kind), t).wait()
        self.io_wait_s += time.perf_counter() - t0
        self.read_link.add(n * 12)
        self._account.add("host", "buffers", sum(t.nbytes for t in kept))
        self.held[u] = kept
        return kept

    def _write_held(self) -> None:
        """Every held unit written to its files (waited for) and let go."""
        handles = [self.store.write(self.name(u, kind), t)
                   for u, kept in self.held.items() for kind, t in zip(STATE_KINDS, kept)]
        for u in self.held:
            self.write_link.add(self.unit_numel[u] * 12)
        for h in handles:
            h.wait()
        for kept in self.held.values():
            self._account.sub("host", "buffers", sum(t.nbytes for t in kept))
        self.held.clear()

    def end_step(self, next_order: list[int], step: int) -> None:
        """Hand the step's tail to a background thread and return: wait for this step's
        writes, commit the manifest with the step counter (the swap files then describe one
        complete step), and submit the reads of the next step's first units. The writes of
        the last blocks and those reads then run during the next forward and backward instead
        of in front of them. Every other entry point joins the tail first (`_join`), so only
        one thread ever touches the pipeline's state at a time."""
        self._join()
        for u in self.written:  # versions: what this step wrote beside is committed now
            self.gen[u] = 1 - self.gen[u]
        self.written.clear()
        self.beside = False
        self._tail = self._tail_thread.submit(self._finish_step, next_order, step)

    def _finish_step(self, next_order: list[int], step: int) -> None:
        self._write_held()  # held units this step did not acquire: their files catch up
        for si in list(self.writing):
            self._finish_writes(si)
            self.free.append(si)
        self.store.set_step(step)
        self.store.commit()
        if self.prefetch:
            pending = set(self.reading)
            self.queue = deque(u for u in next_order if u not in pending)
            self._pump()

    def _join(self) -> None:
        """Wait for the previous step's tail (re-raising its error); counts as IO wait."""
        if self._tail is not None:
            t0 = time.perf_counter()
            tail, self._tail = self._tail, None
            tail.result()
            self.io_wait_s += time.perf_counter() - t0

    def drain(self, reads_matter: bool = True) -> None:
        """No IO in flight and nothing staged (before direct reads or checkpointing). A failed
        read-ahead raises unless `reads_matter` is False (closing: nobody uses its data)."""
        self._join()
        self._write_held()
        for si in list(self.writing):
            self._finish_writes(si)
            self.free.append(si)
        for bi, (si, handles) in list(self.reading.items()):
            for h in handles:
                try:
                    h.wait()
                except OSError:
                    if reads_matter:
                        raise
            self.free.append(si)
        self.reading.clear()
        self.queue.clear()

    def read(self, bi: int, kind: str) -> torch.Tensor:
        """Block bi's state of `kind` over its range (the whole block in one process)."""
        self.drain()
        first, end = self.ranges[bi]
        out = torch.empty(end - first, dtype=torch.float32)
        for u, lo, hi in self.block_units[bi]:
            self.store.read_into(self.name(u, kind), out[lo - first:hi - first]).wait()
        return out

    def load(self, bi: int, kind: str, values: torch.Tensor) -> None:
        """`values`: block bi's state of `kind` over its range."""
        self.drain()
        first = self.ranges[bi][0]
        for u, lo, hi in self.block_units[bi]:
            self.store.write(self.name(u, kind), values[lo - first:hi - first].contiguous()).wait()

    def close(self) -> None:
        try:
            self.drain(reads_matter=False)  # the store itself belongs to the engine
        finally:
            self._tail_thread.shutdown(wait=True)
