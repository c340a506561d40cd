"""One typed, validated configuration for the training engine (OffloadConfig), the rules about
which options go together, and building it from a dict, a DeepSpeed dict or a JSON file.

Every field is checked in `__post_init__`, so a bad value fails where it is given, with a
message that says what is wrong and what would be right — never later, deep in a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from offload.config.deepspeed import DEEPSPEED_TOP_KEYS, AutoValues, deepspeed_fields
from offload.config.values import (DTYPES, PLACEMENTS, ConfigError, DtypeName, GradStorageName,
                                   Placement, StepPathName, dtype_name, parse_bytes,
                                   read_regular_file)


@dataclass(frozen=True)
class CombinationRule:
    """A combination of options that cannot work. `message` names options as {field}, filled in
    with the field names (the library) or the command-line flags (the runners)."""
    broken: Callable[[Any], bool]  # takes anything with the options as attributes
    message: str


# Every rule about which options go together, in one place: OffloadConfig refuses these, the
# runners check them first in their own spelling (`combination_error(options, spell)`), and
# step_path() / grad_landing() below say what the legal combinations do.
COMBINATION_RULES: tuple[CombinationRule, ...] = (
    CombinationRule(lambda c: c.offload == "nvme" and not c.nvme_dir,
                    "{offload}='nvme' needs {nvme_dir}: a directory on a fast local disk for the "
                    "optimizer-state swap files"),
    CombinationRule(lambda c: c.offload_params == "nvme" and not c.nvme_dir,
                    "{offload_params}='nvme' needs {nvme_dir}: a directory on a fast local disk "
                    "for the weights' swap files"),
    CombinationRule(lambda c: c.offload_activations and not c.activation_checkpointing,
                    "{offload_activations} offloads the checkpointed block inputs: add "
                    "{activation_checkpointing}"),
    CombinationRule(lambda c: c.delayed_update and c.offload == "none",
                    "{delayed_update} overlaps the CPU optimizer step with the next forward and "
                    "backward: it needs {offload}='cpu' or 'nvme'"),
    CombinationRule(lambda c: c.delayed_update and c.offload_params != "none",
                    "{delayed_update} needs the 16-bit weights resident on the device "
                    "({offload_params}='none'): streamed weights would be read while the delayed "
                    "step rewrites them"),
    CombinationRule(lambda c: c.speculative_step and c.delayed_update,
                    "{speculative_step} steps each block during backward of the same update; "
                    "{delayed_update} steps it during the next one: choose one"),
    CombinationRule(lambda c: c.speculative_step and not c.overlap_step,
                    "{speculative_step} is the overlapped step with clipping or fp16: it needs "
                    "{overlap_step} on (drop the one that turns it off)"),
)


def combination_error(options: Any, spell: Callable[[str], str] = str) -> str | None:
    """Why `options` (attributes named as OffloadConfig's fields) cannot work together, with
    each option written as spell(field name); None when they can."""
    names = {f.name: spell(f.name) for f in dataclasses.fields(OffloadConfig)}
    for rule in COMBINATION_RULES:
        if rule.broken(options):
            return rule.message.format(**names)
    return None


@dataclass
class OffloadConfig:
    # where the fp32 master weights and Adam moments live: "none" (the device: the plain
    # reference path), "cpu" (host RAM; pageable: only link buffers are pinned) or "nvme"
    # (swap files in nvme_dir)
    offload: Placement = "cpu"
    nvme_dir: str | None = None
    dtype: DtypeName = "bf16"  # the device weights' and gradients' dtype
    device: str | None = None  # "cuda:N" or "cpu"; None = cuda:0 when available, else cpu
    # AdamW, with torch.optim.AdamW's meaning of every field
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # max global L2 norm; 0 = no clipping
    grad_accum_steps: int = 1
    # sequences per forward/backward: the data loader's business, recorded so a DeepSpeed
    # config's train_micro_batch_size_per_gpu reaches the runner (None: the runner decides)
    micro_batch_size: int | None = None
    # host and IO machinery
    pin_memory: bool = True  # page-locked host buffers (only meaningful with CUDA)
    buffer_count: int = 4  # optimizer-state staging buffers (each holds one sub-group's state)
    # blocks larger than this many parameters are stepped and swapped in sub-groups (DeepSpeed's
    # sub_group_size): NVMe staging memory is buffer_count x 12 B x this, not x the largest block
    sub_group_size: int = 1 << 25
    io_threads: int | None = None  # None = the IO engine's measured default
    io_block_bytes: int | None = None
    io_queue_depth: int | None = None
    # the CPU AdamW kernel: one pass with a correctly rounded sqrt (default), or bit-identical
    # to torch.optim.AdamW on this machine (torch's own sqrt between two passes; 1.7-2.6x slower)
    exact_optimizer: bool = False
    # verify every swap read against the CRC-32 of the bytes written (computed in the IO
    # threads as the data moves, so the step does not wait for it)
    verify_checksums: bool = True
    # fsync each swap file around its rename. Off by default: temp-name + rename already keeps
    # the swap directory consistent when the process is killed; against power loss the durable
    # copy is the (always fsynced) training checkpoint. On costs ~2 fsyncs per block per step.
    swap_fsync: bool = False
    prefetch_optimizer_state: bool = True  # read the next step's state during forward/backward
    # NVMe state, mixtures of experts: host RAM ("4GiB" or bytes) for the state of experts whose
    # zero steps were replayed in forward (offload/train/replay.py), kept until the update's
    # step consumes it instead of written and read back; beyond it they are written and read
    # again. None: as much as the staging buffers (buffer_count x 12 B x the largest unit)
    replay_hold_bytes: int | str | None = None
    # per-tier byte budgets ("12GiB" strings or ints); None = measured free memory / disk
    device_budget: int | str | None = None
    host_budget: int | str | None = None
    nvme_budget: int | str | None = None
    # fp16 dynamic loss scaling (torch GradScaler semantics: halve on overflow, double after
    # loss_scale_window clean steps). loss_scale > 0 fixes the scale instead.
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 1
    min_loss_scale: float = 1.0
    block_list: str | None = None  # dotted path of the blocks' ModuleList; None = found automatically
    # ZeRO-Infinity: where the 16-bit weights of the ModuleList's blocks live. "none": on the
    # device; "cpu" / "nvme": streamed to the device block by block in forward and backward.
    offload_params: Placement = "none"
    prefetch_blocks: int = 2  # streamed blocks in flight ahead of the running one (nvme tier)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    offload_activations: bool = False  # checkpointed block inputs kept in host memory
    # step each block on the CPU as soon as its gradients land, while backward continues —
    # only where the math allows (no clipping, no fp16 overflow check: both need every gradient)
    overlap_step: bool = True
    # with clipping or fp16, overlap anyway: each block is stepped as its gradients land as if
    # nothing clips or overflows, its pre-step state kept (host RAM, or the previous swap
    # file) until the global norm is known; then the update is kept, or the touched blocks are
    # restored and stepped again with the clip coefficient (or restored and skipped on an
    # overflow). Exact either way (offload/train/speculative.py)
    speculative_step: bool = False
    # ZeRO-Offload's one-step delayed parameter update: each update's CPU step runs while the
    # next micro-batches' forward and backward run on the weights from one update earlier
    # (those gradients are one step stale). Overlaps the whole step even with clipping or fp16;
    # the first delayed_update_warmup updates are synchronous (early training moves fastest).
    delayed_update: bool = False
    delayed_update_warmup: int = 0
    # ZeRO across data-parallel ranks (torchrun; offload/zero/group.py): 0 = every rank keeps all
    # optimizer state and all-reduces gradients, 1 = masters and moments sharded across ranks,
    # 2 = the gradients kept for the step sharded too. One process: every stage is the same.
    zero_stage: int = 0
    # updates skipped in a row for a non-finite loss or gradient before the engine stops
    # (fp16: counted once the loss scale is at its minimum)
    max_nonfinite_skips: int = 10

    def __post_init__(self) -> None:
        if self.offload not in PLACEMENTS:
            raise ConfigError(f"offload: {self.offload!r} is not one of {', '.join(PLACEMENTS)}")
        self.dtype = dtype_name(self.dtype)
        if self.offload_params not in PLACEMENTS:
            raise ConfigError(f"offload_params: {self.offload_params!r} is not one of "
                              f"{', '.join(PLACEMENTS)}")
        if not isinstance(self.prefetch_blocks, int) or isinstance(self.prefetch_blocks, bool) \
                or self.prefetch_blocks < 1:
            raise ConfigError(f"prefetch_blocks: must be an integer >= 1, got {self.prefetch_blocks!r}")
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError, ValueError):
                raise ConfigError(f"device: {self.device!r} is not a device; use 'cpu' or 'cuda:N'") from None
            if dev.type not in ("cpu", "cuda"):
                raise ConfigError(f"device: {self.device!r}: only 'cpu' and 'cuda:N' are supported")
        for name in ("lr", "eps", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name}: must be a finite number >= 0, got {v!r}")
            setattr(self, name, float(v))
        if self.eps <= 0:
            raise ConfigError(f"eps: must be > 0, got {self.eps}")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
            raise ConfigError(f"betas: must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        for name, lo in (("grad_accum_steps", 1), ("buffer_count", 2), ("initial_scale_power", 0),
                         ("delayed_update_warmup", 0), ("max_nonfinite_skips", 1),
                         ("sub_group_size", 1 << 10),
                         ("loss_scale_window", 1), ("hysteresis", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}: must be an integer >= {lo}, got {v!r}")
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage: must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name, hi in (("io_threads", 1024), ("io_block_bytes", 1 << 40), ("io_queue_depth", 1 << 20),
                         ("micro_batch_size", 1 << 20)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
                raise ConfigError(f"{name}: must be an integer in [1, {hi}] or None, got {v!r}")
        if self.io_block_bytes is not None and self.io_block_bytes % 4096:
            raise ConfigError(f"io_block_bytes: must be a multiple of 4096 (O_DIRECT alignment), "
                              f"got {self.io_block_bytes}")
        # 2 ** initial_scale_power must be a float (and a loss times it finite in fp32)
        if self.initial_scale_power > 127:
            raise ConfigError(f"initial_scale_power: must be <= 127, got {self.initial_scale_power}")
        for name in ("loss_scale", "min_loss_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0 or (name == "min_loss_scale" and v == 0):
                raise ConfigError(f"{name}: must be a finite number "
                                  f"{'>= 0 (0 = dynamic)' if name == 'loss_scale' else '> 0'}, "
                                  f"got {v!r}")
        for name in (f.name for f in dataclasses.fields(self) if f.type in ("bool", bool)):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        for name in ("nvme_dir", "block_list"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{name}: must be a string (a path) or None, got {v!r}")
        for name in ("device_budget", "host_budget", "nvme_budget", "replay_hold_bytes"):
            parse_bytes(getattr(self, name), name)
        # each field is valid; now whether they go together (the one table of such rules)
        why = combination_error(self)
        if why is not None:
            raise ConfigError(why)

    # -- derived values -------------------------------------------------------------------
    def step_path(self, world: int = 1) -> tuple[StepPathName, str]:
        """How the optimizer step meets backward, and why: "overlapped" (each block steps as its
        gradients land, same math), "delayed" (the whole step runs during the next forward and
        backward, one step stale) or "after" (after backward). One answer for the engine, the
        planner and the start banner; `world`: data-parallel ranks."""
        if self.delayed_update:
            warm = (f", after {self.delayed_update_warmup} synchronous warm-up updates"
                    if self.delayed_update_warmup else "")
            return "delayed", ("delayed_update: each update's CPU step runs during the next "
                               "forward and backward, which use the weights from one update "
                               f"earlier{warm}")
        if not self.overlap_step:
            return "after", "overlap_step=False"
        needs = ("gradient clipping needs the global norm of every gradient" if self.grad_clip > 0
                 else "the fp16 overflow check needs every gradient" if self.dtype == "fp16"
                 else None)
        if needs is not None and self.speculative_step:
            if world > 1:
                raise ConfigError(f"speculative_step runs in one process, not across {world} "
                                  f"ranks (a rollback would have to agree across them); drop it "
                                  f"(the step then runs after backward)")
            return "speculative", (f"speculative_step: {needs}, so each block steps as its "
                                   f"gradients land as if nothing clips or overflows, and is "
                                   f"restored and stepped again (or skipped) when that was wrong")
        if needs is not None:
            return "after", f"{needs} first"
        if world > 1:
            return "overlapped", (f"no clipping and no overflow check: each rank steps its part "
                                  f"of a block as soon as the block's gradient is averaged over "
                                  f"the {world} ranks, while backward goes on")
        return "overlapped", "no clipping and no overflow check: each block steps as its gradients land"

    def grad_landing(self, num_blocks: int, device: torch.device,
                     world: int = 1) -> tuple[GradStorageName, int]:
        """Which gradient landing buffers a model of `num_blocks` blocks gets on `device`, and
        how many pool buffers (offload/grads/storage.py): "adopted" (no buffers: autograd's own
        gradients are kept) where they are made in host memory (the CPU device), nothing is
        summed (no accumulation) and they are all held until the step after backward anyway;
        "pooled" needs the overlapped step (each block consumed as soon as it lands), no
        accumulation (nothing kept between micro-batches) and host landing, and pays off only
        with more blocks than buffers; "double" is the delayed update's; otherwise "per_block".
        Across ranks (`world` > 1): "sharded" at ZeRO stage 2 (each rank keeps its shard of
        each gradient), else "per_block" (the collectives run on whole, padded block buffers);
        the delayed update's two sets of either ("double_sharded", "double").
        One answer for the engine and the planner."""
        path = self.step_path(world)[0]
        if world > 1:
            if self.zero_stage >= 2:
                return ("double_sharded" if path == "delayed" else "sharded"), 0
            return ("double" if path == "delayed" else "per_block"), 0
        if path == "delayed":
            return "double", 0
        if path == "after" and self.grad_accum_steps == 1 and device.type == "cpu":
            return "adopted", 0
        # (the speculative step keeps every gradient until the norm is known: per_block)
        if path == "overlapped" and self.grad_accum_steps == 1 and self.offload != "none":
            pool = max(3, self.buffer_count)
            if pool < num_blocks:
                return "pooled", pool
        return "per_block", 0

    def weights_share_masters(self, device: torch.device, world: int = 1) -> bool:
        """The resident blocks' parameters are views of their fp32 masters themselves (no
        second copy of the weights, no copy after each step): fp32 compute, the masters on the
        compute device (host RAM on the CPU device; offload "none" or "cpu"), and no delayed
        update (it computes with the previous weights while the masters move on), and masters
        of the whole model on this rank (one process, or ZeRO stage 0)."""
        return (self.dtype == "fp32" and device.type == "cpu" and self.offload in ("none", "cpu")
                and self.step_path(world)[0] != "delayed" and (world == 1 or self.zero_stage == 0))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def budget_bytes(self, tier: str) -> int | None:
        return parse_bytes(getattr(self, f"{tier}_budget"), f"{tier}_budget")

    def resolve_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"device {self.device!r}: no CUDA GPU is visible; use device='cpu'")
            index = dev.index or 0
            if index >= torch.cuda.device_count():
                raise ConfigError(f"device {self.device!r}: only {torch.cuda.device_count()} GPU(s) "
                                  f"visible (cuda:0..cuda:{torch.cuda.device_count() - 1})")
            dev = torch.device("cuda", index)
        return dev

    # -- construction from dicts -----------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OffloadConfig":
        """Our own flat dict form; a DeepSpeed-style dict (any DeepSpeed key) is recognised."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        if not all(isinstance(k, str) for k in d):
            raise ConfigError(f"config keys must be strings, got {sorted(map(repr, d))}")
        if any(k in d for k in DEEPSPEED_TOP_KEYS):  # a DeepSpeed dict (config/deepspeed.py)
            return from_deepspeed(d)
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(map(repr, unknown))}; valid keys: "
                              f"{', '.join(cls.field_names())}")
        return cls(**d)

    def replace(self, **changes: Any) -> "OffloadConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def as_config(cfg: OffloadConfig | Mapping[str, Any] | None) -> OffloadConfig:
    if cfg is None:
        return OffloadConfig()
    if isinstance(cfg, OffloadConfig):
        return cfg
    return OffloadConfig.from_dict(cfg)


