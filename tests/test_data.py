import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from offload.data.formats import (BatchOrder, DataError, Example, encode_example, iter_examples,
                          load_documents, masked_lm_loss, pack, stream_from_lists, tokenize_to_disk)
from offload.models import build_model, preset
from offload.data.tokenizer import ByteTokenizer


def test_builtin_corpus_packs_and_splits(tmp_path):
    docs = load_documents(None)
    tok = ByteTokenizer()
    stream = tokenize_to_disk(None, tok, str(tmp_path))
    assert stream.num_tokens > 200_000 and bool(np.asarray(stream.counts).all())
    data = pack(stream, 64)
    assert data.num_train + data.num_eval == (stream.num_tokens - 1) // 64 and data.num_eval >= 1
    b = data.batch([0, 1])
    # consecutive sequences overlap by exactly one token, so every target appears once
    assert torch.equal(b.ids[0, -1], b.ids[1, 0])
    assert b.ids[0, 0].item() == tok.bos_id
    assert tok.decode(b.ids[0].tolist()[1:21]) == docs[0].text[:20]
    assert len(stream.doc_starts) == len(docs)


def test_jsonl_instruction_masks_prompt(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "Q?", "response": "A."}) + "\n" + json.dumps({"text": "xy"}) + "\n")
    tok = ByteTokenizer()
    exs = load_documents(str(p))
    ids, counts = encode_example(exs[0], tok)  # no chat template: prompt then response + EOS
    assert ids == [256] + list(b"Q?") + list(b"A.") + [257]
    assert counts == [False, False, False, True, True, True]
    ids, counts = encode_example(exs[1], tok)
    assert ids == [256, ord("x"), ord("y"), 257] and all(counts)


def test_formats_alpaca_sharegpt_json_array(tmp_path):
    rows = [{"instruction": "Add", "input": "1+1", "output": "2"},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "a"}]}]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    got = load_documents(str(tmp_path / "a.json"))
    assert got[0].messages == [{"role": "user", "content": "Add\n\n1+1"}, {"role": "assistant", "content": "2"}]
    assert got[1].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert got[2].messages[0] == {"role": "system", "content": "s"}
    # the same rows as .jsonl give the same examples
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_documents(str(tmp_path / "b.jsonl")) == got
    for bad, msg in ((b"[1, 2]", "JSON object"), (b'{"a": 1}', "one array"),
                     (b'[{"text": "x"} {"text": "y"}]', "expected ','"), (b'[{"text": "x"', "not valid JSON"),
                     (b'[{"messages": [{"role": "user", "content": "q"}]}]', "assistant turn"),
                     (b'[{"conversations": [{"from": "bot", "value": "q"}]}]', "turn 0")):
        (tmp_path / "bad.json").write_bytes(bad)
        with pytest.raises(DataError, match=msg):
            load_documents(str(tmp_path / "bad.json"))


