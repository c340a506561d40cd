"""Peak memory of offloaded training, each case in a fresh process (peak RSS = VmHWM).

    python scripts/bench_memory.py optimizer   # issue 4: >= 6 GB of optimizer state on NVMe,
                                               #   peak RSS goal < 2.5 GB
    python scripts/bench_memory.py depth       # issue 7: 8 vs 32 blocks of the same width;
                                               #   weights + state on NVMe: ratio goal <= 1.2,
                                               #   offload none grows ~4x
    python scripts/bench_memory.py scale       # issue 7: a >= 3B model, weights + state on NVMe,
                                               #   one update, peak RSS goal <= 6 GB

Every case builds the model on the meta device and lets the engine materialise it block by
block from a seeded initialiser, so the full fp32 model never exists in memory. The device is
the CPU, so the "device" tier (16-bit weights, activations) is in RSS too. Swap files go under
--swap-dir (default: a temporary directory under the current directory) and are removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def worker(spec: dict) -> dict:
    """One training run described by `spec`; returns measurements (runs in the child)."""
    import torch

    import offload
    from offload.config import OffloadConfig
    from offload.models import ModelConfig, build_model, num_params, seeded_init

    torch.manual_seed(0)
    mcfg = ModelConfig(**spec["model"])
    model = build_model(mcfg, device="meta", dtype=torch.float32)

    t0 = time.perf_counter()
    engine = offload.initialize(model, OffloadConfig(**spec["engine"]),
                                source=seeded_init(0, mcfg.initializer_range))
    init_s = time.perf_counter() - t0
    ids = torch.randint(0, mcfg.vocab_size, (spec["batch"], spec["seq"] + 1))
    steps = []
    for _ in range(spec["updates"]):
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        steps.append(time.perf_counter() - t0)
        del logits, loss
    rep = engine.last_report
    mem = engine.memory_report()
    engine.close()
    with open("/proc/self/status") as f:
        hwm_kib = int(next(line for line in f if line.startswith("VmHWM")).split()[1])
    return {"params": num_params(mcfg), "init_s": init_s, "step_s": steps[-1],
            "peak_rss_bytes": hwm_kib * 1024, "split": rep.as_dict(),
            "tiers": {t: mem[t]["peak"] for t in ("device", "host", "nvme")}}


def run_case(name: str, spec: dict, swap_root: str) -> dict:
    spec = json.loads(json.dumps(spec))
    if spec["engine"].get("nvme_dir") == "SWAP":
        spec["engine"]["nvme_dir"] = os.path.join(swap_root, name)
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                         capture_output=True, text=True)
    shutil.rmtree(os.path.join(swap_root, name), ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama(hidden: int, layers: int, inter: int, heads: int, vocab: int = 258) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=2048, tie_word_embeddings=False)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def case_optimizer(swap_root: str) -> None:
    # 40 blocks of 12.7M params: 506M params, 6.07 GB of fp32 master + moments on NVMe
    model = llama(1024, 40, 2816, 16)
    base = dict(offload="nvme", nvme_dir="SWAP", dtype="bf16", device="cpu", lr=1e-4,
                buffer_count=4)
    rows = [("nvme, no clipping (overlapped step, pooled gradients)", dict(base, grad_clip=0.0)),
            ("nvme, clipping (every gradient held until the step)", dict(base, grad_clip=1.0))]
    print(f"{'case':<56} {'params':>8} {'opt state':>10} {'peak RSS':>10} {'step s':>7}")
    for label, eng in rows:
        r = run_case("opt", {"model": model, "engine": eng, "batch": 1, "seq": 128, "updates": 2},
                     swap_root)
        print(f"{label:<56} {r['params'] / 1e6:7.0f}M {gib(12 * r['params']):>10} "
              f"{gib(r['peak_rss_bytes']):>10} {r['step_s']:7.1f}")
    print("goal: peak RSS < 2.5 GB (2.33 GiB) with >= 6 GB of optimizer state")


def case_depth(swap_root: str) -> None:
    results = {}
    print(f"{'case':<40} {'blocks':>6} {'params':>8} {'peak RSS':>10}")
    for label, eng in (("weights + optimizer state on NVMe",
                        dict(offload="nvme", offload_params="nvme", nvme_dir="SWAP",
                             activation_checkpointing=True, grad_clip=0.0)),
                       ("offload none (everything resident)", dict(offload="none"))):
        for layers in (8, 32):
            r = run_case(f"depth{layers}", {
                "model": llama(768, layers, 2048, 12),
                "engine": dict(eng, dtype="fp32", device="cpu", lr=1e-4, buffer_count=3),
                "batch": 1, "seq": 64, "updates": 2}, swap_root)
            results[label, layers] = r["peak_rss_bytes"]
            print(f"{label:<40} {layers:>6} {r['params'] / 1e6:7.0f}M {gib(r['peak_rss_bytes']):>10}")
        print(f"  32/8 ratio: {results[label, 32] / results[label, 8]:.2f}")
    print("goal: NVMe ratio <= 1.2; offload none grows ~4x")


def case_scale(swap_root: str) -> None:
    from offload.models import preset

    cfg = preset("3B")
    model = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "max_position_embeddings",
                                          "tie_word_embeddings", "rope_theta")}
    eng = dict(offload="nvme", offload_params="nvme", nvme_dir="SWAP", dtype="bf16",
               device="cpu", lr=1e-5, grad_clip=0.0, activation_checkpointing=True,
               offload_activations=True, buffer_count=2, prefetch_blocks=1)
    r = run_case("scale", {"model": model, "engine": eng, "batch": 1, "seq": 16, "updates": 1},
                 swap_root)
    s = r["split"]
    print(f"model 3B preset: {r['params'] / 1e9:.2f}B params, model state "
          f"{gib(16 * r['params'])} (weights + grads + fp32 master + moments)")
    print(f"init (materialise + write to NVMe) {r['init_s']:.0f} s; one update {r['step_s']:.0f} s: "
          f"forward {s['forward_s']:.0f} s, backward {s['backward_s']:.0f} s, CPU step "
          f"{s['cpu_step_s']:.0f} s, IO wait {s['io_wait_s']:.0f} s, overlapped blocks "
          f"{s['overlapped_blocks']}")
    print("bytes this update: " + ", ".join(f"{k} {gib(v)}" for k, v in s["bytes"].items() if v))
    print(f"peak RSS {gib(r['peak_rss_bytes'])} (goal <= 6 GB = 5.59 GiB); engine peaks: "
          + ", ".join(f"{k} {gib(v)}" for k, v in r["tiers"].items()))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=["optimizer", "depth", "scale"])
    ap.add_argument("--swap-dir", default=".")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-memory-", dir=args.swap_dir)
    try:
        {"optimizer": case_optimizer, "depth": case_depth, "scale": case_scale}[args.case](root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