def from_deepspeed(ds: Mapping[str, Any], *, auto: AutoValues | None = None,
                   notes: list[str] | None = None, **overrides: Any) -> OffloadConfig:
    """Map a DeepSpeed config dict (ZeRO-Offload / ZeRO-Infinity keys) onto OffloadConfig.
    auto: what "auto" values resolve to; notes: receives one line per inert key present (without
    a list, each is a warning: a key is never dropped without a word)."""
    defaults = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
    fields, said = deepspeed_fields(ds, defaults, auto)
    fields.update(overrides)
    _say(said, notes, stacklevel=3)
    return OffloadConfig(**fields)


def _say(said: list[str], notes: list[str] | None, stacklevel: int = 4) -> None:
    """The inert keys' lines into `notes`; a library caller who gave no list gets them as
    warnings rather than not at all."""
    if notes is not None:
        notes.extend(said)
    else:
        for line in said:
            warnings.warn(line, stacklevel=stacklevel)


MAX_CONFIG_FILE_BYTES = 16 << 20


def _read_config_json(path: str) -> Any:
    """A config file's JSON, refusing a key given twice in one object (json.loads would keep the
    last one silently, other readers the first)."""
    try:
        raw = read_regular_file(path, MAX_CONFIG_FILE_BYTES)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read ({e.strerror})") from None
    if raw is None:
        raise ConfigError(f"config file {path}: not a regular JSON file of at most "
                          f"{MAX_CONFIG_FILE_BYTES} bytes")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"config file {path}: the key {key[:80]!r} is given twice in one "
                                  f"object; keep one")
            out[key] = value
        return out

    try:
        return json.loads(raw, object_pairs_hook=no_duplicates)
    except ConfigError:
        raise
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, 5000-digit integers
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise ConfigError(f"config file {path}: not valid JSON ({what})") from None


