"""Experts that got no tokens: stepped with a zero gradient, or skipped -- as the model decides.

torch.optim.AdamW skips a parameter whose `.grad` is None and steps one whose gradient is zero
(its moments decay, weight decay applies, its step count moves on). Which of the two an expert
without tokens gets depends on how the model holds its experts:

- transformers 5 keeps a layer's experts as fused 3-D tensors (`mlp.experts.gate_up_proj`
  [E, 2I, H], `down_proj` [E, H, I]): an expert without tokens is a zero slice of a gradient
  that exists, and torch steps it;
- one module per expert (an nn.ModuleList, as transformers 4 and many user models have): an
  expert without tokens has no gradient at all, and torch skips it.

Our decoder holds one module per expert (each placed, streamed and quantized on its own) but
stands for transformers' model of the same checkpoint, so its MoE modules say
`untouched_experts = "step"` (offload/models/moe.py SparseMoE): the engine then steps their
untouched experts with the zero gradient the landing already holds for a slot without one
(offload/grads/landing.py finish_window), which is exactly transformers' fused AdamW step.
`set_untouched_experts(model, "skip")` gives them torch's ModuleList semantics instead; any
other module keeps torch's semantics for its parameters (skipped when they get no gradient)
unless it carries `untouched_experts = "step"` itself.

Today every expert's optimizer state is read and written every update (stepped eagerly); an
only-the-routed-experts' IO needs per-expert state units and a lazy replay of the zero steps.
"""

from __future__ import annotations

from torch import nn

MODES = ("step", "skip")


def zero_gradient_slots(model: nn.Module) -> frozenset[str]:
    """Names (as model.named_parameters() gives them) of the trainable expert parameters that
    a missing gradient steps with zeros: those under `experts` of every module whose
    `untouched_experts` is "step"."""
    out: set[str] = set()
    for name, module in model.named_modules():
        mode = getattr(module, "untouched_experts", None)
        experts = getattr(module, "experts", None)
        if mode not in MODES or not isinstance(experts, nn.Module):
            continue
        if mode == "step":
            prefix = f"{name}.experts." if name else "experts."
            out.update(prefix + n for n, p in experts.named_parameters() if p.requires_grad)
    return frozenset(out)


def set_untouched_experts(model: nn.Module, mode: str) -> int:
    """Set how every MoE module of `model` treats experts without tokens: "step" (a zero
    gradient, transformers 5's fused tensors) or "skip" (no gradient, one module per expert).
    Returns the number of MoE modules changed; call before offload.initialize."""
    if mode not in MODES:
        raise ValueError(f"untouched experts must be one of {', '.join(MODES)}, got {mode!r}")
    changed = 0
    for module in model.modules():
        if hasattr(module, "untouched_experts") and isinstance(getattr(module, "experts", None), nn.Module):
            module.untouched_experts = mode
            changed += 1
    return changed


def drop_stepped(missing: dict[int, set[str]], stepped: frozenset[str]) -> dict[int, set[str]]:
    """`missing` (block -> slots without a gradient this window) less the slots stepped with a
    zero gradient instead; blocks left with none are dropped."""
    if not stepped:
        return missing
    out = {bi: names - stepped for bi, names in missing.items()}
    return {bi: names for bi, names in out.items() if names}
