"""Generation against `transformers` (greedy, fp32, Llama / Mistral / Qwen2), identical across
weight tiers and with delayed fetches; sampling and stop tokens; tokenizer.json + chat template
against transformers' tokenizer on the same files."""

from __future__ import annotations

import json

import pytest
import torch

from offload.infer.generate import (GenerationError, SamplingParams, filter_logits, generate,
                              next_tokens)
from offload.models import CheckpointReader, build_model, preset, save_pretrained
from offload.models import load_streamed
from offload.data.tokenizer import StreamDecoder, TokenizerError, load_tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]
NEW = 10
ARCHS = {
    "llama": dict(architecture="LlamaForCausalLM"),
    # a window shorter than prompt + generation, so the mask path is exercised
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=6),
    "qwen2": dict(architecture="Qwen2ForCausalLM", attention_bias=True),
}


def _checkpoint(path, arch: str):
    cfg = preset("tiny").replace(initializer_range=0.2, **ARCHS[arch])
    model = build_model(cfg, "cpu", torch.float32, source=7)
    with torch.no_grad():  # non-zero biases, or Qwen2 would equal Llama
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    save_pretrained(model, path)
    return cfg


def _hf_greedy(path, prompts, new: int) -> list[list[int]]:
    """transformers' own greedy generation: rows one at a time and the batch left-padded."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    single = [hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    batched = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[:, T:].tolist()
    return single, batched


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers_on_every_tier(tmp_path, arch):
    _checkpoint(tmp_path, arch)
    single, batched = _hf_greedy(tmp_path, PROMPTS, NEW)
    with CheckpointReader(tmp_path) as reader:
        for residency, delay in ((["device"] * 4, 0.0), (["cpu"] * 4, 0.003), (["nvme"] * 4, 0.003),
                                 (["nvme", "device", "cpu", "nvme"], 0.003)):
            model, streamer = load_streamed(reader, residency, device="cpu", dtype=torch.float32,
                                            zero_copy_host=False, fetch_delay_s=delay)
            try:
                got = [generate(model, [p], max_new_tokens=NEW, streamer=streamer).tokens[0]
                       for p in PROMPTS]
                assert got == single, residency
                assert generate(model, PROMPTS, max_new_tokens=NEW, streamer=streamer).tokens == batched
            finally:
                streamer.close()


def test_stop_tokens_streaming_and_counts(tmp_path):
    cfg = _checkpoint(tmp_path, "llama")
    model = build_model(cfg, "cpu", torch.float32, source=CheckpointReader(tmp_path))
    full = generate(model, PROMPTS, max_new_tokens=NEW).tokens
    stop = full[0][3]
    seen: list[list[int | None]] = []
    res = generate(model, PROMPTS, max_new_tokens=NEW, stop_ids=[stop],
                   on_tokens=lambda step, ids: seen.append(ids))
    first = full[0].index(stop)
    assert res.tokens[0] == full[0][:first + 1] and res.finished[0]
    # each row's streamed ids are exactly its output, finished rows emit None
    for r in range(2):
        assert [s[r] for s in seen if s[r] is not None] == res.tokens[r]
    assert res.decode_tokens == sum(len(t) for t in res.tokens) - 2


def test_sampling_is_seeded_and_filters_are_exact():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])
    top2 = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(top2).tolist() == [[True, False, False, False, True]]
    # probabilities ~ [.23, .08, .05, .01, .63]: top-p 0.8 keeps the two most likely
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(p).tolist() == [[True, False, False, False, True]]
    scaled = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(scaled, logits * 2)
    big = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=3)
    draws = [next_tokens(big, params, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(next_tokens(big, SamplingParams(temperature=1.0, top_k=1), torch.Generator()),
                       big.argmax(-1))
    with pytest.raises(GenerationError):
        SamplingParams(top_p=0.0)


def test_sampled_generation_reproducible_across_tiers(tmp_path):
    _checkpoint(tmp_path, "llama")
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11)
    outs = []
    with CheckpointReader(tmp_path) as reader:
        for residency in (["device"] * 4, ["nvme"] * 4):
            model, streamer = load_streamed(reader, residency, device="cpu", dtype=torch.float32)
            outs.append(generate(model, PROMPTS, max_new_tokens=NEW, sampling=params,
                                 streamer=streamer).tokens)
            streamer.close()
    assert outs[0] == outs[1]


def test_out_of_vocab_prompt_refused(tmp_path):
    cfg = _checkpoint(tmp_path, "llama")
    model = build_model(cfg, "meta")
    with pytest.raises(GenerationError, match="out of range"):
        generate(model, [[1, cfg.vocab_size]], max_new_tokens=2)


# ---- tokenizer -------------------------------------------------------------------------------------
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _write_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers, decoders
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "héllo wörld, streaming tokens 123",
            "<|user|> <|assistant|> offload runs models larger than the device"] * 20
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def test_tokenizer_matches_transformers(tmp_path):
    _write_tokenizer(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["the quick brown fox", "héllo wörld 123", " lazy  dog\n"]:
        assert ours.encode(text) == ref(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
    want = ref.apply_chat_template([{"role": "user", "content": "the fox "}],
                                   add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.encode_chat("the fox ") == list(want)
    assert ours.stop_ids() == [2]
    # streamed pieces add up to the full decode, even through multi-byte characters
    dec = StreamDecoder(ours)
    ids = ours.encode("héllo wörld", add_special_tokens=False)
    assert "".join(dec.push(t) for t in ids) + dec.flush() == ours.decode(ids)


def test_tokenizer_absent_or_broken(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_non_finite_logits_end_generation_in_one_line():
    """An adapter scaled by 1e30 (or damaged weights) made logits inf/nan and generation went on
    emitting <unk> with exit 0: now the first such step ends it, greedy or sampled."""
    torch.manual_seed(0)
    model = build_model(preset("tiny"), device="cpu")
    with torch.no_grad():
        model.lm_head.weight.mul_(1e38).mul_(1e38)  # as an adapter's huge scale does: overflow
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=1)):
        with pytest.raises(GenerationError, match=r"inf/nan logits .*lora_alpha / r"):
            generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4, sampling=sampling)
