"""runners.infer's --quantize: which spec each projection gets, the cached conversion (with a
disk check and a progress bar only when something is converted), and the quantized matmul's
transient bytes for the plan. The mechanisms are offload/quant/ and offload/models/quantized.py."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

from offload.config import format_bytes
from offload.models import ModelConfig, block_parameter_shapes
from offload.models.quantized import (QuantizedBlocks, QuantSettings, gguf_types, projection_specs,
                                      quantize_checkpoint)
from offload.quant.matmul import workspace_bytes
from offload.quant.format import QuantError
from offload.memory.tiers import disk_free_bytes
from runners.common import RunnerError, writable_dir


def quant_source(args, cfg: ModelConfig):
    """None without --quantize; else (settings, per-layer specs, the GGUF path or None)."""
    if args.quantize == "none":
        return None
    # checked in main; the activations are not in the stored codes (load_model sets them)
    settings = QuantSettings(args.quantize, args.group_size, getattr(args, "activations", "fp32"))
    gguf_path = args.model if os.path.isfile(args.model) else None
    types = None
    if gguf_path is not None:
        from offload.models.gguf import GGUFReader
        with GGUFReader(gguf_path) as g:
            types = gguf_types(g)
    return settings, projection_specs(cfg, settings, types), gguf_path


def convert_quantized(args, cfg, reader, dtype, quant) -> QuantizedBlocks:
    """The quantized blocks in the cache, converted now unless a finished conversion of the
    same source and settings is there."""
    settings, _specs, gguf_path = quant
    root = os.path.abspath(os.path.expanduser(args.offload_dir or os.path.join("~", ".cache", "offload")))
    writable_dir(os.path.join(root, "quant"), "--offload-dir")
    bar = None

    def check_disk(qdir: str, need: int) -> None:
        nonlocal bar
        free = disk_free_bytes(os.path.dirname(qdir))
        if need > free:
            raise RunnerError(f"the {args.quantize} blocks need {format_bytes(need)} on disk, "
                              f"{format_bytes(free)} free at {qdir}; use --offload-dir elsewhere")
        bar = tqdm(total=cfg.num_hidden_layers, desc=f"blocks to {args.quantize} (once)",
                   unit="block", file=sys.stderr)

    try:
        return quantize_checkpoint(reader, settings, dtype, cache_root=root, gguf_path=gguf_path,
                                   name=gguf_path or args.model, before_convert=check_disk,
                                   progress=lambda i: bar.update(1))
    except QuantError as e:
        raise RunnerError(f"--quantize {args.quantize}: {e}") from None
    finally:
        if bar is not None:
            bar.close()


def quant_scratch(cfg, quant, batch: int, context: int, new_tokens: int, device, dtype) -> int:
    """The quantized matmul's transient bytes (offload/quant/matmul.py workspace_bytes) for the widest
    projection at the prefill's rows: dequantized chunks, padded inputs, transposed outputs."""
    if quant is None:
        return 0
    rows = batch * max(1, context - new_tokens)
    return max(workspace_bytes(*block_parameter_shapes(cfg, i)[f"{proj}.weight"], spec, rows, device, dtype)
               for i, layer in enumerate(quant[1]) for proj, spec in layer.items())
