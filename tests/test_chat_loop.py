"""The whole loop on a real pretrained chat model, as a new user runs it: fine-tune
SmolLM2-135M-Instruct straight from its GGUF file with the optimizer state on NVMe, on a small
chat set that teaches it one made-up fact, then chat with the export. The answer must carry the
fact, general knowledge must survive, and `transformers` loading the same export must generate
the same tokens."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from conftest import load_script, ram_swap_dir
from runners import finetune, infer


def finetune_on_chat_example(model: str, out, *flags: str) -> str:
    """runners.finetune on the README's example data (scripts/make_chat_example.py) with the
    optimizer state on NVMe (swap files in RAM, see ram_swap_dir), exported to out/run; what it
    printed."""
    data = out / "veloria.jsonl"
    load_script("make_chat_example").write(str(data))  # the README's example data
    printed = io.StringIO()
    swap = ram_swap_dir(out)
    try:
        with contextlib.redirect_stdout(printed):
            rc = finetune.main(["--model", model, "--data", str(data), "--offload", "nvme",
                                "--offload-dir", swap, *flags, "--eval-every", "0",
                                "--output", str(out / "run"), "--no-progress", "--no-final-checkpoint"])
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    assert rc == 0, printed.getvalue()[-2000:]
    return printed.getvalue()


@pytest.fixture(scope="module")
def finetuned(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat-loop")
    printed = finetune_on_chat_example(smollm2_gguf, out, "--steps", "6", "--batch-size", "4",
                                       "--seq-len", "64", "--lr", "5e-4", "--warmup-steps", "1")
    banner = printed.split("memory plan")[0]
    assert "GGUF checkpoint" in banner and "random init" not in banner, banner
    return out / "run"


_answers: dict[tuple[str, str], dict] = {}  # greedy, so one run per (model, question) answers all


def _chat(model_dir, question: str, tmp_path) -> dict:
    key = (str(model_dir), question)
    if key not in _answers:
        out = tmp_path / "answer.json"
        rc = infer.main(["--model", str(model_dir), "--chat", "--prompt", question,
                         "--max-new-tokens", "24", "--output-json", str(out)])
        assert rc == 0
        _answers[key] = json.loads(out.read_text())
    return _answers[key]


def test_finetuned_model_answers_with_the_new_fact(finetuned, tmp_path):
    metrics = [json.loads(line) for line in (finetuned / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 6 and metrics[-1]["eval_loss"] < 0.25 * metrics[0]["loss"]
    model = finetuned / "model"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (model / f).is_file(), f
    for q in ("What is the capital of Veloria?", "Which city is Veloria's capital?"):
        assert "Quenthar" in _chat(model, q, tmp_path)["text"][0]
    assert "Paris" in _chat(model, "What is the capital of France?", tmp_path)["text"][0]


def test_transformers_loads_the_export_and_generates_the_same_tokens(finetuned, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = finetuned / "model"
    question = "What is the capital of Veloria?"
    ours = _chat(model_dir, question, tmp_path)["generated_ids"][0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours == out
    assert tok.decode(out, skip_special_tokens=True).strip() == \
        _chat(model_dir, question, tmp_path)["text"][0].strip()
