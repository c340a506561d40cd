"""Mixture-of-experts decode and prefill with the experts placed one by one, against transformers.

One random Qwen3-MoE checkpoint saved by transformers (default ~1.2B parameters: 12 layers,
hidden 1024, 32 experts of width 896, top-4; generated once into --dir), fp32, one process:

  * experts in RAM, computed in place on the CPU (the dense parts in RAM too), against
    transformers' own generate() on the same checkpoint, both loaded at once and run alternately
    --rounds times: decode tok/s at each --batches size and prefill tok/s of a --prefill-len
    prompt; medians and the median per-round ratio; whether the greedy tokens agree;
  * experts on NVMe (dense parts in RAM), page cache dropped before each run (root), cache off
    and on (--cache-mb): decode tok/s at batch 1, NVMe bytes per decoded token (the routed
    experts' own, counted by the IO engine), the disk floor for those bytes at the rate the IO
    engine reads exactly those expert ranges cold (O_DIRECT, one pass), and % of that floor;
    cache hit rate, prefetch precision and recall;
  * memory: RSS after loading with the experts on NVMe against in RAM, and the buffer pool's
    bytes, which do not grow with the number of experts;
  * training (--train-tokens, 0: off; --only-train: this row alone, in a fresh process, so its
    peak RSS is its own): one update of the same model, fp32, optimizer state and weights on
    NVMe (--offload nvme --offload-params nvme), materialised block by block from the
    checkpoint, after one warm-up update: peak RSS, the time split, and the optimizer-state bytes
    read against the dense part + the routed experts' state (counted from the routers'
    choices) and against every expert's; the weight bytes read against forward + backward x
    (dense + routed experts' weights) and against whole layers.

Usage: python scripts/bench_moe.py --dir /tmp/offload-bench/moe-1b --rounds 3
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as runners/infer.py, before torch starts

import argparse  # noqa: E402
import json
import statistics
import sys
import time

import torch

from bench_infer import _StepClock, prompts_for
from nvme.io import ALIGN, IOEngine, aligned_empty, drop_caches
from offload.config import format_bytes
from offload.infer.expert_plan import plan_experts
from offload.infer.generate import generate
from offload.infer.plan import disk_read_gbps, measure_links
from offload.memory.tiers import cpu_model
from offload.models import CheckpointReader, load_streamed, num_active_params, num_params
from offload.stream.expert_placement import ExpertPlacement


def make_checkpoint(path: str, args) -> None:
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.width, moe_intermediate_size=args.width,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.02 if "norm" not in n else 0.1) + (1.0 if "norm" in n else 0.0))
    print(f"writing a random {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B Qwen3-MoE to {path}",
          file=sys.stderr, flush=True)
    model.save_pretrained(path, max_shard_size="2GB")
    del model


def _log_reads(io: IOEngine) -> list[tuple[str, int, int]]:
    """Note every read submitted to `io` from now on (path, offset, bytes), in order."""
    log: list[tuple[str, int, int]] = []
    submit = io.submit_read

    def logged(path, offset, buf, **kw):
        log.append((path, offset, len(buf)))
        return submit(path, offset, buf, **kw)
    io.submit_read = logged  # an instance attribute: `del io.submit_read` restores the method
    return log


def _replay(io: IOEngine, log: list[tuple[str, int, int]], depth: int) -> float:
    """Seconds to read `log` again, page cache dropped, at most `depth` requests in flight: the
    disk floor for exactly the bytes the run read."""
    drop_caches()
    buf = aligned_empty(max(n for _, _, n in log) * depth + depth * ALIGN) if log else None
    pending, t0 = [], time.perf_counter()
    piece = (len(buf) // depth) if log else 0
    for k, (path, off, n) in enumerate(log):
        if len(pending) == depth:
            pending.pop(0).wait()
        slot = k % depth
        pending.append(io.submit_read(path, off, buf[slot * piece:slot * piece + n]))
    for h in pending:
        h.wait()
    return time.perf_counter() - t0


def bench_ram(reader, path: str, args) -> list[dict]:
    """Experts in RAM computed in place, against transformers' generate, alternately."""
    import transformers
    cfg = reader.config
    L = cfg.num_hidden_layers
    ours, streamer = load_streamed(reader, ["device"] * L, device="cpu", dtype=torch.float32,
                                   experts=ExpertPlacement("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = []

    def run_ours(prompts, new):
        res = generate(ours, prompts, max_new_tokens=new, streamer=streamer)
        if res.decode_steps:
            routed = res.decode_experts.routed / res.decode_steps  # distinct experts per step
            run_ours.bytes_per_step = 4 * (dense_params + routed * expert_params)
        return (res.decode_tokens / res.decode_s if res.decode_s else 0.0), res.prefill_tokens_per_s, res.tokens

    def run_hf(prompts, new):
        clock = _StepClock()
        with torch.inference_mode():
            out = hf.generate(torch.tensor(prompts), max_new_tokens=new, streamer=clock, **kw)
        steps = new - 1
        dec = len(prompts) * steps / clock.decode_s() if steps else 0.0
        return dec, len(prompts) * len(prompts[0]) / clock.prefill_s(), out[:, len(prompts[0]):].tolist()

    expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    # weights one batch-1 token reads: everything but the experts not routed and the embedding
    # table (one row of it), in fp32; the experts routed per token are counted by the store
    dense_params = num_params(cfg) - cfg.num_hidden_layers * cfg.num_experts * expert_params \
        - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    memcpy_gbps = measure_links(torch.device("cpu"), [], seconds=1.0).h2d_gbps
    cases = [("decode", b, args.prompt_len, args.new_tokens) for b in args.batches]
    cases.append(("prefill", 1, args.prefill_len, 1))
    try:
        for kind, b, plen, new in cases:
            prompts = prompts_for(b, plen, cfg.vocab_size)
            run_ours(prompts, new)  # warm-up, both
            run_hf(prompts, new)
            got = {"offload": [], "transformers": []}
            for k in range(args.rounds):
                pair = (("offload", run_ours), ("transformers", run_hf))
                for name, fn in (pair if k % 2 == 0 else pair[::-1]):
                    got[name].append(fn(prompts, new))
            col = 0 if kind == "decode" else 1
            ratio = statistics.median(o[col] / t[col] for o, t in zip(got["offload"], got["transformers"]))
            same = all(o[2] == t[2] for o, t in zip(got["offload"], got["transformers"]))
            row = {"what": kind, "batch": b, "prompt": plen, "tier": "experts in RAM",
                   "offload_tok_s": statistics.median(r[col] for r in got["offload"]),
                   "transformers_tok_s": statistics.median(r[col] for r in got["transformers"]),
                   "ratio": ratio, "tokens_identical": same,
                   # the weights a decode step reads over its time: against memcpy's rate
                   "read_gbps": (run_ours.bytes_per_step * statistics.median(r[0] for r in got["offload"])
                                 / b / 1e9 if kind == "decode" else None),
                   "memcpy_gbps": memcpy_gbps,
                   "runs": {n: [r[col] for r in v] for n, v in got.items()}}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        streamer.close()
        ours.expert_store.close()
    return rows


def bench_nvme(reader, args) -> list[dict]:
    """Experts on NVMe, cold, cache off and on: decode at batch 1 against the disk floor."""
    cfg = reader.config
    L = cfg.num_hidden_layers
    rows = []
    for cache_mb in (0, args.cache_mb):
        io = IOEngine()
        one = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
        k = cfg.num_experts_per_tok
        placement = ExpertPlacement("nvme", cache_slots=cache_mb * (1 << 20) // one,
                                    predict_k=args.predict_k or k,
                                    prefetch_slots=max(k, args.predict_k or k))
        model, streamer = load_streamed(reader, ["device"] * L, device="cpu", dtype=torch.float32,
                                        experts=placement, io=io)
        store = model.expert_store
        ranges = [(r.path, r.offset, r.nbytes) for key in sorted(store.blocks) for r in store._runs[key]]
        try:
            prompts = prompts_for(1, args.prompt_len, cfg.vocab_size)
            generate(model, prompts, max_new_tokens=2, streamer=streamer)  # warm-up (kernels)
            runs = []
            for _ in range(args.rounds):
                dropped = drop_caches()
                s0, read0 = store.stats.copy(), io.bytes_read
                log = _log_reads(io)
                res = generate(model, prompts, max_new_tokens=args.new_tokens, streamer=streamer)
                del io.submit_read  # the engine's own method again
                # the floor: exactly these reads, in this order, as many in flight as the store
                # allows (read-ahead + prefetch), cold, no compute
                replay_s = _replay(io, log, store.window + store.quota["prefetch"])
                st = res.decode_experts
                runs.append({"decode_tok_s": res.decode_tokens / res.decode_s,
                             "run_s": res.prefill_s + res.decode_s, "replay_s": replay_s,
                             "read_bytes": sum(n for _, _, n in log),
                             "disk_bytes_per_token": st.moved_bytes["disk"] / res.decode_tokens,
                             "s_per_step": res.decode_s / res.decode_steps,
                             "hit_rate": st.hit_rate(), "precision": st.precision(), "recall": st.recall(),
                             "io_bytes": io.bytes_read - read0, "cold": dropped,
                             "store_disk": store.stats.minus(s0).moved_bytes["disk"]})
            drop_caches()
            gbps, direct = disk_read_gbps([], io=io, ranges=ranges[:max(1, len(ranges) // 8)])
            med = statistics.median(r["decode_tok_s"] for r in runs)
            per_tok = statistics.median(r["disk_bytes_per_token"] for r in runs)
            pct = statistics.median(100 * r["replay_s"] / r["run_s"] for r in runs)
            row = {"what": "decode", "batch": 1, "tier": "experts on NVMe", "cache_mb": cache_mb,
                   "decode_tok_s": med, "disk_bytes_per_token": per_tok,
                   "disk_gbps_sequential": gbps, "o_direct": direct,
                   "replay_gbps": statistics.median(r["read_bytes"] / r["replay_s"] / 1e9 for r in runs),
                   "percent_of_floor": pct,
                   "hit_rate": runs[-1]["hit_rate"], "prefetch_precision": runs[-1]["precision"],
                   "prefetch_recall": runs[-1]["recall"], "pool_bytes": store.pool_bytes(),
                   "cold": runs[-1]["cold"],
                   "runs_tok_s": [r["decode_tok_s"] for r in runs]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            streamer.close()
            store.close()
            io.close()
    return rows


def bench_train(reader, args) -> dict:
    """One measured update (after a warm-up one) with state and weights on NVMe."""
    import offload
    from offload.memory.tiers import peak_rss_bytes
    from offload.models import build_model
    from offload.models.moe import SparseMoE
    cfg = offload.OffloadConfig(offload="nvme", offload_params="nvme", dtype="fp32", device="cpu",
                                nvme_dir=os.path.join(args.dir + "-train-swap"), lr=1e-5,
                                replay_hold_bytes=args.replay_hold)
    model = build_model(reader.config, "meta", torch.float32)
    t0 = time.perf_counter()
    engine = offload.initialize(model, cfg, source=reader)
    setup_s = time.perf_counter() - t0
    routed: set[tuple[int, int]] = set()

    def route(moe, a, li):
        if torch.is_grad_enabled():
            with torch.no_grad():
                routed.update((li, int(e)) for e in moe.route(a[0].reshape(-1, a[0].shape[-1]))[1].flatten())
    for li, layer in enumerate(model.model.layers):
        next(m for m in layer.modules() if isinstance(m, SparseMoE)).register_forward_pre_hook(
            lambda m, a, li=li: route(m, a, li))
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(2):  # the first warms up (and reads state the initialisation prefetched)
            routed.clear()
            replayed0, written0 = engine.replay.replayed, engine.replay.written
            ids = torch.randint(0, reader.config.vocab_size, (1, args.train_tokens), generator=g)
            t0 = time.perf_counter()
            logits = model(ids)[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            wall = time.perf_counter() - t0
        rep = engine.last_report
        expert = sum(r.hi - r.lo for r in engine.experts[:1])
        total, experts = sum(b.numel for b in engine.blocks), sum(r.hi - r.lo for r in engine.experts)
        # the weights forward and backward must read: each layer's dense part and routed
        # experts, twice but for the last layer (kept bound from forward to backward)
        layers = sorted(engine.parts.layer_of, key=engine.parts.layer_of.get)
        weights_due = 0
        for li, bi in enumerate(layers):
            dense = engine.blocks[bi].numel - sum(r.hi - r.lo for r in engine.experts if r.block == bi)
            hit = sum(1 for lj, _ in routed if lj == li)
            weights_due += (1 if li == len(layers) - 1 else 2) * (dense + expert * hit) * 4
        return {"tier": "training", "tokens": args.train_tokens, "wall_s": wall, "setup_s": setup_s,
                "forward_s": rep.forward_s, "backward_s": rep.backward_s, "cpu_step_s": rep.cpu_step_s,
                "io_wait_s": rep.io_wait_s, "step_s": rep.step_s, "state_read": rep.bytes["nvme_read"],
                "dense_plus_routed": 12 * (total - experts + expert * len(routed)),
                "every_expert": 12 * total, "routed": len(routed),
                "experts": len(engine.experts), "replayed": engine.replay.replayed - replayed0,
                "written": engine.replay.written - written0, "hold": engine.plan.replay_hold_bytes,
                "weights_read": rep.bytes["stream_disk"] + rep.bytes["weights_read"],
                "weights_due": weights_due, "weights_whole": 2 * 4 * sum(engine.blocks[bi].numel for bi in layers),
                "peak_rss": peak_rss_bytes()}
    finally:
        engine.close()


def train_table(r: dict) -> str:
    return "\n".join([
        "| training, state + weights on NVMe | tokens | update s (fwd / bwd / CPU step / IO wait) "
        "| state read | dense + routed | every expert | routed / experts (replayed) | weights read "
        "| fwd + bwd x (dense + routed) | whole layers x 2 | peak RSS |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|",
        f"| one update | {r['tokens']} | {r['wall_s']:.1f} ({r['forward_s']:.1f} / {r['backward_s']:.1f} / "
        f"{r['cpu_step_s']:.1f} / {r['io_wait_s']:.1f}) | {format_bytes(r['state_read'])} | "
        f"{format_bytes(r['dense_plus_routed'])} ({r['state_read'] / r['dense_plus_routed']:.2f}x) | "
        f"{format_bytes(r['every_expert'])} | {r['routed']} / {r['experts']} ({r['replayed']}) | "
        f"{format_bytes(r['weights_read'])} | {format_bytes(r['weights_due'])} | "
        f"{format_bytes(r['weights_whole'])} | {format_bytes(r['peak_rss'])} |",
        f"(replayed experts' state held until the step: cap {format_bytes(r['hold'])}, "
        f"{r['written']} past it written and read again)"])


def table(rows: list[dict]) -> str:
    out = ["| experts | what | batch | offload tok/s | transformers tok/s | ratio | tokens equal "
           "| weights read (memcpy) |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r["tier"] == "experts in RAM":
            bw = f"{r['read_gbps']:.1f} GB/s ({r['memcpy_gbps']:.1f})" if r["read_gbps"] else ""
            out.append(f"| in RAM | {r['what']} ({r['prompt']}-token prompt) | {r['batch']} | "
                       f"{r['offload_tok_s']:.2f} | {r['transformers_tok_s']:.2f} | {r['ratio']:.2f}x | "
                       f"{r['tokens_identical']} | {bw} |")
    out += ["", "| experts on NVMe | decode tok/s | NVMe per token | the same reads replayed cold | "
            "% of that floor | sequential read | cache hit | prefetch precision / recall | pool |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r["tier"] == "experts on NVMe":
            pct = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
            out.append(f"| cache {r['cache_mb']} MB | {r['decode_tok_s']:.2f} | "
                       f"{format_bytes(int(r['disk_bytes_per_token']))} | {r['replay_gbps']:.2f} GB/s | "
                       f"{r['percent_of_floor']:.0f}% | {r['disk_gbps_sequential']:.2f} GB/s | "
                       f"{pct(r['hit_rate'])} | "
                       f"{pct(r['prefetch_precision'])} / {pct(r['prefetch_recall'])} | "
                       f"{format_bytes(r['pool_bytes'])} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/offload-bench/moe-1b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=896)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-mb", type=int, default=512)
    p.add_argument("--skip-ram", action="store_true")
    p.add_argument("--predict-k", type=int, default=0,
                   help="experts per token the next-layer prediction names (0: top-k)")
    p.add_argument("--train-tokens", type=int, default=8,
                   help="tokens of the training row's update (0: no training row)")
    p.add_argument("--only-train", action="store_true", help="the training row alone")
    p.add_argument("--replay-hold", default="4GiB",
                   help="training: RAM for replayed experts' state until the step (replay_hold_bytes)")
    p.add_argument("--output-json")
    args = p.parse_args()
    make_checkpoint(args.dir, args)
    t0 = time.time()
    if args.only_train:
        with CheckpointReader(args.dir) as reader:
            row = bench_train(reader, args)
        print(train_table(row))
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"rows": [row], "cpu": cpu_model(), "torch": torch.__version__}, f, indent=1)
        return
    with CheckpointReader(args.dir) as reader:
        cfg = reader.config
        print(f"model: {num_params(cfg) / 1e9:.2f}B params, {num_active_params(cfg) / 1e9:.3f}B active, "
              f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}, fp32; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, CPU: {cpu_model()}", file=sys.stderr, flush=True)
        rows = [] if args.skip_ram else bench_ram(reader, args.dir, args)
        rows += bench_nvme(reader, args)
        if args.train_tokens:
            rows.append(bench_train(reader, args))
    print(table([r for r in rows if r["tier"] != "training"]))
    for r in rows:
        if r["tier"] == "training":
            print("\n" + train_table(r))
    # memory flat in the number of experts: the pool is sized by read-ahead, prefetch and cache
    one = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    pools = {E: plan_experts(layers=cfg.num_hidden_layers, experts=E, expert_bytes=one, stored_expert_bytes=one,
                             top_k=cfg.num_experts_per_tok, device_room=1 << 50, host_room=1 << 50,
                             device_is_host=True, force="nvme").pool_bytes for E in (cfg.num_experts, 4 * cfg.num_experts)}
    print("\nexperts on NVMe, buffer pool: " + ", ".join(f"{E} experts {format_bytes(b)}" for E, b in pools.items()))
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rows": rows, "cpu": cpu_model(), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
