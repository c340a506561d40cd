"""A DeepSpeed config dict (ZeRO-Offload / ZeRO-Infinity keys) as OffloadConfig's fields. Every
accepted DeepSpeed key is honoured or named; anything else is refused in one line (see the
tables below). This module knows the DeepSpeed keys and OffloadConfig's field names, not the
class: `deepspeed_fields` returns the fields, config/options.py builds the config from them
(and reads JSON files in either form)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from offload.config.values import ConfigError


# --- DeepSpeed JSON import ------------------------------------------------------------------
#
# Every key a DeepSpeed config may hold is in exactly one of three tables, and a test walks them:
# - mapped: the key sets an OffloadConfig field (the test checks a non-default value changes it);
# - inert: the key tunes something a single process does not have (communication buckets between
#   ranks, logging cadence); it is accepted so published configs load, and each one present is
#   reported back in `notes` ("<key> has no effect here: <why>"), which the runner prints — a key
#   is never dropped without a word;
# - anything else is refused in one line listing what is supported.
# "auto" (as the Hugging Face Trainer writes its templates) is resolved from `AutoValues` — the
# runner's flags — or, where nothing supplies it, from OffloadConfig's default; an inert key's
# "auto" needs no value. Where "auto" names a place (a path, a device) it is refused.

@dataclass(frozen=True)
class AutoValues:
    """What a DeepSpeed "auto" resolves to (None: OffloadConfig's default)."""
    lr: float | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    dtype: str | None = None
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None


DEEPSPEED_TOP_KEYS = {
    "zero_optimization", "aio", "fp16", "bf16", "gradient_clipping", "gradient_accumulation_steps",
    "optimizer", "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
    "wall_clock_breakdown", "zero_allow_untested_optimizer", "scheduler",
}
# section -> key -> why it changes nothing in a single process
DEEPSPEED_INERT: dict[str, dict[str, str]] = {
    "": {"steps_per_print": "the runner prints every update (metrics.jsonl, progress bar)",
         "wall_clock_breakdown": "the time split is always measured and reported",
         "zero_allow_untested_optimizer": "the engine's optimizer is always its CPU AdamW"},
    "zero_optimization": {
        "contiguous_gradients": "gradients always land in contiguous per-block buffers",
        "overlap_comm": "across ranks each block's gradient reduction always starts as soon as "
                        "the block's gradients are final, while backward goes on",
        "reduce_bucket_size": "across ranks gradients are reduced one block at a time: each "
                              "block is one bucket",
        "allgather_bucket_size": "across ranks updated weights are all-gathered one block at a "
                                 "time: each block is one bucket",
        "round_robin_gradients": "one process: no gradient partitions",
        "stage3_prefetch_bucket_size": "weights are prefetched per block (offload_param.buffer_count)",
        "stage3_param_persistence_threshold": "one process: no partitioned parameters to gather",
        "stage3_max_live_parameters": "live streamed weights are bounded per block (buffer_count)",
        "stage3_max_reuse_distance": "streamed blocks are released after use, never cached",
        "stage3_gather_16bit_weights_on_model_save": "exports always hold the full weights"},
    "offload_optimizer": {"fast_init": "swap files are written once, at the first step"},
    "offload_param": {"buffer_size": "a streamed block's buffer is sized by the block itself",
                      "max_in_cpu": "the weight tier holds every block (use offload_param.device)"},
    "aio": {"single_submit": "the IO engine submits each request on its own thread",
            "overlap_events": "reads and writes always overlap compute (read-ahead, write-behind)"},
    "fp16": {"auto_cast": "the model casts its inputs itself"},
    "optimizer.params": {"torch_adam": "the fused CPU AdamW kernel always runs"},
}
def _take(d: Mapping[str, Any], allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: must be a dict, got {type(d).__name__}")
    unknown = sorted(map(repr, set(d) - allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"supported: {', '.join(sorted(allowed))}")
    return dict(d)


def _resolve(value: Any, auto_value: Any, default: Any = None) -> Any:
    """`value`, or for "auto" what the runner supplies, else the default."""
    if value != "auto":
        return value
    if auto_value is not None:
        return auto_value
    return default


def deepspeed_fields(ds: Mapping[str, Any], defaults: Mapping[str, Any],
                     auto: AutoValues | None = None) -> tuple[dict[str, Any], list[str]]:
    """(OffloadConfig fields, one line per inert key present) for a DeepSpeed config dict.
    defaults: OffloadConfig's field defaults (what an unresolved "auto" becomes); auto: what
    "auto" values resolve to."""
    auto = auto or AutoValues()
    ds = _take(ds, DEEPSPEED_TOP_KEYS, "DeepSpeed config")
    if "scheduler" in ds:
        raise ConfigError("DeepSpeed config: 'scheduler' is not supported by the engine; "
                          "set the learning rate per step with engine.set_lr() (runners.finetune "
                          "has --lr with warmup + cosine)")
    said: list[str] = []  # one line per inert key present
    _inert("", ds, said)
    out: dict[str, Any] = {"offload": "none"}  # DeepSpeed without offload_optimizer: state on the device
    _deepspeed_zero(ds, defaults, out, said)
    _deepspeed_aio(ds, out, said)
    _deepspeed_precision(ds, defaults, auto, out, said)
    if "gradient_clipping" in ds:
        out["grad_clip"] = _resolve(ds["gradient_clipping"], auto.grad_clip, defaults["grad_clip"])
    _batch_sizes(ds, auto, out)
    if "optimizer" in ds:
        _deepspeed_optimizer(ds["optimizer"], defaults, auto, out, said)
    return out, said


def _inert(section: str, d: Mapping[str, Any], said: list[str]) -> None:
    """A line in `said` for each key of `d` that has no effect in a single process."""
    for key, why in DEEPSPEED_INERT.get(section, {}).items():
        if key in d:
            name = f"{section}.{key}" if section else key
            said.append(f"DeepSpeed config: {name} has no effect here: {why}")


def _no_auto(value: Any, where: str) -> Any:
    if value == "auto":
        raise ConfigError(f"{where}: \"auto\" cannot be resolved here; give a value")
    return value


def _deepspeed_zero(ds: Mapping[str, Any], defaults: Mapping[str, Any], out: dict[str, Any],
                    said: list[str]) -> None:
    """zero_optimization: the stage, where optimizer state and weights live, sub-groups."""
    zero = _take(ds.get("zero_optimization", {}), {
        "stage", "offload_optimizer", "offload_param", "sub_group_size"}
        | set(DEEPSPEED_INERT["zero_optimization"]), "zero_optimization")
    _inert("zero_optimization", zero, said)
    stage = _no_auto(zero.get("stage", 0), "zero_optimization.stage")
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage: {stage!r} is not one of 0, 1, 2, 3")
    out["zero_stage"] = stage  # across data-parallel ranks; one process: the same engine
    nvme_paths = _offload_optimizer(zero, stage, out, said) + _offload_param(zero, stage, out, said)
    if len(set(map(str, nvme_paths))) > 1:
        raise ConfigError("offload_optimizer.nvme_path and offload_param.nvme_path differ; the "
                          "swap files share one directory: give one path")
    if nvme_paths:
        out["nvme_dir"] = nvme_paths[0]
    if "sub_group_size" in zero:
        size = _resolve(zero["sub_group_size"], None, defaults["sub_group_size"])
        # published configs write 1e9: a whole float is an integer here
        out["sub_group_size"] = int(size) if isinstance(size, float) and size.is_integer() else size


def _offload_device(section: Mapping[str, Any], name: str) -> str:
    device = _no_auto(section.get("device", "none"), f"zero_optimization.{name}.device")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"zero_optimization.{name}.device: {device!r} is not one of none, cpu, nvme")
    return device


def _offload_optimizer(zero: Mapping[str, Any], stage: int, out: dict[str, Any],
                       said: list[str]) -> list[Any]:
    """zero_optimization.offload_optimizer -> offload, pin_memory, buffer_count,
    speculative_step (super_offload); its nvme_path."""
    opt_off = _take(zero.get("offload_optimizer", {}), {"device", "nvme_path", "pin_memory",
                                                       "buffer_count", "ratio", "super_offload"}
                    | set(DEEPSPEED_INERT["offload_optimizer"]), "zero_optimization.offload_optimizer")
    _inert("offload_optimizer", opt_off, said)
    if not opt_off:
        return []
    device = _offload_device(opt_off, "offload_optimizer")
    if device != "none" and stage < 1:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (DeepSpeed "
                          "refuses it with stage 0); set zero_optimization.stage")
    if opt_off.get("ratio", 1) not in (1, 1.0):
        raise ConfigError("zero_optimization.offload_optimizer.ratio: partial optimizer offload "
                          "is not supported; use 1 (all of the state) or device 'none'")
    out["offload"] = device
    paths = ([_no_auto(opt_off["nvme_path"], "offload_optimizer.nvme_path")]
             if "nvme_path" in opt_off else [])
    if "pin_memory" in opt_off:
        out["pin_memory"] = opt_off["pin_memory"]
    if "buffer_count" in opt_off:
        out["buffer_count"] = _no_auto(opt_off["buffer_count"], "offload_optimizer.buffer_count")
    if "super_offload" in opt_off:  # SuperOffload's speculation-then-validation step
        out["speculative_step"] = _no_auto(opt_off["super_offload"], "offload_optimizer.super_offload")
    return paths


def _offload_param(zero: Mapping[str, Any], stage: int, out: dict[str, Any],
                   said: list[str]) -> list[Any]:
    """zero_optimization.offload_param -> offload_params, pin_memory, prefetch_blocks; its
    nvme_path."""
    par_off = _take(zero.get("offload_param", {}), {"device", "nvme_path", "pin_memory",
                                                   "buffer_count"}
                    | set(DEEPSPEED_INERT["offload_param"]), "zero_optimization.offload_param")
    _inert("offload_param", par_off, said)
    if not par_off:
        return []
    device = _offload_device(par_off, "offload_param")
    if device != "none" and stage != 3:
        raise ConfigError("zero_optimization.offload_param needs stage 3 (as in DeepSpeed); "
                          "set zero_optimization.stage to 3")
    out["offload_params"] = device
    paths = ([_no_auto(par_off["nvme_path"], "offload_param.nvme_path")]
             if "nvme_path" in par_off else [])
    if "pin_memory" in par_off:
        if "pin_memory" in out and out["pin_memory"] != par_off["pin_memory"]:
            raise ConfigError("offload_optimizer.pin_memory and offload_param.pin_memory differ; "
                              "host buffers are pinned or not as a whole: give one value")
        out["pin_memory"] = par_off["pin_memory"]
    if "buffer_count" in par_off:  # buffers = the running block + the ones read ahead
        count = _no_auto(par_off["buffer_count"], "offload_param.buffer_count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 2:
            raise ConfigError(f"zero_optimization.offload_param.buffer_count: must be an integer "
                              f">= 2 (the block in use and one read ahead), got {count!r}")
        out["prefetch_blocks"] = count - 1
    return paths


def _deepspeed_aio(ds: Mapping[str, Any], out: dict[str, Any], said: list[str]) -> None:
    """aio: the IO engine's block size, queue depth and threads."""
    aio = _take(ds.get("aio", {}), {"block_size", "queue_depth", "thread_count", "use_gds"}
                | set(DEEPSPEED_INERT["aio"]), "aio")
    _inert("aio", aio, said)
    if aio.get("use_gds"):
        raise ConfigError("aio.use_gds: GPUDirect Storage is not supported; reads go through "
                          "pinned host buffers")
    for src, dst in (("block_size", "io_block_bytes"), ("queue_depth", "io_queue_depth"),
                     ("thread_count", "io_threads")):
        if src in aio:
            out[dst] = _resolve(aio[src], None, None)


def _deepspeed_precision(ds: Mapping[str, Any], defaults: Mapping[str, Any], auto: AutoValues,
                         out: dict[str, Any],
                         said: list[str]) -> None:
    """fp16 / bf16: the dtype and the fp16 loss-scaling settings."""
    fp16 = _take(ds.get("fp16", {}), {"enabled", "loss_scale", "initial_scale_power",
                                      "loss_scale_window", "hysteresis", "min_loss_scale"}
                 | set(DEEPSPEED_INERT["fp16"]), "fp16")
    _inert("fp16", fp16, said)
    bf16 = _take(ds.get("bf16", {}), {"enabled"}, "bf16")
    enabled = {}
    for where, section in (("fp16", fp16), ("bf16", bf16)):
        value = section.get("enabled", False)
        if value == "auto":  # on when the runner's --dtype says so
            value = auto.dtype == where
        if not isinstance(value, bool):
            raise ConfigError(f"{where}.enabled: must be true or false, got {value!r}")
        enabled[where] = value
    if enabled["fp16"] and enabled["bf16"]:
        raise ConfigError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; pick one")
    out["dtype"] = "fp16" if enabled["fp16"] else "bf16" if enabled["bf16"] else "fp32"
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "min_loss_scale"):
        if key in fp16:
            out[key] = _resolve(fp16[key], None, defaults[key])


def _deepspeed_optimizer(optimizer: Any, defaults: Mapping[str, Any], auto: AutoValues,
                         out: dict[str, Any],
                         said: list[str]) -> None:
    """optimizer: AdamW only (Adam / CPUAdam / FusedAdam spellings), its lr, betas, eps, decay."""
    opt = _take(optimizer, {"type", "params"}, "optimizer")
    kind = str(opt.get("type", "AdamW")).lower()
    if kind not in ("adam", "adamw", "cpuadam", "fusedadam"):
        raise ConfigError(f"optimizer.type: {opt.get('type')!r} is not supported; the engine "
                          f"runs AdamW (types Adam/AdamW accepted)")
    params = _take(opt.get("params", {}), {"lr", "betas", "eps", "weight_decay",
                                           "adam_w_mode", "bias_correction"}
                   | set(DEEPSPEED_INERT["optimizer.params"]), "optimizer.params")
    _inert("optimizer.params", params, said)
    if params.get("adam_w_mode") is False or params.get("bias_correction") is False:
        raise ConfigError("optimizer.params: only AdamW with bias correction is supported "
                          "(adam_w_mode=true, bias_correction=true)")
    for key, given in (("lr", auto.lr), ("betas", None), ("eps", None),
                       ("weight_decay", auto.weight_decay)):
        if key in params:
            out[key] = _resolve(params[key], given, defaults[key])


def _batch_sizes(ds: Mapping[str, Any], auto: AutoValues, out: dict[str, Any]) -> None:
    """train_batch_size = micro batch x accumulation steps (one process), as DeepSpeed checks.
    The micro batch is the data loader's (the runner's --micro-batch-size); the engine gets the
    accumulation steps, derived from the two batch sizes when not given."""
    micro = _resolve(ds.get("train_micro_batch_size_per_gpu"), auto.micro_batch_size, None)
    accum = _resolve(ds.get("gradient_accumulation_steps"), auto.grad_accum_steps, None)
    total = ds.get("train_batch_size")
    if total == "auto":
        total = micro * accum if micro is not None and accum is not None else None
    if total is not None and micro is None and isinstance(total, int) and not isinstance(total, bool):
        accum = accum if isinstance(accum, int) and accum > 0 else 1  # checked below
        micro = total // accum if total % accum == 0 else None
        if micro is None:
            raise ConfigError(f"train_batch_size {total} is not a multiple of "
                              f"gradient_accumulation_steps {accum} (one process)")
    for name, v in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum),
                    ("train_batch_size", total)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{name}: must be an integer >= 1, got {v!r}")
    if total is not None and micro is not None:
        if total % micro:
            raise ConfigError(f"train_batch_size {total} is not a multiple of "
                              f"train_micro_batch_size_per_gpu {micro} (one process)")
        if accum is not None and total != micro * accum:
            raise ConfigError(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                              f"gradient_accumulation_steps {accum} (one process); fix one of them")
        accum = total // micro
    if accum is not None:
        out["grad_accum_steps"] = accum
    if micro is not None:
        out["micro_batch_size"] = micro


__all__ = ["AutoValues", "DEEPSPEED_INERT", "DEEPSPEED_TOP_KEYS", "deepspeed_fields"]
