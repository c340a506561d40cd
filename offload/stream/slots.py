"""The block streamer's device slots and host staging buffers (offload/stream/streamer.py moves blocks
through them): the states a block goes through on its way into a slot and out, which block owns
each slot, which slots are free and in what order, and the CUDA events that order a slot's or a
staging buffer's reuse. Allocated once; nothing here allocates per fetch."""

from __future__ import annotations

import enum

import torch

from nvme.io import ALIGN, aligned_empty
from offload.gpu import host_event


class BlockState(enum.Enum):
    """Where a block is. Legal moves (anything else raises StreamError):
    ABSENT -> RESIDENT (loaded for the whole run) | IN_FLIGHT (fetch);
    IN_FLIGHT -> IN_USE (wait) | ABSENT (its slot taken back: eviction, release_all);
    IN_USE -> ABSENT (release)."""
    RESIDENT = "resident"  # on the device (or used in place in host RAM) for the whole run
    ABSENT = "absent"  # nowhere on the device; its parameters point at an empty tensor
    IN_FLIGHT = "in_flight"  # a slot holds it or is being filled with it
    IN_USE = "in_use"  # bound: its parameters are views of its slot


LEGAL_MOVES = {(BlockState.ABSENT, BlockState.RESIDENT), (BlockState.ABSENT, BlockState.IN_FLIGHT),
               (BlockState.IN_FLIGHT, BlockState.IN_USE), (BlockState.IN_FLIGHT, BlockState.ABSENT),
               (BlockState.IN_USE, BlockState.ABSENT)}


def slot_raw_bytes(block_bytes: int, cuda: bool) -> int:
    """One slot's bytes for blocks of up to `block_bytes`: on the CPU +ALIGN, room to line a
    direct read up with the file offset."""
    return block_bytes if cuda else block_bytes + ALIGN


class Slot:
    def __init__(self, raw: torch.Tensor, cuda: bool):
        self.raw = raw  # uint8 on the device, max streamed block bytes (+ALIGN on CPU)
        self.owner: int | None = None
        self.free = torch.cuda.Event() if cuda else None  # compute done with the previous owner
        self.free_recorded = False
        self.ready = torch.cuda.Event() if cuda else None  # copy of the current owner done


class SlotPool:
    """The device slots, allocated once: which block owns each, which are free (in the order
    they were freed), and the events that order a slot's reuse -- `free` recorded on the compute
    stream when its owner is released, `ready` on the copy stream when a new owner has landed."""

    def __init__(self, raws: list[torch.Tensor], cuda: bool):
        self.slots = [Slot(raw, cuda) for raw in raws]
        self._free = list(self.slots)

    @classmethod
    def allocate(cls, count: int, nbytes: int, device: torch.device,
                 copy_stream: "torch.cuda.Stream | None") -> "SlotPool":
        """`count` slots of `nbytes`: device memory written on `copy_stream` under CUDA (None:
        the device is the CPU, and the slots are 4 KiB-aligned host memory)."""
        cuda = copy_stream is not None
        raws = []
        for _ in range(count):
            raw = (torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda
                   else aligned_empty(nbytes))
            if cuda:
                # allocated on the compute stream, written on the copy stream: when the slot is
                # freed (close, or the model dropped with prefetches still in flight) the
                # allocator must not hand its memory out before those copies finish (review M3)
                raw.record_stream(copy_stream)
            raws.append(raw)
        return cls(raws, cuda)

    def __len__(self) -> int:
        return len(self.slots)

    def has_free(self) -> bool:
        return bool(self._free)

    def take(self, owner: int) -> Slot | None:
        """The oldest free slot, now owned by block `owner`; None when none is free."""
        if not self._free:
            return None
        slot = self._free.pop(0)
        slot.owner = owner
        return slot

    def of(self, owner: int) -> Slot:
        return next(s for s in self.slots if s.owner == owner)

    def release(self, slot: Slot, compute_stream=None) -> None:
        """The owner is done: on CUDA the slot may be refilled once the compute stream has
        finished what it queued so far (its `free` event)."""
        if compute_stream is not None:
            slot.free.record(compute_stream)
            slot.free_recorded = True
        self.cancel(slot)

    def cancel(self, slot: Slot) -> None:
        """Back to the pool without running its owner (evicted, or cancelled): any later copy
        into it is ordered after the one in flight by the copy stream itself."""
        slot.owner = None
        self._free.append(slot)

    def owner_of(self, storage_ptr: int) -> int | None:
        for s in self.slots:
            if s.raw.untyped_storage().data_ptr() == storage_ptr:
                return s.owner
        return None

    def nbytes(self) -> int:
        return sum(s.raw.numel() for s in self.slots)


class Staging:
    def __init__(self, raw: torch.Tensor, cuda: bool):
        self.raw = raw  # uint8 host buffer (pinned on CUDA), 4 KiB aligned
        # its last host->device copy finished; the stage thread sleeps on it (blocking event)
        self.done = host_event() if cuda else None
        self.done_recorded = False


def byte_view(raw: torch.Tensor, shift: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of a uint8 buffer from byte `shift` (where a block's first run lands aligned)."""
    return raw[shift:shift + nbytes]
