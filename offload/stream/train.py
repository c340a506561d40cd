"""Streamed weights in training (ZeRO-Infinity): the block streamer of inference, driven through
forward and backward, with the updated 16-bit weights written back to their tier.

Order of one micro-batch, per transformer block i (L blocks):

  forward   pre-hook: fetch i, prefetch i+1.. (schedule), wait i (bind params to its slot)
            post-hook: release i — except the last block, which backward needs first
            (a hook on block i's *input* gradient is registered now; see below)
  backward  a hook on block i's *output* gradient fires before any of block i's backward
            nodes run: fetch + wait i (and prefetch i-1..). With activation checkpointing the
            recompute of block i happens inside those nodes, so one fetch serves recompute
            and backward. The hook on block i's *input* gradient fires once every node that
            uses block i's weights has run: release i.

What autograd saves in forward is not only the Parameter objects: decomposed ops save views
of them (`linear` -> `matmul(x, W.t())` saves `W.t()`), and those views point straight into
the slot, which holds another block by the time backward runs. So while a streamed block runs
forward, a saved-tensors pack hook replaces every saved tensor that lives in a slot by a
reference (block, element offset, shape, stride); the unpack hook rebuilds it in backward from
the slot the block is bound to *then* (the output-gradient hook has fetched it). With
activation checkpointing the checkpoint's own hooks are innermost and save only block inputs;
the recompute runs while the block is bound, so its saved views are consistent.

Prefetching is not cyclic: nothing is fetched for the next forward until the optimizer step
has written the new weights (host buffer for the cpu tier, swap file for the nvme tier).

Mixtures of experts on the nvme tier (routed.py): a layer's weights are one swap file per unit
(dense runs, each routed expert); a fetch reads the dense units and, in backward, the experts
the forward recorded; `experts_routed` (the MoE module's before_experts, after its router ran)
reads the routed experts the bound slot lacks, before they compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from nvme.io import ALIGN, CHECKSUM
from offload.memory.blocks import Block
from offload.stream.routed import RoutedStreamer, unit_names, weight_units, write_units
from offload.stream.slots import slot_raw_bytes
from offload.stream.streamer import BlockStreamer, TensorRange, TrainingHomes
from offload.memory.tiers import MemoryAccount, PlanBytes, host_empty

if TYPE_CHECKING:
    from offload.zero.group import ShardGather

WEIGHTS = "weights16"  # swap-store kind of a block's 16-bit weights


@dataclass(frozen=True)
class _SlotRef:
    """A saved tensor that lived in block `layer`'s slot, as a recipe for rebuilding it."""
    layer: int
    offset: int  # bytes from the start of the block's flat view
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _first_grad_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor that requires grad in a module's inputs/outputs (tensor, tuple, dict)."""
    if torch.is_tensor(x):
        return x if x.requires_grad else None
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_grad_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        return _first_grad_tensor(list(x.values()))
    return None


@dataclass(frozen=True)
class StreamSettings:
    """How a training client streams its layers: `tier`, the home of every layer's weights
    ("cpu": host buffers, "nvme": swap files; "device": a quantized base loaded once), the compute
    device and dtype, pinned host memory, and how many blocks ahead each tier is fetched."""
    tier: str
    device: torch.device
    dtype: torch.dtype
    pin: bool
    nvme_ahead: int
    host_ahead: int = 1
    fetch_delay_s: float = 0.0


@dataclass(frozen=True)
class Stage3:
    """ZeRO stage 3 across ranks: the flats hold only this rank's shard of each block, gathered
    from the other ranks at each fetch (`gather`: offload/zero/group.py ShardGather); `home`: the
    account's tier for those shards ("device" when they live in device memory: offload_params
    "none")."""
    gather: "ShardGather"
    home: str = "host"


