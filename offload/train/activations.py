"""Activation checkpointing per block, optionally with the checkpointed inputs offloaded to host
memory.

Each entry of the model's block list keeps only its inputs during forward; backward runs the
block's forward again from them and back-propagates through that recomputation. Activation
memory is one block's internals plus one hidden-state tensor per block, instead of every
block's internals — the trade is one extra forward of compute.

The checkpoint is our own autograd Function (not torch.utils.checkpoint) because it must own
where the saved input lives: with `offload_activations` the inputs that carry gradient (the
hidden states) are copied to host memory in forward (pinned, on a side stream, under CUDA) and
dropped from the device; in backward, when block i's backward begins, its input is brought back
and block i-1's is already requested, so the copy overlaps block i's recompute.

Recomputation runs the same kernels on the same inputs with the same RNG state (saved at
forward), so results are bit-identical to the plain path. The block's forward is called
directly (not through `module(...)`), so module hooks — the weight streamer's — run once per
forward, not again in the recompute; the streamer binds the block's weights before its
backward starts (see offload/stream/train.py).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import torch
from torch import nn

from offload.gpu import on_stream, side_stream_delay
from offload.memory.tiers import host_empty


class ActivationStore:
    """Host copies of checkpointed block inputs, brought back to the device ahead of use."""

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin and device.type == "cuda"
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # keys are (layer index, position among the block's tensor inputs)
        self._host: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}  # -> (host copy, copied)
        self._back: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}  # -> (device copy, ready)
        self.offloaded_bytes = 0  # total bytes sent to the host
        self.held_bytes = 0  # host bytes held right now

    def put(self, key: tuple[int, int], t: torch.Tensor) -> None:
        # pinned under the process's cap, pageable beyond it (offload/memory/tiers.py)
        host = host_empty(t.numel(), t.dtype, self.pin).view(t.shape)
        if self.cuda:
            # the copy may only start once the kernels that produced `t` are done: the side
            # stream waits on the compute stream (GPU-side), and `t` is kept alive for it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with on_stream(self.stream):
                side_stream_delay(self.stream)  # test knob (offload/gpu.py): a late copy
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
                ev = torch.cuda.Event()
                ev.record(self.stream)
        else:
            host.copy_(t)
            ev = None
        self._host[key] = (host, ev)
        n = t.numel() * t.element_size()
        self.offloaded_bytes += n
        self.held_bytes += n

    def prefetch_layer(self, layer: int) -> None:
        """Start bringing back every offloaded input of block `layer`."""
        for key in [k for k in self._host if k[0] == layer]:
            self.prefetch(key)

    def prefetch(self, key: tuple[int, int]) -> None:
        """Start bringing `key` back to the device (no-op if absent or already requested)."""
        if key in self._back or key not in self._host:
            return
        host, copied = self._host.pop(key)
        self.held_bytes -= host.numel() * host.element_size()
        if self.cuda:
            with on_stream(self.stream):
                if copied is not None:
                    self.stream.wait_event(copied)  # the D2H copy into `host` is finished
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self._back[key] = (dev, ev)
        else:
            self._back[key] = (host.to(self.device, copy=True), None)

    def take(self, key: tuple[int, int]) -> torch.Tensor:
        self.prefetch(key)
        dev, ready = self._back.pop(key)
        if ready is not None:
            # compute waits for the copy on the GPU; the tensor was allocated on the side
            # stream, so tell the allocator the compute stream uses it now
            torch.cuda.current_stream(self.device).wait_event(ready)
            dev.record_stream(torch.cuda.current_stream(self.device))
        return dev

    def clear(self) -> None:
        self._host.clear()
        self._back.clear()
        self.held_bytes = 0


class _Checkpoint(torch.autograd.Function):
    """forward: run the block without keeping its graph; keep its inputs (maybe on the host).
    backward: restore the inputs, rerun the block with grad, back-propagate through it."""

    @staticmethod
    def forward(ctx, spec: "_Spec", *inputs: torch.Tensor):
        # inputs past spec.n_tensors are trainable parameters passed only so that autograd
        # records this node: see enable_activation_checkpointing
        tensors = inputs[:spec.n_tensors]
        spec.n_extra = len(inputs) - spec.n_tensors
        ctx.spec = spec
        spec.rng_cpu = torch.get_rng_state()
        spec.rng_cuda = (torch.cuda.get_rng_state(spec.device)
                         if spec.device.type == "cuda" else None)
        with torch.no_grad():
            out = spec.run(tensors)
        kept = []
        for k, t in enumerate(tensors):
            if spec.store is not None and t.requires_grad and t.is_floating_point():
                spec.store.put(spec.key(k), t.detach())
                kept.append(None)  # on the host now: the device copy can go
            else:
                kept.append(t.detach())
        spec.kept = kept
        # The spec (held by ctx until this block's backward) must not keep the inputs alive
        # through its args/kwargs: an offloaded input would stay on the device beside its host
        # copy and the option would free nothing (desk review H2). run() puts the tensors back
        # by position from what backward passes it.
        spec.drop_tensors()
        spec.needs_grad = [t.requires_grad for t in tensors]
        spec.single = torch.is_tensor(out)
        outs = (out,) if spec.single else tuple(out)
        return outs if not spec.single else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        spec: _Spec = ctx.spec
        inputs = []
        for k, t in enumerate(spec.kept):
            if t is None:
                t = spec.store.take(spec.key(k))
            inputs.append(t.detach().requires_grad_(spec.needs_grad[k]))
        spec.kept = None
        with torch.random.fork_rng(devices=[spec.device] if spec.rng_cuda is not None else []):
            torch.set_rng_state(spec.rng_cpu)
            if spec.rng_cuda is not None:
                torch.cuda.set_rng_state(spec.rng_cuda, spec.device)
            with torch.enable_grad():
                out = spec.run(tuple(inputs))
        outs = (out,) if torch.is_tensor(out) else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *[x.grad if need else None for x, need in zip(inputs, spec.needs_grad)],
                *[None] * spec.n_extra)  # the parameters' gradients came from the rerun


class _Spec:
    """How to call one block with a given set of tensor inputs (non-tensors kept aside)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, layer_id: int,
                 store: ActivationStore | None, device: torch.device):
        self.fn, self.layer_id, self.store, self.device = fn, layer_id, store, device
        self.slots: list[tuple[str, Any]] = []  # ("a", index) / ("k", key) of each tensor
        for i, a in enumerate(args):
            if torch.is_tensor(a):
                self.slots.append(("a", i))
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                self.slots.append(("k", k))
        self.args, self.kwargs = list(args), dict(kwargs)
        self.n_tensors = len(self.slots)
        self.n_extra = 0

    def drop_tensors(self) -> None:
        for kind, i in self.slots:
            if kind == "a":
                self.args[i] = None
            else:
                self.kwargs[i] = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.args[i] if kind == "a" else self.kwargs[i] for kind, i in self.slots)

    def run(self, tensors: tuple[torch.Tensor, ...]):
        args, kwargs = list(self.args), dict(self.kwargs)
        for (kind, i), t in zip(self.slots, tensors):
            if kind == "a":
                args[i] = t
            else:
                kwargs[i] = t
        return self.fn(*args, **kwargs)

    def key(self, k: int) -> tuple[int, int]:
        return (self.layer_id, k)


