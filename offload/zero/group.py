"""ZeRO across data-parallel ranks: which part of every block each rank owns, and the collectives.

Every rank runs the same model on its own slice of the global batch. A block's flat buffers
(weights, gradients, fp32 masters, moments) are cut into `world` shards of S elements
(S = ceil(numel / world) rounded up to ALIGN_ELEMS); rank r owns [r*S, min((r+1)*S, numel)).
The flat device weights and gradient buffers are allocated `world * S` long (the padding is
never a parameter and stays zero), so every collective below is one call on one contiguous
tensor, with equal parts, as NCCL and gloo want them.

  stage 0  every rank keeps all optimizer state; each block's gradients are all-reduced
           (averaged) and every rank steps the whole block -- plain data parallelism.
  stage 1  rank r keeps masters and moments of its shards only; gradients are
           reduce-scattered (each rank receives the averaged sum of its own shard), each
           rank steps its shard, and the updated 16-bit shards are all-gathered.
  stage 2  as stage 1, but each block's gradient is reduce-scattered during backward, every
           micro-batch, as soon as it is complete, and a rank keeps only its shard of it
           (offload/zero/grads.py): the gradients take 1/N of the memory, and with gradient
           accumulation the reduction runs once per micro-batch instead of once per update.
  stage 3  as stage 2, and each layer's 16-bit weights live as this rank's shard only (on the
           device, in host RAM with offload_params="cpu", or in one swap file per layer with
           offload_params="nvme"): the block streamer gathers a
           layer from every rank's shard just before it runs, in forward and again in
           backward, and drops it after (ShardGather); the step writes the rank's new shard
           in place. The non-layer block (embeddings, final norm, head) is sharded too: each
           module gathers its own parameters around its forward (offload/zero/rest.py).

Per update a rank sends (ring algorithms, n elements of the block): all-reduce 2n(N-1)/N,
reduce-scatter and all-gather n(N-1)/N each -- so stages 0, 1 and 2 move the same 2Φ elements
per rank, the ZeRO paper's point: sharding the optimizer state costs no extra communication;
stage 3 adds the layers' gathers in forward and backward (at most 3Φ: the last layer is
gathered once, it stays bound between its forward and backward, and each non-layer module
once per forward).
`CommCounter` counts exactly that, per collective, from the calls made.

Every collective is issued in the same order on every rank (blocks in step order, never in the
order their gradients happened to complete), so a model whose blocks finish in a
rank-dependent order cannot pair one rank's block with another's.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from offload.config import ConfigError

ALIGN_ELEMS = 64  # shard boundaries on 64 elements: 128/256-byte aligned in 16/32 bits
NORM_CHUNK_ELEMS = 1 << 22  # global_norm's fp64 cast, a chunk at a time (as grads' fp32_norm)
STAGES = (0, 1, 2, 3)
# The default process group's timeout: every collective of an update, where the ranks work in
# step (a peer that dies usually breaks gloo's connections at once; NCCL waits this long).
# Where one rank works alone for long -- the QLoRA conversion, stage 0's checkpoint writes and
# fsync, the export and --merge -- the others wait in a barrier of a gloo group of its own with
# the long timeout (`long_barrier`): neither a real-size run nor a slow disk aborts the job.
TIMEOUT_ENV, LONG_TIMEOUT_ENV = "OFFLOAD_DIST_TIMEOUT_S", "OFFLOAD_DIST_LONG_TIMEOUT_S"
DEFAULT_TIMEOUT_S, DEFAULT_LONG_TIMEOUT_S = 1800.0, 4 * 3600.0


def dist_timeouts() -> tuple[float, float]:
    """(the default group's timeout, the long-work barriers'), seconds: $OFFLOAD_DIST_TIMEOUT_S
    (default 30 min) and $OFFLOAD_DIST_LONG_TIMEOUT_S (default 4 h, never below the first)."""
    def read(name: str, default: float) -> float:
        raw = os.environ.get(name)
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ConfigError(f"${name}={raw!r}: give the timeout in seconds (> 0), or unset it "
                              f"(default {default:g})")
        return value
    short = read(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    return short, max(short, read(LONG_TIMEOUT_ENV, DEFAULT_LONG_TIMEOUT_S))


def long_work_group():
    """A gloo group over every rank with the long timeout, for barriers where ranks wait while
    one works alone (every rank must call it, at the same point: making a group is collective);
    None under another backend (a test's stand-in: its default group serves)."""
    if dist.get_backend() not in ("gloo", "nccl"):
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=dist_timeouts()[1]))


