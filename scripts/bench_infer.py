"""Decode speed per weight tier and batch size, against the link floor and plain transformers.

One run, one checkpoint (a ~1B Llama; random weights from the `1B` preset are generated once
into --dir when it holds no checkpoint):
  * weights in host RAM: offload and transformers' own generate() on the same checkpoint, both
    loaded at once and run alternately, --rounds times per batch size (this 2-core VM drifts by
    ±25% over minutes, so only side-by-side runs compare); medians and the median per-round ratio;
  * weights streamed from NVMe (cold: O_DIRECT, page cache dropped when root): decode tok/s,
    s/step, bytes read per step, and the floor those bytes imply at the disk bandwidth the
    streamer gets reading exactly those bytes with no compute, measured just before and just
    after the decode runs (the faster of the two: the stricter floor), and % of that floor;
    a full O_DIRECT pass over the shards is printed beside it;
  * the start-up link probe (memcpy, a short disk read) the runner itself uses;
  * quant: the same preset stored in bf16 (computed in fp32) against its int8 and int4 blocks
    (offload/models/quantized.py), all loaded at once and run alternately: streamed cold from
    NVMe at batch 1 (bytes per token, decode tok/s, % of each one's own floor: the disk rate the
    streamer gets on exactly its bytes) and resident in RAM (decode tok/s at --quant-batches).

Usage: python scripts/bench_infer.py --dir /tmp/offload-bench/1B-fp32 --new-tokens 8
"""

from __future__ import annotations

import os

# as runners/infer.py does, before torch starts OpenMP: idle threads sleep (models/kernels.py);
# transformers runs in this process under the same setting
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import gc
import json
import statistics
import sys
import tempfile
import time

import psutil
import torch

from offload.config import format_bytes
from offload.infer.generate import generate
from offload.models import CheckpointReader, num_params, preset
from offload.infer.plan import disk_read_gbps, measure_links, streamer_disk_gbps
from offload.models import kernels, load_streamed
from nvme.io import drop_caches
from offload.memory.tiers import cpu_model, peak_rss_bytes
from runners.infer import random_checkpoint


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def stream_read_gbps(streamer) -> float:
    """Disk bandwidth for exactly the bytes a decode step streams, read by the streamer itself
    (same requests, same depth in flight) with no compute in between, one full pass, page cache
    dropped first: the link the NVMe floor is set by (the runner measures the same way, for
    --probe-seconds)."""
    drop_caches()
    return streamer_disk_gbps(streamer, float("inf"), max_passes=1)[0]


