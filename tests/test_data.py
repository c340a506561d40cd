import json

import pytest
import torch

from offload.data import (BatchOrder, ByteTokenizer, DataError, load_documents, masked_lm_loss,
                          pack, tokenize)


def test_builtin_corpus_packs_and_splits():
    docs = load_documents(None)
    tok = ByteTokenizer()
    ids, mask = tokenize(docs, tok.encode, tok.eos_id)
    assert ids.numel() > 200_000 and bool(mask.all())
    data = pack(ids, mask, 64)
    n = data.train_ids.shape[0] + data.eval_ids.shape[0]
    assert n == (ids.numel() - 1) // 64 and data.eval_ids.shape[0] >= 1
    # consecutive sequences overlap by exactly one token, so every target appears once
    assert torch.equal(data.train_ids[0, -1], data.train_ids[1, 0])
    assert tok.decode(data.train_ids[0].tolist()[:20]) == docs[0].text[:20]


def test_jsonl_instruction_masks_prompt(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "Q?", "response": "A."}) + "\n" + json.dumps({"text": "xy"}) + "\n")
    tok = ByteTokenizer()
    ids, mask = tokenize(load_documents(str(p)), tok.encode, tok.eos_id)
    assert tok.decode(ids.tolist()) == "Q?A.xy"
    assert mask.tolist() == [False, False, True, True, True, True, True, True]


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
    with pytest.raises(DataError, match="fewer than two sequences"):
        pack(torch.arange(10), torch.ones(10, dtype=torch.bool), 64)


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
