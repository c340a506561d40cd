"""Fine-tuning data: text, .jsonl and directories of them, tokenized, packed into fixed-length
sequences, split into train and held-out eval, and served in a seeded order whose position is
one integer (so a resumed run continues with exactly the batches it would have seen).

Formats:
- `.txt`: plain text; documents separated by blank lines.
- `.jsonl`: one JSON object per line, either {"text": ...} or {"prompt": ..., "response": ...}
  (instruction tuning: the loss counts only the response tokens).
- a directory: every .txt/.jsonl file in it, sorted by name.
Without a tokenizer.json the tokenizer is bytes (ids 0..255) plus BOS=256 and EOS=257.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

BUILTIN_CORPUS = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")


class DataError(ValueError):
    """Training data is missing, empty or malformed; the message names the file and the fix."""


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs no files, and any text round-trips."""
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass
class Document:
    text: str = ""
    prompt: str | None = None  # set for instruction pairs; then `text` is the response


def _read_jsonl(path: str) -> list[Document]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: each line must be a JSON object")
            if "prompt" in obj or "response" in obj:
                if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("response"), str):
                    raise DataError(f"{path}:{n}: an instruction line needs string 'prompt' and "
                                    f"'response' fields")
                docs.append(Document(text=obj["response"], prompt=obj["prompt"]))
            elif isinstance(obj.get("text"), str):
                docs.append(Document(text=obj["text"]))
            else:
                raise DataError(f"{path}:{n}: expected a 'text' field or 'prompt'/'response' "
                                f"fields, got keys {sorted(obj)}")
    return docs


def _read_txt(path: str) -> list[Document]:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return [Document(text=p.strip()) for p in text.split("\n\n") if p.strip()]


def load_documents(path: str | None) -> list[Document]:
    """Documents from a .txt/.jsonl file or a directory of them (None: the built-in corpus)."""
    path = BUILTIN_CORPUS if path is None else path
    if not os.path.exists(path):
        raise DataError(f"data path {path} does not exist; pass --data with a .txt or .jsonl "
                        f"file or a directory of them")
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith((".txt", ".jsonl")))
        if not files:
            raise DataError(f"data directory {path} holds no .txt or .jsonl files")
    elif path.endswith((".txt", ".jsonl", ".text", ".md")):
        files = [path]
    else:
        raise DataError(f"data file {path}: unknown format; use .txt (plain text) or .jsonl "
                        f"({{\"text\": ...}} or {{\"prompt\": ..., \"response\": ...}} per line)")
    docs: list[Document] = []
    for f in files:
        if not os.path.isfile(f):  # a FIFO or a device would block or never end
            raise DataError(f"data file {f}: not a regular file")
        try:
            docs.extend(_read_jsonl(f) if f.endswith(".jsonl") else _read_txt(f))
        except OSError as e:
            raise DataError(f"data file {f}: cannot read ({e.strerror})") from None
    if not any(d.text.strip() for d in docs):
        raise DataError(f"data at {path} is empty: no text to train on")
    return docs


def tokenize(docs: list[Document], encode: Callable[[str], list[int]], eos_id: int,
             bos_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token stream for all documents, and a mask of which targets count in the loss
    (all of a text document; only the response of an instruction pair, and its EOS)."""
    ids: list[int] = []
    mask: list[bool] = []
    for d in docs:
        head = [bos_id] if bos_id is not None else []
        if d.prompt is not None:
            p = head + encode(d.prompt)
            ids += p
            mask += [False] * len(p)
            r = encode(d.text) + [eos_id]
        else:
            r = head + encode(d.text) + [eos_id]
        ids += r
        mask += [True] * len(r)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


@dataclass
class PackedData:
    """Sequences of seq_len + 1 tokens (inputs are [:-1], targets [1:]), with target masks."""
    train_ids: torch.Tensor  # [N_train, seq_len + 1] int64
    train_mask: torch.Tensor  # [N_train, seq_len] bool, for targets
    eval_ids: torch.Tensor  # [N_eval, seq_len + 1]
    eval_mask: torch.Tensor  # [N_eval, seq_len]

    @property
    def seq_len(self) -> int:
        return self.train_ids.shape[1] - 1


def pack(ids: torch.Tensor, mask: torch.Tensor, seq_len: int, eval_fraction: float = 0.05
         ) -> PackedData:
    """Chop the stream into sequences of seq_len+1 tokens overlapping by one (every target
    token appears once); the last `eval_fraction` of them (at least one) is held out."""
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    n = (ids.numel() - 1) // seq_len
    if n < 2:
        raise DataError(f"the data has {ids.numel()} tokens: fewer than two sequences of "
                        f"--seq-len {seq_len}; use more data or a shorter --seq-len")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]  # [n, L+1]
    seqs, tmask = ids[idx], mask[idx][:, 1:]
    n_eval = max(1, int(round(n * eval_fraction)))
    return PackedData(seqs[:-n_eval], tmask[:-n_eval], seqs[-n_eval:], tmask[-n_eval:])


class BatchOrder:
    """Seeded epochs over the training sequences. `position` (sequences consumed so far) is the
    whole state: restoring it restores the exact upcoming batches."""

    def __init__(self, num_sequences: int, seed: int, position: int = 0):
        self.num_sequences, self.seed, self.position = num_sequences, seed, position

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_sequences, generator=g)

    def take(self, count: int) -> torch.Tensor:
        """The next `count` sequence indices (crossing epoch boundaries as needed)."""
        out = []
        while count:
            epoch, offset = divmod(self.position, self.num_sequences)
            k = min(count, self.num_sequences - offset)
            out.append(self._perm(epoch)[offset:offset + k])
            self.position += k
            count -= k
        return torch.cat(out)


def eval_batches(data: PackedData, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(0, data.eval_ids.shape[0], batch_size):
        yield data.eval_ids[i:i + batch_size], data.eval_mask[i:i + batch_size]


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens that count. logits [B, T, V], targets [B, T]."""
    ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1), reduction="none")
    m = mask.reshape(-1).to(ce.dtype)
    return (ce * m).sum() / m.sum().clamp_min(1.0)
