"""Today's chat template families render in our chat path exactly as transformers renders them.

The templates are the models' own (tests/fixtures/templates, sources in SOURCES.md): Gemma 2 and 3
(`<start_of_turn>` turns, no system role: Gemma 2 refuses one, Gemma 3 folds it into the first
user turn), Qwen3 (ChatML with the `enable_thinking` switch, reasoning stripped from earlier
assistant turns, `tool` turns), Phi-3 / Phi-3.5 (`<|user|>` ... `<|end|>`) and Phi-4 (`<|im_start|>`
... `<|im_sep|>`). Each conversation is rendered by `Tokenizer.render_chat` and by transformers'
`apply_chat_template(..., tokenize=False)` over the same tiny tokenizer, with and without the
generation prompt and with enable_thinking true, false and absent; the texts must be equal. The
end-of-turn token each family writes must stop generation in the chat loop.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from offload.data.tokenizer import Tokenizer, TokenizerError
from offload.infer.chat import ChatSession

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "templates")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>",
            "<|im_sep|>", "<|endoftext|>", "<s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# Qwen3's <think> and </think> are added tokens, but not special ones: decoding keeps them
ADDED = ["<think>", "</think>"]
WORDS = ("user model assistant system tool You are terse . What is the capital of France ? Paris "
         "And Italy Rome Hi there hmm thinking about it Let me check the weather 21 degrees thanks "
         "tool_response temp rain false padded question answer next late").split()

# family -> (template file, bos, eos, the end-of-turn token its template writes)
FAMILIES = {
    "gemma2": ("gemma2.jinja", "<bos>", "<eos>", "<end_of_turn>"),
    "gemma3": ("gemma3.jinja", "<bos>", "<eos>", "<end_of_turn>"),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", "<|im_end|>"),
    "phi3": ("phi3.jinja", "<s>", "<|endoftext|>", "<|end|>"),
    "phi3_5": ("phi3_5.jinja", "<s>", "<|endoftext|>", "<|end|>"),
    "phi4": ("phi4.jinja", "<|endoftext|>", "<|endoftext|>", "<|im_end|>"),
}

SYS = {"role": "system", "content": "You are terse."}
Q1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
Q2 = {"role": "user", "content": "And Italy?"}
A1_THINK = {"role": "assistant", "content": "<think>\nhmm thinking about it\n</think>\n\nParis."}
A2_THINK = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nRome."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system+user": [SYS, Q1],
    "multi-turn": [Q1, A1, Q2],
    "system+multi-turn": [SYS, Q1, A1, Q2, {"role": "assistant", "content": "Rome."}],
    "whitespace": [{"role": "user", "content": "  padded question \n"},
                   {"role": "assistant", "content": "\n answer  "}, {"role": "user", "content": "next"}],
}
QWEN3_ONLY = {
    "think-history": [SYS, Q1, A1_THINK, Q2],
    "think-last": [Q1, A1_THINK, Q2, A2_THINK],
    "tools": [SYS, {"role": "user", "content": "What is the weather?"},
              {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nLet me check the weather."},
              {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"rain": false}'},
              {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "thanks"}],
    "tool-response-as-user": [Q1, A1_THINK,
                              {"role": "user", "content": "<tool_response>\n21\n</tool_response>"}],
    "late-system": [Q1, A1, {"role": "system", "content": "late"}, Q2],
}
THINKING = [{}, {"enable_thinking": True}, {"enable_thinking": False}]


def _rust_tokenizer():
    from tokenizers import AddedToken, Tokenizer as RustTokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.add_tokens([AddedToken(s, special=False) for s in ADDED])
    return tok


def _template(family: str) -> str:
    with open(os.path.join(FIXTURES, FAMILIES[family][0]), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def pairs():
    """family -> (our Tokenizer, transformers' PreTrainedTokenizerFast) over one tiny vocabulary."""
    from transformers import PreTrainedTokenizerFast
    rust = _rust_tokenizer()
    out = {}
    for family, (_, bos, eos, _) in FAMILIES.items():
        special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
        template = _template(family)
        ours = Tokenizer(rust.to_str(), {**special, "chat_template": template}, source=family)
        ref = PreTrainedTokenizerFast(tokenizer_object=rust, chat_template=template, **special)
        out[family] = ours, ref
    return out


def _cases():
    for family in FAMILIES:
        convs = {**CONVERSATIONS, **(QWEN3_ONLY if family == "qwen3" else {})}
        for name in convs:
            if family == "gemma2" and any(m["role"] == "system" for m in convs[name]):
                continue  # Gemma 2 refuses a system turn: test_gemma_refusals
            yield pytest.param(family, convs[name], id=f"{family}-{name}")


@pytest.mark.parametrize("family,messages", list(_cases()))
def test_renders_as_transformers(pairs, family, messages):
    ours, ref = pairs[family]
    for gen in (True, False):
        for variables in THINKING:
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                           **variables)
            got = ours.render_chat(messages, gen, template_vars=variables)
            assert got == want, (family, gen, variables)
            assert ours.encode_chat(messages, add_generation_prompt=gen, template_vars=variables) == \
                ref.encode(want, add_special_tokens=False)


