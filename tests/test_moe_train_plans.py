"""Plans for fine-tuning the real mixtures of experts (issue 37): full fine-tuning, LoRA and QLoRA
of Qwen3-30B-A3B and gpt-oss-20b, and QLoRA of Qwen3-235B-A22B, on a 24 GB GPU + 64 GB RAM +
NVMe, planned on meta models (offload/train/lora_plan.py: what runners.finetune --dry-run prints
beside its own plan): each fits, its trainable parameters are the published totals (full) or the
adapters' (LoRA), and the state on NVMe is 12 bytes per trained parameter.

The device bytes are the model state's (weights, gradients, frozen base; the activations depend
on batch and sequence and are planned by the runner); the bf16 run keeps optimizer state and
weights on NVMe, the base streamed from there (--offload nvme --offload-params nvme).
"""

from __future__ import annotations

import pytest
import torch

from offload.config import OffloadConfig
from offload.lora import LoraConfig
from offload.models.presets import PUBLISHED_PARAMS, preset
from offload.train import lora_plan

GiB = 1 << 30
BUDGETS = {"device": 24 * GiB, "host": 64 * GiB}
CASES = [("qwen3-30B-A3B", ("full", "lora", "qlora")), ("gpt-oss-20b", ("full", "lora", "qlora")),
         ("qwen3-235B-A22B", ("qlora",))]


@pytest.mark.parametrize("name,methods", CASES, ids=[c[0] for c in CASES])
def test_moe_fine_tuning_plans_fit_a_24gb_gpu_and_64gb_ram(name, methods, monkeypatch, capsys):
    # planned for a CUDA device (its pinned buffers and rings) on this machine, which has none
    monkeypatch.setattr(OffloadConfig, "resolve_device", lambda self: torch.device("cuda"))
    cfg = OffloadConfig(offload="nvme", offload_params="nvme", dtype="bf16", device="cuda",
                        nvme_dir="/nonexistent", device_budget="24GiB", host_budget="64GiB")
    lora = LoraConfig(rank=16, alpha=32, targets=("q", "k", "v", "o"))
    rows = lora_plan.plan_methods(preset(name), cfg, lora, methods=methods)
    assert len(rows) == len(methods)
    with capsys.disabled():
        print(f"\n{name} (bf16, state and weights on NVMe)\n{lora_plan.format_methods(rows)}")
    for row in rows:
        for tier, budget in BUDGETS.items():
            assert row.plan.total(tier) <= budget, (row.method, tier, row.plan.bytes[tier])
        state = row.plan.bytes["nvme"]["masters"] + row.plan.bytes["nvme"]["moments"]
        assert state == 12 * row.trainable
        if row.method == "full":
            published = PUBLISHED_PARAMS[name]
            assert abs(row.trainable - published) <= 0.01 * published
        else:
            assert row.trainable < 1e-3 * PUBLISHED_PARAMS[name]  # adapters only
            assert row.plan.bytes["device"]["frozen"] > 0  # the base's non-layer part resident
