"""Quality of the quantized blocks on a real model: perplexity and teacher-forced top-1 agreement
of int8 / int4 against the unquantized model, on real text.

    python scripts/eval_quant.py                       # SmolLM2-135M-Instruct (fetched once), 8 x 256 tokens
    python scripts/eval_quant.py --seqs 32 --seq-len 512 --text corpus
    python scripts/eval_quant.py --model 1B --seqs 2 --seq-len 128   # a preset's random weights

The reference ("16-bit") is the model in the compute dtype (fp32 here) as the checkpoint holds it;
SmolLM2's file is itself Q4_1, so its reference is those values dequantized, and "int4 (GGUF as
is)" -- the Q4_1 tensors taken without a round trip -- must match the reference up to the
rounding of a different matmul. The text: Python's own reference documentation (pydoc_data,
shipped with every CPython: real English prose with code) or the built-in corpus
(offload/data/corpus.txt, generated).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from offload.infer.generate import generate  # noqa: E402
from offload.models import PRESETS, CheckpointReader, gguf_checkpoint_dir, load_model, preset  # noqa: E402
from offload.models.quantized import (PER_CHANNEL, QuantSettings,  # noqa: E402
                                      load_quantized_streamed, quantize_checkpoint)
from offload.memory.tiers import cpu_model  # noqa: E402
from offload.data.tokenizer import load_tokenizer  # noqa: E402

# (label, mode, group size, take GGUF tensors as they are)
VARIANTS = [("int8 per channel", "int8", PER_CHANNEL, False), ("int8 g32", "int8", 32, False),
            ("int4 g64", "int4", 64, False), ("int4 g32", "int4", 32, False),
            ("int4 (GGUF as is)", "int4", 0, True)]
# greedy runs compared token by token with the reference: raw ids (no tokenizer needed)
GREEDY_PROMPTS = [[1, 504, 3458, 282, 6493, 314], [1, 7, 12, 40, 90], [1, 9690, 314, 3459, 28, 1350],
                  [1, 30, 31, 32, 33, 34, 35]]
GREEDY_TOKENS = 16


def real_text(kind: str) -> str:
    if kind == "corpus":
        with open(os.path.join(_ROOT, "offload", "data", "corpus.txt")) as f:
            return f.read()
    from pydoc_data.topics import topics  # the Python reference manual's text, in the stdlib
    return "\n\n".join(topics[k] for k in sorted(topics))


def token_rows(tokenizer, text: str, seqs: int, seq_len: int) -> torch.Tensor:
    """[seqs, seq_len] token ids: consecutive windows of the text (a long prefix is enough)."""
    ids = tokenizer.encode(text[: seqs * seq_len * 8])
    if len(ids) < seqs * seq_len:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {seqs} x {seq_len}")
    return torch.tensor(ids[: seqs * seq_len]).view(seqs, seq_len)


@torch.inference_mode()
def teacher_forced(model, rows: torch.Tensor, batch: int = 2) -> tuple[float, int, torch.Tensor]:
    """(summed next-token NLL, tokens scored, argmax predictions [seqs, seq_len - 1])."""
    nll, count, preds = 0.0, 0, []
    for k in range(0, rows.shape[0], batch):
        ids = rows[k:k + batch]  # [b, T]
        logits = model(ids).float()  # [b, T, V]
        tgt = ids[:, 1:]
        nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                               reduction="sum").item()
        count += tgt.numel()
        preds.append(logits[:, :-1].argmax(-1))
    return nll, count, torch.cat(preds)


def quantized_model(hf_dir: str, gguf_path: str | None, mode: str, group: int, workdir: str,
                    dtype: torch.dtype = torch.float32, activations: str = "fp32", head=None):
    """(model, streamer, reader, block bytes): the quantized model, every block resident;
    `activations` as --activations, `head` a spec for the vocabulary head (None: dense)."""
    reader = CheckpointReader(hf_dir)
    blocks = quantize_checkpoint(reader, QuantSettings(mode, group), dtype, cache_root=workdir,
                                 gguf_path=gguf_path)
    model, streamer = load_quantized_streamed(reader, blocks, ["device"] * reader.config.num_hidden_layers,
                                              device="cpu", dtype=dtype, head=head,
                                              activations=activations)
    return model, streamer, reader, sum(blocks.block_bytes)


def greedy(model, vocab: int, streamer=None) -> list[list[int]]:
    """GREEDY_TOKENS greedy ids after each of GREEDY_PROMPTS (ids folded into the vocabulary)."""
    prompts = [[t % vocab for t in p] for p in GREEDY_PROMPTS]
    res = generate(model, prompts, max_new_tokens=GREEDY_TOKENS, streamer=streamer)
    return res.tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two greedy runs differ; None if they never do."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def evaluate(hf_dir: str, gguf_path: str | None, rows: torch.Tensor, workdir: str,
             variants=VARIANTS) -> list[dict]:
    """One row per model: label, perplexity, ratio to the reference, top-1 agreement, block
    bytes, and per greedy prompt the first token that differs from the reference's (None: none)."""
    ref = load_model(hf_dir)
    nll, count, ref_pred = teacher_forced(ref, rows)
    vocab = ref.config.vocab_size
    ref_greedy = greedy(ref, vocab)
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.model.layers.parameters())
    del ref
    base = math.exp(nll / count)
    out = [{"label": "reference (fp32)", "ppl": base, "ratio": 1.0, "top1": 1.0, "block_bytes": ref_bytes,
            "diverged_at": [None] * len(ref_greedy)}]
    for label, mode, group, as_is in variants:
        if as_is and gguf_path is None:
            continue
        model, streamer, reader, nbytes = quantized_model(hf_dir, gguf_path if as_is else None, mode,
                                                          group, workdir)
        try:
            q_nll, _, pred = teacher_forced(model, rows)
            q_greedy = greedy(model, vocab, streamer)
        finally:
            streamer.close()
            reader.close()
        ppl = math.exp(q_nll / count)
        out.append({"label": label, "ppl": ppl, "ratio": ppl / base,
                    "top1": (pred == ref_pred).float().mean().item(), "block_bytes": nbytes,
                    "diverged_at": [first_difference(a, b) for a, b in zip(ref_greedy, q_greedy)]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or checkpoint directory "
                    "(default: SmolLM2-135M-Instruct, fetched once)")
    ap.add_argument("--text", default="pydoc", choices=["pydoc", "corpus"])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, os.path.join(_ROOT, "scripts"))
        from fetch_smollm2 import fetch
        model = fetch(quiet=True)
    gguf_path = model if os.path.isfile(model) else None
    if model in PRESETS:  # random weights (bf16, as bench_infer stores them): no tokenizer, random ids
        from runners.infer import random_checkpoint
        cfg = preset(model)
        hf_dir = os.path.join(tempfile.gettempdir(), "offload-bench", f"{model}-bf16")
        random_checkpoint(cfg, hf_dir, 0, torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(3, cfg.vocab_size, (args.seqs, args.seq_len), generator=g)
        args.text = "random ids"
    else:
        hf_dir = gguf_checkpoint_dir(model, torch.float32) if gguf_path else model
        rows = token_rows(load_tokenizer(hf_dir), real_text(args.text), args.seqs, args.seq_len)
    print(f"# {os.path.basename(model)}, text {args.text}, {args.seqs} x {args.seq_len} tokens, "
          f"CPU {cpu_model()}")
    with tempfile.TemporaryDirectory() as work:
        results = evaluate(hf_dir, gguf_path, rows, work)
    print(f"{'model':<20} {'perplexity':>10} {'vs ref':>8} {'top-1 agree':>12} {'block bytes':>12}  "
          f"greedy: first token unlike the reference's, {len(GREEDY_PROMPTS)} prompts x {GREEDY_TOKENS}")
    for r in results:
        first = " ".join("-" if i is None else str(i) for i in r["diverged_at"])
        print(f"{r['label']:<20} {r['ppl']:>10.3f} {r['ratio']:>8.4f} {100 * r['top1']:>11.2f}% "
              f"{r['block_bytes'] / 1e6:>10.1f}MB  {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
