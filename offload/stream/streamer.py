"""Block streamer: run a model whose blocks do not all fit on the device.

Any model whose transformer layers sit in one `nn.ModuleList` can be streamed. Each block has an
explicit *residency*:

  device  its weights live on the device for the whole run (one flat buffer, bound once);
  cpu     its weights live in host RAM (pinned when CUDA is present) and are copied into a
          device slot before the block runs;
  nvme    its weights are read from the checkpoint's own safetensors shards (O_DIRECT where
          the layout allows) into a slot, or into pinned staging and then a slot on CUDA.

A few fixed device *slots*, sized for the largest streamed block, are allocated once; a streamed
block is one flat buffer, so bringing it in is one large copy (or one read per contiguous run of
the file) and binding it is making its parameters views into the slot (`offload.memory.blocks`).

The mechanism is explicit so training can reuse it with its own order (forward, then backward
in reverse, recompute): `fetch(i)` starts bringing block i in, `wait(i)` makes it usable by the
compute stream and binds its parameters, `reuse(i)` uses a bound block again, `release(i)` gives
its slot back, `prefetch(after=i)` fetches the next blocks of the `schedule` within the per-tier
depth. Each call moves the block along `BlockState`'s legal edges or raises. `attach()` installs
forward hooks calling them in the usual order (fetch, prefetch, wait / run / release); the
schedule is cyclic by default, so one forward's last block prefetches the next step's first.
Layouts come from offload/memory/layout.py, slots from offload/stream/slots.py, the schedule from
offload/stream/schedule.py, the counters from offload/stream/stats.py.

Ordering on CUDA (not yet verified on a GPU; the CPU path runs the same state machine):
  * every copy into a slot is issued on one side `copy_stream`;
  * before overwriting a slot the copy stream waits on the slot's `free` event, recorded on the
    compute stream when the previous owner was released, so kernels still reading the old block
    finish first -- a GPU-side wait, the host never blocks on it;
  * `wait(i)` makes the compute stream wait on the slot's `ready` event, recorded after the copy
    -- again GPU-side; the host only waits for the stage thread to have *issued* the copy;
  * pinned staging is reused only after its previous host->device copy is done: the stage thread
    synchronises on that staging buffer's own `done` event (one event, never the whole device).
No call here synchronises the device or a whole stream.

On a CPU device, the device *is* host RAM: cpu-tier blocks are bound in place (no copy) unless
`zero_copy_host=False` (the tests use that to exercise the slot path the GPU uses), and NVMe
blocks whose stored dtype equals the compute dtype are read straight into the slot.

A `fetch_delay_s` in every fetch (a stage-thread sleep, plus a GPU sleep on the copy stream under
CUDA) makes a missing wait show up as wrong output in tests.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn

from nvme.io import ALIGN, IOEngine, aligned_empty
from offload.memory.layout import RangeCheck, Run, StreamError, TensorRange, layout_block, verify_ranges
from offload.memory.blocks import Block, bind_views
from offload.gpu import on_stream, side_stream_delay
from offload.stream.schedule import Schedule
from offload.stream.stats import RESIDENCIES, Residency, StreamStats
from offload.stream.slots import (LEGAL_MOVES, BlockState, Slot, SlotPool, Staging, byte_view,
                                  slot_raw_bytes)
from offload.memory.tiers import freeze_pin_cap, host_aligned, large_frees_to_os, started_worker

if TYPE_CHECKING:
    from offload.zero.group import ShardGather


@dataclass(frozen=True)
class TrainingHomes:
    """What a training client (offload/stream/train.py, frozen.py) owns of its blocks' homes.

    host_flats: per block, a cpu-tier flat host buffer (compute dtype, parameters in module
    order) the client keeps: the training engine writes updated weights straight into it.
    expected_crc32: block index -> the CRC-32 its stored bytes must have (or None), checked on
    every read of a block stored as one run (training's swap files: they change every update).
    shards: ZeRO stage 3: each home holds only this rank's shard (in `host_flats`, or on the
    nvme tier the swap file in `shard_files`); a fetch puts it in its part of the slot and
    all-gathers the rest from the other ranks on the stage thread, so the gather of the next
    block overlaps the compute of this one. frozen_only: stream only the parameters needing no
    gradient (a LoRA base)."""
    host_flats: Sequence[torch.Tensor | None] | None = None
    expected_crc32: Callable[[int], int | None] | None = None
    shards: "ShardGather | None" = None
    shard_files: Sequence[TensorRange | None] | None = None
    frozen_only: bool = False


class BlockStreamer:
    """Residency, slots, fetch/wait/release and a prefetch schedule for the blocks of `layers`.

    layers: the model's ModuleList of blocks. residency: one of RESIDENCIES per block.
    files: per block, where each of its parameters is stored (required for nvme blocks; for the
    others, when given, weights are read from there, else taken from the module's parameters).
    host_ahead / nvme_ahead: how many streamed blocks ahead of the running one may be in flight.
    io: the IO engine to read with (when None, one of its own). progress(i): block i is loaded.
    homes: what a training client owns of the blocks' homes (TrainingHomes). skip: name prefixes
    placed elsewhere (an MoE layer's experts: offload/stream/experts.py); `files` omit them."""

    def __init__(self, layers: nn.ModuleList, residency: Sequence[Residency], *,
                 device: torch.device | str, dtype: torch.dtype,
                 files: Sequence[Sequence[TensorRange] | None] | None = None,
                 host_ahead: int = 1, nvme_ahead: int = 2, pin: bool = True,
                 zero_copy_host: bool | None = None, fetch_delay_s: float = 0.0,
                 io: IOEngine | None = None, progress: Callable[[int], None] | None = None,
                 homes: TrainingHomes = TrainingHomes(), skip: tuple[str, ...] = ()):
        self.layers, self.device, self.dtype = layers, torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        if len(residency) != len(layers):
            raise StreamError(f"residency lists {len(residency)} blocks, the model has {len(layers)}")
        bad = sorted({r for r in residency if r not in RESIDENCIES})
        if bad:
            raise StreamError(f"unknown residency {bad}; use one of {RESIDENCIES}")
        if host_ahead < 1 or nvme_ahead < 1:
            raise StreamError("host_ahead and nvme_ahead must be >= 1")
        self.residency = list(residency)
        self.depth = {"cpu": host_ahead, "nvme": nvme_ahead}
        self.zero_copy_host = (not self.cuda) if zero_copy_host is None else zero_copy_host
        if self.cuda and self.zero_copy_host:
            raise StreamError("zero_copy_host is only possible when the device is the CPU")
        if homes.shards is not None and any(r == "device" for r in residency):
            raise StreamError("sharded blocks (ZeRO stage 3) stream from the cpu or nvme tier")
        self.fetch_delay_s, self.skip = fetch_delay_s, tuple(skip)
        self.homes, self.shards = homes, homes.shards
        self.pin = pin and self.cuda
        if self.pin:
            freeze_pin_cap()  # before the first pinned buffer: see offload/memory/tiers.py
        self.stats = StreamStats()
        self._files = list(files) if files is not None else [None] * len(layers)
        self._adopt = list(homes.host_flats) if homes.host_flats is not None else [None] * len(layers)
        self._io, self._own_io = (io, False) if io is not None else (None, True)
        self._lock = threading.Lock()  # guards stats updated by the stage thread
        self.state: list[BlockState] = []
        self.blocks: list[Block] = []
        self._stored_dtype: list[torch.dtype | None] = []
        self._runs: list[list[Run]] = []
        self._checks: list[list[RangeCheck]] = []  # per block: tensors whose files carry a CRC
        self._shift: list[int] = []  # byte shift that lines a buffer up with the first run
        self._host: dict[int, torch.Tensor] = {}  # cpu-tier flat buffers (compute dtype)
        self._resident: dict[int, torch.Tensor] = {}  # device-tier flat buffers
        self._host_values: dict[int, dict[str, torch.Tensor]] = {}  # module-sourced weights
        self._jobs: dict[int, tuple[Future, Slot]] = {}
        self._bound: dict[int, torch.Tensor] = {}  # block -> the slot view it is bound to
        self._hooks: list = []
        self.schedule = Schedule(len(layers))
        self._empty = torch.empty(0, dtype=dtype, device=self.device)  # what unbound params point at
        for i, layer in enumerate(layers):
            self._layout(i, layer)
        self._allocate_streaming()
        smallest = min(self.block_bytes(i) for i in range(len(layers))) if len(layers) else None
        with large_frees_to_os(smallest):  # block-sized temporaries must not pile up in arenas
            for i in range(len(layers)):
                self._load_resident(i)
                if progress is not None:
                    progress(i)

    # ---- setup ------------------------------------------------------------------------------
    @property
    def io(self) -> IOEngine:
        if self._io is None:
            self._io = IOEngine()
        return self._io

    def _layout(self, i: int, layer: nn.Module) -> None:
        """Block i's flat layout (offload/memory/layout.py) and its starting state. A sharded
        block's layout is the module's (its source is this rank's shard, never the whole block's
        parameters); on the nvme tier its one run is the shard's swap file."""
        if self.shards is not None:
            out = layout_block(i, layer, None, residency="cpu", adopted=True, device=self.device,
                               dtype=self.dtype, empty=self._empty)
            if self.residency[i] == "nvme":
                f = self.homes.shard_files[i]
                out.stored_dtype, out.runs = f.dtype, [Run(f.path, f.offset, f.nbytes, 0)]
        else:
            out = layout_block(i, layer, self._files[i], residency=self.residency[i],
                               adopted=self._adopt[i] is not None, device=self.device,
                               dtype=self.dtype, empty=self._empty,
                               frozen_only=self.homes.frozen_only, skip=self.skip)
        if out.host_values is not None:
            self._host_values[i] = out.host_values
        self._stored_dtype.append(out.stored_dtype)
        self._runs.append(out.runs)
        self._checks.append(out.checks)
        self._shift.append(out.shift)
        self.blocks.append(out.block)
        self.state.append(BlockState.ABSENT)

    def _move(self, i: int, to: BlockState) -> None:
        """The one place a block changes state; an illegal move is a bug in the caller."""
        if (self.state[i], to) not in LEGAL_MOVES:
            legal = ", ".join(sorted(f"{a.value} -> {b.value}" for a, b in LEGAL_MOVES))
            raise StreamError(f"block {i}: illegal move {self.state[i].value} -> {to.value} "
                              f"(legal: {legal})")
        self.state[i] = to

    @property
    def slots(self) -> list[Slot]:
        return self.pool.slots

    def bound_flat(self, i: int) -> torch.Tensor:
        """The flat slot view block i's parameters are bound to right now (state in_use)."""
        if i not in self._bound:
            raise StreamError(f"block {i} is not bound to a slot (state {self.state[i].value}); "
                              f"wait({i}) first")
        return self._bound[i]

    def slot_owner(self, storage_ptr: int) -> int | None:
        """The block whose slot has this storage (untyped_storage().data_ptr()), if any."""
        return self.pool.owner_of(storage_ptr)

    def host_buffer(self, i: int) -> torch.Tensor:
        """The flat host copy (compute dtype) a cpu-tier block is fetched from; writing into it
        changes what the next fetch brings (nothing may be in flight: see release_all)."""
        if i not in self._host:
            raise StreamError(f"block {i} has no host buffer (residency {self.residency[i]})")
        return self._host[i]

    def block_bytes(self, i: int) -> int:
        """Bytes of block i in the compute dtype (what a slot holds)."""
        return self.blocks[i].numel * self.dtype.itemsize

    def _slot_block_bytes(self, i: int) -> int:
        """What a slot must hold for block i: the block, or its padded length when the slot
        receives an all-gather of equal shards."""
        if self.shards is None:
            return self.block_bytes(i)
        return self.shards.padded(self.blocks[i].numel) * self.dtype.itemsize

    def _streamed(self, i: int) -> bool:
        tier = self.residency[i]
        return tier == "nvme" or (tier == "cpu" and not self.zero_copy_host)

    def _direct_into_slot(self, i: int) -> bool:
        return not self.cuda and self._stored_dtype[i] == self.dtype

    def _allocate_streaming(self) -> None:
        """Slots and staging, allocated once for the whole run (no per-fetch allocation)."""
        streamed = [i for i in range(len(self.layers)) if self._streamed(i)]
        self.pool = SlotPool([], self.cuda)
        self.staging: list[Staging] = []
        self._landing: torch.Tensor | None = None
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda and streamed else None
        if not streamed:
            return
        tiers = {self.residency[i] for i in streamed}
        n_slots = 1 + max(self.depth[t] for t in tiers)
        slot_bytes = slot_raw_bytes(max(self._slot_block_bytes(i) for i in streamed), self.cuda)
        self.pool = SlotPool.allocate(n_slots, slot_bytes, self.device, self.copy_stream)
        staged = [i for i in streamed if self.residency[i] == "nvme" and not self._direct_into_slot(i)]
        if staged:
            stored_bytes = max(self._stored_bytes(i) for i in staged)
            for _ in range(self.depth["nvme"]):
                # +ALIGN: room to line the buffer up with the file offset, so reads are O_DIRECT
                # straight into it (pinned and capped under CUDA: offload/memory/tiers.py)
                self.staging.append(Staging(host_aligned(stored_bytes + ALIGN, self.pin), self.cuda))
            if self.cuda and any(self._stored_dtype[i] != self.dtype for i in staged):
                # Bytes land here in the stored dtype, then are converted into the slot on the
                # copy stream; the stream's own order protects it between fetches.
                self._landing = torch.empty(stored_bytes, dtype=torch.uint8, device=self.device)
                self._landing.record_stream(self.copy_stream)  # as the slots (review M3)
        self._staging_next = 0
        self._executor = started_worker("offload-fetch", self.device)

    def _stored_bytes(self, i: int) -> int:
        dt = self._stored_dtype[i] or self.dtype
        return self.blocks[i].numel * dt.itemsize

    def _read_runs(self, i: int, dst: torch.Tensor) -> None:
        """Read block i's stored bytes into `dst` (uint8, contiguous CPU) with the IO engine;
        verified against `expected_crc32` when given (the CRC is taken by the IO threads as the
        bytes arrive: no second pass)."""
        runs = self._runs[i]
        crc32 = self.homes.expected_crc32
        want = crc32(i) if crc32 is not None and len(runs) == 1 else None
        handles = [self.io.submit_read(r.path, r.offset, dst[r.buf_offset:r.buf_offset + r.nbytes],
                                       checksum=want is not None)
                   for r in runs]
        IOEngine.wait_all(handles)
        verify_ranges(i, self._checks[i], dst)
        if want is not None and handles[0].crc32 != want:
            r = runs[0]
            raise StreamError(f"checksum mismatch in streamed weights of block {i}: {r.path}, "
                              f"{r.nbytes} bytes at offset {r.offset}: recorded crc32 {want:08x}, "
                              f"read back {handles[0].crc32:08x}; the file is corrupt")

    def _fill_host(self, i: int, flat: torch.Tensor) -> None:
        """Fill a CPU flat buffer (compute dtype) with block i's weights from its source."""
        if self._runs[i]:
            if self._stored_dtype[i] == self.dtype:
                self._read_runs(i, flat.view(torch.uint8))
            else:
                tmp = aligned_empty(self._stored_bytes(i) + ALIGN)
                raw = byte_view(tmp, self._shift[i], self._stored_bytes(i))
                self._read_runs(i, raw)
                flat.copy_(raw.view(self._stored_dtype[i]))  # converts to the compute dtype
        else:
            values = self._host_values.pop(i)
            block = self.blocks[i]
            for s in block.slots:
                flat[s.offset:s.offset + s.numel].copy_(values[s.name].reshape(-1))

    def _load_resident(self, i: int) -> None:
        tier, nbytes = self.residency[i], self.block_bytes(i)
        if tier == "nvme":
            self._unbind(i)
            return
        if self._adopt[i] is not None:
            flat = self._adopt[i]
            want = (self.blocks[i].numel if self.shards is None else
                    self.shards.padded(self.blocks[i].numel) // self.shards.world)
            if tier != "cpu" or flat.numel() != want or flat.dtype != self.dtype:
                raise StreamError(f"block {i}: an adopted host buffer must be a cpu-tier block's "
                                  f"{want} values in {self.dtype}")
        elif tier == "device" and self.cuda:
            host = aligned_empty(nbytes + ALIGN)
            host_flat = byte_view(host, self._shift[i], nbytes).view(self.dtype)
            self._fill_host(i, host_flat)
            flat = torch.empty(self.blocks[i].numel, dtype=self.dtype, device=self.device)
            flat.copy_(host_flat)  # setup only: a plain blocking copy is fine here
            del host
        elif self.cuda:  # the cpu tier under CUDA: pinned (capped), exactly the block's bytes
            # (no +ALIGN shift: under the allocator's power-of-two rounding it could double the
            # block; the one load reads through the IO engine's bounce buffer instead)
            flat = host_aligned(nbytes, self.pin).view(self.dtype)
            self._fill_host(i, flat)
        else:  # host memory on a CPU device, lined up with the file for O_DIRECT reads
            raw = aligned_empty(nbytes + ALIGN)
            flat = byte_view(raw, self._shift[i], nbytes).view(self.dtype)
            self._fill_host(i, flat)
        if tier == "cpu" and not self.zero_copy_host:
            self._host[i] = flat
            self._unbind(i)
            return
        self._resident[i] = flat
        bind_views(self.blocks[i], flat)
        self._move(i, BlockState.RESIDENT)

    def _unbind(self, i: int) -> None:
        """Point block i's parameters at an empty tensor, so a use without wait() fails loudly."""
        for s in self.blocks[i].slots:
            s.param.data = self._empty

    # ---- the mechanism ------------------------------------------------------------------------
    def fetch(self, i: int) -> None:
        """Start bringing block i into a slot. A block already there (resident, in use) or on
        its way is left as it is: the hooks fetch the block they run and prefetch the next."""
        if self.state[i] is not BlockState.ABSENT:
            return
        slot = self._take_slot(i)
        staging = None
        if self.residency[i] == "nvme" and not self._direct_into_slot(i):
            staging = self.staging[self._staging_next]
            self._staging_next = (self._staging_next + 1) % len(self.staging)
        # The free event is read here, on the thread that recorded it, and handed over.
        wait_free = slot.free if slot.free_recorded else None
        fut = self._executor.submit(self._job, i, slot, staging, wait_free)
        self._jobs[i] = (fut, slot)
        self._move(i, BlockState.IN_FLIGHT)

    def _slot_view(self, i: int, slot: Slot, nbytes: int | None = None) -> torch.Tensor:
        """Block i's view of `slot` (`nbytes`: a longer one, the padded block of stage 3)."""
        shift = 0 if self.cuda else self._shift[i]
        return byte_view(slot.raw, shift, nbytes or self.block_bytes(i)).view(self.dtype)

    def _job(self, i: int, slot: Slot, staging: Staging | None, wait_free) -> None:
        """Stage thread: move block i's bytes into its slot (see the module docstring for order)."""
        t0 = time.perf_counter()
        if self.fetch_delay_s:
            time.sleep(self.fetch_delay_s)
        dst = self._slot_view(i, slot)
        tier, moved = self.residency[i], {}
        if self.shards is not None:  # this rank's shard into its part, the rest from its peers
            whole = self._slot_view(i, slot, self._slot_block_bytes(i))
            part = self.shards.part(whole)
            if tier == "nvme":  # the shard's swap file, into host staging on a GPU
                src = (byte_view(staging.raw, 0, part.numel() * self.dtype.itemsize)
                       if self.cuda else part.view(torch.uint8))
                if self.cuda and staging.done_recorded:
                    staging.done.synchronize()  # its previous copy to the device has left it
                self._read_runs(i, src)
                src = src.view(self.dtype)
                moved["disk"] = part.numel() * self.dtype.itemsize
            else:
                src = self._host[i]
                moved["h2d"] = part.numel() * self.dtype.itemsize
            if self.cuda:
                with torch.cuda.device(self.device), on_stream(self.copy_stream):
                    if wait_free is not None:  # the slot's previous owner's kernels first
                        self.copy_stream.wait_event(wait_free)
                    self.shards.after_home_writes(self.copy_stream)  # the step's (review 2 P2)
                    part.copy_(src, non_blocking=True)
                    if staging is not None:
                        staging.done.record(self.copy_stream)
                        staging.done_recorded = True
                    self.shards.gather(whole)  # NCCL orders itself after the copy stream
                    slot.ready.record(self.copy_stream)
            else:
                if tier != "nvme":  # (an nvme shard was read straight into its part)
                    part.copy_(src)
                self.shards.gather(whole)
        elif self.cuda:
            with torch.cuda.device(self.device):
                self._job_cuda(i, slot, staging, wait_free, dst, moved)
        elif tier == "cpu":
            dst.copy_(self._host[i])
            moved["h2d"] = self.block_bytes(i)
        elif staging is None:  # CPU, same dtype: straight from the file into the slot
            self._read_runs(i, dst.view(torch.uint8))
            moved["disk"] = self._stored_bytes(i)
        else:  # CPU, other dtype: read, then convert into the slot
            raw = byte_view(staging.raw, self._shift[i], self._stored_bytes(i))
            self._read_runs(i, raw)
            dst.copy_(raw.view(self._stored_dtype[i]))
            moved["disk"] = self._stored_bytes(i)
        with self._lock:
            for k, v in moved.items():
                self.stats.moved_bytes[k] += v
            self.stats.fetches[tier] += 1
            self.stats.stage_busy_s += time.perf_counter() - t0

    def _job_cuda(self, i: int, slot: Slot, staging: Staging | None, wait_free,
                  dst: torch.Tensor, moved: dict[str, int]) -> None:
        if staging is not None:
            if staging.done_recorded:
                # The previous host->device copy out of this staging buffer must be finished
                # before the disk overwrites it: wait on that one event only (no device sync).
                staging.done.synchronize()
            raw = byte_view(staging.raw, self._shift[i], self._stored_bytes(i))
            self._read_runs(i, raw)
            moved["disk"] = self._stored_bytes(i)
        with on_stream(self.copy_stream):
            if wait_free is not None:
                # Kernels of the slot's previous owner may still be queued on the compute
                # stream; the copy stream (not the host) waits for them.
                self.copy_stream.wait_event(wait_free)
            if self.fetch_delay_s and hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(int(self.fetch_delay_s * 1e9))  # ~1 GHz cycles: a late copy
            side_stream_delay(self.copy_stream)  # the kit's knob (offload/gpu.py)
            if staging is None:  # cpu tier: pinned host buffer -> slot, one copy
                dst.copy_(self._host[i], non_blocking=True)
            elif self._stored_dtype[i] == self.dtype:
                dst.copy_(raw.view(self.dtype), non_blocking=True)
            else:
                land = self._landing[:raw.numel()]
                land.copy_(raw, non_blocking=True)
                dst.copy_(land.view(self._stored_dtype[i]))  # converts on the device
            if staging is not None:
                staging.done.record(self.copy_stream)
                staging.done_recorded = True
            slot.ready.record(self.copy_stream)
        moved["h2d"] = self.block_bytes(i) if staging is None else self._stored_bytes(i)

    def wait(self, i: int) -> None:
        """Make block i usable by the compute stream and bind its parameters (fetching it first
        if nobody did). A block in use already is an error: use it again with `reuse`."""
        state = self.state[i]
        if state is BlockState.IN_USE:
            raise StreamError(f"block {i} is in use already (waited on, not released); "
                              f"reuse({i}) uses it again without a fetch")
        self._count_use(i)
        if state is BlockState.RESIDENT:
            return
        self.fetch(i)
        fut, slot = self._jobs.pop(i)
        t0 = time.perf_counter()
        try:
            fut.result()  # the stage thread has moved (CPU) or issued the copy of (CUDA) block i
        except BaseException:  # a failed read (damaged file): the slot goes back, the block is out
            self._move(i, BlockState.ABSENT)
            self.pool.cancel(slot)
            raise
        self.stats.wait_s += time.perf_counter() - t0
        if self.cuda:
            # GPU-side: later kernels on the compute stream start after the copy finished.
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        flat = self._slot_view(i, slot)
        bind_views(self.blocks[i], flat)
        self._bound[i] = flat
        self._move(i, BlockState.IN_USE)

    def reuse(self, i: int) -> None:
        """Block i, in use (kept bound, e.g. the last block between forward and backward), is
        used again at the next position of the schedule: counted and the cursor advanced."""
        if self.state[i] is not BlockState.IN_USE:
            raise StreamError(f"block {i} is {self.state[i].value}, not in use: wait({i}) instead")
        self._count_use(i)

    def in_use(self, i: int) -> bool:
        return self.state[i] is BlockState.IN_USE

    def _count_use(self, i: int) -> None:
        self.stats.served_bytes[self.residency[i]] += self.block_bytes(i)
        self.schedule.advance(i)

    def release(self, i: int) -> None:
        """Block i has been run: its slot may be refilled once the compute queued so far is done.
        A resident block stays (the hooks release every block they ran); releasing a block that
        is not in use is an error."""
        if self.state[i] is BlockState.RESIDENT:
            return
        if self.state[i] is not BlockState.IN_USE:
            raise StreamError(f"block {i} is {self.state[i].value}, not in use: release only "
                              f"a block wait({i}) bound")
        self._move(i, BlockState.ABSENT)
        slot = self.pool.of(i)
        self._unbind(i)
        self._bound.pop(i, None)
        self.pool.release(slot, torch.cuda.current_stream(self.device) if self.cuda else None)

    def _take_slot(self, i: int) -> Slot:
        slot = self.pool.take(i)
        if slot is not None:
            return slot
        # No free slot: block i is needed out of schedule order. Give up the fetched block that
        # is needed last; it is fetched again later.
        waiting = [j for j in self._jobs if j != i]
        if not waiting:
            raise StreamError(f"block {i}: all {len(self.pool)} slots hold blocks in use; "
                              f"release blocks before fetching more")
        victim = max(waiting, key=self.schedule.distance)
        fut, slot = self._jobs.pop(victim)
        fut.result()  # the copy into it is in flight; the copy stream keeps later copies after it
        self._move(victim, BlockState.ABSENT)
        self.pool.cancel(slot)  # the only free slot now: taken at once for block i
        return self.pool.take(i)

    def set_schedule(self, order: Sequence[int], cyclic: bool = True) -> None:
        """The order blocks will be waited on (e.g. forward then reverse for training)."""
        self.schedule.set(order, cyclic)

    def prefetch(self, after: int | None = None) -> None:
        """Fetch the streamed blocks that follow `after` in the schedule (from the start when
        None), the k-th of them only if k <= its tier's depth and a slot is free. Fetches are
        issued in schedule order so slots are always consumed in the order they are needed."""
        count = 0
        for j in self.schedule.following(after):
            if not self._streamed(j):
                continue
            count += 1
            if count > self.depth[self.residency[j]]:
                return
            if self.state[j] is not BlockState.ABSENT:
                continue
            if not self.pool.has_free():
                return
            self.fetch(j)

    # ---- hooks ---------------------------------------------------------------------------------
    def attach(self) -> "BlockStreamer":
        """Forward hooks: before block i runs fetch/prefetch/wait, after it release."""
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._before(i)))
            self._hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: self.release(i)))
        return self

    def _before(self, i: int) -> None:
        self.fetch(i)
        self.prefetch(after=i)  # queue the next ones before blocking on this one
        self.wait(i)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def release_all(self) -> None:
        """Release every block in use and let in-flight fetches finish (after an exception)."""
        for i, st in enumerate(self.state):
            if st is BlockState.IN_USE:
                self.release(i)
        try:
            for i in list(self._jobs):
                fut, slot = self._jobs.pop(i)
                try:
                    fut.result()
                finally:
                    self._move(i, BlockState.ABSENT)
                    self.pool.cancel(slot)
        finally:
            if self.copy_stream is not None:
                # the copies just issued may still be running on the GPU: whatever the compute
                # stream does next with this memory (a new owner after close) comes after them
                torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def close(self) -> None:
        self.detach()
        self.release_all()
        if hasattr(self, "_executor"):
            self._executor.shutdown(wait=True)
        if self._own_io and self._io is not None:
            self._io.close()
            self._io = None

    # ---- reporting -----------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Device memory held by the streamer: resident blocks plus slots (and landing)."""
        total = sum(t.numel() * t.element_size() for t in self._resident.values()) if self.cuda else 0
        total += self.pool.nbytes() if self.cuda else 0
        return total + (self._landing.numel() if self._landing is not None else 0)
