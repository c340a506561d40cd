"""Saving and restoring the engine's training state: masters, Adam moments and counters.

One safetensors file per block (written atomically), then `engine_state.json` last, so a
directory whose json exists is complete. Across data-parallel ranks at ZeRO stages 1-3 each rank
writes its shard of each block (`block-B.rank-R.safetensors`, its [lo, hi) in the json's
"shards"), and rank 0 writes the json once every rank's files are written. A load reads, for
each block, the pieces that overlap the range this process owns now -- so a state saved by N
ranks resumes on M ranks or in one process (and one process's on N ranks) with no conversion
step. Everything read back is validated (layout against
this model, counters, shapes and dtypes) and refused in one line that says what to do. A
delayed update still pending at the save is saved as it is (offload/train/delayed.py): the weights
in use go beside the masters, so a resumed run continues exactly.

What is saved comes from the engine's components, never the engine: the `Parts` (blocks,
optimizer state, live weights, ranks), `Updates` (its state_dict(): counters and learning rate)
and the step path (a delayed update's pending job and shadow weights).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

import nvme.format as nvme_format  # write_file looked up per call: fault injection replaces it
from nvme.format import FormatError, SafetensorsFile
from offload.optim.state import NvmeState
from offload.memory.tiers import all_finite
from offload.train.delayed import Delayed
from offload.train.errors import NonFiniteError, StateError
from offload.train.parts import Parts
from offload.train.paths import AfterBackward
from offload.train.stepper import Updates

KINDS = ("master", "exp_avg", "exp_avg_sq")  # a block's fp32 state, in its files


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse to save state holding inf/nan: the last good checkpoint must stay."""
    for kind, t in tensors.items():
        if not all_finite(t):
            raise NonFiniteError(f"{where}: the {kind} holds inf/nan values; not saving it (the "
                                 f"last checkpoint stays as it was) — the run diverged or its "
                                 f"state was damaged: resume from that checkpoint with a lower "
                                 f"learning rate or gradient clipping")


def layout(parts: Parts) -> list[dict[str, Any]]:
    return [{"name": b.name, "numel": b.numel,
             "params": [[s.name, list(s.shape)] for s in b.slots]} for b in parts.blocks]


def delayed_of(path: AfterBackward) -> Delayed | None:
    """The delayed step path (its pending job and shadow weights), when it is the path."""
    return path if isinstance(path, Delayed) else None


def state_meta(parts: Parts, updates: Updates, path: AfterBackward) -> dict[str, Any]:
    """Everything besides the tensors that a resumed run needs to continue exactly."""
    return {"format": "offload-engine-state", "version": 1, **updates.state_dict(),
            "dtype": parts.cfg.dtype, "delayed_pending": path.pending,
            "layout": layout(parts)}


def save_state(parts: Parts, updates: Updates, path: AfterBackward, directory: str) -> None:
    """Write masters, moments and counters into `directory` (one safetensors file per block,
    each written atomically, then engine_state.json last: a directory whose json exists is
    complete). Only whole updates are saved: call at an accumulation boundary."""
    if updates.counters.micro_step % parts.cfg.grad_accum_steps:
        raise RuntimeError("save_state in the middle of gradient accumulation; save after the "
                           "step() that applied an update")
    # A delayed update whose weights are not live yet is saved as it is: the masters
    # already include it and the weights in use are saved beside them ("live"), so the
    # resumed run computes with the same stale weights as the run that goes on.
    path.join()
    pending = path.pending
    os.makedirs(directory, exist_ok=True)
    zero = parts.zero
    meta = state_meta(parts, updates, path)
    if zero is not None and zero.stage >= 1:
        _save_shards(parts, meta, pending, directory)
        return
    if zero is None or zero.rank == 0:  # stage 0: every rank holds the same whole state
        files: dict[str, dict[str, int]] = {}  # file -> its tensors' CRCs: which save it is
        for bi, block in enumerate(parts.blocks):
            tensors = {k: parts.read_state(bi, k) for k in KINDS}
            check_finite(tensors, f"block {block.name}")
            if pending:
                tensors["live"] = parts.weights.flat16[bi].cpu()
            name = f"block-{bi:05d}.safetensors"
            files[name] = _write_checked(os.path.join(directory, name), tensors, {"block": block.name})
        _write_meta(directory, {**meta, "files": files})
    if zero is not None:
        zero.long_barrier()  # nobody goes on before rank 0 wrote the whole state


