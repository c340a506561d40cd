"""What runners.finetune checks about its inputs before and while it trains, beyond the flags
themselves (runners/finetune_args.py): data that can teach something at --seq-len, a resumed
checkpoint's data position, and the model a rank loaded (compared across ranks, runners/ranks.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from runners.common import fail

# under this share of training sequences holding a target token, most updates would have
# nothing to learn from (chat data whose answers are a sliver of each conversation)
MIN_TARGET_ROWS = 0.10


def check_targets(data, args: argparse.Namespace) -> None:
    """Refuse, before training, data whose sequences at --seq-len almost never hold a target
    token; say how many do when some do not (updates without any are skipped and counted)."""
    rows = data.train_rows_with_targets()
    share = rows / data.num_train
    where = (f"--data {args.data or 'the built-in corpus'} at --seq-len {args.seq_len}: {rows} of "
             f"{data.num_train} training sequences ({100 * share:.1f}%) hold a target token")
    if share < MIN_TARGET_ROWS:
        fail(f"{where}; most updates would have nothing to learn from (chat data: the assistant "
             f"turns are too small a part of each conversation): use data with more assistant "
             f"text, or a different --seq-len")
    if rows < data.num_train:
        print(f"note: {where}; an update whose sequences hold none is skipped (counted in the "
              f"summary)", file=sys.stderr)


def check_position(trainer: dict, args: argparse.Namespace, skipped_updates: int) -> None:
    """A checkpoint's data position is what its batches took, exactly: --batch-size sequences
    for each update applied, each skipped for inf/nan (`skipped_updates`, the engine's count)
    and each skipped for holding no target. Anything else is a damaged or edited state."""
    empty = trainer.get("empty_batches", 0)
    if type(empty) is not int or empty < 0:
        fail(f"--resume {args.resume}: 'empty_batches' must be an integer >= 0, got "
             f"{str(empty)[:40]!r}; the checkpoint is damaged: resume from another one")
    expected = args.batch_size * (trainer["step"] + skipped_updates + empty)
    if trainer.get("data_position", 0) != expected:
        fail(f"--resume {args.resume}: the checkpoint's data position "
             f"{str(trainer.get('data_position'))[:40]} is not what its batches took ({expected} "
             f"sequences: {trainer['step']} updates, {skipped_updates} skipped for inf/nan, "
             f"{empty} without a target, at --batch-size {args.batch_size}); the checkpoint is "
             f"damaged or edited: resume from another one")


def model_identity(model_cfg, source) -> str:
    """A short digest of the model a rank loaded: its config, and for a checkpoint the names and
    sizes of the files its tensors come from (every rank reads its own copy)."""
    import hashlib

    files = sorted({(os.path.basename(loc.path), os.path.getsize(loc.path))
                    for loc in getattr(source, "locations", {}).values()})
    text = json.dumps([model_cfg.to_hf(), files], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
