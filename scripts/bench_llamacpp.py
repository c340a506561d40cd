"""offload against llama.cpp on one GGUF: batch-1 decode and prompt-eval tokens/s, side by side.

llama.cpp runs through llama-cpp-python in its OWN virtual environment (`--llama-python`: that
venv's interpreter, a subprocess; nothing of llama.cpp is imported by this project or shipped
with it). Build it once, compiled for this CPU (about 11 minutes on 2 cores):

    python -m venv /work/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/llama-venv/bin/pip install llama-cpp-python==0.3.36

Both sides get the same GGUF, the same prompt ids (llama.cpp's tokenizer, once, so that neither
side's template or BOS rule differs), the same thread count (llama.cpp's n_threads, torch's
OMP_NUM_THREADS), greedy decoding of --new-tokens tokens past EOS. offload runs as the user
would (`python -m runners.infer ... --prompt-ids ... --ignore-eos --output-json`) with
`--quantize int4` (the file's Q4_1 blocks as stored), `--quantize int8` and `--dtype bf16`;
its report's prefill and decode rates are taken. llama.cpp's: prompt eval = the prompt's
tokens over the time of one `eval` of them, decode = new tokens over the time of the
one-token evals and argmaxes after it. Every variant runs in a fresh process per round, the
order rotating every round; medians over --rounds, each round's values kept. The first lines
give the CPU model and flags (lscpu), the thread count and the machine's load average before
and after: on a shared machine only ratios taken in one run mean anything.

    python scripts/bench_llamacpp.py --model ~/.cache/offload/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/bench_llamacpp.py --model M.gguf --variants int4 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based ink and a wooden screw press")
OURS = {"int4": ["--quantize", "int4"], "int8": ["--quantize", "int8"], "bf16": ["--dtype", "bf16"],
        "fp32": ["--dtype", "fp32"],
        # x quantized to int8 per 32 values, as llama.cpp does (opt-in: other math)
        "int4-a8": ["--quantize", "int4", "--activations", "int8"],
        "int8-a8": ["--quantize", "int8", "--activations", "int8"]}

# run by the llama venv's interpreter: {"model", "threads", "ids" | "text", "new"} on stdin
_LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
req = json.loads(sys.stdin.read())
llm = Llama(model_path=req["model"], n_threads=req["threads"], n_threads_batch=req["threads"],
            n_ctx=512, n_batch=512, verbose=False)
if "text" in req:
    print(json.dumps({"ids": llm.tokenize(req["text"].encode(), add_bos=False, special=False)}))
    sys.exit(0)
ids = req["ids"]
vocab = llm.n_vocab()
def last_argmax():  # the last evaluated position's logits (0.3.x copies none without logits_all)
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
t0 = time.perf_counter()
llm.eval(ids)
prompt_s = time.perf_counter() - t0
out = [last_argmax()]
t1 = time.perf_counter()
for _ in range(req["new"] - 1):
    llm.eval([out[-1]])
    out.append(last_argmax())
decode_s = time.perf_counter() - t1
print(json.dumps({"prompt_tok_s": len(ids) / prompt_s, "decode_tok_s": (req["new"] - 1) / decode_s,
                  "tokens": out}))
"""


def lscpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "lscpu: unavailable"
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("Model name", "CPU(s)", "Flags")]
    out = []
    for ln in keep:
        if ln.startswith("Flags"):
            flags = ln.split(":", 1)[1].split()
            ln = "Flags (vector): " + " ".join(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "vnni", "sse4")))
        out.append(" ".join(ln.split()))
    return "; ".join(out)


def llama(python: str, request: dict) -> dict:
    res = subprocess.run([python, "-c", _LLAMA_CHILD], input=json.dumps(request), capture_output=True,
                         text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"llama.cpp ({python}) failed: {res.stderr.strip()[-800:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def ours(variant: str, model: str, ids: list[int], new: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "runners.infer", "--model", model, *OURS[variant],
               "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(new), "--ignore-eos",
               "--output-json", out]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise SystemExit(f"offload {variant} failed: {res.stderr.strip()[-800:]}")
        with open(out) as f:
            got = json.load(f)
    m = got["metrics"]
    return {"prompt_tok_s": m["prefill_tokens_per_s"], "decode_tok_s": m["decode_tokens_per_s"],
            "tokens": got["generated_ids"][0]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the GGUF file both sides load")
    ap.add_argument("--llama-python", default="/work/llama-venv/bin/python",
                    help="the interpreter of the venv llama-cpp-python is installed in")
    ap.add_argument("--variants", default="int4,int8,bf16", help=f"offload's, of {', '.join(OURS)}")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write every round's values here")
    args = ap.parse_args()
    if not os.path.isfile(args.llama_python):
        raise SystemExit(f"--llama-python {args.llama_python}: no such interpreter; build the llama "
                         f"venv first (this script's docstring)")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in OURS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; use some of {', '.join(OURS)}")
    model = os.path.abspath(os.path.expanduser(args.model))
    print(f"CPU: {lscpu()}")
    print(f"threads {args.threads}; load average before: {os.getloadavg()}")
    ids = llama(args.llama_python, {"model": model, "threads": args.threads, "text": args.prompt})["ids"]
    print(f"prompt: {len(ids)} tokens; {args.new_tokens} new, greedy; {args.rounds} rounds, rotated")
    sides = ["llama.cpp"] + variants
    rows: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            got = (llama(args.llama_python, {"model": model, "threads": args.threads, "ids": ids,
                                             "new": args.new_tokens}) if side == "llama.cpp"
                   else ours(side, model, ids, args.new_tokens, args.threads))
            rows[side].append(got)
            print(f"  round {r + 1} {side}: decode {got['decode_tok_s']:.1f} tok/s, prompt {got['prompt_tok_s']:.1f} tok/s",
                  flush=True)
    print(f"load average after: {os.getloadavg()}")
    ref = rows["llama.cpp"]
    med = {s: {k: statistics.median(g[k] for g in rows[s]) for k in ("decode_tok_s", "prompt_tok_s")} for s in sides}
    print("\n| side | decode tok/s (rounds) | vs llama.cpp | prompt tok/s (rounds) | vs llama.cpp | tokens vs llama.cpp |")
    print("|---|---:|---:|---:|---:|---|")
    for s in sides:
        diff = first_difference(rows[s][0]["tokens"], ref[0]["tokens"])
        same = f"{args.new_tokens} of {args.new_tokens} equal" if diff is None else f"first differs at {diff}"
        dec = ", ".join(f"{g['decode_tok_s']:.1f}" for g in rows[s])
        pro = ", ".join(f"{g['prompt_tok_s']:.1f}" for g in rows[s])
        print(f"| {s} | {med[s]['decode_tok_s']:.1f} ({dec}) | {med[s]['decode_tok_s'] / med['llama.cpp']['decode_tok_s']:.3f} "
              f"| {med[s]['prompt_tok_s']:.1f} ({pro}) | {med[s]['prompt_tok_s'] / med['llama.cpp']['prompt_tok_s']:.3f} | {same} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": lscpu(), "threads": args.threads, "prompt_ids": ids, "rounds": rows,
                       "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
