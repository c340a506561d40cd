"""LoRA over a frozen base streamed from NVMe: one model far larger than this machine's RAM
allows to train in full, one update, peak RSS and where the time went.

The model is built on the meta device (nothing allocated), wrapped with LoRA adapters
(offload/lora.py), and handed to the engine with `offload_params="nvme"`: each layer's frozen
base is generated from a seed and written to its swap file one layer at a time (init writes the
random base once), then streamed through forward, recompute and backward
(offload/stream/frozen.py); the adapters' fp32 masters and moments live in host RAM. The
embeddings and head (frozen, bf16) are written once into the swap directory and read through a
memory map, a slice at a time (offload/memory/mapped.py: the device here is the host). Full fine-tuning of the same model would need
16 bytes per parameter of model state (printed beside it).

    python scripts/bench_lora.py                        # 8B, r = 16, bf16 base, 1 x 32 tokens
    python scripts/bench_lora.py --quantize int4        # QLoRA: the base as int4 blocks
    python scripts/bench_lora.py --preset 1B --rank 8   # quicker

With --quantize the seeded base is quantized once, layer by layer, into block files under the
swap directory (offload/models/quantized.py), and the engine streams those as they are stored.

Prints one JSON line per phase and a Markdown row; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import offload  # noqa: E402
from offload.config import OffloadConfig, format_bytes  # noqa: E402
from offload.lora import LoraConfig, apply_lora  # noqa: E402
from offload.models import build_model, num_params, preset  # noqa: E402
from offload.models.llama import seeded_init  # noqa: E402
from offload.models.quantized import quantize_layers  # noqa: E402
from offload.memory.tiers import cpu_model, peak_rss_bytes  # noqa: E402


class _SeededReader:
    """The non-block weights of the seeded model, for QuantizedSource (as a reader gives them)."""

    def __init__(self, init):
        self.read_tensors_into = init


def quantized_source(cfg_model, mode: str, init, directory: str):
    """The seeded base's layers quantized once into block files (one layer in RAM at a time)."""
    from offload.models.config import block_parameter_shapes, block_prefix
    from offload.models.quantized import (QuantizedSource, QuantSettings, convert_blocks,
                                          projection_specs)

    def block(i: int):
        dense = {n: torch.empty(s) for n, s in block_parameter_shapes(cfg_model).items()}
        init({block_prefix(i) + n: t for n, t in dense.items()})
        return dense, {}

    specs = projection_specs(cfg_model, QuantSettings(mode))
    blocks = convert_blocks(directory, f"bench-seed0-{mode}", cfg_model, specs, torch.bfloat16, block)
    return QuantizedSource(_SeededReader(init), blocks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="8B")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--seq", type=int, default=32, help="tokens in the one sequence of the batch")
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=1,
                   help="layers read ahead from NVMe (each one more device slot of a layer's base)")
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="QLoRA: the base's projections as int8/int4 blocks")
    p.add_argument("--dir", default=None, help="swap directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    cfg_model = preset(args.preset)
    swap = args.dir or tempfile.mkdtemp(prefix="offload-lora-")
    init = seeded_init(0, cfg_model.initializer_range)
    model = build_model(cfg_model, dtype=torch.bfloat16)  # meta: nothing allocated
    source, quant_s = init, 0.0
    if args.quantize:
        t0 = time.perf_counter()
        source = quantized_source(cfg_model, args.quantize, init, os.path.join(swap, "quant"))
        quant_s = time.perf_counter() - t0
        quantize_layers(model, source.blocks.specs, torch.bfloat16)
    apply_lora(model, LoraConfig(rank=args.rank, alpha=2 * args.rank, targets=args.targets), seed=0)
    total = num_params(cfg_model)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cfg = OffloadConfig(offload="cpu", offload_params="nvme", dtype="bf16", device="cpu",
                        nvme_dir=swap, activation_checkpointing=True, lr=1e-4,
                        prefetch_blocks=args.prefetch)
    rows = []
    try:
        t0 = time.perf_counter()
        engine = offload.initialize(model, cfg, source=source)
        init_s = time.perf_counter() - t0
        rows.append({"phase": "init", "seconds": init_s, "quantize_s": quant_s,
                     "peak_rss": peak_rss_bytes(),
                     "plan": {t: k for t, k in engine.plan.bytes.items()}})
        print(json.dumps(rows[-1]), flush=True)
        g = torch.Generator().manual_seed(0)
        read_before = 0
        for u in range(args.updates):
            ids = torch.randint(0, cfg_model.vocab_size, (1, args.seq), generator=g)
            t0 = time.perf_counter()
            logits = model(ids)[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            rep = engine.last_report
            stats = engine.streaming.streamer.stats
            rows.append({"phase": f"update {u + 1}", "seconds": time.perf_counter() - t0,
                         "loss": loss.item(), "peak_rss": peak_rss_bytes(),
                         "forward_s": rep.forward_s, "backward_s": rep.backward_s,
                         "cpu_step_s": rep.cpu_step_s, "grad_wait_s": rep.grad_wait_s,
                         "disk_read_bytes": stats.moved_bytes["disk"] - read_before,
                         "stream_fetches": dict(stats.fetches)})
            read_before = stats.moved_bytes["disk"]
            print(json.dumps(rows[-1]), flush=True)
        memory = engine.memory_report()
        engine.close()
    finally:
        if args.dir is None:
            shutil.rmtree(swap, ignore_errors=True)
    upd = rows[-1]
    print(f"\n{args.preset} ({total / 1e9:.2f}B params), LoRA r={args.rank} on {args.targets} "
          f"({adapters / 1e6:.1f}M trainable, {100 * adapters / total:.2f}%), "
          f"{args.quantize or 'bf16'} base streamed "
          f"from NVMe, 1 x {args.seq} tokens, activation checkpointing; CPU: {cpu_model()}")
    print("| phase | s | peak RSS | forward s | backward s | CPU step s | disk read |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['phase']} | {r['seconds']:.1f} | {format_bytes(r['peak_rss'])} | "
              f"{r.get('forward_s', 0):.1f} | {r.get('backward_s', 0):.1f} | "
              f"{r.get('cpu_step_s', 0):.2f} | {format_bytes(r.get('disk_read_bytes', 0))} |")
    print(f"full fine-tuning's model states would be {format_bytes(16 * total)} "
          f"(16 B/param); this run's peak RSS {format_bytes(upd['peak_rss'])}")
    print("memory per tier:", json.dumps(memory))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "memory": memory}, f, indent=1)


if __name__ == "__main__":
    main()
