"""A LoRA model's frozen base streamed through training (offload_params with adapters).

With LoRA (offload/lora.py) every decoder layer holds a large frozen base and small trainable
adapters. The engine trains the adapters as resident blocks; the base is what must not sit on
the device: each layer's frozen parameters are streamed in just before the layer runs, in
forward, in the recompute of activation checkpointing and in backward, exactly as
TrainingStreamer streams trainable weights (the same hooks: train_stream.BlockHooks), with
two differences:

  * nothing is written back: the base never changes, so its home (a host buffer in the compute
    dtype, or one swap file per layer written once at start) is read-only for the whole run and
    the schedule needs no step between a backward and the next forward;
  * only parameters that need no gradient are in the streamed block (TrainingHomes'
    `frozen_only`); the adapters beside them keep their own storage and stay bound.

Autograd still saves views of the base weights in forward (`linear` saves W for the input
gradient); BlockHooks' saved-tensor hooks turn those into slot references rebuilt in backward.
No gradient, master or moment ever exists for the base (the engine's blocks hold trainable
parameters only), and the training plan counts the base's home and slots
(offload/train/plan.py, `frozen_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nvme.io import CHECKSUM
from offload.memory.layout import StreamError, TensorRange, streamed_params
from offload.memory.blocks import TensorFill
from offload.stream.streamer import TrainingHomes
from offload.memory.tiers import MemoryAccount, host_empty
from offload.stream.train import BlockHooks, StreamSettings

FROZEN = "frozen16"  # swap-store kind of a layer's frozen base weights


def frozen_layer_numels(layers: nn.ModuleList) -> list[int]:
    """Elements of each layer's frozen parameters (what FrozenBaseStreamer streams)."""
    return [sum(p.numel() for p in streamed_params(layer, frozen_only=True).values())
            for layer in layers]


@dataclass(frozen=True)
class FilledBase:
    """A 16-bit base, copied into its home at start: parameters still on the meta device are
    filled by `source` (a checkpoint reader's read_tensors_into, a seeded initialiser), one layer
    at a time, by their names `prefix + "<layer>.<name in the layer>"`: a base larger than RAM
    never sits there."""
    source: TensorFill | None = None
    prefix: str = ""


@dataclass(frozen=True)
class StoredBase:
    """A base already stored (QLoRA: offload/models/quantized.py's block files): each layer's
    raw byte ranges, named by `checkpoint_name(parameter name)`, streamed as a byte block exactly
    as inference streams it; nothing is copied or written at start."""
    files: list[list[TensorRange]]
    checkpoint_name: Callable[[str], str] = lambda name: name