def test_what_each_family_writes(pairs):
    """The renderings compared above, spelled out for one conversation each."""
    gemma3, qwen3, phi3, phi4 = (pairs[f][0] for f in ("gemma3", "qwen3", "phi3", "phi4"))
    assert gemma3.render_chat([SYS, Q1]) == (  # the system message folded into the first user turn
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert phi3.render_chat([SYS, Q1], add_generation_prompt=False) == (
        "<|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is the capital of France?<|end|>\n<|endoftext|>")
    assert phi4.render_chat([Q1]) == ("<|im_start|>user<|im_sep|>What is the capital of France?<|im_end|>"
                                      "<|im_start|>assistant<|im_sep|>")
    head = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3.render_chat([Q1]) == head
    assert qwen3.render_chat([Q1], template_vars={"enable_thinking": True}) == head
    assert qwen3.render_chat([Q1], template_vars={"enable_thinking": False}) == \
        head + "<think>\n\n</think>\n\n"
    # an earlier assistant turn loses its reasoning; the last one, after the last question, keeps it
    history = qwen3.render_chat([Q1, A1_THINK, Q2, A2_THINK], add_generation_prompt=False)
    assert "hmm thinking" not in history and "<|im_start|>assistant\nParis.<|im_end|>" in history
    assert history.endswith("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nRome.<|im_end|>\n")
    tools = qwen3.render_chat(QWEN3_ONLY["tools"])
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n'
            '{"rain": false}\n</tool_response><|im_end|>\n') in tools


def test_gemma_refusals(pairs):
    """Gemma 2 has no system role and both Gemmas need alternating turns: the template's own
    raise_exception, one TokenizerError line here, an error in transformers too."""
    import jinja2
    for family, messages, msg in (("gemma2", [SYS, Q1], "System role not supported"),
                                  ("gemma3", [Q1, Q2], "Conversation roles must alternate")):
        ours, ref = pairs[family]
        with pytest.raises(TokenizerError, match=msg):
            ours.render_chat(messages)
        with pytest.raises(jinja2.TemplateError, match=msg):
            ref.apply_chat_template(messages, tokenize=False)


def test_which_templates_read_the_thinking_switch(pairs):
    for family, (ours, _) in pairs.items():
        assert ("enable_thinking" in ours.template_variables) == (family == "qwen3"), family
        assert {"messages", "add_generation_prompt"} <= ours.template_variables


def test_template_variables_are_checked(pairs):
    ours, _ = pairs["qwen3"]
    for bad, msg in (({"messages": []}, "set by the renderer"), ({"add_generation_prompt": 1}, "renderer"),
                     ({"not a name": 1}, "identifier"), ({"_x": 1}, "identifier"),
                     ({"enable_thinking": [True]}, "boolean, number, string or null"),
                     (["enable_thinking"], "mapping")):
        with pytest.raises(TokenizerError, match=msg):
            ours.render_chat([Q1], template_vars=bad)
    # a variable wins over a special token of the same name, as transformers' keyword arguments do
    assert pairs["gemma3"][0].render_chat([Q1], template_vars={"bos_token": "<s>"}).startswith("<s><start")


