"""What a training engine is made of, as values: the model's blocks and ranks (`Grouping`), and
everything built for them from the plan (`Parts`: offload/train/build.py makes it once) -- the
memory account and links, the step thread and the H2D stream, the swap store, the optimizer
state, the live 16-bit weights, the layer streamer, the gradient landing and reducer.

Both are frozen: which component does what never changes after set-up, the components hold the
state that does. The step's collaborators -- the BlockStepper (offload/train/stepper.py), the
step paths (paths.py, delayed.py) and the state files (state.py) -- are given these, never the
engine. Which 16-bit weights are live is the one thing that moves: `LiveWeights` owns them and
the delayed update swaps them with its shadow set.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload.config import OffloadConfig
from offload.grads.landing import GradLanding
from offload.memory.blocks import Block, bind_views
from offload.memory.mapped import forget
from offload.memory.tiers import LinkCounter, MemoryAccount
from offload.optim.state import NvmeState, ResidentState
from offload.stream.frozen import FrozenBaseStreamer
from offload.stream.train import TrainingStreamer
from offload.train.activations import ActivationStore, disable_activation_checkpointing
from offload.train.plan import TrainingPlan
from offload.zero.group import BlockReducer, Reductions, ZeroGroup
from offload.zero.rest import RestGather


@dataclass(frozen=True, eq=False)
class Grouping:
    """The model's trainable parameters in blocks (offload/memory/blocks.py) and the
    data-parallel ranks they are split across: what the plan is made from (build.group)."""
    module: nn.Module
    blocks: list[Block]
    block_list_path: str | None  # the ModuleList's path in the model (None: there is none)
    layers: nn.Module | None  # that ModuleList
    zero: ZeroGroup | None  # the data-parallel ranks (torchrun); None in one process
    device: torch.device  # the compute device (the plan's)

    @property
    def world(self) -> int:
        return self.zero.world if self.zero is not None else 1

    @property
    def gathers_weights(self) -> bool:
        """Each rank steps only its shard and the updated weights are all-gathered after the
        step (stages 1-3 across ranks; at stage 3 only the non-layer block's)."""
        return self.zero is not None and self.zero.stage >= 1

    @property
    def shards_weights(self) -> bool:
        """Stage 3 across ranks: each layer's 16-bit weights live as this rank's shard and are
        gathered from the other ranks when the layer is fetched (offload/zero/group.py ShardGather)."""
        return self.zero is not None and self.zero.stage == 3

    def padded_numels(self) -> list[int] | None:
        """Flat buffer lengths across ranks (blocks padded to equal shards); None in one process."""
        if self.zero is None:
            return None
        return [self.zero.shards(b.numel).padded for b in self.blocks]

    def owned(self, bi: int) -> tuple[int, int]:
        """[lo, hi) of block bi that this rank steps (the whole block in one process)."""
        if self.zero is None:
            return 0, self.blocks[bi].numel
        return self.zero.owned(self.blocks[bi].numel)

    def weight_base(self, bi: int) -> int:
        """Block offset of element 0 of block bi's 16-bit home: at stage 3 it is this rank's
        shard (lo of owned()), the layers' in their tier and the others' on the device
        (offload/zero/rest.py); else the whole block (0)."""
        return self.owned(bi)[0] if self.shards_weights else 0

    def step_order(self) -> list[int]:
        """Blocks in the order their gradients complete: layers last-to-first, then the rest
        block (its embedding gradient is the last one backward produces)."""
        layers = [i for i, b in enumerate(self.blocks) if b.module is not None]
        rest = [i for i, b in enumerate(self.blocks) if b.module is None]
        return layers[::-1] + rest


def unit_steps(block: Block, lo: int, hi: int, skipped: set[str] | frozenset[str] | None) -> bool:
    """Elements [lo, hi) of `block` (one optimizer-state unit) hold a parameter that is stepped:
    one not in `skipped` (the slots not stepped this update)."""
    return not skipped or any(s.name not in skipped and s.offset < hi and s.offset + s.numel > lo
                              for s in block.slots)


def unit_order(state: ResidentState | NvmeState, step_order: list[int],
               blocks: list[Block] | None = None,
               skipped: dict[int, set[str]] | dict[int, frozenset[str]] | None = None) -> list[int]:
    """Optimizer-state units (sub-groups of blocks) in the order the step consumes them; with
    `skipped` (block -> slots not stepped), the units holding nothing else left out."""
    return [u for bi in step_order for u, lo, hi in state.units_of(bi)
            if not skipped or unit_steps(blocks[bi], lo, hi, skipped.get(bi))]


class LiveWeights:
    """The 16-bit weights the model computes with, per block: its flat device buffer (`flat16`;
    None when the block is streamed) and the padded buffer behind it (`padded`: across ranks at
    stages 1-2, where the all-gathers after a step run; else None). The delayed update swaps both
    with its shadow set when an update goes live (offload/train/delayed.py)."""

    def __init__(self, flat16: list[torch.Tensor | None], padded: list[torch.Tensor | None]):
        self.flat16 = flat16
        self.padded = padded

    def swap(self, flat16: list[torch.Tensor], padded: list[torch.Tensor | None]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Make `flat16` (and `padded` behind it) the live buffers; returns the ones they
        replace."""
        old = self.flat16, self.padded
        self.flat16, self.padded = flat16, padded
        return old

    def bind(self, blocks: list[Block], module: nn.Module,
             flats: list[torch.Tensor] | None = None) -> None:
        """Every block's parameters become views of `flats` (default: the live buffers)."""
        for bi, block in enumerate(blocks):
            bind_views(block, (self.flat16 if flats is None else flats)[bi], module)


@dataclass(frozen=True, eq=False)
class Parts(Grouping):
    """Everything an engine steps with, built from the plan (offload/train/build.py)."""
    plan: TrainingPlan  # the bytes and the decisions build allocated from
    account: MemoryAccount
    links: dict[str, LinkCounter]  # bytes moved per link: d2h, h2d, nvme_read, ...
    step_thread: ThreadPoolExecutor  # "offload-step": the overlapped and delayed steps' jobs
    h2d_stream: Any  # torch.cuda.Stream updated 16-bit weights go up on; None off CUDA
    store: Any  # nvme.SwapStore under nvme_dir, or None
    state: ResidentState | NvmeState  # masters and Adam moments
    weights: LiveWeights
    layer_of: dict[int, int]  # block index -> layer index, for streamed blocks
    streaming: TrainingStreamer | FrozenBaseStreamer | None
    mapped: list[torch.Tensor]  # frozen weights mapped from swap files (offload/memory/mapped.py)
    rest_gathers: list[RestGather]  # stage 3: the non-layer blocks' gathers (offload/zero/rest.py)
    act_store: ActivationStore | None  # checkpointed layers' inputs in host RAM
    checkpointed: bool  # activation checkpointing was enabled here (and is undone at close)
    grads: GradLanding
    reducer: BlockReducer | None  # stages 0-1 across ranks: each block's gradient averaged

    @property
    def cfg(self) -> OffloadConfig:
        return self.plan.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.cfg.torch_dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pin(self) -> bool:
        return self.plan.cfg.pin_memory and self.cuda

    @property
    def reductions(self) -> Reductions | None:
        """Across ranks, the gradient reductions the step waits for: stage 0-1's BlockReducer
        or stage 2-3's sharded landing (offload/zero/group.py Reductions); None in one process."""
        if self.zero is None:
            return None
        return self.reducer if self.reducer is not None else self.grads.storage

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the streamer's slots, the working buffers streamed or gathered
        layers are bound to while they run; the account counts them as device weights, the
        ZeRO formulas count only the weights' homes (reports show them apart)."""
        streamer = getattr(self.streaming, "streamer", None)
        return sum(s.raw.numel() * s.raw.element_size() for s in streamer.slots) if streamer else 0

    def unit_order(self, skipped: dict[int, set[str]] | None = None) -> list[int]:
        """Optimizer-state units (sub-groups of blocks) in the order the step consumes them.
        `skipped`: the slots this update does not step (experts without tokens), whose units
        are left out; None (not known yet: the next update's read-ahead, an overlapped update
        begun in backward): every expert's unit left out -- each is read when it is stepped."""
        return unit_order(self.state, self.step_order(), self.blocks,
                          self.plan.expert_slots if skipped is None else skipped)

    def read_state(self, bi: int, kind: str) -> torch.Tensor:
        """A CPU copy of block bi's whole flat fp32 state of `kind`; across ranks at stages
        1-2 gathered from every rank's shard (a collective: every rank must call it)."""
        flat = self.state.read(bi, kind)
        if self.gathers_weights:
            flat = self.zero.gather_full(flat, self.blocks[bi].numel)
        return flat

    def close(self, *, after_error: bool = False) -> None:
        """Finish IO, release the swap directory's lock and every thread. Every part is closed
        even when one fails; the first failure is raised then, unless `after_error`."""
        steps = [self.grads.close, lambda: self.step_thread.shutdown(wait=True)]
        steps += [g.close for g in self.rest_gathers]
        if self.checkpointed:  # the model's own forwards back, hooks gone
            steps.append(lambda: disable_activation_checkpointing(self.layers))
        if self.cuda:
            # device buffers (weights, a delayed job's shadow set) may be freed after this while
            # uploads into them or gradient copies out of them are queued on the side streams:
            # the caching allocator would hand the memory to the compute stream at once, so
            # the compute stream waits for both first (GPU-side; desk review M3/L8)
            steps.append(self._order_after_side_streams)
        if self.streaming is not None:
            steps.append(self.streaming.close)
        steps.append(self.state.close)
        # mapped frozen weights (offload/memory/mapped.py) stay usable; their maps are no longer tracked
        steps += [lambda t=t: forget(t) for t in self.mapped]
        if self.store is not None:
            # the store was given the engine: it does not close it
            steps += [self.store.close, self.store.engine.close]
        first: BaseException | None = None
        for close_step in steps:
            try:
                close_step()
            except Exception as e:  # noqa: BLE001 - the rest must still be released
                first = first or e
        if first is not None and not after_error:
            raise first

    def _order_after_side_streams(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.h2d_stream)
        if self.grads.cuda:
            compute.wait_stream(self.grads.stream)
