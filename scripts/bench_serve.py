"""runners.serve's throughput: N concurrent requests against one, with the weights streamed.

Starts `python -m runners.serve` as a subprocess (every block streamed from NVMe by default:
--weights nvme; --ignore-eos so every request makes exactly --new-tokens), then, alternately for
--rounds rounds: one request alone, and --concurrent requests at once (different prompts), each
through the official `openai` client, streamed. Prints the wall time of each, the ratio
(concurrent / one: the issue's bar is <= 2x for 8), aggregate tok/s and the server's decode
steps. Each decode step reads every streamed block once for all the rows in flight, so the
ratio is near (prefills + steps) / (1 + steps) when the disk is the bound.

Usage: python scripts/bench_serve.py [--model M] [--new-tokens 32] [--concurrent 8]
       [-- extra runners.serve flags, e.g. --quantize int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPICS = ["the sea", "a cat", "Paris", "gravity", "bread", "mountains", "music", "the number seven",
          "rain", "a library", "trains", "the moon", "tea", "winter", "bees", "a lighthouse"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def _steps(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())["steps"]


def _run(client, model: str, topics: list[str], new_tokens: int) -> tuple[float, int]:
    """Wall seconds for these requests sent at once, and the tokens they made."""
    made = [0] * len(topics)
    barrier = threading.Barrier(len(topics) + 1)

    def one(k):
        barrier.wait()
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write about {topics[k]}."}],
            max_tokens=new_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                made[k] = chunk.usage.completion_tokens

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(topics))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(made)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser(
        "~/.cache/offload/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--weights", default="nvme")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    import openai
    port = _free_port()
    cmd = [sys.executable, "-m", "runners.serve", "--model", args.model, "--weights", args.weights,
           "--port", str(port), "--ignore-eos", "--max-batch", str(args.concurrent),
           "--max-context", "512", "--log-level", "warning", *extra]
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        _wait_ready(port, proc)
        client = openai.OpenAI(api_key="none", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0,
                               timeout=3600)
        name = client.models.list().data[0].id
        _run(client, name, TOPICS[:1], 4)  # warm-up: kernels chosen, checks run
        ones, manys = [], []
        for r in range(args.rounds):
            s0 = _steps(port)
            t1, n1 = _run(client, name, TOPICS[:1], args.new_tokens)
            s1 = _steps(port)
            tn, nn = _run(client, name, TOPICS[:args.concurrent], args.new_tokens)
            s2 = _steps(port)
            ones.append(t1)
            manys.append(tn)
            print(f"round {r + 1}: 1 request {t1:.2f} s ({n1} tokens, {s1 - s0} decode steps); "
                  f"{args.concurrent} at once {tn:.2f} s ({nn} tokens, {s2 - s1} decode steps, "
                  f"{nn / tn:.1f} tok/s in all); ratio {tn / t1:.2f}x", flush=True)
        one, many = statistics.median(ones), statistics.median(manys)
        print(f"median: 1 request {one:.2f} s, {args.concurrent} concurrent {many:.2f} s: "
              f"{many / one:.2f}x the time for {args.concurrent}x the tokens "
              f"({'within' if many <= 2 * one else 'OVER'} the 2x bar)")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