class FrozenBaseStreamer(BlockHooks):
    """Streams the frozen parameters of `layers` from `settings.tier` ("cpu": host buffers,
    "nvme": one swap file per layer in `store`) through forward and backward; see the module
    docstring."""

    def __init__(self, layers: nn.ModuleList, settings: StreamSettings, *, store,
                 account: MemoryAccount, base: FilledBase | StoredBase):
        tier = settings.tier
        if tier not in ("cpu", "nvme") and not (tier == "device" and isinstance(base, StoredBase)):
            raise StreamError(f"a frozen base streams from cpu or nvme, not {tier!r} (a 16-bit base "
                              f"on the device is placed with the model's other frozen parameters)")
        self.layers, self.tier, self.store = layers, tier, store
        if isinstance(base, StoredBase):
            self._start_byte_blocks(settings, base, account)
        else:
            self._start_filled(settings, base, account)
        self._install_hooks()

    def _start_filled(self, settings: StreamSettings, base: FilledBase,
                      account: MemoryAccount) -> None:
        """Each layer's frozen parameters copied into one flat home in the compute dtype (a host
        buffer, or its swap file written once), one layer's base in RAM at a time."""
        tier, dtype, store = settings.tier, settings.dtype, self.store
        host_flats: list[torch.Tensor | None] = [None] * len(self.layers)
        files: list[list[TensorRange]] | None = [] if tier == "nvme" else None
        for li, layer in enumerate(self.layers):  # one layer's base in RAM at a time
            params = streamed_params(layer, frozen_only=True)
            if not params:
                raise StreamError(f"layer {li} has no frozen parameters to stream")
            quantized = [name for name, p in params.items() if not p.is_floating_point()]
            if quantized:
                raise StreamError(f"layer {li}: frozen parameter {quantized[0]!r} is quantized; a "
                                  f"quantized base (QLoRA) is not streamed in training yet: keep "
                                  f"it resident (offload_params='none')")
            numel = sum(p.numel() for p in params.values())
            flat = host_empty(numel, dtype, pin=settings.pin and tier == "cpu")  # module order
            pos, missing = 0, {}
            for rel, p in params.items():
                view = flat[pos:pos + p.numel()].view(p.shape)
                if p.device.type == "meta":
                    missing[f"{base.prefix}{li}.{rel}"] = view
                else:
                    view.copy_(p.detach())
                pos += p.numel()
            if missing:
                if base.source is None:
                    raise StreamError(f"layer {li}: frozen parameter {next(iter(missing))!r} is on "
                                      f"the meta device and no source was given; pass source= or "
                                      f"load the base weights before initialising the engine")
                base.source(missing)
            if tier == "cpu":
                host_flats[li] = flat
                account.add("host", "weights", flat.numel() * flat.element_size())
            else:
                store.write(self._name(li), flat).wait()
                files.append(self._ranges(li, params))
                account.add("nvme", "weights", flat.numel() * flat.element_size())
                del flat
        self._open_streamer(settings, files, TrainingHomes(
            host_flats=host_flats, expected_crc32=self._expected_crc32, frozen_only=True),
            io=store.engine if store is not None else None)
        account.add("device", "weights", sum(s.raw.numel() for s in self.streamer.slots))
        account.add("host", "buffers", sum(s.raw.numel() for s in self.streamer.staging))

    def _start_byte_blocks(self, settings: StreamSettings, base: StoredBase,
                           account: MemoryAccount) -> None:
        """The base is in files already (a quantized base): each layer's frozen parameters are
        mapped onto their stored ranges and streamed as one byte block, every parameter in its
        own dtype (codes, fp16 scales, norms). Tier "device": each block is read onto the
        device once and stays there (inference's residency "device"); the hooks then bind the
        same buffer at every use."""
        tier, renamed = settings.tier, []
        for li, layer in enumerate(self.layers):
            stored = {r.name: r for r in base.files[li]}
            ranges = []
            for rel in streamed_params(layer, frozen_only=True):
                r = stored.get(base.checkpoint_name(rel))
                if r is None:
                    raise StreamError(f"layer {li}: the stored base has no "
                                      f"{base.checkpoint_name(rel)!r}")
                # the CRC the block file carries goes with it: every read of the base is checked
                ranges.append(TensorRange(rel, r.path, r.offset, r.nbytes, r.dtype, r.checksum))
            renamed.append(ranges)
            nbytes = sum(r.nbytes for r in ranges)
            if tier == "device":  # loaded once, kept: counted like the other frozen weights there
                account.add("device", "frozen", nbytes)
            else:
                account.add("nvme" if tier == "nvme" else "host", "weights", nbytes)
        self._open_streamer(settings, renamed, TrainingHomes(frozen_only=True), dtype=torch.uint8)
        for tier_kind, nbytes in ((("device", "weights"), sum(s.raw.numel() for s in self.streamer.slots)),
                                  (("host", "buffers"), sum(s.raw.numel() for s in self.streamer.staging))):
            if nbytes:
                account.add(*tier_kind, nbytes)

    def _name(self, li: int) -> str:
        return f"layer{li}.{FROZEN}"

    def _ranges(self, li: int, params: dict[str, nn.Parameter]) -> list[TensorRange]:
        """Layer li's frozen parameters as byte ranges of its swap file (module order)."""
        entry = self.store.info(self._name(li))
        path = f"{self.store.dir}/{entry.file}"
        ranges, pos = [], 0
        for rel, p in params.items():
            nbytes = p.numel() * entry.dtype.itemsize
            ranges.append(TensorRange(rel, path, entry.offset + pos, nbytes, entry.dtype))
            pos += nbytes
        return ranges

    def _expected_crc32(self, li: int) -> int | None:
        """The CRC the store recorded when it wrote layer li's base (written once, never again)."""
        if self.store is None or self.store.verify == "never":
            return None
        entry = self.store.info(self._name(li))
        return entry.crc32 if entry.checksum == CHECKSUM else None
