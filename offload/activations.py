"""Activation checkpointing per block.

Each entry of the model's block list keeps only its input during forward; backward runs the
block's forward again to rebuild the activations it needs. Activation memory then grows with
one block's internals plus one hidden-state tensor per block, instead of every block's
internals — the trade is one extra forward of compute.

torch.utils.checkpoint with use_reentrant=False is used: it works with keyword arguments,
with inputs that do not require grad, and with post-accumulate-grad hooks (the engine's
gradient offload), and recomputation runs the same kernels so results are bit-identical.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def enable_activation_checkpointing(layers: nn.ModuleList) -> int:
    """Wrap every block's forward in a checkpoint (idempotent). Returns how many were wrapped.
    Inference (grad disabled) calls the plain forward: nothing to recompute."""
    wrapped = 0
    for layer in layers:
        if getattr(layer, "_offload_checkpointed", False):
            continue
        plain = layer.forward

        @functools.wraps(plain)
        def forward(*args, _plain=plain, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_plain, *args, use_reentrant=False, **kwargs)
            return _plain(*args, **kwargs)

        layer.forward = forward
        layer._offload_checkpointed = True
        wrapped += 1
    return wrapped


def disable_activation_checkpointing(layers: nn.ModuleList) -> None:
    for layer in layers:
        if getattr(layer, "_offload_checkpointed", False):
            del layer.forward  # drop the instance attribute: the class's forward is back
            layer._offload_checkpointed = False
