"""The run directory (--output) is guarded: one run in it at a time (every tier, not only
NVMe), never started over by accident, and no other path of the run inside the parts each
checkpoint save replaces. A resume refuses every setting that would make it diverge from the
run that saved the checkpoint."""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from nvme.format import lock_pid_file
from runners.common import fail

LOCK = ".offload-run.lock"
# what a run writes into --output that only the run can make again: a new run there is refused
# unless --resume or --overwrite (the swap directory is the store's: it removes its own files)
PROTECTED = ("checkpoint", "checkpoint.old", "model", "adapter", "metrics.jsonl")
REMADE = ("checkpoint.tmp", "data", "loss.png")  # rebuilt by every run: removed by --overwrite
# rewritten by every save (checkpoint) or at the end (model, a LoRA run's adapter)
REPLACED = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "model", "adapter")


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.abspath(path), os.path.abspath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


class RunDirectory:
    def __init__(self, output: str):
        self.path = os.path.abspath(output)
        self._fd = -1

    def lock(self) -> None:
        """Hold an exclusive lock on the directory for the whole run (released at exit, also
        when the process is killed: it is an flock)."""
        os.makedirs(self.path, exist_ok=True)
        try:
            self._fd = lock_pid_file(os.path.join(self.path, LOCK), "offload-run")
        except BlockingIOError as e:
            fail(f"--output {self.path} is in use by another run (process "
                 f"{getattr(e, 'holder', 'unknown')}); wait for it to finish or choose another "
                 f"--output")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def previous_run(self, metrics_path: str) -> list[str]:
        """The parts of an earlier run in the directory (an empty metrics file does not count)."""
        def there(path: str) -> bool:
            if path.endswith(".jsonl"):
                return os.path.isfile(path) and os.path.getsize(path) > 0
            return os.path.lexists(path)

        found = [p for p in PROTECTED if there(os.path.join(self.path, p))]
        if os.path.abspath(metrics_path) != os.path.join(self.path, "metrics.jsonl") and \
                there(metrics_path):
            found.append(metrics_path)
        return found

    def prepare(self, *, resume: str | None, overwrite: bool, metrics_path: str) -> None:
        """Refuse to start over a previous run unless --resume continues it or --overwrite
        says to replace it (then its files are removed first, and only those)."""
        found = self.previous_run(metrics_path)
        if not found:
            return
        if resume is not None:
            from offload.train.checkpoint import find_checkpoint
            if _inside(find_checkpoint(resume), self.path):
                return  # the resumed run appends to its metrics and replaces its checkpoint
            fail(f"--output {self.path} already holds another run ({', '.join(found)}); a run "
                 f"resumed from {resume} would replace it: choose another --output")
        if not overwrite:
            fail(f"--output {self.path} already holds a run ({', '.join(found)}); continue it with "
                 f"--resume {self.path}, start over with --overwrite (deletes those), or choose "
                 f"another --output")
        for part in found + [p for p in REMADE if os.path.lexists(os.path.join(self.path, p))]:
            path = part if os.path.isabs(part) else os.path.join(self.path, part)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)


def check_run_paths(output: str, metrics: str | None, offload_dir: str | None,
                    data: str | None) -> None:
    """No path of the run inside what a checkpoint save replaces, and none on the data."""
    for flag, path in (("--metrics", metrics), ("--offload-dir", offload_dir)):
        if path is None:
            continue
        for part in REPLACED:
            guarded = os.path.join(output, part)
            if _inside(path, guarded):
                fail(f"{flag} {path} is inside {guarded}, which every checkpoint save replaces; "
                     f"choose a path outside it")
        if data is not None and (_inside(data, path) if flag == "--offload-dir" else
                                 _inside(path, data)):
            fail(f"{flag} {path} overlaps the training data {data}; choose a path outside it")


# Settings a resumed run must share with the run that saved the checkpoint: each changes the
# data order, the batches or the update arithmetic, so a changed one cannot continue exactly.
# Everything else (tiers, directories, IO, budgets, --save-every, --no-final-checkpoint,
# --eval-every, --stop-after, --gpu) may change: the math is the same (on another device, to
# its rounding).
TRAJECTORY = {"seq_len": "--seq-len", "seed": "--seed", "batch_size": "--batch-size",
              "micro_batch_size": "--micro-batch-size", "steps": "--steps (the LR schedule)",
              "warmup_steps": "--warmup-steps", "min_lr_ratio": "--min-lr-ratio",
              "dtype": "--dtype", "lr": "--lr", "weight_decay": "--weight-decay",
              "grad_clip": "--grad-clip", "betas": "betas (--config)", "eps": "eps (--config)",
              "exact_optimizer": "exact_optimizer (--config)",
              "delayed_update": "--delayed-update", "delayed_update_warmup": "--delayed-update-warmup",
              "lora": "LoRA (--lora-rank, --lora-alpha, --lora-dropout, --lora-targets, "
                      "--quantize, --group-size; None: full fine-tuning)"}


FROM_ARGS = ("seq_len", "seed", "batch_size", "steps", "warmup_steps", "min_lr_ratio")


def trajectory(args: argparse.Namespace, cfg, micro: int, lora: str | None = None) -> dict[str, Any]:
    """The values of TRAJECTORY for this run (saved in every checkpoint): the runner's own
    flags from `args`, the engine's settings from the resolved config (a --config file may
    have set them), the micro-batch as resolved, the LoRA settings (None: full fine-tuning)."""
    out: dict[str, Any] = {"micro_batch_size": micro, "lora": lora}
    for key in TRAJECTORY:
        if key in FROM_ARGS:
            out[key] = getattr(args, key)
        elif key not in out:
            value = getattr(cfg, key)
            out[key] = list(value) if isinstance(value, tuple) else value  # as JSON keeps it
    return out


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], resume: str) -> None:
    """Refuse in one line a resume whose trajectory settings differ from the checkpoint's."""
    if saved is None:
        return  # a checkpoint from before these were recorded: nothing to compare with
    changed = [f"{TRAJECTORY[k]} {now[k]!r} (the checkpoint has {saved.get(k)!r})"
               for k in TRAJECTORY if saved.get(k) != now[k]]
    if changed:
        fail(f"--resume {resume}: {'; '.join(changed)}; a resumed run continues exactly only with "
             f"the settings it was saved with: use them, or start a new run (another --output, "
             f"or --overwrite)")