class BlockHooks:
    """The hooks that drive a BlockStreamer (`self.streamer`) over `self.layers` through forward
    and backward (module docstring); shared by the trainable streamed blocks (TrainingStreamer)
    and a LoRA model's frozen base (FrozenBaseStreamer)."""

    layers: nn.ModuleList
    streamer: BlockStreamer

    def _open_streamer(self, settings: StreamSettings, files, homes: TrainingHomes, *,
                       io=None, dtype: torch.dtype | None = None, routed: dict | None = None) -> None:
        """The streamer of every layer from `settings.tier`, blocks in `dtype` (default: the
        compute dtype); slots always filled by a copy, never bound in place. `routed`: the
        keyword arguments of a RoutedStreamer (experts read once routed: routed.py)."""
        s = settings
        kind = BlockStreamer if routed is None else RoutedStreamer
        self.streamer = kind(
            self.layers, [s.tier] * len(self.layers), device=s.device, dtype=dtype or s.dtype,
            files=files, host_ahead=s.host_ahead, nvme_ahead=s.nvme_ahead, pin=s.pin,
            zero_copy_host=False, fetch_delay_s=s.fetch_delay_s, io=io, homes=homes,
            **(routed or {}))

    def _install_hooks(self) -> None:
        n = len(self.layers)
        fwd = list(range(n))
        self.streamer.set_schedule(fwd + fwd[::-1], cyclic=False)
        self._hooks: list = []
        self._saving = None  # the saved-tensors hooks context of the block running forward
        for li, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(
                lambda m, args, kwargs, li=li: self._before_forward(li, args, kwargs),
                with_kwargs=True))
            # always_call: a forward that raises still leaves the saved-tensors context the
            # pre-hook entered, and releases its block (out is None then)
            self._hooks.append(layer.register_forward_hook(
                lambda m, args, out, li=li: self._after_forward(li, out), always_call=True))

    # -- hooks ------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.device != self.streamer.device:
            return t
        owner = self.streamer.slot_owner(t.untyped_storage().data_ptr())
        if owner is None:
            return t
        flat = self.streamer.bound_flat(owner)
        # in bytes: a byte block (a quantized base: codes, fp16 scales and norms in one uint8
        # slot) holds views of other dtypes than its flat's
        return _SlotRef(owner, t.data_ptr() - flat.data_ptr(), tuple(t.shape), tuple(t.stride()),
                        t.dtype)

    def _unpack(self, x):
        if isinstance(x, _SlotRef):
            # the output-gradient hook bound the block before any of its backward nodes ran
            flat = self.streamer.bound_flat(x.layer)
            storage = flat.untyped_storage()
            start = flat.data_ptr() - storage.data_ptr() + x.offset  # bytes into the storage
            item = x.dtype.itemsize
            assert start % item == 0, "a saved view of streamed weights is not element-aligned"
            # set_ counts the offset in elements of x.dtype from the start of the storage
            return torch.empty(0, dtype=x.dtype, device=flat.device).set_(
                storage, start // item, x.shape, x.stride)
        return x

    def _before_forward(self, li: int, args, kwargs) -> None:
        s = self.streamer
        s.fetch(li)
        s.prefetch(after=li)
        s.wait(li)
        if torch.is_grad_enabled():
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saving.__enter__()
            x = _first_grad_tensor(args)
            if x is None:
                x = _first_grad_tensor(kwargs)
            if x is not None:
                # grad of the block's input complete => every node using its weights has run
                x.register_hook(lambda g, li=li: self._after_backward(li))

    def _after_forward(self, li: int, out) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        y = _first_grad_tensor(out) if torch.is_grad_enabled() else None
        if y is None:  # no backward through this block (eval / no_grad, or its forward raised)
            if self.streamer.in_use(li):  # a forward that raised in wait() bound nothing
                self.streamer.release(li)
            return
        y.register_hook(lambda g, li=li: self._before_backward(li))
        if li != len(self.layers) - 1:  # backward starts with the last block: keep it
            self.streamer.release(li)

    def _before_backward(self, li: int) -> None:
        s = self.streamer
        s.fetch(li)
        s.prefetch(after=li)
        if s.in_use(li):  # the last block: kept bound from its forward
            s.reuse(li)
        else:
            s.wait(li)

    def _after_backward(self, li: int) -> None:
        self.streamer.release(li)

    def end_backward(self) -> None:
        """After loss.backward(): nothing stays bound or in flight (blocks whose input needed no
        gradient never fired their release hook)."""
        self.streamer.release_all()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.streamer.close()


class TrainingStreamer(BlockHooks):
    """Owns the BlockStreamer for the layers of a model in training and the 16-bit weights'
    home tier (`settings.tier` -- "cpu": pinned host buffers; "nvme": one swap file per block)."""

    def __init__(self, layers: nn.ModuleList, blocks: list[Block], layer_block: list[int],
                 settings: StreamSettings, *, flats16: list[torch.Tensor | None], store,
                 account: MemoryAccount, stage3: Stage3 | None = None,
                 experts: dict[int, list[tuple[int, int]]] | None = None):
        """`flats16`: each layer's 16-bit weights (cpu tier; this rank's shard at stage 3), or
        None where the engine wrote them to their swap file in `store` already. `experts`:
        block -> its routed experts' element ranges, each its own weight unit (nvme tier, one
        process, CPU device: the engine wrote them so, `write_units`; routed.py)."""
        tier, dtype = settings.tier, settings.dtype
        self.layers, self.blocks, self.tier = layers, blocks, tier
        experts = experts or {}
        # per layer: its weight units (one, the whole block, but for routed experts) and which
        # of them are experts, read once routed (routed.py)
        self.units = [weight_units(blocks[b].numel, experts.get(b, [])) for b in layer_block]
        self.expert_unit = [{lo: k for k, (lo, hi) in enumerate(units) if (lo, hi) in experts.get(b, [])}
                            for units, b in zip(self.units, layer_block)]
        self.recorded: dict[int, set[int]] = {}  # layer -> expert units its forward routed to
        self.shards = stage3.gather if stage3 is not None else None
        self.layer_block = layer_block  # layer index -> engine block index
        self.store = store
        n = len(layers)
        host_flats: list[torch.Tensor | None] = [None] * n
        files: list[list[TensorRange] | None] | None = None
        shard_files: list[TensorRange] | None = None
        # stage 3: the elements of this rank's shard of each layer (padded: equal shards)
        self.shard_numel = ([self.shards.padded(blocks[b].numel) // self.shards.world
                             for b in layer_block] if stage3 is not None else None)
        if tier == "cpu":
            home = stage3.home if stage3 is not None else "host"
            for li in range(n):
                flat = flats16[li]
                if home == "host" and settings.pin and torch.cuda.is_available() \
                        and not flat.is_pinned():
                    pinned = host_empty(flat.numel(), dtype, pin=True)
                    pinned.copy_(flat)
                    flat = pinned
                host_flats[li] = flat
                account.add(home, "weights", flat.numel() * flat.element_size())
        elif stage3 is not None:  # the engine wrote this rank's shard of each to a swap file
            shard_files = [self._shard_range(blocks[layer_block[li]], dtype) for li in range(n)]
            for f in shard_files:
                account.add("nvme", "weights", f.nbytes)
        else:
            files = []  # the engine already wrote each block's weights to its swap file
            for li in range(n):
                block = blocks[layer_block[li]]
                files.append(self._ranges(layers[li], block, self.units[li]))
                account.add("nvme", "weights", block.numel * dtype.itemsize)
        routed = None
        if any(self.expert_unit):
            routed = {"lazy": [set(e.values()) for e in self.expert_unit],
                      "run_crc32": self._run_crc32}
        self._open_streamer(settings, files, TrainingHomes(
            host_flats=host_flats, expected_crc32=self._expected_crc32, shards=self.shards,
            shard_files=shard_files), io=store.engine if store is not None else None,
            routed=routed)
        if routed is not None:  # one run per unit, in block order (unit_name sorts so)
            for li, units in enumerate(self.units):
                item = dtype.itemsize
                assert self.streamer.runs_of(li) == [(a * item, b * item) for a, b in units], \
                    "weight units and file runs differ"
        # the streamer may have replaced Parameter objects (meta / other dtype): the engine's
        # slots must name the ones the model now holds
        for li in range(n):
            ours, theirs = blocks[layer_block[li]].slots, self.streamer.blocks[li].slots
            assert [s.numel for s in ours] == [s.numel for s in theirs], "block layout differs"
            for a, b in zip(ours, theirs):
                a.param = b.param
        slot_bytes = sum(s.raw.numel() for s in self.streamer.slots)
        account.add("device", "weights", slot_bytes)
        account.add("host", "buffers", sum(s.raw.numel() for s in self.streamer.staging))
        self._install_hooks()

    @staticmethod
    def plan_bytes(layer_numels: list[int], tier: str, itemsize: int, *, cuda: bool,
                   pin: Callable[[int], int], host_ahead: int, nvme_ahead: int,
                   world: int = 1, home: str = "host") -> PlanBytes:
        """What the constructor allocates for layers of these sizes streamed from `tier`: the
        device slots (one running + the blocks in flight), the weights' home, and on a GPU the
        pinned staging between disk and device (on the CPU, with weights stored in the compute
        dtype, reads go straight into the slot). `world` > 1: ZeRO stage 3 -- slots hold the
        padded block, the home (`home`: "host" or "device") one shard of each."""
        from offload.zero.group import Shards
        padded = [Shards(n, world).padded if world > 1 else n for n in layer_numels]
        largest = max(padded) * itemsize
        depth = nvme_ahead if tier == "nvme" else host_ahead
        out = {("device", "weights"): (1 + depth) * slot_raw_bytes(largest, cuda)}
        homes = [p // world * itemsize for p in padded]  # the whole block in one process
        if tier == "cpu":
            if home == "device":
                out["device", "weights"] += sum(homes)
            else:
                out["host", "weights"] = sum(pin(b) for b in homes)
        else:
            out["nvme", "weights"] = sum(homes)
            if cuda:
                out["host", "buffers"] = nvme_ahead * pin(largest + ALIGN)
        return out

    def _expected_crc32(self, li: int) -> int | None:
        """The CRC of layer li's latest weights file (the store records it at each write), when
        the store verifies reads. Sound because no write of a block's weights is in flight while
        the streamer reads it: the step writes them after the block's backward, and the update
        waits for those writes before the next forward fetches anything."""
        if self.store is None or self.store.verify == "never":
            return None
        entry = self.store.info(self.name(self.blocks[self.layer_block[li]]))
        return entry.crc32 if entry.checksum == CHECKSUM else None  # the streamer's kind

    def _run_crc32(self, li: int, k: int) -> int | None:
        """The CRC of layer li's weight unit k's latest file (as _expected_crc32)."""
        if self.store is None or self.store.verify == "never":
            return None
        entry = self.store.info(self.unit_name(li, k))
        return entry.crc32 if entry.checksum == CHECKSUM else None

    @staticmethod
    def name(block: Block) -> str:
        return f"{block.name}.{WEIGHTS}"

    @staticmethod
    def unit_names(block: Block, units: list[tuple[int, int]]) -> list[str]:
        return unit_names(TrainingStreamer.name(block), units)

    def unit_name(self, li: int, k: int) -> str:
        return self.unit_names(self.blocks[self.layer_block[li]], self.units[li])[k]

    # -- routed experts (routed.py): read once the router has chosen -----------------------
    def _before_forward(self, li: int, args, kwargs) -> None:
        if li == 0 and torch.is_grad_enabled() and self.recorded:
            # a new training forward: the experts its backward needs are recorded afresh
            for lj in self.recorded:
                self.streamer.want(lj, set())
            self.recorded.clear()
        super()._before_forward(li, args, kwargs)

    def experts_routed(self, li: int, ranges: list[tuple[int, int]]) -> None:
        """Layer li (bound) is about to run the experts at these element ranges: those its slot
        lacks are read now; in a training forward they are recorded, and the backward's fetch
        of the layer (recompute included) reads them with its dense units."""
        units = [self.expert_unit[li][lo] for lo, _ in ranges if lo in self.expert_unit[li]]
        if not units:
            return
        self.streamer.read_routed(li, units)
        if torch.is_grad_enabled():
            self.recorded.setdefault(li, set()).update(units)
            self.streamer.want(li, self.recorded[li])

    def _shard_range(self, block: Block, dtype: torch.dtype) -> TensorRange:
        """Where this rank's shard of a block's weights lies in its swap file (stage 3)."""
        entry = self.store.info(self.name(block))
        return TensorRange("shard", f"{self.store.dir}/{entry.file}", entry.offset, entry.nbytes,
                           entry.dtype)

    def _ranges(self, layer: nn.Module, block: Block, units: list[tuple[int, int]]
                ) -> list[TensorRange]:
        """The block's parameters as byte ranges of its weight units' swap files (flat, module
        order; a parameter never straddles two units: they are cut at experts' bounds)."""
        names = self.unit_names(block, units)
        entries = [self.store.info(n) for n in names]
        paths = [self.store.path(n) if hasattr(self.store, "path") else f"{self.store.dir}/{e.file}"
                 for n, e in zip(names, entries)]
        params = dict(layer.named_parameters())
        ranges, pos, k = [], 0, 0
        item = entries[0].dtype.itemsize
        for rel, p in params.items():
            while pos >= units[k][1]:
                k += 1
            assert pos + p.numel() <= units[k][1], "a parameter straddles two weight units"
            ranges.append(TensorRange(rel, paths[k], entries[k].offset + (pos - units[k][0]) * item,
                                      p.numel() * item, entries[k].dtype))
            pos += p.numel()
        assert pos == block.numel
        return ranges

    # -- the optimizer writes weights back to the tier ----------------------------------------
    def weight_target(self, li: int) -> torch.Tensor | None:
        """Where the step may write block li's new 16-bit weights in place (cpu tier; at stage 3
        with offload_params="none" that home is a device tensor: a CPU kernel may not write it,
        the stepper uploads into it instead)."""
        return self.streamer.host_buffer(li) if self.tier == "cpu" else None

    def write_weights(self, li: int, flat16: torch.Tensor, units: list[int] | None = None):
        """nvme tier: write-behind of the new weights (stage 3: this rank's shard, whose padded
        tail is never a parameter); `units`: only these weight units (default all); returns a
        handle whose wait() waits for every file written."""
        if self.shard_numel is not None:
            n = self.shard_numel[li]
            if flat16.numel() < n:  # a block smaller than its padded shard (a few elements)
                flat16 = torch.cat([flat16, flat16.new_zeros(n - flat16.numel())])
            flat16 = flat16[:n]
            return self.store.write(self.name(self.blocks[self.layer_block[li]]), flat16)
        return write_units(self.store, self.unit_names(self.blocks[self.layer_block[li]],
                                                       self.units[li]), self.units[li], flat16, units)

    def write_unit(self, li: int, k: int, flat16: torch.Tensor) -> None:
        """Weight unit k of layer li's new values (its elements) to its file, waited for."""
        self.store.write(self.unit_name(li, k), flat16).wait()

    def read_unit(self, li: int, k: int, out: torch.Tensor) -> None:
        """Weight unit k of layer li from its file into `out` (its elements)."""
        self.store.read_into(self.unit_name(li, k), out).wait()

    def load_weights(self, li: int, flat16: torch.Tensor) -> None:
        """Block li's weights (this rank's shard of them at stage 3) into their home."""
        if self.tier == "cpu":
            self.streamer.host_buffer(li)[:flat16.numel()].copy_(flat16)
            if self.shards is not None:  # a device home: later fetches wait for this copy
                self.shards.homes_written(self.streamer.device)
        else:
            self.write_weights(li, flat16).wait()  # stage 3: padded to the shard's length

