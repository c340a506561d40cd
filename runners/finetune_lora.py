"""runners.finetune's LoRA half (--lora-rank): the model the adapters train on, the plan's and
the banner's account of it, what a checkpoint holds, and the run's outputs.

- The model: built on the meta device in the compute dtype (with --quantize its projections as
  QuantLinears: QLoRA, runners/finetune_qlora.py), the embeddings, final norm and head read onto
  the device, then apply_lora, its adapters seeded by --seed. The decoder layers' base is left
  on meta and filled by the engine from `source` (the checkpoint reader, a preset's seeded
  init, or a quantized base's block files), one parameter at a time onto the device
  (--offload-params none) or one layer at a time into its home in host RAM or NVMe
  (--offload-params cpu|nvme, offload/stream/frozen.py): the base is never whole in RAM.
  The engine gives only the adapters masters and moments.
- A checkpoint holds adapter/ (the adapters' fp32 masters in PEFT's format, so any checkpoint
  is a usable adapter) instead of model/, plus the engine state as always. The base never
  changes, so --resume re-reads it from --model; a fingerprint of its bits, taken as the engine
  reads them (no read of its own), is saved with the checkpoint and a resume onto other
  weights is refused in one line (the LoRA settings themselves are in the run's trajectory,
  runners/rundir.py).
- The outputs: OUTPUT/adapter (PEFT's format, read back before the run says it is done), and
  with --merge the merged model in OUTPUT/model, each base tensor read again from the source
  (a QLoRA base's dequantized) plus its adapter's update, one tensor at a time. Without --merge
  no copy of the base is written: that is the point of LoRA.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn

from nvme.format import fsync_dir, write_file, write_json_atomic
from offload.config import format_bytes
from offload.lora import (CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, LoraConfig, apply_lora,
                          base_checkpoint_name, load_adapter)
from offload.memory.mapped import maps_frozen_rest
from offload.models.quantized import PER_CHANNEL
from runners.common import fail
from runners.finetune_args import lora_config
from runners import finetune_qlora as qlora

ADAPTER = "adapter"  # the directory name, in OUTPUT and in OUTPUT/checkpoint
CHUNK_ELEMENTS = 1 << 24  # the fingerprint sums a tensor this many elements at a time
BITS_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # float itemsize -> same-size int


@dataclass
class LoraRun:
    cfg: LoraConfig
    merge: bool
    seed: int  # the adapters' init is seeded by (seed, module name), as apply_lora does
    base_name: str  # adapter_config.json's base_model_name_or_path: --model, a path made absolute
    args: argparse.Namespace  # --model, --quantize, --group-size, --cache-dir
    base_fingerprint: str | None = None  # of the frozen base's bits, once the engine has read it
    source: "RecordingSource | None" = None  # the base's source as the engine reads it (build)
    blocks: object = None  # QLoRA: the converted QuantizedBlocks (build)
    frozen_names: list[str] = field(default_factory=list)  # the base's parameters, model order

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoraRun | None":
        cfg = lora_config(args)
        if cfg is None:
            return None
        base = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
        return cls(cfg, args.merge, args.seed, base, args)

    @property
    def quantize(self) -> str | None:
        return None if self.args.quantize == "none" else self.args.quantize

    def settings(self) -> str:
        """What a resume must share with the run that saved the checkpoint (its trajectory)."""
        c = self.cfg
        out = (f"rank {c.rank}, alpha {float(c.alpha)!r}, dropout {float(c.dropout)!r}, "
               f"targets {','.join(c.targets)}")
        if self.quantize:  # another quantization is another base
            from offload.models.quantized import QuantSettings
            group = QuantSettings(self.quantize, self.args.group_size).spec().group_size
            out += f", base {self.quantize} group {group}"
        return out

    def infer_flags(self) -> str:
        """runners.infer's flags for the base these adapters were trained over: a QLoRA
        adapter's base is the quantized one (the same cached blocks)."""
        if not self.quantize:
            return ""
        a = self.args
        group = "channel" if a.group_size == PER_CHANNEL else a.group_size
        return (f" --quantize {self.quantize}" + (f" --group-size {group}" if a.group_size else "")
                + (f" --offload-dir {qlora.cache_root(a.cache_dir)}" if a.cache_dir else "")
                + (f" --init-seed {a.seed}" if not os.path.exists(a.model) else ""))

    # ---- before anything is loaded: the plan and the banner, from the model on meta --------
    def plan_model(self, model_cfg, dtype: torch.dtype) -> nn.Module:
        """The base as it will train, on meta: in the compute dtype (a quantized base's norms
        are stored so), its projections quantized for QLoRA."""
        from offload.models import build_model

        model = build_model(model_cfg, "meta", dtype)
        if self.quantize:
            from offload.models.quantized import quantize_layers
            quantize_layers(model, qlora.plan_specs(self.args, model_cfg), dtype)
        return model

    def adapter_blocks(self, model: nn.Module) -> list[tuple[int, bool]]:
        """(adapter elements, True) for each layer apply_lora will give adapters: r x (in + out)
        per targeted projection. Counted on the meta model without building the adapters (a
        70B dry run at rank 64 would otherwise allocate 3 GB of them)."""
        from offload.memory.blocks import find_block_list

        found = find_block_list(model)
        layers = found[1] if found is not None else []
        sizes = [sum(self.cfg.rank * (m.in_features + m.out_features)
                     for name, m in layer.named_modules()
                     if name.rpartition(".")[2] in self.cfg.targets) for layer in layers]
        if not any(sizes):
            fail(f"--lora-targets {','.join(self.cfg.targets)}: this model's layers have no such "
                 f"projection")
        return [(n, True) for n in sizes if n]

    def frozen_plan_bytes(self, model: nn.Module, dtype: torch.dtype) -> tuple[list[int], int]:
        """(bytes of each layer's base, bytes of the base outside the layers), as the engine
        counts them (train/build.py plan_model): 16-bit in the compute dtype, a quantized base's
        layers as stored. The meta model is frozen here as apply_lora freezes the real one (it
        serves only the plan and the banner)."""
        from offload.memory.blocks import find_block_list, frozen_bytes

        model.requires_grad_(False)
        found = find_block_list(model)
        return frozen_bytes(model, found[0] if found is not None else None, dtype,
                            own_dtypes=self.quantize is not None)

    @staticmethod
    def dense_transient_bytes(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
        """The largest dense weight one quantized projection of `model` (on meta) dequantizes
        to compute in training (offload/quant/matmul.py _DenseProduct: in forward, recompute
        and backward, one at a time; float32 on the CPU, the compute dtype on a GPU): the
        plan's transient (review 2 P4)."""
        itemsize = 4 if device.type == "cpu" else dtype.itemsize
        return max((m.out_features * m.in_features * itemsize for m in model.modules()
                    if hasattr(m, "part_names")), default=0)

    def candidates(self, world: int) -> list[tuple[str, dict]]:
        """--offload auto's configurations: the planner's frozen-base list (the same on any
        number of ranks: each streams the whole base from its own tier)."""
        from offload.train.plan import FROZEN_BASE_CANDIDATES

        return list(FROZEN_BASE_CANDIDATES)

    def describe(self, model_cfg, adapters: list[tuple[int, bool]],
                 frozen: tuple[list[int], int], cfg) -> str:
        """The banner's line: the adapters, trainable parameters against the total (the
        model's own count: a quantized base's packed codes are not its parameters), the base
        and where it lives."""
        from offload.models import num_params

        c, trainable, base = self.cfg, sum(n for n, _ in adapters), num_params(model_cfg)
        short = ",".join(t.removesuffix("_proj") for t in c.targets)
        layers, rest = sum(frozen[0]), frozen[1]
        kind = f"{self.quantize} blocks" if self.quantize else cfg.dtype
        if cfg.offload_params == "none":
            where = f"the frozen base ({format_bytes(layers + rest)} in {kind}) stays on the device"
        else:
            home = ("host RAM" if cfg.offload_params == "cpu" else
                    "its block files" if self.quantize else "NVMe swap files")
            rest_where = ("is mapped from its swap files"
                          if maps_frozen_rest(cfg.offload_params, cfg.resolve_device())
                          else "stays on the device")
            where = (f"the frozen base's layers ({format_bytes(layers)} in {kind}) stream from "
                     f"{home} one layer ahead, the rest ({format_bytes(rest)}) {rest_where}")
        return (f"  lora      rank {c.rank}, alpha {c.alpha:g} (scaling {c.scaling:g}), dropout "
                f"{c.dropout:g} on {short}: {trainable / 1e6:.3f}M trainable parameters of "
                f"{(base + trainable) / 1e6:.2f}M ({100 * trainable / (base + trainable):.2f}%); "
                f"{where}" + ("; --merge exports the merged model" if self.merge else ""))

    def budget_advice(self, cfg, frozen: tuple[list[int], int]) -> str:
        """What a refused plan's message adds: what of the device the frozen base takes and
        how to move it (the library's advice is about optimizer state)."""
        if cfg.offload_params == "none":
            return (f"of that, the frozen LoRA base takes {format_bytes(sum(frozen[0]) + frozen[1])}: "
                    f"stream it with --offload-params cpu (or nvme), or quantize it "
                    f"(--quantize int4 --offload-params cpu), or --offload auto")
        return (f"of that, the base's embeddings and head take {format_bytes(frozen[1])}: a smaller "
                f"--micro-batch-size or --seq-len, --activation-checkpointing, or --offload auto")

    def methods_table(self, model_cfg, cfg) -> str:
        """The dry run's full / LoRA / QLoRA table (offload/train/lora_plan.py) for these settings."""
        from offload.train.lora_plan import format_methods, plan_methods

        rows = plan_methods(model_cfg, cfg, self.cfg, quantize=self.quantize or "int4",
                            group_size=self.args.group_size)
        return ("methods (these settings, planned on meta; model states, no activations):\n"
                + format_methods(rows))

    # ---- the model ---------------------------------------------------------------------------
    def build(self, model_cfg, source, device: torch.device, dtype: torch.dtype,
              offload_params: str = "none", ranks=None) -> tuple[nn.Module, "RecordingSource"]:
        """(the model, the source to initialise the engine with): the base on meta but for the
        embeddings, final norm and head (on the device; a tied head is re-tied to its
        embedding, which the engine's fill of one parameter would not do), the adapters added.
        QLoRA: the base quantized into the cache first (once)."""
        from offload.models import build_model
        from offload.models.llama import materialize_non_block

        if self.quantize:
            from offload.models.quantized import QuantizedSource, quantize_layers
            # torchrun: each machine's local rank 0 converts (once, into the shared cache) while
            # the others wait, then they find the finished conversion and reuse it
            first = ranks is None or not ranks.many or ranks.local == 0
            if not first:  # a long wait (minutes for a large base): review 2 P3
                ranks.long_barrier()
            reader, self.blocks = qlora.convert(self.args, model_cfg, source,
                                                qlora.cache_root(self.args.cache_dir), dtype)
            if first and ranks is not None and ranks.many:
                ranks.long_barrier()
            source = QuantizedSource(reader, self.blocks)
        self.source = RecordingSource(source)
        model = build_model(model_cfg, "meta", dtype)
        if self.blocks is not None:
            quantize_layers(model, self.blocks.specs, dtype)
        if not maps_frozen_rest(offload_params, device):
            materialize_non_block(model, device, dtype, self.source)
        # else the engine writes them into the swap directory one at a time and maps them there
        # (offload/memory/mapped.py): they are never resident, not even while the engine starts
        apply_lora(model, self.cfg, seed=self.seed)
        self.frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
        return model, self.source

    def take_fingerprint(self, trainer: dict, resume: str | None) -> None:
        """Once the engine has read the base: its fingerprint; a resume must re-read the base
        the adapters were trained on."""
        blocks = qlora.blocks_digest(self.blocks) if self.blocks is not None else None
        self.base_fingerprint = self.source.fingerprint(self.frozen_names, blocks)
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

    def merged_params(self, model_cfg, masters: dict[str, torch.Tensor],
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged model, (checkpoint name, tensor) in checkpoint order, one tensor at a
        time: each base tensor read again in `dtype` from the source (a QLoRA projection
        dequantized from its block), its adapter's B @ A * alpha / r (from the fp32 masters)
        added in place as merge_lora adds it. No tier holds the base whole for this."""
        from offload.models import parameter_shapes

        fill = self.source.fill  # the plain read: the fingerprint is taken already
        layers = qlora.DequantizedLayers(self.blocks, model_cfg) if self.blocks is not None else None
        try:
            for name, shape in parameter_shapes(model_cfg).items():
                t = layers.read(name, dtype) if layers is not None else None
                if t is None:
                    t = torch.empty(shape, dtype=dtype)
                    fill({name: t})
                module = name.removesuffix(".weight")
                a = masters.get(f"{module}.lora_A.weight")
                if a is not None:  # PEFT's get_delta_weight, fp32 adapters: (B @ A) * scaling
                    b = masters[f"{module}.lora_B.weight"]
                    t += (b.to("cpu", torch.float32) @ a.to("cpu", torch.float32)) * self.cfg.scaling
                yield name, t
        finally:
            if layers is not None:
                layers.close()


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


def bits_total(t: torch.Tensor) -> int:
    """A tensor's bits summed as integers (exact, the same on every device) a chunk at a time,
    each chunk's sum weighted by its position: no copy of the whole tensor."""
    flat = t.detach().reshape(-1)
    bits = flat.view(BITS_OF[flat.element_size()]) if flat.is_floating_point() else flat
    return sum((k + 1) * int(chunk.sum(dtype=torch.int64))
               for k, chunk in enumerate(bits.split(CHUNK_ELEMENTS)))


class RecordingSource:
    """The base's source (a checkpoint reader, a seeded init, a QuantizedSource) as the engine
    reads it: every tensor filled through read_tensors_into leaves its fingerprint term (name,
    dtype, shape, bits_total), so the base is fingerprinted without a read of its own, in
    whatever tier and order the engine fills it. layer_ranges is passed on when the source has
    it (the engine streams a quantized base from its files by it)."""

    def __init__(self, source):
        self.fill = getattr(source, "read_tensors_into", source)
        self.terms: dict[str, str] = {}
        if hasattr(source, "layer_ranges"):
            self.layer_ranges = source.layer_ranges

    def read_tensors_into(self, tensors: dict[str, torch.Tensor]) -> None:
        self.fill(tensors)
        for name, t in tensors.items():
            self.terms[name] = f"{t.dtype}:{list(t.shape)}:{bits_total(t)}"

    def fingerprint(self, frozen_names: list[str], blocks_digest: str | None = None) -> str:
        """A digest of every frozen parameter's name (the model's), dtype, shape and bits, in
        model order -- the same digest as the materialised base's parameters give -- and, for
        a quantized base (whose layers never pass through here), its blocks' digest."""
        digest = hashlib.blake2b(digest_size=12)
        for name in frozen_names:
            term = self.terms.get(base_checkpoint_name(name))
            if term is not None:
                digest.update(f"{name}:{term};".encode())
            elif blocks_digest is None or not name.startswith("model.layers."):
                raise RuntimeError(f"the frozen parameter {name!r} was never read from the source")
        if blocks_digest is not None:
            digest.update(f"quantized layers:{blocks_digest};".encode())
        return digest.hexdigest()