def config_file_fields(path: str, *, auto: AutoValues | None = None,
                       notes: list[str] | None = None) -> dict[str, Any]:
    """Only the OffloadConfig fields a JSON file (our flat form or DeepSpeed's) sets, checked and
    normalised: what a caller with defaults of its own (the runners) lays over them. A DeepSpeed
    file sets what DeepSpeed would decide from it (its ZeRO stage, where state lives); "auto"
    values become `auto`'s (see from_deepspeed for auto and notes)."""
    d = _read_config_json(path)
    try:
        if isinstance(d, Mapping) and any(k in d for k in DEEPSPEED_TOP_KEYS):
            defaults = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
            fields, said = deepspeed_fields(d, defaults, auto)
            OffloadConfig(**fields)  # checked as a whole
            _say(said, notes)
            return fields
        cfg = OffloadConfig.from_dict(d)
        return {k: getattr(cfg, k) for k in d}
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None


def load_config_file(path: str, *, auto: AutoValues | None = None,
                     notes: list[str] | None = None) -> OffloadConfig:
    """A JSON file in our flat form or DeepSpeed's (see from_deepspeed for auto and notes); what
    it does not set takes OffloadConfig's defaults."""
    return OffloadConfig(**config_file_fields(path, auto=auto, notes=notes))
