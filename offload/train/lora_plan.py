"""Full fine-tuning, LoRA and QLoRA of one model, planned side by side: the table a user reads to
choose (the fine-tuning runner's dry run prints it).

Each row is the training plan (offload/train/plan.py) of the model as that method builds it,
on the meta device (nothing allocated, a 70B shape in a few hundred MB): full fine-tuning
trains every parameter; LoRA wraps the targeted projections (offload/lora.py) and freezes the
rest, the base in the compute dtype; QLoRA does the same over int4/int8 projections
(offload/models/quantized.py), the base as stored. Frozen bases are placed like the 16-bit
weights (`offload_params`): on the device, or streamed from host RAM or NVMe; the trainable
part keeps the config's optimizer tier.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from offload.memory.blocks import frozen_bytes, group_blocks
from offload.config import OffloadConfig, format_bytes
from offload.lora import LoraConfig, apply_lora
from offload.memory.tiers import TIERS
from offload.train.plan import TrainingPlan, plan_training


@dataclass
class MethodPlan:
    method: str  # "full", "LoRA r=16", "QLoRA int4 r=16"
    trainable: int  # parameters with optimizer state
    plan: TrainingPlan


@contextlib.contextmanager
def _no_initialisers():
    """nn.Linear / nn.Embedding built without running their initialisers: on the meta device
    they compute nothing, yet cost ~2.6 ms a Linear (measured), and a mixture of experts has
    tens of thousands (Qwen3-30B-A3B: 18k; a 235B-A22B plan took minutes)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _meta_model(model_cfg, dtype: torch.dtype, quantize: str | None, group_size: int = 0):
    from offload.models import build_model
    with _no_initialisers():
        model = build_model(model_cfg, dtype=dtype)  # meta
    if quantize is not None:
        from offload.models.quantized import QuantSettings, projection_specs, quantize_layers
        quantize_layers(model, projection_specs(model_cfg, QuantSettings(quantize, group_size)), dtype)
    return model


def plan_methods(model_cfg, cfg: OffloadConfig, lora: LoraConfig,
                 quantize: str = "int4", qlora_params: str | None = None,
                 group_size: int = 0,
                 methods: tuple[str, ...] = ("full", "lora", "qlora")) -> list[MethodPlan]:
    """The plans of full fine-tuning, LoRA and QLoRA (`quantize` int4|int8, `group_size` 0: the
    mode's default) of `model_cfg` under `cfg`; nothing is allocated. `qlora_params`: the QLoRA row's offload_params when it
    differs from cfg's (runners.finetune streams a quantized base: cpu where cfg has none).
    `methods`: the rows to plan, of "full", "lora", "qlora" (each builds its meta model)."""
    rows = []
    device = cfg.resolve_device()
    qcfg = (cfg if qlora_params in (None, cfg.offload_params)
            else cfg.replace(offload_params=qlora_params))
    qlabel = f"QLoRA {quantize} r={lora.rank}" + ("" if qcfg is cfg else f" (base from {qlora_params})")
    for key, method, quant, wrap in (("full", "full", None, False),
                                     ("lora", f"LoRA r={lora.rank}", None, True),
                                     ("qlora", qlabel, quantize, True)):
        if key not in methods:
            continue
        row_cfg = qcfg if quant is not None else cfg
        model = _meta_model(model_cfg, cfg.torch_dtype, quant, group_size)
        if wrap:
            apply_lora(model, lora, seed=0, device="meta")  # adapters' shapes only
        blocks, path = group_blocks(model)
        layer_bytes, rest_bytes = frozen_bytes(model, path, cfg.torch_dtype,
                                               own_dtypes=quant is not None)
        plan = plan_training([(b.numel, b.module is not None) for b in blocks], row_cfg, device,
                             frozen_layer_bytes=layer_bytes, frozen_resident_bytes=rest_bytes)
        rows.append(MethodPlan(method, sum(b.numel for b in blocks), plan))
    return rows


def format_methods(rows: list[MethodPlan]) -> str:
    """A Markdown table: trainable parameters and bytes per tier of each method."""
    out = ["| method | trainable params | " + " | ".join(TIERS) + " |",
           "|---|---:|" + "---:|" * len(TIERS)]
    for r in rows:
        millions = f"{r.trainable / 1e6:,.1f}" if r.trainable >= 100_000 else f"{r.trainable / 1e6:.3f}"
        out.append(f"| {r.method} | {millions}M | "
                   + " | ".join(format_bytes(r.plan.total(t)) for t in TIERS) + " |")
    return "\n".join(out)