def enable_activation_checkpointing(layers: nn.ModuleList, store: ActivationStore | None = None,
                                    device: torch.device | None = None) -> int:
    """Wrap every block's forward in a checkpoint (idempotent); with `store`, the inputs that
    carry gradient are kept in host memory. Returns how many blocks were wrapped. With grad
    disabled (inference, evaluation) the plain forward runs: nothing to recompute. Everything
    installed here is removed by disable_activation_checkpointing."""
    wrapped = 0
    device = device or next((p.device for p in layers.parameters()), torch.device("cpu"))
    for li, layer in enumerate(layers):
        if getattr(layer, "_offload_checkpointed", False):
            continue
        plain = layer.forward

        @functools.wraps(plain)
        def forward(*args, _plain=plain, _li=li, _layer=layer, **kwargs):
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            spec = _Spec(_plain, args, kwargs, _li, store, device)
            tensors = spec.tensors()
            # A block whose inputs need no gradient (LoRA: the embeddings are frozen) but whose
            # own parameters do: autograd records a Function only if one of its inputs requires
            # grad, so without one the adapters inside would never get a gradient. One
            # trainable parameter is passed along (never kept: it may be a view of a streamed
            # slot); the rerun in backward accumulates every parameter's gradient as usual.
            extra = () if any(t.requires_grad for t in tensors) else tuple(
                p for p in itertools.islice((p for p in _layer.parameters() if p.requires_grad), 1))
            return _Checkpoint.apply(spec, *tensors, *extra)

        layer.forward = forward
        layer._offload_checkpointed = True
        # the prefetch hook's handle lives on the block, so disabling removes it too
        layer._offload_prefetch_hook = (layer.register_forward_hook(
            functools.partial(_after_forward, store=store, li=li)) if store is not None else None)
        wrapped += 1
    return wrapped


def _after_forward(module, args, out, store: ActivationStore, li: int) -> None:
    """When block li's backward starts (its output's gradient is ready), request the offloaded
    inputs of blocks li and li-1, so li-1's copy runs during li's recompute and backward."""
    y = out if torch.is_tensor(out) else next((o for o in out if torch.is_tensor(o)), None)
    if y is None or not y.requires_grad:
        return

    def on_grad(g):
        for j in (li, li - 1):
            if j >= 0:
                store.prefetch_layer(j)
    y.register_hook(on_grad)


def disable_activation_checkpointing(layers: nn.ModuleList) -> None:
    """Undo enable_activation_checkpointing: the class's forward back, the prefetch hooks gone."""
    for layer in layers:
        if getattr(layer, "_offload_checkpointed", False):
            del layer.forward  # drop the instance attribute: the class's forward is back
            del layer._offload_checkpointed
            hook = layer.__dict__.pop("_offload_prefetch_hook", None)
            if hook is not None:
                hook.remove()
