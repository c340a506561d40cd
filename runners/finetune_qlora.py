"""runners.finetune --lora-rank R --quantize int4|int8 (QLoRA): the quantized base.

The base's projections are quantized once into the cache by runners.infer's own conversion
(runners/infer_quant.py -> offload/models/quantized.py quantize_checkpoint), into the cache
directory runners.infer --quantize reads by default, so inference with the adapter reuses the
same blocks (the cache key is the source's identity and the settings; a changed checkpoint
converts again). A preset has no checkpoint to quantize: its seeded weights are written once as
one, exactly as runners.infer does for a preset (the same directory, the same values). The
engine streams the blocks as stored (offload/stream/frozen.py, QuantizedSource).

Also here: the blocks' digest (the base fingerprint of a QLoRA run: the engine never reads the
quantized layers through the source; every tensor's CRC-32C, against which each read of the
blocks is checked), and the dequantized base tensors that --merge folds the adapters into (PEFT
merges QLoRA into the dequantized 16-bit base).
"""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import torch

from nvme.format import SafetensorsFile
from offload.models.quantized import (PROJECTIONS, QuantizedBlocks, block_file, default_cache_root,
                                      projection_specs)
from runners.common import dtype_label



def cache_root(cache_dir: str | None) -> str:
    """--cache-dir, or runners.infer's default (~/.cache/offload), absolute."""
    return os.path.abspath(os.path.expanduser(cache_dir or default_cache_root()))


def plan_specs(args, model_cfg) -> list[dict]:
    """Each layer's {projection: QuantSpec} for the plan, without converting anything (a GGUF
    source's Q8_0/Q4_x tensors kept at group 32, as the conversion keeps them)."""
    from runners.infer_quant import quant_source

    if os.path.isfile(args.model):
        return quant_source(args, model_cfg)[1]
    from offload.models.quantized import QuantSettings
    return projection_specs(model_cfg, QuantSettings(args.quantize, args.group_size))


def convert(args, model_cfg, source, root: str, dtype: torch.dtype):
    """(checkpoint reader, QuantizedBlocks): the base quantized into `root`/quant unless a
    finished conversion of the same source and settings is there. A preset's seeded weights
    are first written as a checkpoint in `root`, where runners.infer --model PRESET
    --init-seed SEED --offload-dir ROOT writes (and then reuses) them."""
    from offload.models import CheckpointReader
    from runners.infer_quant import convert_quantized, quant_source

    reader = source if hasattr(source, "locations") else None
    if reader is None:  # a preset: the seed is --seed, as its unquantized base's
        from runners.infer import random_checkpoint
        path = os.path.join(root, f"{args.model}-seed{args.seed}-{dtype_label(dtype)}")
        random_checkpoint(model_cfg, path, args.seed, dtype)
        reader = CheckpointReader(path)  # open for the run, as load_model's readers are
    ns = SimpleNamespace(quantize=args.quantize, group_size=args.group_size, model=args.model,
                         offload_dir=root)
    return reader, convert_quantized(ns, model_cfg, reader, dtype, quant_source(ns, model_cfg))


def blocks_digest(blocks: QuantizedBlocks) -> str:
    """The quantized layers' part of the base fingerprint: a digest of every block tensor's
    CRC-32C as its file carries it. Every read of those bytes (the streamer's, the device
    load's) is checked against the same CRCs (offload/models/quantized.py QuantizedBlocks.ranges),
    so the run computes with exactly the bytes this digest names: a damaged block stops the run
    at its first read, a block rewritten whole (bytes and CRCs) changes the digest and a resume
    refuses it. Nothing is read back from a file of its own (a digest kept beside the blocks
    would vouch for bytes it never saw)."""
    digest = hashlib.blake2b(digest_size=12)
    for i in range(len(blocks.specs)):
        for r in blocks.ranges(i):
            digest.update(f"{i}:{r.name}:{r.nbytes}:{r.checksum[0]}:{r.checksum[1]:08x};".encode())
    return digest.hexdigest()


class DequantizedLayers:
    """A QLoRA base's decoder-layer tensors as the dense values it computes with: projection
    weights dequantized from their codes and scales, norms and biases as stored; one layer's
    file open at a time (checkpoint order reads the layers in turn)."""

    def __init__(self, blocks: QuantizedBlocks, model_cfg):
        from offload.models import block_parameter_shapes

        self.blocks, self.shapes_of = blocks, lambda i: block_parameter_shapes(model_cfg, i)
        self.shapes = self.shapes_of(0)
        self._layer, self._file = -1, None

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor `name` (a checkpoint name) in `dtype`, or None outside the layers."""
        from offload.quant.format import dequantize

        if not name.startswith("model.layers."):
            return None
        layer, rel = name[len("model.layers."):].split(".", 1)
        if int(layer) != self._layer:
            self.close()
            self._layer, self._file = int(layer), SafetensorsFile(block_file(self.blocks.path, int(layer)))
            self.shapes = self.shapes_of(int(layer))  # DeepSeek's dense layers differ
        proj = rel.rsplit(".", 1)[0]
        spec = self.blocks.specs[self._layer].get(proj)
        if rel.endswith(".weight") and proj in PROJECTIONS and spec is not None:
            parts = {k: self._file.read(f"{proj}.{k}") for k in ("qweight", "scales", "mins")
                     if f"{proj}.{k}" in self._file.tensors}
            return dequantize(parts, spec, self.shapes[rel][1], dtype)
        return self._file.read(rel).to(dtype)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
