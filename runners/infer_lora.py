"""runners.infer's --adapter: a LoRA adapter (runners.finetune --lora-rank's OUTPUT/adapter, or
any plain-LoRA PEFT adapter) loaded onto the base model without merging it.

The adapters stay on the device in fp32 beside the base, whatever tier the base's blocks live
in: a streamed block's base weights are bound into the same projection modules the adapters
wrap (the streamer changes the parameters' storage, never the modules), so device, host and
NVMe blocks and quantized projections all compute base(x) + B A x alpha / r. The adapter is
checked against the model's shapes on the meta device before anything is loaded, and its
bytes are planned as part of the resident weights."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from offload.config import format_bytes
from offload.lora import LoraConfig, load_adapter, lora_state_dict
from offload.models import ModelConfig, build_model


@dataclass(frozen=True)
class Adapter:
    path: str
    cfg: LoraConfig
    num_params: int

    @property
    def device_bytes(self) -> int:  # fp32 on the device, as load_adapter makes them
        return 4 * self.num_params

    def describe(self) -> str:
        c = self.cfg
        return (f"adapter: {self.path} (LoRA rank {c.rank}, alpha {c.alpha:g}, on "
                f"{','.join(t.removesuffix('_proj') for t in c.targets)}: "
                f"{self.num_params / 1e6:.3f}M parameters, {format_bytes(self.device_bytes)} fp32 "
                f"on the device beside the base, resident or streamed; not merged)")


def add_adapter_arg(parser) -> None:
    parser.add_argument("--adapter", default=None, metavar="DIR",
                        help="a LoRA adapter directory (adapter_config.json + "
                             "adapter_model.safetensors: runners.finetune --lora-rank's "
                             "OUTPUT/adapter or PEFT's save_pretrained) applied to --model "
                             "without merging")


def check_adapter(path: str | None, cfg: ModelConfig) -> Adapter | None:
    """The adapter read and checked against the model's shapes (names, ranks, finite values) on
    a meta model: a bad one is one line (LoraError) before the base is touched."""
    if path is None:
        return None
    probe = build_model(cfg, "meta")
    lora = load_adapter(probe, path)
    return Adapter(path, lora, sum(t.numel() for t in lora_state_dict(probe).values()))


def attach_adapter(model: nn.Module, adapter: Adapter | None) -> None:
    """Load the adapter onto the loaded model and switch it to eval mode (LoRA's dropout off,
    as PEFT's inference does)."""
    if adapter is None:
        return
    load_adapter(model, adapter.path)
    model.eval()
    print(adapter.describe(), file=sys.stderr)