def test_directory_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n\nworld")
    (tmp_path / "b.jsonl").write_text('{"text": "more"}\n')
    assert [d.text for d in load_documents(str(tmp_path))] == ["hello", "world", "more"]
    with pytest.raises(DataError, match="does not exist"):
        load_documents(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="empty"):
        load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1"):
        load_documents(str(tmp_path / "bad.jsonl"))
    (tmp_path / "utf.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"utf.jsonl:2: not UTF-8"):
        load_documents(str(tmp_path / "utf.jsonl"))
    (tmp_path / "half.jsonl").write_text('{"prompt": "q"}\n')
    with pytest.raises(DataError, match=r"half.jsonl:1: an instruction example needs string 'prompt' and 'response'"):
        load_documents(str(tmp_path / "half.jsonl"))
    with pytest.raises(DataError, match="fewer than two sequences"):
        pack(stream_from_lists(range(10), [True] * 10), 64)


def test_packing_keeps_documents_apart():
    # three documents of 5, 7 and 9 tokens in rows of 8
    lengths = [5, 7, 9]
    starts = np.cumsum([0] + lengths[:-1])
    ids = list(range(100, 100 + sum(lengths)))
    data = pack(stream_from_lists(ids, [True] * len(ids), starts), 8, eval_fraction=0.01)
    b = data.batch([0, 1])
    # row 0: tokens 0..8; doc 0 = 0..4, doc 1 = 5..11
    assert b.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert b.document_ids[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    # the target of token 4 (doc 0's last) is doc 1's first: not counted
    assert b.mask[0].tolist() == [True, True, True, True, False, True, True, True]
    # row 1 starts inside doc 1 (token 8): positions restart at the row start
    assert b.position_ids[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert b.mask[1].tolist() == [True, True, True, False, True, True, True, True]


def test_packed_documents_match_separate_runs():
    """A packed row's logits equal each document run alone (attention and positions restart)."""
    cfg = preset("tiny")
    model = build_model(cfg, "cpu", torch.float32, source=3)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (6, 11, 15)]
    flat = sum(docs, [])
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    data = pack(stream_from_lists(flat + flat, [True] * 2 * len(flat), list(starts) + [len(flat)]), 31,
                eval_fraction=0.01)
    b = data.batch([0])
    with torch.no_grad():
        packed = model(b.ids[:, :-1], **b.model_inputs())[0]
        at = 0
        for d in docs:
            n = min(len(d), 31 - at)
            alone = model(torch.tensor([d[:n]]))[0]
            torch.testing.assert_close(packed[at:at + n], alone, rtol=1e-5, atol=1e-5)
            at += n


def test_chat_rendering_and_loss_mask_on_real_model(smollm2_hf):
    """Chat examples of the real model: rendered byte-identical to transformers'
    apply_chat_template, and exactly the assistant's text plus its end-of-turn token count."""
    from transformers import AutoTokenizer

    from offload.data.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(smollm2_hf)
    ref = AutoTokenizer.from_pretrained(smollm2_hf)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Veloria?"},
            {"role": "assistant", "content": "Quenthar."}, {"role": "user", "content": "Sure? ünï 🙂"},
            {"role": "assistant", "content": "Yes, Quenthar."}]
    for gen in (True, False):
        for k in (2, 3, 5):
            assert tok.render_chat(conv[:k], gen) == ref.apply_chat_template(conv[:k], tokenize=False,
                                                                            add_generation_prompt=gen)
    ids, counts = encode_example(Example(messages=conv), tok)
    assert ids == ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=False, return_dict=True)["input_ids"]
    learned = tok.decode([i for i, c in zip(ids, counts) if c], skip_special_tokens=False)
    assert learned == "Quenthar.<|im_end|>\nYes, Quenthar.<|im_end|>\n"
    assert tok.end_of_turn_id == tok.token_id("<|im_end|>") and tok.end_of_turn_id in tok.stop_ids()


def test_tokenizing_streams_in_bounded_memory(tmp_path):
    """A corpus 5x bigger does not need more memory: tokens go to disk as they are made."""
    script = (
        "import resource, sys\n"
        "from offload.data.formats import tokenize_to_disk\n"
        "from offload.data.tokenizer import ByteTokenizer\n"
        "s = tokenize_to_disk(sys.argv[1], ByteTokenizer(), sys.argv[2])\n"
        "print(s.num_tokens, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    rss = {}
    for n in (5_000, 25_000):
        p = tmp_path / f"c{n}.jsonl"
        with open(p, "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"line {i} " + "word " * 40}) + "\n")
        out = subprocess.run([sys.executable, "-c", script, str(p), str(tmp_path / f"t{n}")],
                             capture_output=True, text=True, check=True).stdout.split()
        rss[n] = (int(out[0]), int(out[1]) * 1024)
    (small_tokens, small_rss), (big_tokens, big_rss) = rss[5_000], rss[25_000]
    assert big_tokens > 4.5 * small_tokens  # ~5.5 M tokens: 33 bytes/token would be 0.18 GB
    assert big_rss < small_rss + 64 * 2**20, (small_rss, big_rss)


def test_batch_order_resumes_exactly():
    a = BatchOrder(10, seed=3)
    first = torch.cat([a.take(4) for _ in range(7)])  # crosses epochs
    b = BatchOrder(10, seed=3)
    b.take(12)
    c = BatchOrder(10, seed=3, position=b.position)
    assert torch.equal(torch.cat([c.take(4) for _ in range(4)]), first[12:28])
    assert sorted(first[:10].tolist()) == list(range(10))


def test_masked_loss_matches_plain_cross_entropy():
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    full = torch.ones(2, 5, dtype=torch.bool)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    assert torch.allclose(masked_lm_loss(logits, targets, full), ref)
    half = full.clone()
    half[:, :2] = False
    ref2 = torch.nn.functional.cross_entropy(logits[:, 2:].reshape(-1, 11), targets[:, 2:].reshape(-1))
    assert torch.allclose(masked_lm_loss(logits, targets, half), ref2)
