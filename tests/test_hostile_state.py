"""Hostile saved state: swap manifests and training checkpoints from strangers (the
safetensors headers and Hugging Face directories are test_hostile.py's). Each bad case is one
typed error with a clear message, and nothing outside the swap directory is touched; each case
is listed in docs/RELIABILITY.md."""

from __future__ import annotations

import json

import pytest
import torch

from nvme.swap import SwapError, SwapStore
from offload.train.checkpoint import CheckpointNotFound, find_checkpoint, load_trainer_state


# ---- swap manifests -------------------------------------------------------------------------
def _manifest(d, body) -> None:
    (d / "manifest.json").write_text(body if isinstance(body, str) else json.dumps(body))


def _entry_json(file="a.safetensors"):
    return {"dtype": "F32", "shape": [4], "nbytes": 16, "crc32": "00000000", "file": file,
            "offset": 4096}


MANIFEST_CASES = {
    "file outside the store (../)": ({"format": "offload-swap/1", "step": 0,
                                      "tensors": {"a": _entry_json("../victim.txt")}}, "expected"),
    "absolute file path": ({"format": "offload-swap/1", "step": 0,
                            "tensors": {"a": _entry_json("/tmp/victim.txt")}}, "expected"),
    "a JSON list": ([1, 2], "unreadable"),
    "tensors a list": ({"format": "offload-swap/1", "step": 0, "tensors": []}, "unreadable"),
    "foreign format": ({"format": "deepspeed", "step": 0, "tensors": {}}, "unreadable"),
    "unknown dtype": ({"format": "offload-swap/1", "step": 0,
                       "tensors": {"a": {**_entry_json(), "dtype": "Q4"}}}, "unreadable"),
    "nested 50000 deep": ("[" * 50_000 + "]" * 50_000, "unreadable"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_bad_swap_manifest(case, tmp_path):
    body, match = MANIFEST_CASES[case]
    d = tmp_path / "swap"
    d.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    _manifest(d, body)
    with pytest.raises(SwapError, match=match):
        SwapStore(d)
    assert victim.read_text() == "not yours"
    SwapStore(d / "fresh").close()  # the failed open left no lock behind in this process


def test_damaged_swap_file_header_is_reported_on_read(tmp_path):
    d = tmp_path / "swap"
    with SwapStore(d) as s:
        s.write("a", torch.ones(8)).wait()
    (d / "a.safetensors").write_bytes(b"\xff" * 64)
    with SwapStore(d) as s:
        with pytest.raises(SwapError, match="header is damaged"):
            s.read("a")


# ---- training checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize("body, match", [
    ("{", "unreadable"), ("[1]", "not an object"), ('{"step": "7"}', "step"),
    ('{"step": 1, "data_position": -1, "rng": {}, "history": []}', "data_position"),
    ('{"step": 1, "data_position": 0, "rng": {"torch": "!!"}, "history": []}', "rng"),
    ('{"step": 1, "data_position": 0, "rng": {"torch": "AAAA"}, "history": []}', "rng"),
    ('{"step": 1, "data_position": 0, "rng": RNG, "history": {}}', "history"),
    ('{"step": 1, "data_position": 0, "rng": RNG, "history": [], "eval_loss0": "low"}', "eval_loss0"),
])
def test_bad_trainer_state(tmp_path, body, match):
    from offload.train.checkpoint import rng_state

    body = body.replace("RNG", json.dumps(rng_state()))
    ckpt = tmp_path / "out" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(body)
    with pytest.raises(CheckpointNotFound, match=match):
        load_trainer_state(find_checkpoint(str(tmp_path / "out")))