def _write_checked(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, int]:
    """One block file, each tensor's CRC in its metadata (checked on every read); returns the
    CRCs, which engine_state.json records per file: a file of another save (an older one of the
    same run, or another run's) mixed into the directory is refused on resume. Content, not a
    random id: the same state saved twice is the same bytes (the chaos campaigns compare them)."""
    entry, sums = nvme_format.checksum_metadata(tensors)
    nvme_format.write_file(path, tensors, {**metadata, **entry})
    return sums


def _write_meta(directory: str, meta: dict[str, Any]) -> None:
    tmp = os.path.join(directory, "engine_state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, "engine_state.json"))


def _save_shards(parts: Parts, meta: dict[str, Any], pending: bool, directory: str) -> None:
    """Each rank its own shard of every block; the json (rank 0) after all are written. A
    shard with inf/nan stops every rank before the json exists (the save is incomplete, so
    the previous checkpoint stays the one to resume from). `pending`: a delayed update
    (stages 1-2) whose weights in use each rank saves its part of."""
    zero = parts.zero
    bad = None
    files: dict[str, dict[str, int]] = {}  # this rank's shard files -> their tensors' CRCs
    for bi, block in enumerate(parts.blocks):
        lo, hi = parts.owned(bi)
        if hi <= lo:
            continue
        tensors = {k: parts.state.read(bi, k) for k in KINDS}
        if pending:
            tensors["live"] = parts.weights.flat16[bi][lo:hi].cpu()
        try:
            check_finite(tensors, f"block {block.name} (rank {zero.rank}'s shard)")
        except NonFiniteError as e:
            bad = e
            break
        files[_shard_file(bi, zero.rank)] = _write_checked(
            os.path.join(directory, _shard_file(bi, zero.rank)), tensors,
            {"block": block.name, "lo": str(lo), "hi": str(hi)})
    if zero.any_rank(bad is not None):
        raise bad or NonFiniteError("another rank's optimizer state holds inf/nan values; not "
                                    "saving (the last checkpoint stays as it was)")
    every = zero.gather_objects(files)  # every rank's files and CRCs, for the json
    if zero.rank == 0:
        shards = [[[r, *zero.shards(b.numel).range(r)] for r in range(zero.world)
                   if _nonempty(zero.shards(b.numel).range(r))] for b in parts.blocks]
        _write_meta(directory, {**meta, "shards": {"world": zero.world, "pieces": shards},
                                "files": {k: v for f in every for k, v in f.items()}})
    zero.long_barrier()


def _nonempty(rng: tuple[int, int]) -> bool:
    return rng[1] > rng[0]


def _shard_file(bi: int, rank: int) -> str:
    return f"block-{bi:05d}.rank-{rank:05d}.safetensors"


def load_state(parts: Parts, updates: Updates, path: AfterBackward, directory: str) -> None:
    """Restore what save_state wrote; refuses a state saved from a different model."""
    meta, meta_path = _read_meta(directory)
    delayed = delayed_of(path)
    if delayed is not None:
        delayed.drop()  # everything below overwrites what the pending job produced
    skips, pending = check_meta(parts, meta, meta_path, directory)
    pieces = _pieces(parts, meta, meta_path, directory)
    for bi in range(len(parts.blocks)):
        _load_block(parts, delayed, bi, pending, pieces[bi], meta.get("files"))
    if parts.gathers_weights:  # each rank loaded its shard of the 16-bit weights
        parts.zero.gather_weights(parts.weights.padded, parts.step_order())
    updates.load_state_dict({**meta, "slot_skips": skips})
    if pending and delayed is not None:
        delayed.mark_pending()  # the next step() makes the masters' weights live
    if isinstance(parts.state, NvmeState):
        parts.state.end_step(parts.unit_order(), updates.counters.global_step)


def _read_meta(directory: str) -> tuple[dict, str]:
    """engine_state.json of a saved state, and its path; StateError when missing or unreadable."""
    meta_path = os.path.join(directory, "engine_state.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise StateError(f"{directory}: no engine_state.json — not a saved training state "
                         f"(or the save was interrupted)") from None
    except (OSError, ValueError, RecursionError) as e:  # bad JSON or UTF-8, deep nesting
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise StateError(f"{meta_path}: unreadable ({reason}); the saved state is damaged — "
                         f"resume from another checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != "offload-engine-state":
        raise StateError(f"{meta_path}: not an offload engine state")
    return meta, meta_path


def check_meta(parts: Parts, meta: dict, meta_path: str, directory: str
                ) -> tuple[dict, bool]:
    """Refuse a state from another model, dtype or configuration, or with damaged counters;
    returns the validated slot_skips and whether a delayed update was pending."""
    cfg = parts.cfg
    if meta.get("layout") != layout(parts):
        raise StateError(f"{directory}: the saved state is for a different model (its "
                         f"parameter names or shapes differ from this model's); resume with "
                         f"the model it was saved from or start a fresh run")
    for key, kind in (("global_step", int), ("micro_step", int), ("clean_steps", int),
                      ("hysteresis_left", int), ("skipped_steps", int),
                      ("loss_scale", (int, float)), ("lr", (int, float))):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, kind) or (
                isinstance(value, float) and not math.isfinite(value)) or value < 0 or (
                key == "loss_scale" and value == 0):
            raise StateError(f"{meta_path}: {key!r} is missing or not a valid number "
                             f"({value!r}); the saved state is damaged — resume from "
                             f"another checkpoint")
    skips = meta.get("slot_skips", {})
    names = {s.name for b in parts.blocks for s in b.slots}
    if not isinstance(skips, dict) or not all(
            k in names and type(v) is int and 0 < v <= meta["global_step"] for k, v in skips.items()):
        raise StateError(f"{meta_path}: 'slot_skips' must map this model's parameter names to "
                         f"update counts in [1, global_step]; the saved state is damaged — resume "
                         f"from another checkpoint")
    if meta.get("dtype") != cfg.dtype:
        raise StateError(f"{meta_path}: saved with dtype {meta.get('dtype')!r}, this engine runs "
                         f"{cfg.dtype!r} (the loss scale and gradient rounding differ); "
                         f"resume with the dtype it was saved with")
    if meta["micro_step"] % cfg.grad_accum_steps or \
            meta["micro_step"] < meta["global_step"] * cfg.grad_accum_steps:
        raise StateError(f"{meta_path}: micro_step {meta['micro_step']} does not fit global_step "
                         f"{meta['global_step']} with grad_accum_steps "
                         f"{cfg.grad_accum_steps} (states are saved at an update "
                         f"boundary); the saved state is damaged or from another configuration")
    pending = meta.get("delayed_pending", False)
    if not isinstance(pending, bool):
        raise StateError(f"{meta_path}: 'delayed_pending' must be true or false, got "
                         f"{pending!r}; the saved state is damaged — resume from another "
                         f"checkpoint")
    return skips, pending


def _pieces(parts: Parts, meta: dict, meta_path: str,
            directory: str) -> list[list[tuple[str, int, int]]]:
    """Per block, the files its state was saved in and the [lo, hi) each holds: one whole-block
    file (one process, or stage 0), or one per rank (stages 1-3), checked to tile the block."""
    shards = meta.get("shards")
    if shards is None:
        return [[(os.path.join(directory, f"block-{bi:05d}.safetensors"), 0, b.numel)]
                for bi, b in enumerate(parts.blocks)]
    pieces = shards.get("pieces") if isinstance(shards, dict) else None
    out = []
    for bi, b in enumerate(parts.blocks):
        rows = pieces[bi] if isinstance(pieces, list) and bi < len(pieces) else None
        ok = (isinstance(rows, list) and len(pieces) == len(parts.blocks)
              and all(isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r)
                      for r in rows))
        if ok:
            bounds = [0] + [x for _, lo, hi in rows for x in (lo, hi)] + [b.numel]
            ok = all(bounds[k] == bounds[k + 1] for k in range(0, len(bounds), 2)) and \
                all(lo < hi for _, lo, hi in rows)
        if not ok:
            raise StateError(f"{meta_path}: 'shards' does not describe how block {b.name!r} "
                             f"was split across ranks; the saved state is damaged — resume "
                             f"from another checkpoint")
        out.append([(os.path.join(directory, _shard_file(bi, r)), lo, hi) for r, lo, hi in rows])
    return out


