"""An engine's parts, built once from the plan (offload/train/engine.py calls these in __init__):

    grouping = group(model, cfg)                 # the blocks and the data-parallel ranks
    plan = plan_model(grouping, cfg, source)     # bytes and decisions; checked by the caller
    parts = build(grouping, plan, source)        # everything allocated, as one frozen Parts

Each block's fp32 masters go into the optimizer state and its 16-bit weights to their tier: a
device flat buffer the parameters become views of, or the streamer's home (host buffer or swap
file; at ZeRO stage 3 this rank's shard of it). One block at a time: the extra memory while
initialising is one block. Then the streamer starts: TrainingStreamer for trainable layers
(offload_params, stage 3), or FrozenBaseStreamer for a LoRA model's frozen base (offload_params
with frozen parameters in the layers: the adapters stay resident), and every other frozen
parameter goes to the device. Also here: the swap store, the optimizer state, the gradient
landing and the data-parallel group the placement depends on.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import nn

from offload.memory.layout import streamed_params
from offload.memory.blocks import (bind_views, frozen_bytes, gather_flat, group_blocks,
                                   move_frozen_and_buffers)
from offload.config import ConfigError, OffloadConfig, parse_bytes
from offload.grads.landing import GradLanding
from offload.stream.frozen import FilledBase, FrozenBaseStreamer, StoredBase
from offload.memory.mapped import map_frozen, maps_frozen_rest
from offload.memory.tiers import (LinkCounter, MemoryAccount, freeze_pin_cap, large_frees_to_os,
                                  started_worker)
from offload.optim.state import NvmeState, ResidentState
from offload.zero.rest import RestGather, largest_module_numel
from offload.lora import base_checkpoint_name
from offload.stream.routed import weight_units, write_units
from offload.stream.train import Stage3, StreamSettings, TrainingStreamer
from offload.train.activations import ActivationStore, enable_activation_checkpointing
from offload.train.experts import decide_experts, expert_cuts, expert_ranges
from offload.train.parts import Grouping, LiveWeights, Parts, unit_order
from offload.train.plan import TrainingPlan, plan_training, training_device
from offload.zero.group import BlockReducer, ShardGather, ZeroGroup, ensure_process_group, rank_dir

# weights_read: a layer's 16-bit weights read back from their swap file by the step or an
# expert replay (offload/train/replay.py), where some experts' units were not stepped
LINKS = ("d2h", "h2d", "nvme_read", "nvme_write", "stream_h2d", "stream_disk", "act_offload",
         "weights_read")


def group(model: nn.Module, cfg: OffloadConfig) -> Grouping:
    """The model's trainable parameters in blocks, on the device the engine trains on, and the
    data-parallel ranks (torchrun) they are split across."""
    device = training_device(cfg)
    blocks, path = group_blocks(model, cfg.block_list)
    layers = model.get_submodule(path) if path is not None else None
    zero = make_zero(cfg, device, has_frozen_layers(layers))
    return Grouping(model, blocks, path, layers, zero, device)


def plan_model(g: Grouping, cfg: OffloadConfig, source: Any) -> TrainingPlan:
    """The plan of these blocks (offload/train/plan.py), frozen parameters included: a quantized
    base (QLoRA) streams in its stored dtypes, a 16-bit one in the compute dtype."""
    frozen_layers, frozen_rest = frozen_bytes(g.module, g.block_list_path, cfg.torch_dtype,
                                              own_dtypes=hasattr(source, "layer_ranges"))
    plan = plan_training([(b.numel, b.module is not None) for b in g.blocks], cfg, g.device,
                         world=g.world, frozen_layer_bytes=frozen_layers,
                         frozen_resident_bytes=frozen_rest,
                         frozen_in_place=hasattr(source, "layer_ranges"),
                         rest_module_numel=largest_module_numel(
                             g.module, [b for b in g.blocks if b.module is None]))
    # experts as their own state units, and how those without tokens are stepped (experts.py)
    ranges = expert_ranges(g.module, g.blocks)
    plan.unit_cuts = expert_cuts(ranges, len(g.blocks))
    for r in ranges:
        plan.expert_slots[r.block] = plan.expert_slots.get(r.block, frozenset()) | {
            s.name for s in r.slots}
    plan.expert_replay, plan.expert_replay_why = decide_experts(g.module, ranges, g.world,
                                                                plan.step_path)
    if plan.expert_replay == "lazy" and cfg.offload == "nvme":
        hold = parse_bytes(cfg.replay_hold_bytes, "replay_hold_bytes")
        plan.replay_hold_bytes = hold if hold is not None else NvmeState.staging_bytes(
            [b.numel for b in g.blocks], cfg.buffer_count, cfg.sub_group_size)
        host = plan.bytes.setdefault("host", {})
        host["buffers"] = host.get("buffers", 0) + plan.replay_hold_bytes
    return plan


def build(g: Grouping, plan: TrainingPlan, source: Any) -> Parts:
    """Everything the plan says, allocated: optimizer state, then the 16-bit weights one block
    at a time (the peak extra memory while initialising is one block), the streamer,
    activation checkpointing, the gradient landing. Parameters on the meta device are filled
    from `source`: an object with read_tensors_into({name: tensor}) (a checkpoint reader) or
    such a callable."""
    cfg = plan.cfg
    if cfg.pin_memory and g.device.type == "cuda":
        # the pinned-memory cap is fixed now, from the RAM available before this engine
        # allocates anything: measured per request, every earlier (pageable) allocation
        # would lower it and the buffers that most need pinning come last (desk review H3)
        freeze_pin_cap()
    step_thread = started_worker("offload-step", g.device)  # first: nothing to undo if it fails
    account = MemoryAccount()
    links = {k: LinkCounter() for k in LINKS}
    store = make_store(cfg, g, plan)
    state = make_state(cfg, g, store, account, links, plan.unit_cuts, plan.replay_hold_bytes,
                       versions=plan.step_path == "speculative")
    smallest = min(b.numel for b in g.blocks) * cfg.torch_dtype.itemsize
    with large_frees_to_os(smallest):  # RSS must not grow with the number of blocks (tiers.py)
        placed = _Placement(g, plan, state, store, account).place(source)
    act_store, checkpointed = _enable_checkpointing(cfg, g)
    if isinstance(state, NvmeState):
        # init state durable + first prefetch (experts' units are read when routed to)
        state.end_step(unit_order(state, g.step_order(), g.blocks, plan.expert_slots), 0)
    grads = make_grads(g, plan, account, links)
    # stages 0-1 across ranks: each block's gradient averaged once final (offload/zero/group.py)
    reducer = (BlockReducer(g.zero, grads.buffer, [b.numel for b in g.blocks], g.step_order())
               if g.zero is not None and not grads.sharded else None)
    # updated 16-bit weights go up on this stream (stepper.py)
    h2d_stream = torch.cuda.Stream(g.device) if g.device.type == "cuda" else None
    return Parts(**{f.name: getattr(g, f.name) for f in fields(Grouping)}, plan=plan,
                 account=account, links=links, step_thread=step_thread, h2d_stream=h2d_stream,
                 store=store, state=state, weights=LiveWeights(placed.flat16, placed.padded),
                 layer_of=placed.layer_of, streaming=placed.streaming, mapped=placed.mapped,
                 rest_gathers=placed.rest_gathers, act_store=act_store,
                 checkpointed=checkpointed, grads=grads, reducer=reducer)


def routed_weight_units(g: Grouping, plan: TrainingPlan) -> dict[int, list[tuple[int, int]]]:
    """Block -> the element ranges of its routed experts whose 16-bit weights are their own
    swap files, read only once routed (offload/stream/routed.py): nvme-tier weights, one
    process, the CPU device, MoE modules that say which experts they run (before_experts)."""
    cfg = plan.cfg
    if cfg.offload_params != "nvme" or g.world > 1 or g.device.type != "cpu":
        return {}
    modules = dict(g.module.named_modules())
    out: dict[int, list[tuple[int, int]]] = {}
    for r in expert_ranges(g.module, g.blocks):
        if hasattr(type(modules[r.module]), "before_experts") and g.blocks[r.block].module is not None:
            out.setdefault(r.block, []).append((r.lo, r.hi))
    return out


def make_state(cfg: OffloadConfig, g: Grouping, store, account: MemoryAccount,
               links: dict[str, LinkCounter], cuts: list[list[int]] | None = None,
               hold_cap_bytes: int = 0, versions: bool = False) -> ResidentState | NvmeState:
    """The masters and Adam moments of this rank's range of each block, in their tier
    (`versions`: NVMe keeps each unit's committed files beside a step's, the speculative step's)."""
    ranges = [g.owned(bi) for bi in range(len(g.blocks))]
    if cfg.offload == "nvme":
        return NvmeState(g.blocks, store, cfg.buffer_count, account,
                         links["nvme_read"], links["nvme_write"],
                         prefetch=cfg.prefetch_optimizer_state,
                         sub_group_params=cfg.sub_group_size, ranges=ranges,
                         cuts=cuts, hold_cap_bytes=hold_cap_bytes, versions=versions)
    tier = "device" if cfg.offload == "none" else "host"
    # never pinned: the CPU kernel reads and writes masters and moments in place; they never
    # cross the link, and pinning them would spend the pinned-memory cap on them instead of
    # on the buffers that do (landing, staging, upload ring, streamed weights; review H3)
    return ResidentState(g.blocks, tier, g.device, False, account, ranges)


def make_grads(g: Grouping, plan: TrainingPlan, account: MemoryAccount,
               links: dict[str, LinkCounter]) -> GradLanding:
    """The gradient landing (offload/grads/landing.py), its hooks attached. offload="none"
    keeps gradients on the device (the plain reference path); the delayed update steps from one
    set while the next backward lands in the other."""
    cfg = plan.cfg
    grads = GradLanding(
        g.blocks, cfg.torch_dtype, cfg.grad_accum_steps, account, links["d2h"],
        source_device=g.device, pin=cfg.pin_memory and g.device.type == "cuda",
        landing_tier="device" if cfg.offload == "none" else "host",
        storage=plan.grad_storage, pool_buffers=plan.grad_pool,
        pooled_blocks={i for i, b in enumerate(g.blocks) if b.module is not None} or None,
        buffer_numels=g.padded_numels(), zero=g.zero, step_order=g.step_order())
    grads.attach()
    return grads


def _enable_checkpointing(cfg: OffloadConfig, g: Grouping) -> tuple[ActivationStore | None, bool]:
    """Activation checkpointing of the layers when configured: (the store of their inputs in
    host RAM with offload_activations, whether this engine wrapped any layer)."""
    if not cfg.activation_checkpointing:
        return None, False
    if g.layers is None:
        raise ConfigError("activation_checkpointing needs a model whose blocks are an "
                          "nn.ModuleList (none was found)")
    pin = cfg.pin_memory and g.device.type == "cuda"
    act_store = ActivationStore(g.device, pin) if cfg.offload_activations else None
    # only what this engine wrapped is unwrapped at close (a model the caller had
    # checkpointed already stays so)
    return act_store, enable_activation_checkpointing(g.layers, act_store, g.device) > 0


class _Placement:
    """Where the weights go, block by block (the module docstring); what it places is collected
    here until build() freezes it into the Parts."""

    def __init__(self, g: Grouping, plan: TrainingPlan, state, store, account: MemoryAccount):
        self.g, self.plan, self.cfg = g, plan, plan.cfg
        self.state, self.store, self.account = state, store, account
        self.dtype = plan.cfg.torch_dtype
        self.pin = plan.cfg.pin_memory and g.device.type == "cuda"
        self.flat16: list[torch.Tensor | None] = []  # device flat buffers (None when streamed)
        # stages 1-3: resident device weights padded to equal shards, all-gathered in place
        # after a step
        self.padded: list[torch.Tensor | None] = []
        self.layer_of: dict[int, int] = {}  # block index -> layer index, for streamed blocks
        self.rest_gathers: list[RestGather] = []
        self.streaming = None
        self.mapped: list[torch.Tensor] = []
        self.weight_experts = routed_weight_units(g, plan)

    def place(self, source: Any) -> "_Placement":
        """Masters into the state, 16-bit weights to their tier, then the streamer (module
        docstring)."""
        g, model = self.g, self.g.module
        # LoRA: the layers' frozen base is streamed instead, the adapters stay resident
        frozen_base = streams_frozen_base(self.cfg, g)
        streams = (self.cfg.offload_params != "none" and not frozen_base) or g.shards_weights
        if streams:
            check_streamable(g)
        stream_flats: list[torch.Tensor | None] = []
        fill = getattr(source, "read_tensors_into", source)
        trainable: set[int] = set()
        for bi, block in enumerate(g.blocks):
            master = gather_flat(block, torch.float32, source=fill)
            if g.zero is not None:  # every rank starts from rank 0's weights
                g.zero.broadcast_(master)
            self.state.init_block(bi, master)
            trainable.update(id(s.param) for s in block.slots)
            if streams and block.module is not None:
                self.layer_of[bi] = len(self.layer_of)
                stream_flats.append(self._stream_home(bi, master))
                self._add(None, None)
                continue
            if g.shards_weights:  # stage 3: this rank's shard is the home, modules gather the rest
                home = self._shard(bi, master, g.device)
                self.account.add("device", "weights", home.numel() * home.element_size())
                self.rest_gathers.append(RestGather(model, block, home, g.zero, self.account,
                                                    self.dtype, g.device))
                trainable.update(id(s.param) for s in block.slots)  # meta ones were replaced
                self._add(home, None)  # nothing all-gathered after a step (zero_rest.py)
                del master
                continue
            self._resident(bi, master)
            del master
        self._start_streaming(stream_flats, frozen_base, source, fill, trainable)
        return self

    def _add(self, flat: torch.Tensor | None, padded: torch.Tensor | None) -> None:
        self.flat16.append(flat)
        self.padded.append(padded)

    def _resident(self, bi: int, master: torch.Tensor) -> None:
        """Block bi's 16-bit weights on the device, its parameters views of them -- or of its
        fp32 masters themselves on the CPU (the stepper then neither copies nor uploads them)."""
        g, block = self.g, self.g.blocks[bi]
        padded = None
        if self.plan.shares_masters:
            flat = self.state.acquire(bi)[0]
        else:
            size = g.padded_numels()[bi] if g.gathers_weights else block.numel
            padded = torch.zeros(size, dtype=self.dtype, device=g.device)
            flat = padded[:block.numel]
            flat.copy_(master)
            self.account.add("device", "weights", padded.numel() * padded.element_size())
        bind_views(block, flat, g.module)
        self._add(flat, padded)

    def _shard(self, bi: int, master: torch.Tensor, device) -> torch.Tensor:
        """Stage 3: this rank's shard of block bi's 16-bit weights, padded, on `device`."""
        lo, hi = self.g.owned(bi)
        home = torch.zeros(self.g.zero.shards(self.g.blocks[bi].numel).size, dtype=self.dtype,
                           device=device)
        home[:hi - lo].copy_(master[lo:hi])
        return home

    def _stream_home(self, bi: int, master: torch.Tensor) -> torch.Tensor | None:
        """Block bi's streamed 16-bit weights' home: a host buffer the streamer adopts, or None
        when they went straight to their swap file (stage 3: this rank's padded shard)."""
        cfg, block = self.cfg, self.g.blocks[bi]
        if self.g.shards_weights:  # stage 3: the home is this rank's shard, padded
            home = self._shard(bi, master, self.g.device if cfg.offload_params == "none" else "cpu")
            if cfg.offload_params == "nvme":  # its own swap file, in the rank's store
                self.store.write(TrainingStreamer.name(block), home).wait()
                return None
            return home
        if cfg.offload_params == "cpu":  # the streamer adopts it as the block's home
            return master.to(self.dtype)
        # straight to its swap file(s): the model never sits in RAM at once (a routed
        # expert's weights are a file of their own: offload/stream/routed.py)
        units = weight_units(block.numel, self.weight_experts.get(bi, []))
        write_units(self.store, TrainingStreamer.unit_names(block, units), units,
                    master.to(self.dtype)).wait()
        return None

    def _start_streaming(self, stream_flats: list, frozen_base: bool, source: Any, fill,
                         trainable: set[int]) -> None:
        """The streamer of the trainable layers or of the frozen base, then every other frozen
        parameter onto the device."""
        g, cfg, model = self.g, self.cfg, self.g.module
        stage3_on_device = g.shards_weights and cfg.offload_params == "none"
        if self.layer_of:
            self.streaming = TrainingStreamer(
                g.layers, g.blocks, sorted(self.layer_of, key=self.layer_of.get),
                StreamSettings("cpu" if stage3_on_device else cfg.offload_params, g.device,
                               self.dtype, self.pin, nvme_ahead=cfg.prefetch_blocks),
                flats16=stream_flats, store=self.store, account=self.account,
                stage3=(Stage3(ShardGather(g.zero), home="device" if stage3_on_device else "host")
                        if g.shards_weights else None), experts=self.weight_experts)
            trainable.update(id(s.param) for bi in self.layer_of for s in g.blocks[bi].slots)
        # frozen parameters still on meta come from the source under their checkpoint names
        fill_frozen = ((lambda views: fill({base_checkpoint_name(n): v for n, v in views.items()}))
                       if fill is not None else None)
        # a quantized base (QLoRA) is a byte block in its files whatever its tier: on the device it
        # is loaded once by the same streamer, as inference's residency "device" (a 16-bit base
        # there is an ordinary frozen parameter, placed below)
        quantized_resident = (not frozen_base and cfg.offload_params == "none"
                              and g.layers is not None and hasattr(source, "layer_ranges"))
        if frozen_base or quantized_resident:
            self.streaming = FrozenBaseStreamer(
                g.layers, StreamSettings("device" if quantized_resident else cfg.offload_params,
                                         g.device, self.dtype, self.pin,
                                         nvme_ahead=cfg.prefetch_blocks),
                store=self.store, account=self.account,
                # a quantized base (QLoRA) is streamed from its block files as they are
                base=(StoredBase([source.layer_ranges(i) for i in range(len(g.layers))],
                                 base_checkpoint_name) if hasattr(source, "layer_ranges")
                      else FilledBase(fill_frozen, prefix=f"{g.block_list_path}.")))
            trainable.update(id(p) for layer in g.layers
                             for p in streamed_params(layer, frozen_only=True).values())
        if maps_frozen_rest(cfg.offload_params, g.device):
            # the device is the host: the embeddings and head are read through a map of their
            # swap files rather than held (offload/memory/mapped.py)
            self.mapped = map_frozen(model, self.store, self.dtype, trainable, fill_frozen)
            if self.mapped:
                self.account.add("nvme", "frozen",
                                 sum(t.numel() * t.element_size() for t in self.mapped))
        moved = move_frozen_and_buffers(model, g.device, self.dtype, trainable, fill_frozen)
        if moved:
            self.account.add("device", "frozen", moved)


def streams_frozen_base(cfg: OffloadConfig, g: Grouping) -> bool:
    """offload_params on a model whose layers hold frozen parameters (LoRA's base): those are
    streamed (offload/stream/frozen.py) and the trainable ones stay resident."""
    if cfg.offload_params == "none" or not has_frozen_layers(g.layers):
        return False
    if g.zero is not None and g.zero.stage == 3:
        raise ConfigError("a frozen base (LoRA) at ZeRO stage 3 is not built (its layers would be "
                          "gathered from the ranks' shards): use zero_stage 0, 1 or 2")
    return True


def has_frozen_layers(layers: nn.Module | None) -> bool:
    """The layers hold frozen parameters (a LoRA base)."""
    return layers is not None and any(not p.requires_grad for p in layers.parameters())


def check_streamable(g: Grouping) -> None:
    if g.layers is None:
        raise ConfigError("offload_params streams the blocks of the model's nn.ModuleList; "
                          "this model has none")
    owned = {id(s.param) for b in g.blocks if b.module is not None for s in b.slots}
    for layer in g.layers:
        for name, p in layer.named_parameters():
            if id(p) not in owned:
                raise ConfigError(f"offload_params: parameter {name!r} of a block is frozen "
                                  f"or shared outside the block; streamed blocks must own "
                                  f"all their parameters and train them")


def make_store(cfg: OffloadConfig, g: Grouping, plan: TrainingPlan):
    """The swap store under nvme_dir, when optimizer state or weights live on NVMe."""
    if cfg.offload != "nvme" and cfg.offload_params != "nvme":
        return None
    from nvme import IOEngine, SwapStore

    io = IOEngine(threads=cfg.io_threads, block_bytes=cfg.io_block_bytes,
                  queue_depth=cfg.io_queue_depth)
    # each rank its own directory: its own lock, manifest and shard files
    directory = cfg.nvme_dir if g.zero is None else rank_dir(cfg.nvme_dir, g.zero.rank)
    store = SwapStore(directory, engine=io, durable=cfg.swap_fsync,
                      verify="always" if cfg.verify_checksums else "never")
    # a resumed run rewrites the files a stopped one left: their space is reusable (one
    # tensor at a time is written beside its old version, the largest block's worth)
    largest = max(b.numel for b in g.blocks) * 4
    store.preflight(max(plan.total("nvme") - store.stored_bytes(), largest))
    return store


def make_zero(cfg: OffloadConfig, device: torch.device,
              frozen_base: bool = False) -> ZeroGroup | None:
    """The data-parallel group when this process is one of several ranks (the default
    process group, or one initialised from torchrun's environment), else None. `frozen_base`:
    the layers hold frozen parameters (LoRA), which offload_params streams at stages 0-2 too --
    each rank the whole base, from its own tier (nothing of it is sharded or communicated)."""
    if not ensure_process_group(device):
        return None
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return None
    why = across_ranks_error(cfg, frozen_base)
    if why is not None:
        raise ConfigError(why)
    return ZeroGroup(cfg.zero_stage, device)


def across_ranks_error(cfg: OffloadConfig, frozen_base: bool = False) -> str | None:
    """Why `cfg` cannot run on several data-parallel ranks (one line saying what to change),
    or None."""
    if cfg.offload_params != "none" and cfg.zero_stage < 3 and not frozen_base:
        return ("offload_params across data-parallel ranks streams each rank's shard of the "
                "16-bit weights: that is ZeRO stage 3; set zero_stage=3 (--zero-stage 3), or "
                "offload_params='none'")
    if cfg.delayed_update and cfg.zero_stage == 3:
        return ("delayed_update at ZeRO stage 3 is not supported: the layers' 16-bit weights "
                "are gathered from the very shards the delayed step would be writing; use "
                "zero_stage 0-2 (--zero-stage 2) or drop delayed_update")
    return None
