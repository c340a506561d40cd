"""What a fine-tuning run prints and writes: the start banner (each choice and why), the end
summary (time split, bytes per link, peak memory per tier), the metrics rows (valid JSON, cut
back to the checkpoint on resume), and a loss-curve PNG where matplotlib is installed."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import torch

from offload.config import OffloadConfig, format_bytes


class Banner:
    def __init__(self, args: argparse.Namespace, cfg: OffloadConfig, model_cfg, plan,
                 device: torch.device, choice: str | None = None, world: int = 1,
                 lora: str | None = None, sources: dict[str, str] | None = None):
        self.args, self.cfg, self.model_cfg, self.plan, self.device = args, cfg, model_cfg, plan, device
        self.sources = sources or {}  # config field -> "flag" / "file" / "default" (engine_config)
        self.choice = choice  # the planner's sentence when --offload auto chose the configuration
        self.world = world  # data-parallel ranks (torchrun)
        self.lora = lora  # a LoRA run's line (runners/finetune_lora.py), None otherwise

    def render(self) -> str:
        a, cfg, m = self.args, self.cfg, self.model_cfg
        source = (f"checkpoint {a.model}" if os.path.isdir(a.model)
                  else f"GGUF checkpoint {a.model} (dequantized to fp32)" if os.path.isfile(a.model)
                  else f"preset {a.model!r}, random init (seed {a.seed})")
        why_device = (f"--gpu {a.gpu}" if a.gpu is not None else
                      "no --gpu given" + (" (a GPU is visible: add --gpu 0 to use it)"
                                          if torch.cuda.is_available() else ""))
        why_offload = {"none": "everything on the device (the plain reference path)",
                       "cpu": "fp32 masters + Adam moments in host RAM"
                              + (" (pageable: the CPU step reads them in place; the buffers that "
                                 "cross the link are the pinned ones)"
                                 if cfg.pin_memory and self.device.type == "cuda" else ""),
                       "nvme": f"fp32 masters + Adam moments in swap files under {cfg.nvme_dir}, "
                               f"{cfg.buffer_count} staging buffers, read ahead during forward/backward"}
        accum = cfg.grad_accum_steps
        lines = [
            "offload finetune",
            f"  model     {m.architecture}, {m.num_hidden_layers} layers, hidden {m.hidden_size}, "
            f"vocab {m.vocab_size} — {source}",
            f"  device    {self.device} ({why_device})",
            f"  dtype     {cfg.dtype} weights and gradients on the device"
            + (", dynamic loss scaling" if cfg.dtype == "fp16" else ""),
            f"  offload   {cfg.offload}: {why_offload[cfg.offload]}",
            f"  batch     {a.batch_size} x {a.seq_len} tokens"
            + (f" = {accum} micro-batches of {a.batch_size // accum}" if accum > 1 else "")
            + f", {a.steps} updates, lr {cfg.lr:g} (warmup {a.warmup_steps}, cosine), "
              f"clip {cfg.grad_clip:g}, weight decay {cfg.weight_decay:g}",
            f"  budgets   device {_budget(cfg.budget_bytes('device'))}, host "
            f"{_budget(cfg.budget_bytes('host'))}"
            + (f", nvme {_budget(cfg.budget_bytes('nvme'))}" if cfg.offload == "nvme" else ""),
        ]
        if self.world > 1 and cfg.zero_stage == 3:
            where = "host RAM" if cfg.offload_params == "cpu" else "device memory"
            lines.append(f"  weights   each rank keeps its 1/{self.world} of every block's {cfg.dtype} "
                         f"weights in {where}; a block is gathered from all ranks one block ahead "
                         f"in forward and backward and dropped after it runs (the embeddings, norm "
                         f"and head too, each module's around its forward)")
        elif cfg.offload_params != "none" and not self.lora:  # a LoRA base: the lora line says it
            lines.append(f"  weights   the blocks' {cfg.dtype} weights live in "
                         f"{'host RAM' if cfg.offload_params == 'cpu' else 'NVMe swap files'} and are "
                         f"streamed to the device one block ahead in forward and backward")
        if self.lora:
            lines.append(self.lora)
        if a.config:  # each value the file could have set, and where it came from
            fields = set(cfg.to_dict())
            lines.append(f"  config    {a.config}: " + ", ".join(
                f"{k} {getattr(cfg, k)} ({src})" for k, src in sorted(self.sources.items())
                if k in fields))
        if cfg.activation_checkpointing:
            lines.append("  activations checkpointed per block (recomputed in backward)"
                         + ("; checkpointed inputs kept in host RAM" if cfg.offload_activations else ""))
        if self.world > 1:
            phi = self.plan.num_params
            formula = zero_state_bytes(cfg, phi, self.world)
            moved = 3 if cfg.zero_stage == 3 else 2
            lines.append(f"  ranks     {self.world} data-parallel ranks, ZeRO stage {cfg.zero_stage}: "
                         f"model states per rank " + ", ".join(
                             f"{k} {format_bytes(v)}" for k, v in formula.items())
                         + f" (Φ = {phi / 1e6:.1f}M parameters); gradients and weights move "
                         f"{format_bytes(moved * phi * (self.world - 1) / self.world * cfg.torch_dtype.itemsize)}"
                         f" per rank per update ({moved}Φ(N-1)/N"
                         + (", at most" if cfg.zero_stage == 3 else "") + ")")
        path, why = cfg.step_path(self.world)
        lines.append("  CPU step  " + {"overlapped": "overlapped with backward: ",
                                       "speculative": "overlapped with backward, speculative: ",
                                       "delayed": "one step delayed: ",
                                       "after": "after backward: "}[path] + why)
        if self.choice:
            lines.append(f"  planner   {self.choice}")
        lines += ["  " + line for line in self.plan.format().splitlines()]
        return "\n".join(lines)


def zero_state_bytes(cfg: OffloadConfig, phi: int, world: int) -> dict[str, int]:
    """The ZeRO paper's model states per rank for Φ parameters over `world` ranks at
    cfg.zero_stage, in this run's dtypes: weights, gradients (fp32 when accumulated), fp32
    masters and the two moments -- 2Φ + 2Φ + 12Φ in mixed precision, sharded by the stage. The
    delayed update holds two sets of weights and of gradients (offload/train/delayed.py)."""
    item = cfg.torch_dtype.itemsize
    grad_item = 4 if cfg.grad_accum_steps > 1 else item
    copies = 2 if cfg.delayed_update else 1
    shard = lambda n, stage: n // world if cfg.zero_stage >= stage else n  # noqa: E731
    return {"weights": copies * shard(phi * item, 3),
            "gradients": copies * shard(phi * grad_item, 2),
            "masters + moments": shard(12 * phi, 1)}


def _budget(b: int | None) -> str:
    return "free memory" if b is None else format_bytes(b)


def summary_table(engine, totals: dict[str, float], wall_s: float, tokens: int,
                  eval_loss0: float | None, eval_final: float | None,
                  rank_memory: list[dict] | None = None) -> str:
    """Time split, bytes per link, peak memory per tier — the run's own account."""
    step_s = max(totals.get("step_s", 0.0), 1e-9)
    t = lambda k: totals.get(k, 0.0)  # noqa: E731
    hidden_step, hidden_upload = t("hidden_cpu_step_s"), t("hidden_upload_s")
    # shares of the wall time: what ran on the main thread, and what it waited for; the step
    # thread's own work (overlapped with forward/backward) is listed apart
    parts = [("forward", t("forward_s")), ("backward", t("backward_s")),
             ("gradient offload wait", t("grad_wait_s")),
             ("CPU optimizer step", t("cpu_step_s") - hidden_step),
             ("optimizer-state IO wait", t("io_wait_s")),
             ("weight upload", t("upload_s") - hidden_upload),
             ("waiting for the step thread", t("overlap_wait_s")),
             ("waiting for other ranks", t("comm_wait_s"))]
    other = step_s - sum(v for _, v in parts)
    lines = ["", f"summary: {tokens} tokens in {wall_s:.1f} s ({tokens / max(wall_s, 1e-9):.0f} tokens/s)"]
    if eval_loss0 is not None and eval_final is not None:
        lines.append(f"  eval loss {eval_loss0:.4f} -> {eval_final:.4f} "
                     f"({100 * (1 - eval_final / eval_loss0):.1f}% lower)")
    lines.append("  time split           seconds   share")
    for name, v in parts + [("other (data, eval-free loop)", other)]:
        lines.append(f"    {name:<28} {v:8.2f}  {100 * v / step_s:5.1f}%")
    if t("forward_gpu_s") or t("backward_gpu_s"):
        # on a GPU the host times above are mostly kernel queueing; this is the GPU's own time
        lines.append(f"    on the GPU (timing events): forward {t('forward_gpu_s'):.2f} s, "
                     f"backward {t('backward_gpu_s'):.2f} s")
    if hidden_step or hidden_upload:
        lines.append(f"    on the step thread, hidden behind forward/backward: CPU step "
                     f"{hidden_step:.2f} s, weight upload {hidden_upload:.2f} s")
    path = getattr(engine, "path", None)
    if getattr(path, "name", None) == "speculative":  # offload/train/speculative.py
        lines.append(f"    speculative step: {path.rollbacks} of {path.speculated} updates begun in "
                     f"backward rolled back ({100 * path.rollback_rate:.1f}%; clipped and stepped "
                     f"again, or skipped), restoring them {t('rollback_s'):.2f} s")
    lines.append("  bytes per link       total       per update")
    updates = max(engine.global_step, 1)
    for link, label in (("d2h", "device->host (grads)"), ("h2d", "host->device (weights)"),
                        ("nvme_read", "nvme read (state)"), ("nvme_write", "nvme write (state)"),
                        ("all_reduce", "all-reduce (grads, sent)"),
                        ("reduce_scatter", "reduce-scatter (grads, sent)"),
                        ("all_gather", "all-gather (weights, sent)"),
                        ("all_gather_fetch", "all-gather (stage 3 fetch)"),
                        ("all_gather_eval", "all-gather (stage 3, eval)")):
        b = totals.get("bytes_" + link, 0)
        if b:
            lines.append(f"    {label:<28} {format_bytes(b):>10}  {format_bytes(b / updates):>10}")
    if getattr(engine, "zero", None) is not None:
        lines += zero_lines(engine, totals, updates)
    rep = engine.memory_report()
    lines.append("  peak memory per tier")
    for tier in ("device", "host", "nvme"):
        lines.append(f"    {tier:<28} {format_bytes(rep[tier]['peak']):>10}  (held by the engine)")
    if rank_memory and len(rank_memory) > 1:  # per rank, where ranks differ (shards' sizes)
        for tier in ("device", "host", "nvme"):
            peaks = [m[tier]["peak"] for m in rank_memory]
            if len(set(peaks)) > 1:
                lines.append(f"    {tier + ' by rank':<28} " + ", ".join(
                    f"{r}: {format_bytes(p)}" for r, p in enumerate(peaks)))
    lines.append(f"    {'process RSS':<28} {format_bytes(rep['process']['peak_rss']):>10}")
    if "peak_device_allocated" in rep["process"]:
        lines.append(f"    {'CUDA allocated':<28} {format_bytes(rep['process']['peak_device_allocated']):>10}")
    return "\n".join(lines)


