"""A KV cache that lives in host RAM and visits the device one layer at a time (throughput mode).

A large batch's KV cache outgrows the device long before its weights do (70B, batch 64, 4096
positions: 80 GB of fp16 keys and values). FlexGen and ZeRO-Inference keep it in host RAM and
bring each layer's part to the device just before the layer runs. `OffloadedKVCache` does that
with the `KVCache` interface the model already calls (`layer(i)` before layer i runs), plus
`written(i, start, end)` after it:

  * host: per layer, keys and values [max_len, B, kv_heads, D] -- position-major, so the
    positions a step reads ([:start]) and writes ([start:end]) are each one contiguous range,
    one DMA each way (pinned under CUDA);
  * device: `ahead + 1` slot pairs of the same shape, a ring (layer i uses slot i % slots);
    `layer(i)` returns the slot as [B, kv_heads, max_len, D] views (permuted, D still
    innermost), the layout attention indexes.

Ordering on CUDA (not yet verified on a GPU; the CPU path runs the same calls in order):
  * every copy runs on one side `copy_stream`;
  * the copy of layer j's past positions into its slot waits on the slot's `free` event,
    recorded on the copy stream after the write-back of the slot's previous layer -- which
    itself waited for that layer's compute -- so a slot is never overwritten while read;
  * `layer(i)` makes the compute stream wait on slot i's `ready` event (GPU-side, the host
    does not block) and issues the copy of layer i + ahead, which so overlaps layer i's compute;
  * `written(i, ...)` records an event on the compute stream and has the copy stream wait on
    it before copying the new positions back to the host. Only `sync()` (before the host reads
    the cache, e.g. a test) waits on the host.
On a CPU device the "device" slots are host tensors too and the copies are plain: the path
exists to be tested (the tokens must not change), not to save memory.
"""

from __future__ import annotations

import math

import torch

from offload.gpu import on_stream
from offload.memory.tiers import host_zeros
from offload.models.config import ModelConfig


def offloaded_kv_device_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype,
                              ahead: int = 1) -> int:
    """Device bytes of an OffloadedKVCache: `ahead + 1` layers' keys and values."""
    per_position = sum(heads * width for heads, width in cfg.kv_cache_widths())
    per_layer = batch_size * max_len * per_position * dtype.itemsize
    return (ahead + 1) * per_layer


class OffloadedKVCache:
    """Keys and values in host RAM, each layer's brought to a device slot before it runs."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *,
                 device: torch.device | str, dtype: torch.dtype, ahead: int = 1,
                 pin: bool | None = None):
        """`pin`: the host tensors page-locked (default: on a CUDA device, where the copies need
        it to run asynchronously)."""
        if ahead < 1:
            raise ValueError("ahead must be >= 1")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.layers = cfg.num_hidden_layers
        # position-major; MLA's keys and values are its latent and rotated key (config.kv_cache_widths)
        shapes = [(max_len, batch_size, heads, width) for heads, width in cfg.kv_cache_widths()]
        # zeros, not empty: a NaN in a never-written position would survive a 0 attention weight
        pin = self.cuda if pin is None else pin
        self.host = [self._host_layer(shapes, dtype, pin) for _ in range(self.layers)]
        self.slots = [tuple(torch.zeros(s, dtype=dtype, device=self.device) for s in shapes)
                      for _ in range(min(ahead + 1, self.layers))]
        self.ahead = len(self.slots) - 1
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [torch.cuda.Event() for _ in self.slots] if self.cuda else []
        self._free = [torch.cuda.Event() for _ in self.slots] if self.cuda else []
        self._free_recorded = [False] * len(self.slots)
        self._issued: set[int] = set()  # layers whose past positions are on their way this forward
        self.h2d_bytes = 0  # counters for the report: past positions in, new positions out
        self.d2h_bytes = 0

    def _host_layer(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                    pin: bool) -> tuple[torch.Tensor, ...]:
        """One layer's host tensors, views of one buffer: pinned under the process's cap (the
        pinned allocator's rounded size counted), pageable with a warning past it or when
        pinning fails (offload/memory/tiers.py pinned_or_pageable; review 2 P10). The
        inference plan counts one rounded buffer per layer (offload/infer/plan.py kv_host)."""
        sizes = [math.prod(s) for s in shapes]
        flat = host_zeros(sum(sizes), dtype, pin)
        return tuple(part.view(s) for part, s in zip(flat.split(sizes), shapes))

    # ---- the KVCache interface -----------------------------------------------------------------
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values on the device, [B, kv_heads, max_len, D], filled up to
        `length`; issues the copy of layer i + ahead so it overlaps this layer's compute."""
        if i == 0:
            self._issued.clear()
        for j in range(i, min(i + self.ahead, self.layers - 1) + 1):
            if j not in self._issued:
                self._bring(j)
        s = i % len(self.slots)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[s])
        k, v = self.slots[s]
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def written(self, i: int, start: int, end: int) -> None:
        """Layer i wrote positions [start, end) into its slot: copy them to the host."""
        s = i % len(self.slots)
        (hk, hv), (dk, dv) = self.host[i], self.slots[s]
        if self.cuda:
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.device))
            with on_stream(self.copy_stream):
                self.copy_stream.wait_event(computed)  # the layer's kernels wrote them first
                hk[start:end].copy_(dk[start:end], non_blocking=True)
                hv[start:end].copy_(dv[start:end], non_blocking=True)
                self._free[s].record(self.copy_stream)  # the slot may be refilled after this
            self._free_recorded[s] = True
        else:
            hk[start:end].copy_(dk[start:end])
            hv[start:end].copy_(dv[start:end])
        self.d2h_bytes += (hk[start:end].numel() + hv[start:end].numel()) * hk.element_size()

    def _bring(self, j: int) -> None:
        """Copy layer j's filled positions into its slot (the new ones are written there by the
        layer itself)."""
        self._issued.add(j)
        s = j % len(self.slots)
        (hk, hv), (dk, dv) = self.host[j], self.slots[s]
        n = self.length
        if self.cuda:
            with on_stream(self.copy_stream):
                if self._free_recorded[s]:
                    self.copy_stream.wait_event(self._free[s])  # the previous layer's write-back
                if n:
                    dk[:n].copy_(hk[:n], non_blocking=True)
                    dv[:n].copy_(hv[:n], non_blocking=True)
                self._ready[s].record(self.copy_stream)
        elif n:
            dk[:n].copy_(hk[:n])
            dv[:n].copy_(hv[:n])
        self.h2d_bytes += (hk[:n].numel() + hv[:n].numel()) * hk.element_size()

    def reset(self) -> None:
        self.length = 0

    def sync(self) -> None:
        """Wait on the host for every copy issued (before the host reads `host`)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    @property
    def nbytes(self) -> int:
        """Host bytes (the whole cache)."""
        return sum(t.numel() * t.element_size() for pair in self.host for t in pair)

    @property
    def device_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.slots for t in pair)