def _load_block(parts: Parts, delayed: Delayed | None, bi: int, pending: bool,
                pieces: list[tuple[str, int, int]], files: dict | None) -> None:
    """Block bi's masters and moments over the range this process owns (its shard across
    ranks) from the saved pieces that overlap it, into the optimizer state, and its 16-bit
    weights (from the masters, or the saved live weights of a pending delayed update) into
    their tier."""
    block, dtype = parts.blocks[bi], parts.dtype
    lo, hi = parts.owned(bi)
    values = {k: torch.empty(hi - lo, dtype=torch.float32) for k in KINDS}
    # a pending delayed update's weights in use, over [lo, hi) too (saved whole or per rank)
    live = torch.empty(hi - lo, dtype=dtype) if pending else None
    for path, plo, phi in pieces:
        a, b = max(lo, plo), min(hi, phi)
        if a >= b:
            continue
        try:  # each tensor checked against its CRC where the file carries one
            with SafetensorsFile(path) as f:
                # a state saved before files were recorded (files None) resumes unchecked here
                if files is not None and files.get(os.path.basename(path)) != f.checksums:
                    raise StateError(
                        f"{path}: not the file engine_state.json records (its checksums differ): "
                        f"the checkpoint mixes files of different saves or runs; resume from a "
                        f"checkpoint as it was written")
                saved = {k: f.read(k) for k in values}
                saved_live = f.read("live") if pending else None
        except (FormatError, KeyError, OSError) as e:
            raise StateError(f"{path}: cannot load block {block.name!r}: {e}") from None
        for kind, t in saved.items():  # a saved state is never non-finite: this one is damaged
            if not all_finite(t):
                raise StateError(f"{path}: the {kind} holds inf/nan values, which no save writes: "
                                 f"this checkpoint is damaged; resume from another one (an "
                                 f"earlier save) or start over")
        for kind, t in saved.items():
            if t.shape != (phi - plo,) or t.dtype != torch.float32:
                raise StateError(f"{path}: {kind} has shape {tuple(t.shape)} {t.dtype}, "
                                 f"expected ({phi - plo},) float32")
            values[kind][a - lo:b - lo] = t[a - plo:b - plo]
        if saved_live is not None:
            if saved_live.shape != (phi - plo,) or saved_live.dtype != dtype:
                raise StateError(f"{path}: live weights have shape {tuple(saved_live.shape)} "
                                 f"{saved_live.dtype}, expected ({phi - plo},) {dtype}")
            live[a - lo:b - lo] = saved_live[a - plo:b - plo]
    restore_block(parts, bi, values, live, delayed)