def zero_lines(engine, totals: dict[str, float], updates: int) -> list[str]:
    """Across ranks: what this rank sent per update against the ZeRO bound, and its model
    states per kind against the formulas (rank 0's; the others' differ by a padding's worth)."""
    cfg, world = engine.cfg, engine.world
    phi = sum(b.numel for b in engine.blocks)
    k = 3 if cfg.zero_stage == 3 else 2
    sent = sum(totals.get("bytes_" + c, 0) for c in
               ("all_reduce", "reduce_scatter", "all_gather", "all_gather_fetch")) / updates
    bound = k * phi * (world - 1) / world * cfg.torch_dtype.itemsize
    lines = [f"  ZeRO stage {cfg.zero_stage} over {world} ranks: sent {format_bytes(sent)} per update "
             f"= {sent / bound:.2f} x {k}Φ(N-1)/N ({format_bytes(bound)})"
             + (" (the delayed update's last weights are gathered when they go live, after "
                "this count)" if engine.delayed is not None and cfg.zero_stage >= 1 else ""),
             "  model states per rank  measured     formula"
             + (" (x2 weights and gradients: the delayed update's second set)"
                if cfg.delayed_update else "")]
    held = engine.account.kind_peaks()
    slots = engine.slot_bytes  # working buffers, not model states: shown apart below
    got = {"weights": sum(v for (_, kind), v in held.items() if kind == "weights") - slots,
           "gradients": sum(v for (_, kind), v in held.items() if kind == "grads"),
           "masters + moments": sum(v for (_, kind), v in held.items()
                                    if kind in ("masters", "moments"))}
    for kind, want in zero_state_bytes(cfg, phi, world).items():
        lines.append(f"    {kind:<20} {format_bytes(got[kind]):>10}  {format_bytes(want):>10}")
    if slots:
        lines.append(f"    (+ {format_bytes(slots)} of device slots the streamed layers are bound to)")
    return lines


