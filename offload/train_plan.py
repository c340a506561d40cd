"""The memory plan of offloaded training: bytes per tier and kind, decided before anything is
allocated, checked against budgets, printable. The engine refuses to start on a plan that does
not fit; `runners.finetune --dry-run` prints the same plan and exits.

Per parameter (Φ) and 16-bit training, the model state is 16 bytes: 2 (weights) + 2 (grads) +
12 (fp32 master + exp_avg + exp_avg_sq). Where each part lives is the offload choice:

    offload   device           host                                  nvme
    none      2 + 2(4) + 12    -                                     -
    cpu       2                2(4) grads + 12 state                 -
    nvme      2                2(4) grads + buffers x largest block  12

(gradients are 4 bytes when accumulating micro-batches or training in fp32.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.config import OffloadConfig, format_bytes
from offload.tiers import (TIERS, check_fits, device_free_bytes, disk_free_bytes,
                           host_free_bytes)


@dataclass
class TrainingPlan:
    cfg: OffloadConfig
    device: torch.device
    num_params: int
    max_block_params: int
    num_blocks: int
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> kind -> bytes

    def total(self, tier: str) -> int:
        return sum(self.bytes.get(tier, {}).values())

    def check(self) -> None:
        """Raise BudgetError (saying what would fit) unless every tier fits its budget and what
        is free right now."""
        cfg = self.cfg
        what = f"{self.num_params / 1e6:.1f}M parameters ({cfg.dtype}, offload={cfg.offload!r})"
        check_fits("device", self.total("device"), cfg.budget_bytes("device"),
                   device_free_bytes(self.device), what,
                   "use offload='cpu' or 'nvme' (optimizer state off the device), a smaller "
                   "model, or raise the device budget (--gpu-memory)")
        host_hint = ("use offload='nvme' to keep optimizer state on disk, or raise the host "
                     "budget (--cpu-memory)" if cfg.offload == "cpu" else
                     "lower buffer_count, or raise the host budget (--cpu-memory)")
        check_fits("host", self.total("host"), cfg.budget_bytes("host"), host_free_bytes(),
                   what, host_hint)
        if self.device.type == "cpu":  # device and host are one RAM: both at once must fit
            check_fits("host", self.total("device") + self.total("host"), None,
                       host_free_bytes(), what + " (device and host tiers share the CPU's RAM)",
                       "use offload='nvme' or a smaller model")
        if cfg.offload == "nvme":
            check_fits("nvme", self.total("nvme"), cfg.budget_bytes("nvme"),
                       disk_free_bytes(cfg.nvme_dir or "."), what,
                       f"free disk space under {cfg.nvme_dir} or choose another offload dir")

    def format(self) -> str:
        cfg = self.cfg
        lines = [f"memory plan: {self.num_params / 1e6:.2f}M trainable parameters in "
                 f"{self.num_blocks} blocks (largest {self.max_block_params / 1e6:.2f}M), "
                 f"{cfg.dtype}, offload={cfg.offload}, device={self.device}"]
        for tier in TIERS:
            kinds = self.bytes.get(tier, {})
            if not kinds:
                continue
            budget = cfg.budget_bytes(tier)
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items() if v)
            lines.append(f"  {tier:>6}: {format_bytes(self.total(tier)):>11}  ({parts})"
                         + (f"  budget {format_bytes(budget)}" if budget is not None else ""))
        return "\n".join(lines)


def plan_training(block_params: list[int], cfg: OffloadConfig,
                  device: torch.device | None = None) -> TrainingPlan:
    """Bytes per tier for training a model whose trainable parameters form blocks of the given
    sizes (element counts), under `cfg`."""
    device = device or cfg.resolve_device()
    n, largest = sum(block_params), max(block_params)
    itemsize = cfg.torch_dtype.itemsize
    grad_bytes = n * (4 if cfg.grad_accum_steps > 1 else itemsize)
    plan = TrainingPlan(cfg, device, n, largest, len(block_params))
    plan.bytes = {"device": {"weights": n * itemsize}, "host": {}, "nvme": {}}
    if cfg.offload == "none":
        plan.bytes["device"].update(grads=grad_bytes, masters=n * 4, moments=n * 8)
        return plan
    plan.bytes["host"]["grads"] = grad_bytes
    if device.type == "cuda":
        # pinned staging the 16-bit weights are uploaded from (a ring of buffer_count blocks)
        ring = max(2, min(cfg.buffer_count, len(block_params)))
        plan.bytes["host"]["buffers"] = ring * largest * itemsize
        if cfg.grad_accum_steps > 1:  # 16-bit gradients staged before the fp32 host add
            plan.bytes["host"]["buffers"] += n * itemsize
    if cfg.offload == "cpu":
        plan.bytes["host"].update(masters=n * 4, moments=n * 8)
    else:
        plan.bytes["host"]["buffers"] = (plan.bytes["host"].get("buffers", 0)
                                         + cfg.buffer_count * largest * 12)
        plan.bytes["nvme"].update(masters=n * 4, moments=n * 8)
    return plan