def bench_runner_floor(reader, path: str, args) -> dict:
    """The runner's printed floor against an O_DIRECT read of the same bytes just before: an
    all-NVMe run of `python -m runners.infer` in this process (issue 16: within 10%, and never
    more than 100% of it)."""
    from runners.common import run_main
    from runners.infer import main as infer_main
    L = reader.config.num_hidden_layers
    ranges = [(loc.path, loc.offset, loc.nbytes) for i in range(L) for loc in reader.block_locations(i)]
    # the probe's own way (16 x 4 MiB requests in flight) before and after, for comparison
    drop_caches()
    first, _ = disk_read_gbps([], ranges=ranges)
    # the same bytes read O_DIRECT the way the streamer reads them (whole blocks, its depth in
    # flight), one full pass by a streamer of our own, just before the run
    model, streamer = load_streamed(reader, ["nvme"] * L, device="cpu", dtype=torch.float32,
                                    nvme_ahead=args.nvme_ahead)
    try:
        direct = stream_read_gbps(streamer)
    finally:
        streamer.close()
        del model, streamer
        gc.collect()
    out = os.path.join(tempfile.mkdtemp(), "run.json")
    rc = run_main(infer_main, ["--model", path, "--weights", "nvme", "--prompt-ids", "3,14,15,92",
                               "--max-new-tokens", str(args.new_tokens), "--output-json", out,
                               "--nvme-ahead", str(args.nvme_ahead)])
    if rc != 0:
        raise SystemExit(f"the runner failed (exit {rc})")
    with open(out) as f:
        m = json.load(f)["metrics"]
    drop_caches()
    after, _ = disk_read_gbps([], ranges=ranges)
    row = {"o_direct_first_gbps": first, "o_direct_gbps": direct, "o_direct_after_gbps": after,
           "runner_disk_gbps": m["link_gbps"]["disk"],
           "runner_pct_of_floor": m["percent_of_floor"], "beat_floor": m["beat_floor"],
           "run_disk_gbps": m["run_disk_gbps"]}
    row["runner_vs_o_direct"] = row["runner_disk_gbps"] / direct
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def bench_nvme(reader, shards: list[str], batches: list[int], args) -> list[dict]:
    cfg = reader.config
    L = cfg.num_hidden_layers
    drop_caches()
    full_pass, _ = disk_read_gbps(shards)
    print(f"disk, full O_DIRECT pass over the shards: {full_pass:.2f} GB/s", file=sys.stderr, flush=True)
    model, streamer = load_streamed(reader, ["nvme"] * L, device="cpu", dtype=torch.float32,
                                    nvme_ahead=args.nvme_ahead)
    rows, disk = [], []
    try:
        # warm-up (first-call allocations, thread pools) outside the timed runs
        generate(model, prompts_for(1, args.prompt_len, cfg.vocab_size), max_new_tokens=2,
                 streamer=streamer)
        disk.append(stream_read_gbps(streamer))
        print(f"disk, the streamed bytes alone, before: {disk[-1]:.2f} GB/s", file=sys.stderr, flush=True)
        for b in batches:
            drop_caches()
            res = generate(model, prompts_for(b, args.prompt_len, cfg.vocab_size),
                           max_new_tokens=args.new_tokens, streamer=streamer)
            st = res.decode_stream
            rows.append({"engine": "offload", "tier": "nvme", "batch": b,
                         "prefill_tok_s": res.prefill_tokens_per_s,
                         "decode_tok_s": res.decode_tokens_per_s,
                         "s_per_step": res.decode_s / res.decode_steps,
                         "disk_bytes_per_step": st.moved_bytes["disk"] / res.decode_steps,
                         "compute_wait_s_per_step": st.wait_s / res.decode_steps})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        disk.append(stream_read_gbps(streamer))
        print(f"disk, the streamed bytes alone, after: {disk[-1]:.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        streamer.close()
        del model, streamer
        gc.collect()
    for r in rows:  # the faster measurement sets the stricter floor
        r["disk_gbps"] = max(disk)
        r["full_pass_disk_gbps"] = full_pass
        r["floor_s_per_step"] = r["disk_bytes_per_step"] / (max(disk) * 1e9)
        r["pct_of_floor"] = 100 * r["floor_s_per_step"] / r["s_per_step"]
    return rows


def quant_settings(variant: str):
    """A variant's settings: int8 or int4 (the runner's default groups), int8/ch (per channel),
    int8/g32, int4/g32, ..."""
    from offload.models.quantized import PER_CHANNEL, QuantSettings
    mode, _, group = variant.partition("/")
    return QuantSettings(mode, 0 if group == "" else PER_CHANNEL if group == "ch" else int(group.lstrip("g")))


def bench_quant(args) -> list[dict]:
    from offload.models.quantized import load_quantized_streamed, quantize_checkpoint
    if args.quant_model:  # a real checkpoint directory (e.g. SmolLM2 converted from its GGUF)
        path = args.quant_model
        with CheckpointReader(path) as reader:
            cfg = reader.config
    else:
        cfg = preset(args.preset)
        path = os.path.join(os.path.dirname(os.path.abspath(args.dir)), f"{args.preset}-bf16")
        random_checkpoint(cfg, path, 0, torch.bfloat16)
    L = cfg.num_hidden_layers
    rows = []
    variants = args.quant_variants.split(",")
    with CheckpointReader(path) as reader:
        cache_root = os.path.join(os.path.dirname(os.path.abspath(args.dir)), "quant-cache")
        blocks = {v: quantize_checkpoint(reader, quant_settings(v), torch.float32, cache_root=cache_root)
                  for v in variants}

        def load(variant: str, tier: str):
            if variant == "bf16":
                return load_streamed(reader, [tier] * L, device="cpu", dtype=torch.float32,
                                     nvme_ahead=args.nvme_ahead)
            return load_quantized_streamed(reader, blocks[variant], [tier] * L, device="cpu",
                                           dtype=torch.float32, nvme_ahead=args.nvme_ahead)

        ram_batches = [int(b) for b in args.quant_batches.split(",")]
        tiers = [t for t in (("nvme", [1]), ("cpu", ram_batches)) if t[0] in args.quant_tiers.split(",")]
        for tier, batches in tiers:
            loaded = {v: load(v, tier) for v in ["bf16"] + variants}
            floor_gbps = {}
            try:
                for v, (model, streamer) in loaded.items():  # warm-up: allocations, thread pools
                    generate(model, prompts_for(1, args.prompt_len, cfg.vocab_size), max_new_tokens=2,
                             streamer=streamer)
                    if tier == "nvme":
                        floor_gbps[v] = stream_read_gbps(streamer)
                for b in batches:
                    got: dict[str, list] = {v: [] for v in loaded}
                    for k in range(args.rounds):
                        order = list(loaded) if k % 2 == 0 else list(loaded)[::-1]
                        for v in order:
                            model, streamer = loaded[v]
                            if tier == "nvme":
                                drop_caches()
                            res = generate(model, prompts_for(b, args.prompt_len, cfg.vocab_size),
                                           max_new_tokens=args.new_tokens, streamer=streamer)
                            got[v].append((res.decode_tokens / res.decode_s,
                                           res.decode_stream.moved_bytes["disk"] / res.decode_steps,
                                           res.tokens))
                    base = statistics.median(r[0] for r in got["bf16"])
                    for v, runs in got.items():
                        tok_s = statistics.median(r[0] for r in runs)
                        row = {"variant": v, "tier": tier, "batch": b, "decode_tok_s": tok_s,
                               "runs_tok_s": [r[0] for r in runs], "vs_bf16": tok_s / base,
                               "disk_bytes_per_step": runs[-1][1],
                               "block_bytes": sum(loaded[v][1].block_bytes(i) for i in range(L))}
                        if tier == "nvme":
                            row["disk_gbps"] = floor_gbps[v]
                            row["floor_s_per_step"] = row["disk_bytes_per_step"] / (floor_gbps[v] * 1e9)
                            row["pct_of_floor"] = 100 * row["floor_s_per_step"] * tok_s / b
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                for model, streamer in loaded.values():
                    streamer.close()
                del loaded
                gc.collect()
    return rows


def quant_table(rows: list[dict]) -> str:
    out = ["| weights | tier | batch | decode tok/s | vs bf16 | read per step | vs bf16 bytes | "
           "disk GB/s (its bytes) | % of its floor |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["tier"], r["batch"]): r["disk_bytes_per_step"] for r in rows if r["variant"] == "bf16"}
    for r in rows:
        nvme = r["tier"] == "nvme"
        ratio = (f"{r['disk_bytes_per_step'] / base[(r['tier'], r['batch'])]:.2f}x"
                 if nvme and base.get((r["tier"], r["batch"])) else "-")
        out.append(f"| {r['variant']} | {r['tier']} | {r['batch']} | {r['decode_tok_s']:.2f} | "
                   f"{r['vs_bf16']:.2f}x | {format_bytes(r['disk_bytes_per_step']) if nvme else '-'} | "
                   f"{ratio} | {r.get('disk_gbps', 0):.2f} | "
                   f"{(str(round(r['pct_of_floor'])) + '%') if nvme else '-'} |")
    return "\n".join(out)


class _StepClock:
    """A transformers streamer that only notes when each token arrives: put() gets the prompt
    first (just before the prefill forward), then every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def prefill_s(self) -> float:  # the prompt's forward and the first token's choice
        return self.times[1] - self.times[0]

    def decode_s(self) -> float:  # from the first generated token to the last
        return self.times[-1] - self.times[1]


def bench_ram(reader, path: str, batches: list[int], args) -> list[dict]:
    """offload (weights in host RAM) and transformers, alternately, in one process: decode and
    prefill tok/s, and whether both produced the same (greedy) tokens."""
    import transformers
    cfg = reader.config
    ours, streamer = load_streamed(reader, ["cpu"] * cfg.num_hidden_layers, device="cpu",
                                   dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    steps = args.new_tokens - 1

    def run_ours(prompts) -> tuple[float, float, list[list[int]]]:
        res = generate(ours, prompts, max_new_tokens=args.new_tokens, streamer=streamer)
        assert res.decode_steps == steps
        return res.decode_tokens / res.decode_s, res.prefill_tokens_per_s, res.tokens

    def run_hf(prompts) -> tuple[float, float, list[list[int]]]:
        clock = _StepClock()
        with torch.inference_mode():
            out = hf.generate(torch.tensor(prompts), max_new_tokens=args.new_tokens,
                              streamer=clock, **kw)
        new = out[:, len(prompts[0]):].tolist()  # prompts_for gives equal lengths: no padding
        return (len(prompts) * steps / clock.decode_s(),
                len(prompts) * len(prompts[0]) / clock.prefill_s(), new)

    rows = []
    try:
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, cfg.vocab_size)
            # warm-up at this batch size, both: first-call allocations, and offload's one-time
            # kernel measurement for these shapes (offload/models/kernels.py)
            run_ours(prompts)
            run_hf(prompts)
            got: dict[str, list] = {"offload": [], "transformers": []}
            for k in range(args.rounds):  # alternate which goes first
                pair = (("offload", run_ours), ("transformers", run_hf))
                for name, fn in (pair if k % 2 == 0 else pair[::-1]):
                    got[name].append(fn(prompts))
            same = all(o[2] == t[2] for o, t in zip(got["offload"], got["transformers"]))
            decode = statistics.median(o[0] / t[0] for o, t in zip(got["offload"], got["transformers"]))
            prefill = statistics.median(o[1] / t[1] for o, t in zip(got["offload"], got["transformers"]))
            for engine, runs in got.items():
                med = statistics.median(r[0] for r in runs)
                rows.append({"engine": engine, "tier": "ram", "batch": b, "decode_tok_s": med,
                             "s_per_step": b / med, "runs_tok_s": [r[0] for r in runs],
                             "prefill_tok_s": statistics.median(r[1] for r in runs),
                             "ratio_vs_transformers": decode if engine == "offload" else None,
                             "prefill_ratio_vs_transformers": prefill if engine == "offload" else None,
                             "tokens_identical": same})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        streamer.close()
    return rows  # both models are freed on return


def table(rows: list[dict]) -> str:
    out = ["| engine | weights | batch | decode tok/s | s/step | vs transformers | prefill tok/s | "
           "prefill vs transformers | same tokens | disk read/step | floor s/step | % of floor | "
           "compute waited s/step |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['ratio_vs_transformers']:.2f}x" if r.get("ratio_vs_transformers") else "-"
        pre = f"{r['prefill_tok_s']:.1f}" if r.get("prefill_tok_s") else "-"
        pre_ratio = (f"{r['prefill_ratio_vs_transformers']:.2f}x"
                     if r.get("prefill_ratio_vs_transformers") else "-")
        same = {True: "yes", False: "**no**"}.get(r.get("tokens_identical"), "-")
        pct = f"{r['pct_of_floor']:.0f}%" if r.get("pct_of_floor") else "-"
        floor = f"{r['floor_s_per_step']:.2f}" if r.get("floor_s_per_step") else "-"
        disk = format_bytes(r["disk_bytes_per_step"]) if r.get("disk_bytes_per_step") else "-"
        wait = f"{r['compute_wait_s_per_step']:.2f}" if "compute_wait_s_per_step" in r else "-"
        out.append(f"| {r['engine']} | {r['tier']} | {r['batch']} | {r['decode_tok_s']:.2f} | "
                   f"{r['s_per_step']:.3f} | {ratio} | {pre} | {pre_ratio} | {same} | {disk} | "
                   f"{floor} | {pct} | {wait} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/offload-bench/1B-fp32")
    p.add_argument("--preset", default="1B")
    p.add_argument("--parts", default="ram,nvme,runner",
                   help="ram (vs transformers), nvme (streamed decode), runner (its floor vs O_DIRECT), "
                        "quant (bf16 vs int8 vs int4 blocks; not in the default)")
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--quant-batches", default="1,2,4,8,16",
                   help="quant part: batch sizes of the in-RAM rows (NVMe rows: batch 1)")
    p.add_argument("--quant-model", help="quant part: this checkpoint directory instead of the "
                   "preset's random weights (its stored dtype is the 16-bit baseline)")
    p.add_argument("--quant-variants", default="int8,int4",
                   help="quantized variants beside bf16: int8, int4 (the runner's default groups), "
                        "int8/ch (per channel), int8/g32, int4/g32, ...")
    p.add_argument("--quant-tiers", default="nvme,cpu",
                   help="quant part: nvme (batch 1, streamed cold) and/or cpu (in RAM, --quant-batches)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="alternating runs per batch (ram part)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--nvme-ahead", type=int, default=2)
    p.add_argument("--json", help="write all rows here")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    parts = args.parts.split(",")
    cfg = preset(args.preset).replace(dtype="float32")
    random_checkpoint(cfg, args.dir, 0, torch.float32)
    rows: list[dict] = []
    with CheckpointReader(args.dir) as reader:
        shards = sorted({loc.path for loc in reader.locations.values()})
        drop_caches()
        links = measure_links(torch.device("cpu"), shards, seconds=2.0)
        print(f"start-up probe: memcpy {links.h2d_gbps:.2f} GB/s, disk read {links.disk_gbps:.2f} GB/s "
              f"(O_DIRECT: {links.disk_direct})", file=sys.stderr)
        if "ram" in parts:
            rows += bench_ram(reader, args.dir, batches, args)
        if "nvme" in parts:
            rows += bench_nvme(reader, shards, batches, args)
        floor = bench_runner_floor(reader, args.dir, args) if "runner" in parts else None
    quant_rows = bench_quant(args) if "quant" in parts else []
    nv = {r["batch"]: r["decode_tok_s"] for r in rows if r["tier"] == "nvme"}
    header = (f"{args.preset} ({num_params(cfg) / 1e9:.2f}B params, fp32), {torch.get_num_threads()} "
              f"threads, CPU: {cpu_model()}, "
              f"{format_bytes(psutil.virtual_memory().total)} RAM; start-up probe: disk "
              f"{links.disk_gbps:.2f} GB/s, memcpy {links.h2d_gbps:.2f} GB/s; prompt "
              f"{args.prompt_len} tokens, {args.new_tokens} new tokens, {args.rounds} rounds; "
              f"peak RSS {format_bytes(peak_rss_bytes())}")
    print(header)
    if rows:
        print(table(rows))
    ram = [r for r in rows if r["tier"] == "ram" and r["engine"] == "offload"]
    if ram:
        worst = min(min(r["ratio_vs_transformers"], r["prefill_ratio_vs_transformers"]) for r in ram)
        same = all(r["tokens_identical"] for r in ram)
        print(f"ram vs transformers: slowest decode or prefill ratio {worst:.2f}x, tokens "
              f"{'identical' if same else 'DIFFERENT'} (goal: >= 1.0x at every batch, identical)")
        for (out_f, in_f, rows_n), c in sorted(kernels.choices().items()):
            timed = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in c["seconds"].items())
            print(f"  few-rows kernel [{rows_n} x {in_f}] -> {out_f}: {c['kernel']} ({timed} on "
                  f"the first {min(out_f, kernels.PROBE_BYTES // (in_f * 4))} rows of the weight)")
    if nv and min(nv) in nv and max(nv) != min(nv):
        print(f"nvme: batch {max(nv)} decode = {nv[max(nv)] / nv[min(nv)]:.1f}x batch {min(nv)}")
    if floor is not None:
        pct = floor["runner_pct_of_floor"]
        print(f"runner floor: disk {floor['runner_disk_gbps']:.2f} GB/s vs O_DIRECT read of the same "
              f"bytes just before {floor['o_direct_gbps']:.2f} GB/s = {floor['runner_vs_o_direct']:.2f}x "
              f"(the start-up probe's way, 16 x 4 MiB in flight: {floor['o_direct_first_gbps']:.2f} "
              f"before, {floor['o_direct_after_gbps']:.2f} GB/s after the run) "
              f"(goal within 10%); printed "
              + (f"{pct:.0f}% of floor" if pct is not None else
                 f"disk-bound at {floor['run_disk_gbps']:.2f} GB/s (faster than the floor)"))
    if quant_rows:
        print(quant_table(quant_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, "quant_rows": quant_rows, "links": vars(links)},
                      f, indent=1)


if __name__ == "__main__":
    main()
