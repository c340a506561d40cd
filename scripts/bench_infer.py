"""Decode speed per weight tier and batch size, against the link floor and plain transformers.

One run, one checkpoint (a ~1B Llama; random weights from the `1B` preset are generated once
into --dir when it holds no checkpoint):
  * link probe: host->device copy (memcpy on CPU) and O_DIRECT disk read of the checkpoint;
  * for each tier in --tiers and each batch in --batches: prefill + greedy decode of
    --new-tokens tokens with every block in that tier; decode tok/s, s/step, bytes streamed
    per step, the floor those bytes imply at the measured bandwidths, and % of that floor;
  * transformers' own generate() on the same checkpoint held in RAM (same dtype, batch sizes).
NVMe runs are cold: reads use O_DIRECT and the page cache is dropped first (when root).

Usage: python scripts/bench_infer.py --dir /tmp/offload-bench/1B-fp32 --new-tokens 5
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time

import psutil
import torch

from offload.config import format_bytes
from offload.generate import generate
from offload.models import CheckpointReader, num_params, preset
from offload.planner import measure_links
from offload.stream import load_streamed
from nvme.io import drop_caches
from offload.tiers import peak_rss_bytes
from runners.infer import random_checkpoint


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def bench_ours(reader, tier: str, batches: list[int], args, links) -> list[dict]:
    cfg = reader.config
    L = cfg.num_hidden_layers
    if tier == "nvme":
        drop_caches()
    model, streamer = load_streamed(reader, [tier] * L, device="cpu", dtype=torch.float32,
                                    nvme_ahead=args.nvme_ahead)
    rows = []
    try:
        # warm-up (first-call allocations, thread pools) outside the timed runs
        generate(model, prompts_for(1, args.prompt_len, cfg.vocab_size), max_new_tokens=2,
                 streamer=streamer)
        for b in batches:
            if tier == "nvme":
                drop_caches()
            res = generate(model, prompts_for(b, args.prompt_len, cfg.vocab_size),
                           max_new_tokens=args.new_tokens, streamer=streamer)
            st = res.decode_stream
            step_s = res.decode_s / res.decode_steps
            # what one step must move: every streamed block once (zero-copy host tier on CPU)
            disk_step = sum(streamer._stored_bytes(i) for i in range(L) if tier == "nvme")
            h2d_step = sum(streamer.block_bytes(i) for i in range(L)
                           if tier == "cpu" and not streamer.zero_copy_host)
            floor = disk_step / (links.disk_gbps * 1e9) + (h2d_step / (links.h2d_gbps * 1e9) if h2d_step else 0)
            rows.append({"engine": "offload", "tier": tier, "batch": b,
                         "prefill_tok_s": res.prefill_tokens_per_s,
                         "decode_tok_s": res.decode_tokens_per_s, "s_per_step": step_s,
                         "disk_bytes_per_step": st.moved_bytes["disk"] / res.decode_steps,
                         "h2d_bytes_per_step": st.moved_bytes["h2d"] / res.decode_steps,
                         "floor_s_per_step": floor,
                         "pct_of_floor": 100 * floor / step_s if floor else None,
                         "compute_wait_s_per_step": st.wait_s / res.decode_steps})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        streamer.close()
        del model, streamer
        gc.collect()
    return rows


def bench_transformers(path: str, batches: list[int], args, vocab: int) -> list[dict]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    rows = []
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():  # warm-up, as for ours
        model.generate(torch.tensor(prompts_for(1, args.prompt_len, vocab)), max_new_tokens=2, **kw)
    for b in batches:
        ids = torch.tensor(prompts_for(b, args.prompt_len, vocab))
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)  # prefill + first token
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, **kw)
            t2 = time.perf_counter()
        decode_s = (t2 - t1) - (t1 - t0)  # the extra new_tokens - 1 decode steps
        steps = args.new_tokens - 1
        rows.append({"engine": "transformers", "tier": "ram", "batch": b,
                     "prefill_tok_s": b * args.prompt_len / (t1 - t0),
                     "decode_tok_s": b * steps / decode_s, "s_per_step": decode_s / steps})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    del model
    gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    out = ["| engine | weights | batch | prefill tok/s | decode tok/s | s/step | disk read/step | "
           "floor s/step | % of floor | compute waited s/step |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = f"{r['pct_of_floor']:.0f}%" if r.get("pct_of_floor") else "n/a"
        floor = f"{r['floor_s_per_step']:.2f}" if r.get("floor_s_per_step") else "-"
        disk = format_bytes(r["disk_bytes_per_step"]) if r.get("disk_bytes_per_step") else "-"
        wait = f"{r['compute_wait_s_per_step']:.2f}" if "compute_wait_s_per_step" in r else "-"
        out.append(f"| {r['engine']} | {r['tier']} | {r['batch']} | {r['prefill_tok_s']:.1f} | "
                   f"{r['decode_tok_s']:.2f} | {r['s_per_step']:.2f} | {disk} | {floor} | {pct} | {wait} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/offload-bench/1B-fp32")
    p.add_argument("--preset", default="1B")
    p.add_argument("--tiers", default="device,cpu,nvme")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--new-tokens", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--nvme-ahead", type=int, default=2)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", help="write all rows here")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = preset(args.preset).replace(dtype="float32")
    random_checkpoint(cfg, args.dir, 0, torch.float32)
    rows: list[dict] = []
    with CheckpointReader(args.dir) as reader:
        shards = sorted({loc.path for loc in reader.locations.values()})
        drop_caches()
        links = measure_links(torch.device("cpu"), shards, seconds=2.0)
        print(f"links: memcpy {links.h2d_gbps:.2f} GB/s, disk read {links.disk_gbps:.2f} GB/s "
              f"(O_DIRECT: {links.disk_direct})", file=sys.stderr)
        for tier in args.tiers.split(","):
            if tier == "nvme":  # the disk is shared and noisy: measure it again just before use
                drop_caches()
                links = measure_links(torch.device("cpu"), shards, seconds=2.0)
                print(f"links before nvme runs: disk read {links.disk_gbps:.2f} GB/s", file=sys.stderr)
            rows += bench_ours(reader, tier, batches, args, links)
    if not args.skip_transformers:
        rows += bench_transformers(args.dir, batches, args, cfg.vocab_size)
    header = (f"{args.preset} ({num_params(cfg) / 1e9:.2f}B params, fp32), {torch.get_num_threads()} "
              f"threads, {platform.processor() or platform.machine()}, "
              f"{format_bytes(psutil.virtual_memory().total)} RAM; disk {links.disk_gbps:.2f} GB/s, "
              f"memcpy {links.h2d_gbps:.2f} GB/s; prompt {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens; peak RSS {format_bytes(peak_rss_bytes())}")
    print(header)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, "links": vars(links)}, f, indent=1)


if __name__ == "__main__":
    main()
