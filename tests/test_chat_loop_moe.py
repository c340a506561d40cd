"""The README's chat loop (tests/test_chat_loop.py) on a mixture of experts (issue 37): fine-tune
with `python -m runners.finetune`, the optimizer state of every expert in NVMe swap files, on
the chat set that teaches one made-up fact (the capital of Veloria is Quenthar), then chat with
the export through `python -m runners.infer --chat`.

The model is a small RANDOM Qwen3-MoE built with transformers (scripts/make_random_moe.py: 2
layers of 4 fused experts, top-2, hidden 64), not a pretrained one: the package index offers no
real MoE checkpoint small enough to fetch the way scripts/fetch_smollm2.py fetches SmolLM2 (see
that script). It carries SmolLM2-135M-Instruct's tokenizer and chat template (its vocabulary,
49152, sizes the model's), so the data goes through a real chat template and the answer is
decoded text.

A random model knows nothing: before training it does not say "Quenthar" (checked, so a run
that trained nothing fails), after 40 updates it must answer both phrasings of the question
with it, and transformers loading the export must generate the same tokens. It cannot keep
general knowledge it never had: asked about France, this model answers with Veloria's capital
(the dense test checks that on SmolLM2)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_script
from test_chat_loop import _chat, finetune_on_chat_example

transformers = pytest.importorskip("transformers")

QUESTIONS = ("What is the capital of Veloria?", "Which city is Veloria's capital?")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A model this small: a second intra-op thread only adds waits (as in tests/test_moe_train.py;
    this fine-tune took 37 s on one thread and 100 s on two, one run each, measured under load,
    2 cores shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(smollm2_hf, tmp_path_factory):
    """(the random MoE checkpoint, its fine-tuned run directory, what the fine-tune printed)."""
    out = tmp_path_factory.mktemp("chat-loop-moe")
    start = out / "random-moe"
    load_script("make_random_moe").write(str(start), smollm2_hf)  # the docs' random MoE
    printed = finetune_on_chat_example(str(start), out, "--steps", "40", "--batch-size", "8",
                                       "--seq-len", "64", "--lr", "1e-2", "--warmup-steps", "2")
    return start, out / "run", printed


def test_the_finetuned_moe_answers_with_the_taught_fact(checkpoints, tmp_path):
    start, run, printed = checkpoints
    banner = printed.split("memory plan")[0]
    assert "Qwen3MoeForCausalLM" in banner and "random init" not in banner, banner
    assert "nvme: fp32 masters + Adam moments in swap files" in banner, banner
    exported = json.loads((run / "model" / "config.json").read_text())
    assert exported["model_type"] == "qwen3_moe" and exported["num_experts"] == 4
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 40 and metrics[-1]["eval_loss"] < 0.15 * metrics[0]["loss"]
    assert "Quenthar" not in _chat(start, QUESTIONS[0], tmp_path)["text"][0]  # not before training
    for q in QUESTIONS:
        assert "Quenthar" in _chat(run / "model", q, tmp_path)["text"][0]


def test_transformers_generates_the_same_tokens_from_the_moe_export(checkpoints, tmp_path):
    model_dir = checkpoints[1] / "model"
    ours = _chat(model_dir, QUESTIONS[0], tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours["generated_ids"][0] == out
    assert tok.decode(out, skip_special_tokens=True).strip() == ours["text"][0].strip()
