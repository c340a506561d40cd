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

Only the routed experts' state moves. Each expert is its own optimizer-state unit (NVMe: its
own swap files, `expert_cuts`), and a unit holding only experts without tokens is neither read
nor written. "skip" experts need nothing more. "step" experts are replayed lazily
(offload/train/replay.py): an untouched expert's zero-gradient steps are recorded, and run
through the same fused kernel with g = 0 -- bit-identical to stepping it each update -- when it
is next routed to (the MoE module calls `before_experts` with the experts it is about to run),
and for all of them before a checkpoint, an export or master_params(). The plan decides once
(`decide_experts`): lazy in one process whose step is not delayed and whose "step" MoE modules
call before_experts; otherwise eager (every "step" expert stepped with zeros each update, its
state read and written: across ranks a forward-time replay would need another rank's shard of
the expert's state, a collective that depends on the routing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from offload.memory.blocks import Block, ParamSlot

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


@dataclass(frozen=True, eq=False)
class ExpertRange:
    """One routed expert's trainable parameters: contiguous elements [lo, hi) of block `block`."""
    module: str  # the MoE module's name in model.named_modules()
    expert: int
    block: int
    lo: int
    hi: int
    slots: tuple[ParamSlot, ...]
    zero_step: bool  # its module's untouched_experts is "step"


def expert_ranges(model: nn.Module, blocks: list[Block]) -> list[ExpertRange]:
    """Every expert of every MoE module (one with `untouched_experts` and an `experts` list)
    whose trainable parameters lie in one block, contiguously (as group_blocks lays them out)."""
    slot_of = {s.name: (bi, s) for bi, b in enumerate(blocks) for s in b.slots}
    out = []
    for name, module in model.named_modules():
        mode = getattr(module, "untouched_experts", None)
        experts = getattr(module, "experts", None)
        if mode not in MODES or not isinstance(experts, nn.ModuleList):
            continue
        for e, expert in enumerate(experts):
            prefix = f"{name}.experts.{e}." if name else f"experts.{e}."
            found = [slot_of[prefix + n] for n, p in expert.named_parameters()
                     if p.requires_grad and prefix + n in slot_of]
            if not found or len({bi for bi, _ in found}) != 1:
                continue
            slots = tuple(sorted((s for _, s in found), key=lambda s: s.offset))
            lo, hi = slots[0].offset, slots[-1].offset + slots[-1].numel
            if hi - lo == sum(s.numel for s in slots):
                out.append(ExpertRange(name, e, found[0][0], lo, hi, slots, mode == "step"))
    return out


def expert_cuts(ranges: list[ExpertRange], num_blocks: int) -> list[list[int]] | None:
    """Per block, the element offsets where an optimizer-state unit must end (each expert's
    bounds); None without experts."""
    if not ranges:
        return None
    cuts: list[list[int]] = [[] for _ in range(num_blocks)]
    for r in ranges:
        cuts[r.block] += [r.lo, r.hi]
    return cuts


def decide_experts(model: nn.Module, ranges: list[ExpertRange], world: int,
                   step_path: str) -> tuple[str, str]:
    """How experts without tokens under "step" are stepped: ("lazy" | "eager" | "none", why)."""
    step_modules = {r.module for r in ranges if r.zero_step}
    if not step_modules:
        return "none", "no expert is stepped with a zero gradient"
    modules = dict(model.named_modules())
    if world > 1:
        return "eager", ("across ranks: an expert's state is sharded over them, and a replay "
                         "when it is routed to would be a collective that depends on routing")
    if step_path == "delayed":
        return "eager", "the delayed update steps while the next forward runs"
    if not all(hasattr(type(modules[m]), "before_experts") for m in step_modules):
        return "eager", "an MoE module does not say which experts it runs (before_experts)"
    return "lazy", ("an untouched expert's zero-gradient steps are replayed when it is next "
                    "routed to, or before a checkpoint, an export or master_params()")


def untouched_experts(ranges: list[ExpertRange], missing: dict[int, set[str]]
                      ) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """`missing` (block -> slots without a gradient) split into (what stays missing, the
    slots of "step" experts none of whose parameters got a gradient: deferred)."""
    deferred: dict[int, set[str]] = {}
    for r in ranges:
        names = missing.get(r.block)
        if r.zero_step and names and all(s.name in names for s in r.slots):
            deferred.setdefault(r.block, set()).update(s.name for s in r.slots)
    rest = {bi: names - deferred.get(bi, set()) for bi, names in missing.items()}
    return {bi: n for bi, n in rest.items() if n}, deferred


class RoutedCalls:
    """What each MoE module's `before_experts(hit)` does (it is called in every forward --
    training, recompute, evaluation -- with the experts about to run, before any computes):
    first a streamed layer whose experts are weight units of their own reads the routed ones'
    weights (`streaming.experts_routed`: offload/stream/routed.py), then the lazy replay brings
    the replayed ones up to date (offload/train/replay.py: it patches the bound slot and the
    expert's file, so it comes after the read)."""

    def __init__(self, model: nn.Module, ranges: list[ExpertRange], layer_of: dict[int, int],
                 streaming, replay):
        self.by_module: dict[str, dict[int, ExpertRange]] = {}
        for r in ranges:
            self.by_module.setdefault(r.module, {})[r.expert] = r
        self.layer_of = layer_of
        self.streaming = streaming if any(getattr(streaming, "expert_unit", ())) else None
        self.replay = replay
        replayed = {m for m, _ in replay.ranges} if replay is not None else set()
        self._modules: list[nn.Module] = []
        for name, module in model.named_modules():
            if name in replayed or (self.streaming is not None and name in self.by_module
                                    and hasattr(type(module), "before_experts")):
                module.before_experts = functools.partial(self.routed, name)
                self._modules.append(module)

    def routed(self, module: str, hit: list[int]) -> None:
        experts = self.by_module.get(module, {})
        rs = [experts[e] for e in hit if e in experts]
        if self.streaming is not None and rs and rs[0].block in self.layer_of:
            self.streaming.experts_routed(self.layer_of[rs[0].block], [(r.lo, r.hi) for r in rs])
        if self.replay is not None:
            self.replay.routed(module, hit)

    def detach(self) -> None:
        for module in self._modules:
            module.__dict__.pop("before_experts", None)
        self._modules.clear()
