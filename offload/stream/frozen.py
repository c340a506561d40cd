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
  * only parameters that need no gradient are in the streamed block (BlockStreamer's
    `frozen_only`); the adapters beside them keep their own storage and stay bound.

Autograd still saves views of the base weights in forward (`linear` saves W for the input
gradient); BlockHooks' saved-tensor hooks turn those into slot references rebuilt in backward.
No gradient, master or moment ever exists for the base (the engine's blocks hold trainable
parameters only), and the training plan counts the base's home and slots
(offload/train/plan.py, `frozen_layers`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nvme.io import CHECKSUM
from offload.memory.layout import StreamError, TensorRange, streamed_params
from offload.memory.blocks import TensorFill
from offload.stream.streamer import BlockStreamer
from offload.memory.tiers import MemoryAccount, host_empty
from offload.stream.train import BlockHooks

FROZEN = "frozen16"  # swap-store kind of a layer's frozen base weights


def frozen_layer_numels(layers: nn.ModuleList) -> list[int]:
    """Elements of each layer's frozen parameters (what FrozenBaseStreamer streams)."""
    return [sum(p.numel() for p in streamed_params(layer, frozen_only=True).values())
            for layer in layers]


class FrozenBaseStreamer(BlockHooks):
    """Streams the frozen parameters of `layers` from `tier` ("cpu": host buffers, "nvme": one
    swap file per layer in `store`) through forward and backward; see the module docstring."""

    def __init__(self, layers: nn.ModuleList, tier: str, *, device: torch.device,
                 dtype: torch.dtype, pin: bool, store, account: MemoryAccount, host_ahead: int,
                 nvme_ahead: int, fetch_delay_s: float = 0.0, source: TensorFill | None = None,
                 prefix: str = "", files: list[list[TensorRange]] | None = None,
                 checkpoint_name: Callable[[str], str] = lambda name: name):
        """`source` fills base parameters still on the meta device (a checkpoint reader's
        read_tensors_into, a seeded initialiser), one layer at a time, by their names
        `prefix + "<layer>.<name in the layer>"`: a base larger than RAM never sits there.
        `files`: each layer's base is already stored, as raw byte ranges named by
        `checkpoint_name(parameter name)` -- a quantized base (QLoRA: offload/models/quantized.py's
        block files), streamed as a byte block exactly as inference streams it; nothing is
        copied or written at start."""
        if tier not in ("cpu", "nvme") and not (tier == "device" and files is not None):
            raise StreamError(f"a frozen base streams from cpu or nvme, not {tier!r} (a 16-bit base "
                              f"on the device is placed with the model's other frozen parameters)")
        self.layers, self.tier, self.store = layers, tier, store
        n = len(layers)
        if files is not None:
            self._start_byte_blocks(layers, tier, device, files, checkpoint_name, host_ahead,
                                    nvme_ahead, pin, fetch_delay_s, account)
            return
        host_flats: list[torch.Tensor | None] = [None] * n
        files: list[list[TensorRange]] | None = [] if tier == "nvme" else None
        for li, layer in enumerate(layers):  # one layer's base in RAM at a time
            params = streamed_params(layer, frozen_only=True)
            if not params:
                raise StreamError(f"layer {li} has no frozen parameters to stream")
            quantized = [name for name, p in params.items() if not p.is_floating_point()]
            if quantized:
                raise StreamError(f"layer {li}: frozen parameter {quantized[0]!r} is quantized; a "
                                  f"quantized base (QLoRA) is not streamed in training yet: keep "
                                  f"it resident (offload_params='none')")
            numel = sum(p.numel() for p in params.values())
            flat = host_empty(numel, dtype, pin=pin and tier == "cpu")  # [numel], module order
            pos, missing = 0, {}
            for rel, p in params.items():
                view = flat[pos:pos + p.numel()].view(p.shape)
                if p.device.type == "meta":
                    missing[f"{prefix}{li}.{rel}"] = view
                else:
                    view.copy_(p.detach())
                pos += p.numel()
            if missing:
                if source is None:
                    raise StreamError(f"layer {li}: frozen parameter {next(iter(missing))!r} is on "
                                      f"the meta device and no source was given; pass source= or "
                                      f"load the base weights before initialising the engine")
                source(missing)
            if tier == "cpu":
                host_flats[li] = flat
                account.add("host", "weights", flat.numel() * flat.element_size())
            else:
                store.write(self._name(li), flat).wait()
                files.append(self._ranges(li, params))
                account.add("nvme", "weights", flat.numel() * flat.element_size())
                del flat
        self.streamer = BlockStreamer(layers, [tier] * n, device=device, dtype=dtype, files=files,
                                      host_ahead=host_ahead, nvme_ahead=nvme_ahead,
                                      io=store.engine if store is not None else None, pin=pin,
                                      zero_copy_host=False, fetch_delay_s=fetch_delay_s,
                                      host_flats=host_flats, expected_crc32=self._expected_crc32,
                                      frozen_only=True)
        account.add("device", "weights", sum(s.raw.numel() for s in self.streamer.slots))
        account.add("host", "buffers", sum(s.raw.numel() for s in self.streamer.staging))
        self._install_hooks()

    def _start_byte_blocks(self, layers, tier, device, files, checkpoint_name, host_ahead,
                           nvme_ahead, pin, fetch_delay_s, account) -> None:
        """The base is in files already (a quantized base): each layer's frozen parameters are
        mapped onto their stored ranges and streamed as one byte block, every parameter in its
        own dtype (codes, fp16 scales, norms). `tier` "device": each block is read onto the
        device once and stays there (inference's residency "device"); the hooks then bind the
        same buffer at every use."""
        renamed = []
        for li, layer in enumerate(layers):
            stored = {r.name: r for r in files[li]}
            ranges = []
            for rel in streamed_params(layer, frozen_only=True):
                r = stored.get(checkpoint_name(rel))
                if r is None:
                    raise StreamError(f"layer {li}: the stored base has no {checkpoint_name(rel)!r}")
                ranges.append(TensorRange(rel, r.path, r.offset, r.nbytes, r.dtype))
            renamed.append(ranges)
            nbytes = sum(r.nbytes for r in ranges)
            if tier == "device":  # loaded once, kept: counted like the other frozen weights there
                account.add("device", "frozen", nbytes)
            else:
                account.add("nvme" if tier == "nvme" else "host", "weights", nbytes)
        self.streamer = BlockStreamer(layers, [tier] * len(layers), device=device,
                                      dtype=torch.uint8, files=renamed, host_ahead=host_ahead,
                                      nvme_ahead=nvme_ahead, pin=pin, zero_copy_host=False,
                                      fetch_delay_s=fetch_delay_s, frozen_only=True)
        for tier_kind, nbytes in ((("device", "weights"), sum(s.raw.numel() for s in self.streamer.slots)),
                                  (("host", "buffers"), sum(s.raw.numel() for s in self.streamer.staging))):
            if nbytes:
                account.add(*tier_kind, nbytes)
        self._install_hooks()

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
