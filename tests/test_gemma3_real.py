"""The second real model, Gemma 3 270M (Q4_K_M GGUF), against transformers loading the same file.

transformers dequantizes the GGUF in fp32 itself (its own loader, the `gguf` package's reference
dequantization, Gemma's norms minus 1); we convert it once into a Hugging Face directory and run
our decoder on it resident, streamed from RAM and streamed from NVMe files. Greedy tokens must be
identical, perplexity within 0.1%; a fine-tune through runners.finetune (plain text, offload cpu)
must lower the eval loss, and its export must answer the same tokens in transformers and in
runners.infer.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from offload.data.tokenizer import Tokenizer
from offload.infer.generate import generate
from offload.models import CheckpointReader, gguf_checkpoint_dir, load_model, load_streamed

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
           "Photosynthesis converts light energy into"]
NEW_TOKENS = 32
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a screw press adapted from winemaking. "
        "Within fifty years, presses operated in more than two hundred cities across Europe, and the "
        "price of books fell sharply, which in turn helped spread literacy, science and new ideas.")


@pytest.fixture(scope="module")
def gemma_dir(gemma3_gguf) -> str:
    return gguf_checkpoint_dir(gemma3_gguf, torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(gemma_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(gemma_dir)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference_tokens(gemma3_reference, prompt_ids) -> list[list[int]]:
    """transformers' greedy continuation of the prompts as one left-padded batch (as ours runs
    them), with their attention mask."""
    model, width = gemma3_reference[1], max(map(len, prompt_ids))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.inference_mode():
        y = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return y[:, width:].tolist()


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item()


def test_greedy_tokens_and_perplexity_equal_transformers_resident(gemma_dir, gemma3_reference,
                                                                  prompt_ids, reference_tokens):
    model = load_model(gemma_dir)
    got = generate(model, prompt_ids, max_new_tokens=NEW_TOKENS).tokens
    assert got == reference_tokens
    ids = torch.tensor([Tokenizer.from_dir(gemma_dir).encode(TEXT)])
    with torch.inference_mode():
        ours, theirs = _nll(model(ids), ids), _nll(gemma3_reference[1](ids).logits, ids)
    assert abs(math.exp(ours) / math.exp(theirs) - 1) < 1e-3, (math.exp(ours), math.exp(theirs))


def _streamed(gemma_dir: str, tier: str):
    with CheckpointReader(gemma_dir) as reader:
        return load_streamed(reader, [tier] * reader.config.num_hidden_layers, device="cpu",
                             dtype=torch.float32)


def test_greedy_tokens_equal_transformers_streamed_from_ram(gemma_dir, prompt_ids, reference_tokens):
    model, streamer = _streamed(gemma_dir, "cpu")
    try:
        got = generate(model, prompt_ids, max_new_tokens=NEW_TOKENS, streamer=streamer).tokens
    finally:
        streamer.close()
    assert got == reference_tokens


def test_greedy_tokens_equal_transformers_streamed_from_nvme(gemma_dir, prompt_ids, reference_tokens):
    """From NVMe files, in one pass over the blocks instead of 32 (each decode step reads all
    383 MB of them again): each prompt followed by transformers' 32 tokens, teacher-forced; the
    argmax at every position must be the next of those tokens -- exactly what greedy decoding
    from the same weights produces, token by token (generation itself, with its KV cache,
    streams from RAM above and from NVMe in tests/test_families_infer.py)."""
    model, streamer = _streamed(gemma_dir, "nvme")
    try:
        for ids, want in zip(prompt_ids, reference_tokens):
            x = torch.tensor([ids + want])
            with torch.inference_mode():
                picks = model(x)[0, len(ids) - 1:-1].argmax(-1).tolist()
            assert picks == want
    finally:
        streamer.close()
    assert streamer.stats.fetches["nvme"] >= 3 * 18 and streamer.stats.moved_bytes["disk"] > 0


def test_finetune_lowers_eval_loss_and_its_export_answers_alike(gemma_dir, tmp_path, capsys):
    """runners.finetune on plain text with the optimizer offloaded to host RAM; the export then generates the same
    greedy tokens in transformers and in runners.infer."""
    from transformers import AutoModelForCausalLM

    from runners.common import run_main
    from runners.finetune import main as finetune
    from runners.infer import main as infer
    data = tmp_path / "text.txt"
    data.write_text((TEXT + "\n") * 8)
    out, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    # the optimizer in host RAM: swap files of a real model are tests/test_chat_loop.py's (SmolLM2);
    # here they would write 3 GB (the 262K x 640 embedding's masters and moments) for one step
    rc = run_main(finetune, ["--model", gemma_dir, "--data", str(data), "--offload", "cpu",
                             "--steps", "1", "--batch-size", "2",
                             "--seq-len", "32", "--lr", "5e-5", "--warmup-steps", "0",
                             "--eval-every", "1", "--eval-batches", "1", "--output", str(out),
                             "--metrics", str(metrics), "--no-progress", "--no-final-checkpoint"])
    assert rc == 0
    before = float(re.search(r"step 0: eval loss ([0-9.]+)", capsys.readouterr().out).group(1))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    after = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
    assert after < before, (before, after)
    export = out / "model"
    assert (export / "config.json").is_file() and not (out / "checkpoint").exists()
    prompt = Tokenizer.from_dir(str(export)).encode(PROMPTS[0])
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    with torch.inference_mode():
        x = torch.tensor([prompt])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    del hf
    result = tmp_path / "infer.json"
    assert run_main(infer, ["--model", str(export), "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", "8", "--probe-seconds", "0",
                            "--output-json", str(result)]) == 0
    assert json.loads(result.read_text())["generated_ids"] == [want]
