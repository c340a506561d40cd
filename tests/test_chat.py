"""Chat at inference on the real model: a multi-turn session keeps its KV cache between turns and
gives the tokens `transformers` gives for the whole conversation; templates that re-render history
stay exact (Qwen3's own, with its thinking switch); streamed weights give the same tokens; the
CLI's --interactive / --system / --max-context / --thinking."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from offload.infer.chat import ChatOverflow, ChatSession, common_prefix
from offload.models import CheckpointReader, build_model
from offload.models import load_streamed
from offload.data.tokenizer import Tokenizer
from runners import infer
from runners.common import run_main
from runners.infer_checks import chat_template_vars, check_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.path.join(ROOT, "tests", "fixtures", "templates", "qwen3.jinja")
QUESTIONS = ["What is the capital of France?", "And the capital of Italy?"]


@pytest.fixture(scope="module")
def real(smollm2_hf):
    with CheckpointReader(smollm2_hf) as reader:
        model = build_model(reader.config, "cpu", torch.float32, source=reader)
    return model, Tokenizer.from_dir(smollm2_hf)


@pytest.fixture(scope="module")
def reference(smollm2_hf):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()


def _reference_reply(ref, tok: Tokenizer, messages, max_new: int = 24, template_vars=None) -> list[int]:
    ids = torch.tensor([tok.encode_chat(messages, template_vars=template_vars)])
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=tok.stop_ids())
    return out[0, ids.shape[1]:].tolist()


def test_second_turn_reuses_the_cache_and_matches_transformers(real, reference):
    model, tok = real
    session = ChatSession(model, tok, max_context=512)
    first = session.reply(QUESTIONS[0], 24)
    assert first.stopped and first.ids[-1] == tok.token_id("<|im_end|>") and "Paris" in first.text
    second = session.reply(QUESTIONS[1], 24)
    assert second.fed_tokens < 20 < second.prompt_tokens  # only the new turn went through the model
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": QUESTIONS[1]}]
    assert second.ids == _reference_reply(reference, tok, messages)
    assert session.messages[-1] == {"role": "assistant", "content": second.text}


def test_a_template_that_rerenders_history_stays_exact(real, reference, smollm2_hf):
    """The system line counts the messages, so every turn changes the conversation's first
    tokens: the cache is cut back to the common prefix and the answer is still the reference's."""
    model, tok = real
    files = tok.files()
    config = dict(files["tokenizer_config.json"])
    config["chat_template"] = (
        "<|im_start|>system\nThis conversation has {{ messages|length }} messages.<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    counting = Tokenizer(files["tokenizer.json"], config, files.get("generation_config.json"))
    session = ChatSession(model, counting, max_context=512)
    first = session.reply(QUESTIONS[0], 24)
    second = session.reply(QUESTIONS[1], 24)
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": QUESTIONS[1]}]
    # only the ids before the message count differ are kept: "<|im_start|>system\nThis conversation has"
    kept = common_prefix(counting.encode_chat(messages[:1]), counting.encode_chat(messages))
    assert 0 < kept < 10 and second.fed_tokens == second.prompt_tokens - kept
    assert second.ids == _reference_reply(reference, counting, messages)


def _with_template(tok: Tokenizer, path: str) -> Tokenizer:
    """The model's tokenizer with another family's chat template (SmolLM2 is ChatML too)."""
    files = tok.files()
    with open(path, encoding="utf-8") as f:
        config = {**files["tokenizer_config.json"], "chat_template": f.read()}
    return Tokenizer(files["tokenizer.json"], config, files.get("generation_config.json"))


def test_qwen3_template_with_thinking_off(real, reference):
    """Qwen3's own template in the chat loop, thinking off: every prompt ends in the empty think
    block, the next turn renders the earlier answer without one (the cache is cut back there) and
    the tokens are transformers' for the conversation."""
    model, tok = real
    qwen = _with_template(tok, QWEN3)
    off = {"enable_thinking": False}
    session = ChatSession(model, qwen, max_context=512, template_vars=off)
    first = session.reply(QUESTIONS[0], 16)
    assert first.stopped and first.ids[-1] == qwen.token_id("<|im_end|>")
    second = session.reply(QUESTIONS[1], 16)
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": QUESTIONS[1]}]
    prompt = qwen.render_chat(messages, template_vars=off)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and prompt.count("<think>") == 1
    assert second.prompt_tokens - second.fed_tokens < len(qwen.encode_chat(messages[:1], template_vars=off))
    assert second.ids == _reference_reply(reference, qwen, messages, 16, off)


def test_thinking_flag(smollm2_hf, capsys):
    """--thinking reaches the prompts as enable_thinking; on a template that does not read it, one
    note line says the flag changes nothing and the run goes on."""
    qwen = _with_template(Tokenizer.from_dir(smollm2_hf), QWEN3)
    args = infer.build_parser().parse_args(["--model", smollm2_hf, "--chat", "--prompt", QUESTIONS[0],
                                            "--thinking", "off"])
    check_flags(args)
    args.template_vars = chat_template_vars(args, qwen)
    assert args.template_vars == {"enable_thinking": False} and capsys.readouterr().err == ""
    prompts = infer.read_prompts(args, qwen, qwen)  # (the tokenizer has the vocab_size read_prompts checks)
    assert prompts == [qwen.encode_chat(QUESTIONS[0], template_vars={"enable_thinking": False})]
    assert qwen.decode(prompts[0], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert run_main(infer.main, ["--model", smollm2_hf, "--chat", "--prompt", "hi", "--thinking", "on",
                                 "--dry-run", "--probe-seconds", "0"]) == 0
    assert ("note: --thinking on: this model's chat template does not read enable_thinking, so the "
            "flag changes nothing") in capsys.readouterr().err.splitlines()


def test_overflow_is_refused_and_the_conversation_kept(real):
    model, tok = real
    session = ChatSession(model, tok, max_context=64)
    session.reply("Hi", 8)
    before = list(session.messages)
    with pytest.raises(ChatOverflow, match="--max-context 64"):
        session.reply("Tell me everything about the history of Rome in detail please.", 40)
    assert session.messages == before
    session.reset()
    assert session.messages == [] and session.cache.length == 0


def test_streamed_weights_give_the_same_turns(smollm2_hf, real):
    model, tok = real
    resident = ChatSession(model, tok, max_context=256)
    want = [resident.reply(q, 16).ids for q in QUESTIONS]
    with CheckpointReader(smollm2_hf) as reader:
        L = reader.config.num_hidden_layers
        streamed, streamer = load_streamed(reader, ["cpu"] * L, device=torch.device("cpu"),
                                           dtype=torch.float32)
        try:
            session = ChatSession(streamed, tok, max_context=256, streamer=streamer)
            assert [session.reply(q, 16).ids for q in QUESTIONS] == want
        finally:
            streamer.close()


def test_interactive_cli_two_turns(smollm2_gguf, tmp_path):
    out = tmp_path / "chat.json"
    done = subprocess.run(
        [sys.executable, "-m", "runners.infer", "--model", smollm2_gguf, "--interactive",
         "--max-new-tokens", "24", "--max-context", "256", "--output-json", str(out)],
        # a line that is not UTF-8 between the turns: said, and the session goes on
        input=b"What is the capital of France?\n\xff\xfe oops\nAnd of Italy?\n/exit\n",
        capture_output=True, cwd=ROOT, timeout=300)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    assert "error: that line is not UTF-8 text (byte 1); type it again" in stderr
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert "Paris" in lines[0] and "Rome" in lines[1]
    turns = json.loads(out.read_text())["transcript"]
    assert len(turns) == 2 and turns[1]["fed_tokens"] < turns[1]["prompt_tokens"]


def test_system_message_and_bad_flags(smollm2_hf, tmp_path, capsys):
    tok = Tokenizer.from_dir(smollm2_hf)
    assert "Answer in French." in tok.decode(tok.encode_chat("Hi", system="Answer in French."),
                                             skip_special_tokens=False)
    for argv, msg in ((["--model", smollm2_hf, "--system", "x", "--prompt", "hi"], "add --chat"),
                      (["--model", smollm2_hf, "--thinking", "off", "--prompt", "hi"], "add --chat"),
                      (["--model", smollm2_hf, "--max-context", "64"], "add --interactive"),
                      (["--model", smollm2_hf, "--interactive", "--prompt", "hi"], "reads the prompts from stdin"),
                      (["--interactive"], "needs a model whose tokenizer has a chat template"),
                      (["--model", smollm2_hf, "--interactive", "--max-context", "16",
                        "--max-new-tokens", "16"], "leaves no room")):
        assert run_main(infer.main, argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error:") and msg in err[-1], (argv, err)
        assert not any("Traceback" in line for line in err)
