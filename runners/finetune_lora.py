"""runners.finetune's LoRA half (--lora-rank): the model the adapters train on, the plan's and
the banner's account of it, what a checkpoint holds, and the run's outputs.

- The model: the base read from --model (or a preset's seeded init) straight onto the device in
  the compute dtype, frozen; then apply_lora, its adapters seeded by --seed. The engine gives
  only the adapters masters and moments; the base stays where it is, on the device (this
  runner does not stream it yet: finetune_args refuses --offload-params with --lora-rank).
- A checkpoint holds adapter/ (the adapters' fp32 masters in PEFT's format, so any checkpoint
  is a usable adapter) instead of model/, plus the engine state as always. The base never
  changes, so --resume re-reads it from --model; a fingerprint of its bits is saved with the
  checkpoint and a resume onto other weights is refused in one line (the LoRA settings
  themselves are in the run's trajectory, runners/rundir.py).
- The outputs: OUTPUT/adapter (PEFT's format, read back before the run says it is done), and
  with --merge the merged model in OUTPUT/model, exported like a full run's. Without --merge
  no copy of the base is written: that is the point of LoRA.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable

import torch
from torch import nn

from nvme.format import fsync_dir, write_file, write_json_atomic
from offload.config import format_bytes
from offload.lora import (CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, LoraConfig, apply_lora,
                          load_adapter, lora_modules, merge_lora)
from runners.common import fail
from runners.finetune_args import lora_config

ADAPTER = "adapter"  # the directory name, in OUTPUT and in OUTPUT/checkpoint
CHUNK_ELEMENTS = 1 << 24  # the fingerprint sums a tensor this many elements at a time
BITS_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # float itemsize -> same-size int


@dataclass
class LoraRun:
    cfg: LoraConfig
    merge: bool
    seed: int  # the adapters' init is seeded by (seed, module name), as apply_lora does
    base_name: str  # adapter_config.json's base_model_name_or_path: --model, a path made absolute
    base_fingerprint: str | None = None  # of the frozen base's bits, once it is built

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoraRun | None":
        cfg = lora_config(args)
        if cfg is None:
            return None
        base = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
        return cls(cfg, args.merge, args.seed, base)

    def settings(self) -> str:
        """What a resume must share with the run that saved the checkpoint (its trajectory)."""
        c = self.cfg
        return (f"rank {c.rank}, alpha {float(c.alpha)!r}, dropout {float(c.dropout)!r}, "
                f"targets {','.join(c.targets)}")

    # ---- before anything is loaded: the plan and the banner, from the model on meta --------
    def adapter_blocks(self, model: nn.Module) -> list[tuple[int, bool]]:
        """(adapter elements, True) for each layer apply_lora will give adapters: r x (in + out)
        per targeted projection. Counted on the meta model without building the adapters (a
        70B dry run at rank 64 would otherwise allocate 3 GB of them)."""
        from offload.blocks import find_block_list

        found = find_block_list(model)
        layers = found[1] if found is not None else []
        sizes = [sum(self.cfg.rank * (m.in_features + m.out_features)
                     for name, m in layer.named_modules()
                     if name.rpartition(".")[2] in self.cfg.targets) for layer in layers]
        if not any(sizes):
            fail(f"--lora-targets {','.join(self.cfg.targets)}: this model's layers have no such "
                 f"projection")
        return [(n, True) for n in sizes if n]

    @staticmethod
    def frozen_plan_bytes(model: nn.Module, dtype: torch.dtype) -> tuple[list[int], int]:
        """(bytes of each layer's base, bytes of the base outside the layers) in the compute
        dtype, for plan_training: the whole model is the frozen base. The meta model is frozen
        here as apply_lora freezes the real one (it serves only the plan and the banner)."""
        from offload.blocks import find_block_list, frozen_bytes

        model.requires_grad_(False)
        found = find_block_list(model)
        return frozen_bytes(model, found[0] if found is not None else None, dtype)

    def describe(self, model: nn.Module, adapters: list[tuple[int, bool]], frozen_bytes: int,
                 dtype: str) -> str:
        """The banner's line: the adapters, trainable parameters against the total, the base."""
        c, trainable = self.cfg, sum(n for n, _ in adapters)
        base = sum(p.numel() for p in model.parameters())
        short = ",".join(t.removesuffix("_proj") for t in c.targets)
        return (f"  lora      rank {c.rank}, alpha {c.alpha:g} (scaling {c.scaling:g}), dropout "
                f"{c.dropout:g} on {short}: {trainable / 1e6:.3f}M trainable parameters of "
                f"{(base + trainable) / 1e6:.2f}M ({100 * trainable / (base + trainable):.2f}%); the "
                f"frozen base ({format_bytes(frozen_bytes)} in {dtype}) "
                f"stays on the device" + ("; --merge exports the merged model" if self.merge else ""))

    # ---- the model ---------------------------------------------------------------------------
    def build(self, model_cfg, source, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The base filled from `source` (a checkpoint reader or a seeded init) on the device in
        `dtype`, one block at a time, then the adapters; its fingerprint taken."""
        from offload.models import build_model

        if not hasattr(source, "read_tensors_into"):  # a seeded init is a plain fill function
            source = SimpleNamespace(read_tensors_into=source)
        model = build_model(model_cfg, device, dtype, source=source)
        apply_lora(model, self.cfg, seed=self.seed)
        self.base_fingerprint = base_fingerprint(model)
        return model

    def check_base(self, trainer: dict, resume: str) -> None:
        """A resume must re-read the base the adapters were trained on."""
        saved = trainer.get("lora_base_fingerprint")
        if saved is not None and saved != self.base_fingerprint:
            fail(f"--resume {resume}: the base model's weights differ from those the checkpoint's "
                 f"adapters were trained on (fingerprint {self.base_fingerprint}, the checkpoint "
                 f"has {saved}); pass the same --model (and --seed for a preset)")

    # ---- what is written -----------------------------------------------------------------------
    def write_adapter(self, params: Iterable[tuple[str, torch.Tensor]], directory: str) -> str:
        """The adapters' fp32 masters ((our parameter name, tensor)) as a PEFT adapter directory:
        the files save_adapter writes, taken from the masters rather than the model's
        compute-dtype copies (bf16 on a GPU). Weights first, each file atomic."""
        state = {PEFT_PREFIX + name: t.detach().to("cpu", torch.float32).contiguous()
                 for name, t in params}
        os.makedirs(directory, exist_ok=True)
        write_file(os.path.join(directory, WEIGHTS_FILE), state, {"format": "pt"}, atomic=True)
        write_json_atomic(os.path.join(directory, CONFIG_FILE), self.cfg.to_peft(self.base_name),
                          indent=2, sort_keys=True)
        fsync_dir(directory)
        return directory

    def checkpoint_writer(self):
        """save_checkpoint's write_weights: the adapter in the checkpoint's adapter/."""
        return lambda params, checkpoint_dir: self.write_adapter(
            params, os.path.join(checkpoint_dir, ADAPTER))

    def export_adapter(self, engine, output: str, model_cfg,
                       main: bool) -> tuple[str, dict[str, torch.Tensor]]:
        """OUTPUT/adapter from the engine's masters, read back onto the model's shape the way
        a loader will. Every rank takes part (the masters are gathered across ranks); rank 0
        writes. Returns (its path, the masters: --merge folds them in)."""
        masters = dict(engine.iter_master_params())
        path = os.path.join(output, ADAPTER)
        if main:
            self.write_adapter(masters.items(), path)
            verify_adapter(path, model_cfg)
        return path, masters

    @staticmethod
    def merge_into(model: nn.Module, masters: dict[str, torch.Tensor]) -> None:
        """Fold the adapters into the base weights, from the fp32 masters: each adapter's
        weights become its master (beside its base weight) before merge_lora adds B A alpha/r."""
        for name, m in lora_modules(model).items():
            device = m.base_layer.weight.device
            for part in ("lora_A", "lora_B"):
                getattr(m, part).weight = nn.Parameter(
                    masters[f"{name}.{part}.weight"].to(device), requires_grad=False)
        merge_lora(model)


def verify_adapter(path: str, model_cfg) -> None:
    """Load the written adapter onto the model's shape (on meta: only the adapters get storage):
    names, shapes, finiteness and config checked as runners.infer --adapter will check them."""
    from offload.lora import LoraError
    from offload.models import build_model

    try:
        load_adapter(build_model(model_cfg, "meta"), path)
    except LoraError as e:
        fail(f"the adapter written to {path} cannot be read back ({str(e)[:200]}); the training "
             f"checkpoint is complete: its adapter/ holds the same weights")


def base_fingerprint(model: nn.Module) -> str:
    """A digest of every frozen parameter's name, shape, dtype and bits. The bits are summed as
    integers (exact, the same on every device) a chunk at a time, each chunk's sum weighted by
    its position: a few milliseconds per GB on a GPU, no copy of a whole tensor."""
    digest = hashlib.blake2b(digest_size=12)
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        flat = p.detach().reshape(-1)
        bits = flat.view(BITS_OF[flat.element_size()]) if flat.is_floating_point() else flat
        total = sum((k + 1) * int(chunk.sum(dtype=torch.int64))
                    for k, chunk in enumerate(bits.split(CHUNK_ELEMENTS)))
        digest.update(f"{name}:{p.dtype}:{list(p.shape)}:{total};".encode())
    return digest.hexdigest()
