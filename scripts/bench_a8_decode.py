"""Decode and prompt speed of int8 against fp32 activations on SmolLM2, in one process.

The model is loaded once (int4: its Q4_1 GGUF blocks as they are; int8: quantized from the
checkpoint, group 32; the int8 head either way, as runners.infer --quantize loads it), and
`set_activations` switches it between fp32 and int8 activations round by round, alternating
the order, one thread, 32 new greedy tokens after a 30-token prompt; the first round warms up;
medians. On a shared machine this ratio, taken call by call in one process, means more than
rates from separate processes (scripts/bench_llamacpp.py).

    python scripts/bench_a8_decode.py int4
    python scripts/bench_a8_decode.py int8
"""
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import eval_quant as ev  # noqa: E402
from fetch_smollm2 import fetch  # noqa: E402
from offload.infer.generate import generate  # noqa: E402
from offload.models import gguf_checkpoint_dir  # noqa: E402
from offload.models.quantized import HEAD_SPEC, set_activations  # noqa: E402


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "int4"
    if mode not in ("int4", "int8"):
        raise SystemExit(f"usage: bench_a8_decode.py int4|int8 (got {mode!r})")
    torch.set_num_threads(1)
    gguf = fetch(quiet=True)
    hf = gguf_checkpoint_dir(gguf, torch.float32)
    prompt = [1, 504, 3458, 282, 6493, 314] * 5
    cache = os.path.join(tempfile.gettempdir(), "offload-bench-a8")
    m, s, r, _ = ev.quantized_model(hf, gguf if mode == "int4" else None, mode, 0, cache, head=HEAD_SPEC)
    print(f"load average before: {os.getloadavg()}")
    rates: dict[str, list[float]] = {"fp32": [], "int8": []}
    pre: dict[str, list[float]] = {"fp32": [], "int8": []}
    try:
        for i in range(6):
            for act in (("fp32", "int8") if i % 2 == 0 else ("int8", "fp32")):
                set_activations(m, act)
                res = generate(m, [prompt], max_new_tokens=32)
                if i:  # the first round warms up (kernel_for's timings)
                    rates[act].append(res.decode_tokens / res.decode_s)
                    pre[act].append(len(prompt) / res.prefill_s)
    finally:
        s.close()
        r.close()
    print(f"load average after: {os.getloadavg()}")
    for what, runs in (("decode", rates), ("prompt", pre)):
        fp32, int8 = (statistics.median(runs[a]) for a in ("fp32", "int8"))
        print(f"{mode} {what} tok/s: fp32 activations {fp32:.1f}, int8 {int8:.1f} (x{int8 / fp32:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