def test_generation_tag_and_transformers_context(pairs):
    """transformers' renderer knows `{% generation %}` (its assistant masks) and always defines
    `tools` and `documents` (as none): the same here."""
    ours, ref = pairs["qwen3"]
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
                "{{ tools is none }} {{ documents is defined }} {{ tools is defined }}")
    want = ref.apply_chat_template([Q1, A1], tokenize=False, chat_template=template)
    mine = Tokenizer(ours.files()["tokenizer.json"], {"chat_template": template})
    assert mine.render_chat([Q1, A1], add_generation_prompt=False) == want
    assert want == "What is the capital of France?Paris.True True True"  # trim_blocks ate the newline


@pytest.mark.parametrize("family", list(FAMILIES))
def test_end_of_turn_token_is_a_stop_id(pairs, family):
    ours, _ = pairs[family]
    eot = ours.token_id(FAMILIES[family][3])
    assert ours.end_of_turn_id == eot and eot in ours.stop_ids()


class ScriptedModel(torch.nn.Module):
    """The chat loop's view of a model: it emits the scripted ids one per forward, whatever it
    is fed, and records what it was fed."""

    def __init__(self, vocab_size: int, script: list[int]):
        super().__init__()
        # what the KV cache is sized from: one layer of one head of width 2 for keys and values
        self.config = SimpleNamespace(num_hidden_layers=1, kv_cache_widths=lambda: ((1, 2), (1, 2)))
        self.vocab_size, self.script, self.fed = vocab_size, list(script), []

    def forward(self, x, kv_cache=None, last_only=False):
        self.fed.append(x[0].tolist())
        kv_cache.length += x.shape[1]
        logits = torch.full((1, 1, self.vocab_size), -1e4)
        logits[0, 0, self.script.pop(0)] = 0.0
        return logits


def _session(tok: Tokenizer, words: list[str], **kwargs) -> tuple[ChatSession, ScriptedModel]:
    model = ScriptedModel(tok.vocab_size, [tok.token_id(w) for w in words])
    return ChatSession(model, tok, max_context=256, **kwargs), model


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3", "phi3", "phi4"])
def test_chat_loop_stops_at_the_end_of_turn(pairs, family):
    tok, _ = pairs[family]
    eot = FAMILIES[family][3]
    session, model = _session(tok, ["Paris", eot, "Rome", "Rome", eot])
    first = session.reply("What is the capital of France?", 8)
    assert first.stopped and first.text == "Paris" and first.ids == [tok.token_id("Paris"), tok.token_id(eot)]
    assert model.script[0] == tok.token_id("Rome")  # nothing generated past the end of the turn
    second = session.reply("And Italy?", 8)
    assert second.stopped and second.text == "Rome Rome"
    assert second.fed_tokens < second.prompt_tokens  # the first turn came from the cache


def test_chat_loop_thinking_switch_and_history(pairs):
    """Qwen3 in the chat loop: thinking off puts the empty think block in the prompt; with it on,
    the reply's reasoning is dropped from the history on the next turn (the template re-renders
    it), and the cache is cut back to where the ids differ, so the prompt is still the template's."""
    tok, _ = pairs["qwen3"]
    think, end_think = tok.token_id("<think>"), tok.token_id("</think>")
    session, model = _session(tok, ["Paris", "<|im_end|>"], template_vars={"enable_thinking": False})
    session.reply("What is the capital of France?", 4)
    assert model.fed[0][-2:] == [think, end_think]
    session, model = _session(tok, ["<think>", "hmm", "</think>", "Paris", "<|im_end|>", "Rome", "<|im_end|>"],
                              template_vars={"enable_thinking": True})
    first = session.reply("What is the capital of France?", 8)
    assert model.fed[0][-1] == tok.token_id("assistant") and first.text == "<think> hmm </think> Paris"
    second = session.reply("And Italy?", 8)
    want = tok.encode_chat(session.messages[:-1], template_vars={"enable_thinking": True})
    assert second.prompt_tokens == len(want) and tok.token_id("hmm") not in want
    assert session.cached_ids[:len(want)] == want  # what the cache holds is the template's prompt
