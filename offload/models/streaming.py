"""Streaming a Llama-family checkpoint: each decoder layer's tensors read in place from the
checkpoint's safetensors shards by the block streamer (offload/stream/streamer.py), which knows nothing of
checkpoints or of the `model.layers.{i}.` naming -- that knowledge lives here, with the model."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from nvme.io import IOEngine
from offload.models.families import moe_names
from offload.models.llama import build_model, materialize_non_block
from offload.models.hf import CheckpointError
from offload.models.mxfp4 import refuse_in_place
from offload.stream.expert_placement import ExpertPlacement
from offload.stream.experts import ExpertStore
from offload.stream.streamer import BlockStreamer, TensorRange


def checkpoint_ranges(reader, layer: int) -> list[TensorRange]:
    """Block `layer`'s tensors as byte ranges of the checkpoint's shards (names relative to the
    layer), for the streamer to read in place: no conversion pass, no second copy on disk;
    each with the CRC its shard carries for it (files this program wrote), checked on every read."""
    prefix = f"model.layers.{layer}."
    refuse_in_place(reader.block_locations(layer), CheckpointError)  # gpt-oss's MXFP4 experts (mxfp4.py)
    return [TensorRange(loc.name[len(prefix):], loc.path, loc.offset, loc.nbytes, loc.dtype,
                        reader.checksum(loc.name))  # checked on every read where the file has one
            for loc in reader.block_locations(layer)]


def load_streamed(reader, residency: Sequence[str], *, device: torch.device | str, dtype: torch.dtype,
                  host_ahead: int = 1, nvme_ahead: int = 2, io: IOEngine | None = None,
                  fetch_delay_s: float = 0.0, zero_copy_host: bool | None = None,
                  progress: Callable[[int], None] | None = None,
                  experts: ExpertPlacement | None = None):
    """(model, attached streamer) for an open `offload.models.CheckpointReader`: built on meta,
    non-block weights materialised on the device, blocks placed per `residency`. `experts`: an
    MoE model's routed experts placed one by one (`model.expert_store`), the blocks' dense parts
    streamed without them."""
    model = build_model(reader.config, "meta", dtype)
    materialize_non_block(model, device, dtype, reader)
    files = [checkpoint_ranges(reader, i) for i in range(reader.config.num_hidden_layers)]
    return stream_blocks(model, reader, files, residency, dtype, experts, device=device, dtype=dtype,
                         host_ahead=host_ahead, nvme_ahead=nvme_ahead, io=io,
                         zero_copy_host=zero_copy_host, fetch_delay_s=fetch_delay_s, progress=progress)


def stream_blocks(model, reader, files: list[list[TensorRange]], residency: Sequence[str],
                  store_dtype: torch.dtype, experts: ExpertPlacement | None, **streamer_args):
    """The streamer over `model`'s blocks from `files`, and with `experts` the expert store
    (set as `model.expert_store`, None otherwise; the dense parts then stream without them)."""
    cfg = reader.config
    model.expert_store = None
    skip: tuple[str, ...] = ()
    if experts is not None and cfg.num_experts:
        skip = (expert_prefix(cfg),)
        model.expert_store = place_experts(model, reader, files, experts, store_dtype,
                                           streamer_args["device"], streamer_args["io"])
        files = [[r for r in block if not r.name.startswith(skip)] for block in files]
    streamer = BlockStreamer(model.model.layers, residency, files=files, skip=skip, **streamer_args)
    return model, streamer.attach()


def expert_prefix(cfg) -> str:
    """Where a layer's routed experts sit, relative to the layer (`mlp.experts.`)."""
    return f"{moe_names(cfg.architecture)[0]}.experts."


def place_experts(model, reader, files: list[list[TensorRange]], placement: ExpertPlacement,
                  dtype: torch.dtype, device, io) -> ExpertStore:
    """The ExpertStore of `model`'s MoE layers (DeepSeek-V3's first dense layers have none: the
    placement's homes are per MoE layer): each expert's ranges cut out of its layer's `files`
    (names made relative to the expert), a copy of every router for the prediction, every MoE
    module switched to the store."""
    cfg = reader.config
    prefix, ffn = expert_prefix(cfg), moe_names(cfg.architecture)[0]
    L, E, moe_layers = cfg.num_hidden_layers, cfg.num_experts, cfg.moe_layers
    per_expert: list[list[list[TensorRange]] | None] = [
        [[] for _ in range(E)] if cfg.moe_layer(i) else None for i in range(L)]
    for i, block in enumerate(files):
        for r in block:
            if r.name.startswith(prefix):
                e, _, rest = r.name[len(prefix):].partition(".")
                per_expert[i][int(e)].append(dataclasses.replace(r, name=rest))
    moes = {i: model.model.layers[i].get_submodule(ffn) for i in moe_layers}
    first = moes[moe_layers[0]]
    # the router is `gate` (gpt-oss: `router`, with a bias); its top-k are the prediction's
    # (DeepSeek-V3's: the logits' top-k, without its sigmoid, groups and correction bias)
    name = "router" if hasattr(first, "router") else "gate"
    parts = ["weight"] + (["bias"] if getattr(getattr(first, name), "bias", None) is not None else [])
    routers = {f"model.layers.{i}.{ffn}.{name}.{p}": torch.empty(
        (E, cfg.hidden_size) if p == "weight" else (E,), dtype=model_dtype(model), device=device)
        for i in moe_layers for p in parts}
    reader.read_tensors_into(routers)
    homes: list[list[str] | None] = [None] * L
    for i, h in zip(moe_layers, placement.homes_for(len(moe_layers), E)):
        homes[i] = h
    store = ExpertStore([moes[i].experts if i in moes else None for i in range(L)], homes, device=device,
                        dtype=dtype, files=per_expert, io=io, top_k=cfg.num_experts_per_tok,
                        routers=[(routers[f"model.layers.{i}.{ffn}.{name}.weight"],
                                  routers.get(f"model.layers.{i}.{ffn}.{name}.bias"))
                                 if i in moes else None for i in range(L)],
                        **placement.store_args(cfg.num_experts_per_tok))
    for i, m in moes.items():
        m.use_store(store, i)
    return store


def model_dtype(model) -> torch.dtype:
    return model.model.embed_tokens.weight.dtype