def restore_block(parts: Parts, bi: int, values: dict[str, torch.Tensor],
                  live: torch.Tensor | None = None, delayed: Delayed | None = None) -> None:
    """Block bi's fp32 `values` (KINDS, over the range this process owns) into the optimizer
    state, and its 16-bit weights into their tier: from the masters, or `live` (the weights a
    pending delayed update's run computed with) with the masters in `delayed`'s shadow. Also
    what OffloadAdamW.load_state_dict restores (offload/train/torch_optim.py)."""
    lo, hi = parts.owned(bi)
    for kind, t in values.items():
        parts.state.load(bi, kind, t)
    flat16 = parts.weights.flat16
    if bi in parts.layer_of:  # 16-bit weights follow the masters, in their tier
        parts.streaming.load_weights(parts.layer_of[bi], values["master"].to(parts.dtype))
    elif live is not None and delayed is not None:
        # the saved run was computing with the weights from before its last update; across
        # ranks each rank fills its part of both, gathered after (load_state, the next step)
        flat16[bi][lo:hi].copy_(live)
        delayed.shadow[bi][lo:hi].copy_(values["master"])
    else:  # not delayed now: the pending update simply goes live
        base = parts.weight_base(bi)  # stage 3: the home is this rank's shard
        flat16[bi][lo - base:hi - base].copy_(values["master"])