def write_loss_plot(history: list[dict[str, Any]], path: str) -> str | None:
    """A PNG of train and eval loss per update, when matplotlib is installed (it is optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train")
    ev = [h for h in history if "eval_loss" in h]
    if ev:
        ax.plot([h["step"] for h in ev], [h["eval_loss"] for h in ev], "o-", label="eval")
    ax.set_xlabel("update")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finite_or_null(value):
    """`value` with every inf/nan float replaced by None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def truncate_metrics(path: str, step: int) -> None:
    """Keep only the metrics rows of updates up to `step` (atomically rewritten)."""
    try:  # a damaged byte spoils its line only (kept with U+FFFD, or dropped as torn)
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def kernels_line(k: dict) -> str:
    """`kernels: quantized products c 1320, fused 240 | checked on this CPU: fused int8 4 shapes
    trusted, 1 refused (in 72 out 45: the check was killed by SIGSEGV on this case)`."""
    calls = ", ".join(f"{name} {n}" for name, n in sorted(k["quantized_calls"].items()))
    checked = []
    for probe, cases in sorted(k["checked"].items()):
        bad = {case: why for case, why in cases.items() if why != "trusted"}
        text = f"{probe.rsplit(':', 1)[-1]} {len(cases) - len(bad)} trusted"
        if bad:
            case, why = next(iter(bad.items()))
            text += f", {len(bad)} refused ({case}: {why})"
        checked.append(text)
    parts = ([f"quantized products {calls}"] if calls else []) + (
        [f"checked on this CPU: {'; '.join(checked)}"] if checked else [])
    return "kernels: " + " | ".join(parts) if parts else ""
