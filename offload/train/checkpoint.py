"""Training checkpoints: the model in Hugging Face layout plus the full training state, saved
atomically.

    OUTPUT/checkpoint/
        model/               config.json + safetensors shards (transformers and runners.infer load it)
                             -- or, where the caller writes the weights itself, what it writes
                             (a LoRA run: adapter/, the adapters in PEFT's format; the frozen
                             base is re-read from the original model on resume)
        engine/              masters, moments, loss scale, step counters (Engine.save_state)
        trainer_state.json   step, data position, RNG states, loss history, run arguments

A save builds everything in `checkpoint.tmp/`, fsyncs it, then swaps directories with two
renames (`checkpoint` -> `checkpoint.old`, `checkpoint.tmp` -> `checkpoint`) and removes the
old one. A crash at any moment leaves `checkpoint` or `checkpoint.old` complete;
`find_checkpoint` picks whichever is complete (trainer_state.json is written last, so its
presence marks a complete directory).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Any, Callable, Iterable

import torch

from nvme.format import fsync_dir, write_json_atomic

TRAINER_STATE = "trainer_state.json"


class CheckpointNotFound(FileNotFoundError):
    """No complete checkpoint where one was asked for."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, IO error); the previous one is left as it was."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def rng_state(device: torch.device | None = None) -> dict[str, str]:
    """Every RNG a training step may draw from, as JSON-safe strings: the CPU generator and,
    when training runs on a GPU, that GPU's generator only -- saving every visible device's
    would make a resume under fewer visible GPUs fail (desk review L7)."""
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device is not None and device.type == "cuda":
        state["cuda"] = [base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes())
                         .decode()]  # type: ignore[assignment]
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore rng_state()'s generators; the CUDA one onto `device` (the run's GPU). A state
    saved elsewhere may list more GPUs (older checkpoints saved all visible ones, device 0
    first): only the first is used, and none on a CPU run."""
    def decode(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["torch"]))
    if device is not None and device.type == "cuda" and state.get("cuda"):
        torch.cuda.set_rng_state(decode(state["cuda"][0]), device)


WeightsWriter = Callable[[Iterable[tuple[str, torch.Tensor]], str], Any]


def save_checkpoint(directory: str, engine, model_config, trainer_state: dict[str, Any],
                    export_dtype: torch.dtype, *, write_weights: WeightsWriter | None = None) -> str:
    """Atomically (re)write `directory` with the model, the engine state and `trainer_state`.
    `write_weights(params, new_checkpoint_dir)` writes the trained weights from the engine's
    fp32 masters ((name, tensor) pairs, one block at a time; on rank 0 only): by default the
    Hugging Face model in model/."""
    from offload.models import save_pretrained

    directory = os.path.abspath(directory)
    tmp, old = directory + ".tmp", directory + ".old"
    # across data-parallel ranks every rank writes its optimizer-state shards and takes part in
    # gathering the weights; rank 0 writes the rest and swaps the directories, after everyone
    zero = engine.zero
    main = zero is None or zero.rank == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        if main:
            os.makedirs(tmp)
        if zero is not None:
            zero.long_barrier()  # tmp exists before any rank writes into it
        engine.save_state(os.path.join(tmp, "engine"))
        params = engine.iter_master_params()
        if main:
            if write_weights is None:
                save_pretrained(params, os.path.join(tmp, "model"), config=model_config,
                                dtype=export_dtype)
            else:
                write_weights(params, tmp)
            write_json_atomic(os.path.join(tmp, TRAINER_STATE), trainer_state)
            _fsync_tree(tmp)  # every rank's files: one machine or a shared filesystem
        else:
            for _ in params:  # the gather is collective; rank 0 writes
                pass
    except OSError as e:
        # Nothing of the previous checkpoint was touched yet; free the space the partial copy
        # took (a full disk is the usual cause) and say what is still there.
        shutil.rmtree(tmp, ignore_errors=True)
        kept = next((c for c in (directory, old) if is_complete(c)), None)
        raise CheckpointSaveError(e.errno, f"saving the checkpoint to {directory} failed: "
                                           f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
                                  + (f"; the previous checkpoint {kept} is intact (resume from it)"
                                     if kept else "; no earlier checkpoint exists")) from e
    if main:
        if os.path.exists(directory):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
        fsync_dir(os.path.dirname(directory))
        shutil.rmtree(old, ignore_errors=True)
    if zero is not None:
        zero.long_barrier()  # no rank goes on before rank 0 wrote, fsynced and swapped it
    return directory


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINER_STATE))


def find_checkpoint(path: str) -> str:
    """The complete checkpoint under `path`: `path` itself, `path/checkpoint`, or the `.old`
    twin of either when a crash interrupted the swap."""
    for candidate in (path, os.path.join(path, "checkpoint")):
        for c in (candidate, candidate + ".old"):
            if is_complete(c):
                return c
    raise CheckpointNotFound(f"--resume {path}: no complete checkpoint there (expected "
                             f"{os.path.join(path, 'checkpoint', TRAINER_STATE)}); was the run "
                             f"saved with --output {path}?")


def load_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint `path`, its fields checked (it may come from anywhere:
    a bad value is a CheckpointNotFound naming the field, not a traceback mid-resume)."""
    where = os.path.join(path, TRAINER_STATE)
    try:
        with open(where, "rb") as f:
            state = json.loads(f.read(64 << 20))
    except (OSError, ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, deep nesting
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise CheckpointNotFound(f"{where}: unreadable ({reason})") from None
    problem = _trainer_state_problem(state)
    if problem:
        raise CheckpointNotFound(f"{where}: {problem}; not a checkpoint this program wrote (or "
                                 f"it was damaged)")
    return state


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _trainer_state_problem(state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"not an object but {type(state).__name__}"
    if not _is_count(state.get("step")):
        return f"'step' must be an integer >= 0, got {str(state.get('step'))[:40]!r}"
    if not _is_count(state.get("data_position", 0)):
        return f"'data_position' must be an integer >= 0, got {str(state.get('data_position'))[:40]!r}"
    rng = state.get("rng")
    if not isinstance(rng, dict) or "torch" not in rng:
        return "'rng' must be an object of base64 RNG states with a 'torch' entry"
    want = torch.get_rng_state().numel()
    for key, value in rng.items():
        for v in (value if key == "cuda" and isinstance(value, list) else [value]):
            try:
                n = len(base64.b64decode(v, validate=True)) if isinstance(v, str) else -1
            except ValueError:
                n = -1
            if n < 0 or (key == "torch" and n != want):
                return f"'rng' entry {key!r} is not a valid RNG state"
    history = state.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return "'history' must be a list of objects"
    loss0 = state.get("eval_loss0")
    if loss0 is not None and (isinstance(loss0, bool) or not isinstance(loss0, (int, float))):
        return f"'eval_loss0' must be a number, got {str(loss0)[:40]!r}"
    return None
