"""The routers' load-balancing loss of training, as transformers computes it.

transformers' Qwen3-MoE, OLMoE, Mixtral and gpt-oss (5.24) add `router_aux_loss_coef x aux` to
the language-model loss when `output_router_logits` is on (the config's value by default), with
`aux = load_balancing_loss_func(every layer's router logits, num_experts, top_k, mask)`: the
Switch Transformer loss E x sum_e f_e x P_e (f_e: the fraction of top-k choices that went to
expert e, P_e: its mean routing probability, both over every layer's tokens). `load_balancing_loss`
is that function with the same operators in the same order (so the same number, to the bit, and
the same gradient: only P_e carries one, into the routers and what feeds them).

`RouterLogits(model)` collects each MoE layer's router logits of a training forward (our
SparseMoE calls `record_logits`); `aux_loss()` takes them once per forward. A forward under
no_grad (evaluation) records nothing. Logits computed without their gradient during a
training forward -- activation checkpointing recomputes each block's forward in backward, so
the first forward's logits carry none -- are refused in one line rather than silently not
trained.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from offload.models.families import ConfigError
from offload.models.moe import SparseMoE


def load_balancing_loss(gate_logits: list[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (5.24): `gate_logits` one [tokens, experts]
    tensor per layer, `attention_mask` [batch, seq] (1 = a real token) or None."""
    device = gate_logits[0].device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total_rows = 0.0
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        routing_weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
        if attention_mask is None:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.histc(
                selected_experts.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts)
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=device
            ).scatter_add_(0, selected_experts.reshape(-1), flat_mask.repeat_interleave(top_k))
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


class RouterLogits:
    """Records every MoE layer's router logits during `model`'s training forwards (installed on
    the model's SparseMoE modules; `close()` removes it). `coef`: the config's
    router_aux_loss_coef (transformers' default for the family when the file has none)."""

    def __init__(self, model: nn.Module):
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        cfg = getattr(model, "config", None)
        if not self.moes or cfg is None:
            raise ConfigError("the router's auxiliary loss needs a mixture-of-experts model of "
                              "offload.models; this model has no MoE layers")
        if cfg.moe_router == "sigmoid_group_topk":
            raise ConfigError("DeepSeek-V3 has no router auxiliary loss in transformers (its balance is "
                              "the routers' correction bias); leave output_router_logits off")
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.coef = float(cfg.to_hf()["router_aux_loss_coef"])
        self._logits: list[torch.Tensor | None] = [None] * len(self.moes)
        self._active = False
        self._no_grad = False
        for i, moe in enumerate(self.moes):
            moe.record_logits = functools.partial(self._record, i)
        self._hook = model.register_forward_pre_hook(self._start)

    def _start(self, module, args) -> None:
        self._active = torch.is_grad_enabled()
        self._no_grad = False
        self._logits = [None] * len(self.moes)

    def _record(self, i: int, logits: torch.Tensor) -> None:
        if not self._active:
            return
        if not torch.is_grad_enabled():
            self._no_grad = True  # a checkpointed block's first forward: recomputed in backward
        self._logits[i] = logits

    def aux_loss(self, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' aux loss of the last training forward (without the coefficient);
        the logits are given up, so each forward's are taken once."""
        logits, self._logits, self._active = self._logits, [None] * len(self.moes), False
        if self._no_grad:
            raise ConfigError("the router's auxiliary loss needs the router logits' gradient, which "
                              "activation checkpointing drops; turn activation checkpointing off or set "
                              "output_router_logits to false")
        if any(t is None for t in logits):
            raise RuntimeError("no router logits of a training forward to take: call aux_loss once "
                               "after each forward with gradients on")
        return load_balancing_loss(logits, self.num_experts, self.top_k, attention_mask)

    def close(self) -> None:
        self._hook.remove()
        for moe in self.moes:
            moe.record_logits = None


def router_logits_for(model: nn.Module) -> RouterLogits | None:
    """A RouterLogits recorder when `model`'s config turns the auxiliary loss on
    (output_router_logits), else None."""
    cfg = getattr(model, "config", None)
    return RouterLogits(model) if getattr(cfg, "output_router_logits", False) else None