@dataclass(frozen=True)
class Shards:
    """How one block of `numel` elements is cut across `world` ranks."""
    numel: int
    world: int

    @property
    def size(self) -> int:
        """S: elements per shard (the last one's tail is padding)."""
        per = -(-self.numel // self.world)
        return -(-per // ALIGN_ELEMS) * ALIGN_ELEMS

    @property
    def padded(self) -> int:
        """world * S: the length of the block's flat buffers that collectives run on."""
        return self.size * self.world

    def range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the real elements rank `rank` owns (hi <= numel; may be empty)."""
        lo = min(rank * self.size, self.numel)
        return lo, min(lo + self.size, self.numel)


@dataclass
class CommCounter:
    """Elements one rank sent per collective kind (ring algorithms), their bytes, and the time
    spent waiting for them. Thread-safe: stage 3's weight gathers are counted by the streamer's
    stage thread."""
    elements: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    wait_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, numel: int, itemsize: int, world: int) -> None:
        factor = 2 if kind == "all_reduce" else 1
        sent = factor * numel * (world - 1) // world
        with self._lock:
            self.elements[kind] = self.elements.get(kind, 0) + sent
            self.nbytes[kind] = self.nbytes.get(kind, 0) + sent * itemsize

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.nbytes)


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    def read(name: str, default: int) -> int:
        value = os.environ.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"${name}={value!r} is not an integer; launch with torchrun, "
                              f"which sets it") from None
    return read("RANK", 0), read("WORLD_SIZE", 1), read("LOCAL_RANK", 0)


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank of `group` when `flag` is True on any: one MAX all-reduce, on
    `device` (NCCL reduces device tensors only)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def rank_dir(directory: str, rank: int) -> str:
    """Rank `rank`'s own subdirectory of a swap directory shared by the job's ranks."""
    return os.path.join(directory, f"rank{rank:05d}")


def ensure_process_group(device: torch.device, timeout_s: float | None = None) -> bool:
    """Use the default process group when one is initialised, or initialise it from torchrun's
    environment (NCCL on CUDA, gloo on the CPU) when WORLD_SIZE > 1, with `timeout_s` (default:
    dist_timeouts()). True when there is one. On CUDA `device` becomes this thread's current
    device first (review 2 P8: torch puts object collectives on the current device)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        return True
    _, world, _ = env_world()
    if world <= 1:
        return False
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    timeout_s = dist_timeouts()[0] if timeout_s is None else timeout_s
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return True


# torch >= 2.12 spells these *_single (the old names warn); older torch has only the old ones
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ZeroGroup:
    """One rank's view of the data-parallel group: its shards and the collectives of an update."""

    def __init__(self, stage: int, device: torch.device, group=None):
        if stage not in STAGES:
            raise ConfigError(f"zero_stage: must be one of {STAGES}, got {stage!r}")
        self.stage = stage
        self.device = device
        self.group = group
        # NCCL reduces device tensors only; gradients that land in host memory (offload cpu /
        # nvme on a GPU) are reduced by a gloo group over the same ranks instead. Reducing on
        # the device before they leave it (DeepSpeed's order) is the faster design, not built.
        self.host_group = (dist.new_group(ranks=list(range(dist.get_world_size(group))),
                                          backend="gloo")
                           if dist.get_backend(group) == "nccl" else None)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.long_group = long_work_group() if group is None else None
        self.comm = CommCounter()
        # what stage 3's weight gathers are counted as: set by the engine at each forward, so
        # an evaluation's gathers ("all_gather_eval") are not an update's communication
        self.fetch_kind = "all_gather_fetch"

    # -- layout -----------------------------------------------------------------------------
    def shards(self, numel: int) -> Shards:
        return Shards(numel, self.world)

    def owned(self, numel: int) -> tuple[int, int]:
        """[lo, hi) of a block of `numel` elements that this rank steps and keeps state for:
        its shard from stage 1 on, the whole block at stage 0."""
        return self.shards(numel).range(self.rank) if self.stage >= 1 else (0, numel)

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Rank 0's values of `tensor` into every rank's, in place (initial weights: replicas
        must start equal, whatever each process's seed made)."""
        on = tensor if tensor.device == self.device else tensor.to(self.device)
        dist.broadcast(on, src=0, group=self.group)
        if on is not tensor:
            tensor.copy_(on)

    # -- gradients --------------------------------------------------------------------------
    def agree_missing(self, names: list[str], missing: dict[int, set[str]],
                      block_of: dict[str, int]) -> dict[int, set[str]]:
        """Slots without a gradient on *every* rank (a slot another rank used has a reduced
        gradient here too, and must be stepped); one small all-reduce (MIN)."""
        local = {n for s in missing.values() for n in s}
        flags = torch.tensor([1 if n in local else 0 for n in names], dtype=torch.int32,
                             device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        out: dict[int, set[str]] = {}
        for n, f in zip(names, flags.tolist()):
            if f:
                out.setdefault(block_of[n], set()).add(n)
        return out

    def reduce_scatter_async(self, out: torch.Tensor, whole: torch.Tensor):
        """Start summing `whole` (a padded block buffer) over ranks into `out` (this rank's
        [S] part); returns the work to wait() for (stage 2's landing, offload/zero/grads.py)."""
        self.comm.add("reduce_scatter", whole.numel(), whole.element_size(), self.world)
        return _reduce_scatter(out, whole, group=self.group_for(whole), async_op=True)

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.comm.wait_s += time.perf_counter() - t0

    def global_norm(self, owned: list[torch.Tensor], losses_finite: bool) -> torch.Tensor:
        """The L2 norm of the whole averaged gradient (fp32 0-d), inf when a loss on any rank
        was not: each rank sums the squares of its shards (`owned`: this rank's [lo, hi) of
        each block's averaged gradient) in fp64, one all-reduce adds them."""
        pair = torch.zeros(2, dtype=torch.float64, device=self.device)
        for grad in owned:  # a chunk at a time: vector_norm(dtype=) casts its whole input first
            for i in range(0, grad.numel(), NORM_CHUNK_ELEMS):  # (review 2 P12: 8 GB at 8B)
                part = grad[i:i + NORM_CHUNK_ELEMS]
                pair[0] += torch.linalg.vector_norm(part, dtype=torch.float64).to(self.device) ** 2
        pair[1] = 0.0 if losses_finite else 1.0
        dist.all_reduce(pair, group=self.group)
        total = pair.cpu()  # the host needs it now (the clip coefficient): one small sync
        if total[1] > 0:
            return torch.tensor(float("inf"), dtype=torch.float32)
        return total[0].sqrt().to(torch.float32)

    # -- weights ----------------------------------------------------------------------------
    def gather_weights(self, flats: list[torch.Tensor], order: list[int]) -> float:
        """Stages 1-3: every rank's updated shard of each resident block to every rank (in
        place: the input is this rank's part of the padded flat buffer). Seconds waited."""
        t0 = time.perf_counter()
        works = []
        for bi in order:
            flat = flats[bi]
            if flat is None:  # stage 3: a streamed block, gathered when it is fetched
                continue
            size = flat.numel() // self.world
            mine = flat[self.rank * size:(self.rank + 1) * size]
            works.append(_all_gather(flat, mine, group=self.group, async_op=True))
            self.comm.add("all_gather", flat.numel(), flat.element_size(), self.world)
        for work in works:
            work.wait()
        waited = time.perf_counter() - t0
        self.comm.wait_s += waited
        return waited

    def gather_full(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """A block's full tensor from every rank's shard of it (for reading state: exports,
        checkpoints, tests); every rank must call it. Stage 0: the shard is the whole."""
        if self.stage == 0:
            return shard
        sh = self.shards(numel)
        mine = torch.zeros(sh.size, dtype=shard.dtype, device=self.device)
        mine[:shard.numel()].copy_(shard)
        full = torch.empty(sh.padded, dtype=shard.dtype, device=self.device)
        _all_gather(full, mine, group=self.group)
        return full[:numel].to(shard.device)

    def group_for(self, t: torch.Tensor):
        """The process group that can reduce `t` where it lies (see host_group)."""
        return self.host_group if t.device.type == "cpu" and self.host_group is not None \
            else self.group

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any (a failure every rank must act on)."""
        return any_rank(flag, self.device, self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def long_barrier(self) -> None:
        """A barrier where the ranks wait while one of them works alone (rank 0 writing a
        stage-0 checkpoint, its fsync): the long timeout, not the default group's (review 2 P3)."""
        dist.barrier(group=self.long_group or self.group)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's small picklable `obj`, in rank order, on every rank (checkpoint records).
        On a CPU-capable group: NCCL would pickle through device tensors."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.host_group or self.group)
        return out


class InOrder:
    """Runs `issue(block, complete)` for blocks as they complete, but only in `order` (the same
    on every rank): a block that completes early waits for the ones before it, so collectives
    pair up across ranks whatever order each rank's blocks happened to finish in. `complete`
    says the block's gradients all landed on this rank (False for a block issued by flush())."""

    def __init__(self, order: list[int], issue):
        self.order, self.issue = order, issue
        self.done: set[int] = set()
        self.cursor = 0  # order[:cursor] issued

    def complete(self, bi: int) -> None:
        self.done.add(bi)
        while self.cursor < len(self.order) and self.order[self.cursor] in self.done:
            self.issue(self.order[self.cursor], True)
            self.cursor += 1

    def flush(self) -> None:
        """Issue every block not issued yet, in order, and start over."""
        for bi in self.order[self.cursor:]:
            self.issue(bi, bi in self.done)
        self.done.clear()
        self.cursor = 0


class Reductions:
    """What the step paths see of a rank's gradient reductions (BlockReducer, and stage 2's
    ShardedLanding in offload/zero/grads.py). Reductions complete in the order they were issued
    (the step order, the same on every rank); `complete_through(bi)` returns once block bi's
    averaged gradient is final for this window, from any thread; `on_issued(bi)` -- set by the
    overlapped step for the window's last backward -- is told of each block issued whose
    gradients all landed on this rank, so that its step can be queued behind its reduction.

    Who waits: the thread that lands gradients only to bound the buffers in flight (stage 2);
    the step thread (overlapped: each job waits for its own block's reduction, so backward does
    not); the main thread at the step for the rest. They take turns per reduction (`_lock`):
    one completes and is folded into its block at a time, oldest first, so two micro-batches'
    sums of one block are never added at once and the landing thread waits at most for one."""

    def __init__(self, zero: ZeroGroup):
        self.zero = zero
        self.works: deque = deque()  # (block, output, work, ...) in issue order
        self.final: set[int] = set()  # blocks whose averaged gradient is final this window
        self.on_issued = None  # Callable[[int], None] | None
        self._lock = threading.Lock()

    def _finalize(self, item) -> None:
        """One completed reduction folded into its block's gradient (the subclass's layout)."""
        raise NotImplementedError

    def _complete_oldest(self) -> None:
        """The oldest reduction waited for and folded in; the caller holds `_lock`."""
        item = self.works.popleft()
        item[2].wait()
        self._finalize(item)

    def complete_through(self, bi: int) -> None:
        """Wait until block bi's averaged gradient is final (its last reduction folded in)."""
        while True:
            with self._lock:
                if bi in self.final:
                    return
                assert self.works, f"block {bi}: no reduction pending and none final"
                self._complete_oldest()

    def new_window(self) -> None:
        """Before an accumulation window's first backward (the last window's step jobs, which
        read `final`, were joined at its step)."""
        self.final.clear()

    def complete_all(self) -> None:
        with self._lock:
            while self.works:
                self._complete_oldest()

    def _issued(self, bi: int, complete: bool) -> None:
        on_issued = self.on_issued  # read once: the main thread clears it when backward ends
        if complete and on_issued is not None:
            on_issued(bi)


class BlockReducer(Reductions):
    """Stages 0-1: each block's gradient is averaged across ranks once it is final -- started
    during the window's last backward as each block completes (gloo and NCCL run it on their
    own threads/streams while backward goes on), the rest at the step. All-reduced whole at
    stage 0; at stage 1 reduce-scattered, and this rank's part of the buffer receives the mean
    of its shard (the rest of the buffer is not read)."""

    def __init__(self, zero: ZeroGroup, buffer, numels: list[int], order: list[int]):
        super().__init__(zero)
        self.buffer, self.numels = buffer, numels
        self.blocks = InOrder(order, self._issue)
        self._flushed = False

    def complete(self, bi: int) -> None:
        """Block bi's gradients are final (any thread that lands gradients)."""
        self.blocks.complete(bi)

    def _issue(self, bi: int, complete: bool) -> None:
        z, buf = self.zero, self.buffer(bi)
        sh = z.shards(self.numels[bi])
        assert buf.numel() == sh.padded, (buf.numel(), sh.padded)
        # appended without the lock (deque appends and pops are atomic): a consumer waiting
        # for an older reduction must not hold up backward's next issue
        if z.stage == 0:
            z.comm.add("all_reduce", sh.padded, buf.element_size(), z.world)
            self.works.append((bi, None, dist.all_reduce(buf, group=z.group_for(buf),
                                                         async_op=True)))
        else:
            out = torch.empty(sh.size, dtype=buf.dtype, device=buf.device)
            self.works.append((bi, out, z.reduce_scatter_async(out, buf)))
        self._issued(bi, complete)

    def _finalize(self, item) -> None:
        bi, out, _ = item
        buf = self.buffer(bi)
        if out is None:
            buf.div_(self.zero.world)  # the mean over ranks: each rank's loss is its batch's mean
        else:
            lo = self.zero.rank * out.numel()
            buf[lo:lo + out.numel()].copy_(out).div_(self.zero.world)
        self.final.add(bi)

    def issue_rest(self) -> None:
        """At the step, before any other collective: the blocks not started during backward, in
        order. A block with a slot this rank gave no gradient never completes here, so its
        reduction and every later one wait for this; a rank that used the slot issued them all
        in backward. Any collective issued first (the missing-gradient agreement) would pair
        with another rank's block reduction (review 2 P6)."""
        self.blocks.flush()
        self._flushed = True

    def finish(self) -> float:
        """At the step (every gradient final, untouched slots zeroed): the blocks not started
        yet, in order (unless issue_rest() did); then wait for all and turn sums into means.
        Seconds waited."""
        t0 = time.perf_counter()
        if not self._flushed:
            self.blocks.flush()
        self._flushed = False
        self.complete_all()
        waited = time.perf_counter() - t0
        self.zero.comm.wait_s += waited
        return waited


class ShardGather:
    """Stage 3: a streamed block's 16-bit weights live as this rank's shard only (its home, in
    the tier offload_params names); the block streamer (offload/stream/streamer.py) puts the shard in
    its part of a slot and calls gather() to fill the rest from the other ranks, just before
    the block runs in forward and again in backward, and drops the slot after. The gathers run
    on the streamer's stage thread, on a process group of their own: a group's collectives must
    be issued in one order, and the main thread issues the gradient collectives meanwhile."""

    def __init__(self, zero: ZeroGroup):
        self.zero, self.world, self.rank = zero, zero.world, zero.rank
        self.group = dist.new_group(ranks=list(range(zero.world)))  # every rank calls it, once
        self._homes_written = None  # CUDA event: the last queued write of a device home

    def homes_written(self, device: torch.device) -> None:
        """The calling thread's current stream has queued writes of this rank's shards on the
        device (the step's kernels, its uploads joined, a loaded state): every later fetch's copy
        out of a home waits for them (review 2 P2: the copy stream is otherwise ordered only
        after the slot's last reader, so it could spread a half-updated shard to every rank).
        One event per step; nothing on the CPU."""
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._homes_written = event

    def after_home_writes(self, stream) -> None:
        """Order `stream` (the streamer's copy stream) after the last homes_written()."""
        event = self._homes_written  # read once: the main thread replaces it at each step
        if event is not None:
            stream.wait_event(event)

    def padded(self, numel: int) -> int:
        return self.zero.shards(numel).padded

    def part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a padded block buffer."""
        size = whole.numel() // self.world
        return whole[self.rank * size:(self.rank + 1) * size]

    def gather(self, whole: torch.Tensor) -> None:
        """Every rank's part into `whole`, in place (this rank's part is already there); the
        main thread's wait for it is the streamer's own wait time."""
        _all_gather(whole, self.part(whole), group=self.group)
        self.zero.comm.add(self.zero.fetch_kind, whole.numel(), whole.element_size(), self.world)
