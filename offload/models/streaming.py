"""Streaming a Llama-family checkpoint: each decoder layer's tensors read in place from the
checkpoint's safetensors shards by the block streamer (offload/stream/streamer.py), which knows nothing of
checkpoints or of the `model.layers.{i}.` naming -- that knowledge lives here, with the model."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from nvme.io import IOEngine
from offload.models.llama import build_model, materialize_non_block
from offload.stream.streamer import BlockStreamer, TensorRange


def checkpoint_ranges(reader, layer: int) -> list[TensorRange]:
    """Block `layer`'s tensors as byte ranges of the checkpoint's shards (names relative to the
    layer), for the streamer to read in place: no conversion pass, no second copy on disk;
    each with the CRC its shard carries for it (files this program wrote), checked on every read."""
    prefix = f"model.layers.{layer}."
    return [TensorRange(loc.name[len(prefix):], loc.path, loc.offset, loc.nbytes, loc.dtype,
                        reader.checksum(loc.name))  # checked on every read where the file has one
            for loc in reader.block_locations(layer)]


def load_streamed(reader, residency: Sequence[str], *, device: torch.device | str, dtype: torch.dtype,
                  host_ahead: int = 1, nvme_ahead: int = 2, io: IOEngine | None = None,
                  fetch_delay_s: float = 0.0, zero_copy_host: bool | None = None,
                  progress: Callable[[int], None] | None = None):
    """(model, attached streamer) for an open `offload.models.CheckpointReader`: built on meta,
    non-block weights materialised on the device, blocks placed per `residency`."""
    model = build_model(reader.config, "meta", dtype)
    materialize_non_block(model, device, dtype, reader)
    files = [checkpoint_ranges(reader, i) for i in range(reader.config.num_hidden_layers)]
    streamer = BlockStreamer(model.model.layers, residency, device=device, dtype=dtype, files=files,
                             host_ahead=host_ahead, nvme_ahead=nvme_ahead, io=io,
                             zero_copy_host=zero_copy_host, fetch_delay_s=fetch_delay_s,
                             progress=progress)
    return model, streamer.attach()
