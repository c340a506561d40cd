"""Where an engine's weights go at set-up (offload/train/engine.py calls these once, in __init__).

Each block's fp32 masters go into the optimizer state and its 16-bit weights to their tier: a
device flat buffer the parameters become views of, or the streamer's home (host buffer or swap
file; at ZeRO stage 3 this rank's shard of it). One block at a time: the extra memory while
initialising is one block. Then the streamer starts: TrainingStreamer for trainable layers
(offload_params, stage 3), or FrozenBaseStreamer for a LoRA model's frozen base (offload_params
with frozen parameters in the layers: the adapters stay resident), and every other frozen
parameter goes to the device. Also here: the swap store and the data-parallel group the
placement depends on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload.memory.layout import streamed_params
from offload.memory.blocks import bind_views, gather_flat, move_frozen_and_buffers
from offload.config import ConfigError, OffloadConfig
from offload.stream.frozen import FrozenBaseStreamer
from offload.memory.mapped import map_frozen, maps_frozen_rest
from offload.zero.rest import RestGather
from offload.lora import base_checkpoint_name
from offload.stream.train import TrainingStreamer
from offload.zero.group import ShardGather, ZeroGroup, ensure_process_group, rank_dir

if TYPE_CHECKING:
    from offload.train.engine import Engine


def place_weights(engine: "Engine", model: nn.Module, source: Any) -> None:
    """Masters into the state, 16-bit weights to their tier, then the streamer (module
    docstring). Parameters on the meta device are filled from `source`: an object with
    read_tensors_into({name: tensor}) (a checkpoint reader) or such a callable."""
    e, cfg = engine, engine.cfg
    e.flat16 = []  # device flat buffers (None when streamed)
    e.layers = model.get_submodule(e.block_list_path) if e.block_list_path is not None else None
    e.layer_of = {}  # block index -> layer index, for streamed blocks
    # LoRA: the layers' frozen base is streamed instead, the adapters stay resident
    frozen_base = streams_frozen_base(e)
    streams = (cfg.offload_params != "none" and not frozen_base) or e.shards_weights
    if streams:
        check_streamable(e)
    stream_flats: list[torch.Tensor | None] = []
    # fp32 on the CPU: resident parameters are views of their masters (the stepper then
    # neither copies nor uploads the updated weights)
    e.shares_masters = cfg.weights_share_masters(e.device, e.world)
    # stages 1-3: resident device weights padded to equal shards, all-gathered in place after a step
    e.flat16_padded = []
    fill = getattr(source, "read_tensors_into", source)
    trainable: set[int] = set()
    for bi, block in enumerate(e.blocks):
        master = gather_flat(block, torch.float32, source=fill)
        if e.zero is not None:  # every rank starts from rank 0's weights
            e.zero.broadcast_(master)
        e.state.init_block(bi, master)
        trainable.update(id(s.param) for s in block.slots)
        if streams and block.module is not None:
            e.layer_of[bi] = len(e.layer_of)
            stream_flats.append(_stream_home(e, bi, master))
            e.flat16.append(None)
            e.flat16_padded.append(None)
            continue
        if e.shards_weights:  # stage 3: this rank's shard is the home, modules gather the rest
            lo, hi = e.owned(bi)
            home = torch.zeros(e.zero.shards(block.numel).size, dtype=e.dtype, device=e.device)
            home[:hi - lo].copy_(master[lo:hi])
            e.account.add("device", "weights", home.numel() * home.element_size())
            e.rest_gathers.append(RestGather(model, block, home, e.zero, e.account, e.dtype, e.device))
            trainable.update(id(s.param) for s in block.slots)  # meta ones were replaced
            e.flat16.append(home)
            e.flat16_padded.append(None)  # nothing all-gathered after a step (zero_rest.py)
            del master
            continue
        padded = None
        if e.shares_masters:
            flat = e.state.acquire(bi)[0]
        else:
            size = e._padded_numels()[bi] if e.gathers_weights else block.numel
            padded = torch.zeros(size, dtype=e.dtype, device=e.device)
            flat = padded[:block.numel]
            flat.copy_(master)
            e.account.add("device", "weights", padded.numel() * padded.element_size())
        bind_views(block, flat, model)
        e.flat16.append(flat)
        e.flat16_padded.append(padded)
        del master
    _start_streaming(e, model, stream_flats, frozen_base, source, fill, trainable)


def _stream_home(e: "Engine", bi: int, master: torch.Tensor) -> torch.Tensor | None:
    """Block bi's streamed 16-bit weights' home: a host buffer the streamer adopts, or None
    when they went straight to their swap file (stage 3: this rank's padded shard)."""
    cfg, block = e.cfg, e.blocks[bi]
    if e.shards_weights:  # stage 3: the home is this rank's shard, padded
        lo, hi = e.owned(bi)
        home = torch.zeros(e.zero.shards(block.numel).size, dtype=e.dtype,
                           device=e.device if cfg.offload_params == "none" else "cpu")
        home[:hi - lo].copy_(master[lo:hi])
        if cfg.offload_params == "nvme":  # its own swap file, in the rank's store
            e.store.write(TrainingStreamer.name(block), home).wait()
            return None
        return home
    if cfg.offload_params == "cpu":  # the streamer adopts it as the block's home
        return master.to(e.dtype)
    # straight to its swap file: the model never sits in RAM at once
    e.store.write(TrainingStreamer.name(block), master.to(e.dtype)).wait()
    return None


def _start_streaming(e: "Engine", model: nn.Module, stream_flats: list, frozen_base: bool,
                     source: Any, fill, trainable: set[int]) -> None:
    """The streamer of the trainable layers or of the frozen base, then every other frozen
    parameter onto the device."""
    cfg = e.cfg
    e.streaming = None
    if e.layer_of:
        e.streaming = TrainingStreamer(
            e.layers, e.blocks, sorted(e.layer_of, key=e.layer_of.get),
            "cpu" if e.shards_weights and cfg.offload_params == "none" else cfg.offload_params,
            device=e.device, dtype=e.dtype, pin=e.pin, flats16=stream_flats, store=e.store,
            account=e.account, host_ahead=1, nvme_ahead=cfg.prefetch_blocks,
            shards=ShardGather(e.zero) if e.shards_weights else None,
            home="device" if e.shards_weights and cfg.offload_params == "none" else "host")
        trainable.update(id(s.param) for bi in e.layer_of for s in e.blocks[bi].slots)
    # frozen parameters still on meta come from the source under their checkpoint names
    fill_frozen = ((lambda views: fill({base_checkpoint_name(n): v for n, v in views.items()}))
                   if fill is not None else None)
    # a quantized base (QLoRA) is a byte block in its files whatever its tier: on the device it
    # is loaded once by the same streamer, as inference's residency "device" (a 16-bit base
    # there is an ordinary frozen parameter, placed below)
    quantized_resident = (not frozen_base and cfg.offload_params == "none" and e.layers is not None
                          and hasattr(source, "layer_ranges"))
    if frozen_base or quantized_resident:
        e.streaming = FrozenBaseStreamer(
            e.layers, "device" if quantized_resident else cfg.offload_params,
            device=e.device, dtype=e.dtype, pin=e.pin,
            store=e.store, account=e.account, host_ahead=1, nvme_ahead=cfg.prefetch_blocks,
            source=fill_frozen, prefix=f"{e.block_list_path}.",
            # a quantized base (QLoRA) is streamed from its block files as they are
            files=([source.layer_ranges(i) for i in range(len(e.layers))]
                   if hasattr(source, "layer_ranges") else None),
            checkpoint_name=base_checkpoint_name)
        trainable.update(id(p) for layer in e.layers
                         for p in streamed_params(layer, frozen_only=True).values())
    if maps_frozen_rest(cfg.offload_params, e.device):
        # the device is the host: the embeddings and head are read through a map of their
        # swap files rather than held (offload/memory/mapped.py)
        e.mapped = map_frozen(model, e.store, e.dtype, trainable, fill_frozen)
        if e.mapped:
            e.account.add("nvme", "frozen", sum(t.numel() * t.element_size() for t in e.mapped))
    moved = move_frozen_and_buffers(model, e.device, e.dtype, trainable, fill_frozen)
    if moved:
        e.account.add("device", "frozen", moved)


def streams_frozen_base(e: "Engine") -> bool:
    """offload_params on a model whose layers hold frozen parameters (LoRA's base): those are
    streamed (offload/stream/frozen.py) and the trainable ones stay resident."""
    if e.cfg.offload_params == "none" or not has_frozen_layers(e.layers):
        return False
    if e.zero is not None and e.zero.stage == 3:
        raise ConfigError("a frozen base (LoRA) at ZeRO stage 3 is not built (its layers would be "
                          "gathered from the ranks' shards): use zero_stage 0, 1 or 2")
    return True


def has_frozen_layers(layers: nn.Module | None) -> bool:
    """The layers hold frozen parameters (a LoRA base)."""
    return layers is not None and any(not p.requires_grad for p in layers.parameters())


def check_streamable(e: "Engine") -> None:
    if e.layers is None:
        raise ConfigError("offload_params streams the blocks of the model's nn.ModuleList; "
                          "this model has none")
    owned = {id(s.param) for b in e.blocks if b.module is not None for s in b.slots}
    for layer in e.layers:
        for name, p in layer.named_parameters():
            if id(p) not in owned:
                raise ConfigError(f"offload_params: parameter {name!r} of a block is frozen "
                                  f"or shared outside the block; streamed blocks must own "
                                  f"all their parameters and train them")


def make_store(e: "Engine"):
    """The swap store under nvme_dir, when optimizer state or weights live on NVMe."""
    cfg = e.cfg
    if cfg.offload != "nvme" and cfg.offload_params != "nvme":
        return None
    from nvme import IOEngine, SwapStore

    io = IOEngine(threads=cfg.io_threads, block_bytes=cfg.io_block_bytes,
                  queue_depth=cfg.io_queue_depth)
    # each rank its own directory: its own lock, manifest and shard files
    directory = cfg.nvme_dir if e.zero is None else rank_dir(cfg.nvme_dir, e.zero.rank)
    store = SwapStore(directory, engine=io, durable=cfg.swap_fsync,
                      verify="always" if cfg.verify_checksums else "never")
    # a resumed run rewrites the files a stopped one left: their space is reusable (one
    # tensor at a time is written beside its old version, the largest block's worth)
    largest = max(b.numel for b in e.blocks) * 4
    store.preflight(max(e.plan.total("nvme") - store.stored_bytes(), largest))
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
