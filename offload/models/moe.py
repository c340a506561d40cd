"""Mixture-of-experts MLPs (Qwen3-MoE, OLMoE, Mixtral), computed as transformers computes them.

A layer's MoE module (`mlp`; Mixtral's `block_sparse_moe`) holds the router `gate` (an
nn.Linear [num_experts, hidden], no bias) and `experts`, an nn.ModuleList of one gated MLP per
expert whose projections carry the names transformers' save_pretrained writes
(`mlp.experts.E.gate_proj/up_proj/down_proj`; Mixtral's `w1/w3/w2`). transformers 5 keeps the
experts as two fused 3-D tensors in memory and converts on load and save; here each expert is
its own module, so each has its own parameters: what the planner will need to place experts
one by one (device / RAM / NVMe), and what int8 / int4 conversion quantizes one by one (the
router stays dense).

The forward is transformers' eager one (`Qwen3MoeExperts.forward` and its siblings, 5.24):
router logits in the compute dtype, softmax over every expert in fp32, top-k, renormalised when
`norm_topk_prob` (Mixtral always), the weights cast to the compute dtype (Qwen3-MoE, OLMoE) or
kept in fp32 (Mixtral); then, expert by expert in ascending order, only the experts that got
tokens run their MLP on those tokens (through `project`, like the dense MLP), their outputs
scaled by the routing weights and added into a zero tensor of the compute dtype with
index_add_. transformers' default on the CPU, "grouped_mm", sums each token's k weighted outputs
instead: the same numbers in fp32 for top-2 (a + b), a different rounding order for k > 2 and
in 16 bits.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from offload.models.config import ModelConfig
from offload.models.families import ConfigError, moe_names
from offload.models.projections import project


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), no bias, its projections named as the family's
    checkpoints name them (gate_proj / up_proj / down_proj, or Mixtral's w1 / w3 / w2)."""

    def __init__(self, hidden: int, width: int, names: tuple[str, str, str]):
        super().__init__()
        gate, up, down = names
        self.names = names
        self.add_module(gate, nn.Linear(hidden, width, bias=False))
        self.add_module(up, nn.Linear(hidden, width, bias=False))
        self.add_module(down, nn.Linear(width, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate, up, down = (self._modules[n] for n in self.names)
        return project(down, F.silu(project(gate, x)) * project(up, x))


class SparseMoE(nn.Module):
    """The router and the experts of one layer (see the module docstring for the order of
    operations, which is transformers')."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _, names = moe_names(cfg.architecture)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size, names)
                                     for _ in range(cfg.num_experts))
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.fp32_weights = cfg.moe_router == "softmax_topk_fp32"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (routing weights [N, k], expert ids [N, k])."""
        # F.linear, not `project`: a kernel rounding differently could change which experts run
        logits = F.linear(x, self.gate.weight)  # [N, E] in the compute dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(logits.dtype)), ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> [B, T, H]."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # [N, H]
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        with torch.no_grad():
            # [E, k, N]: which (token, rank) pairs each expert got; experts without tokens skipped
            mask = F.one_hot(ids, num_classes=len(self.experts)).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            rank, token = torch.where(mask[e])
            y = self.experts[e](x[token]) * weights[token, rank, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.reshape(shape)


# ---- transformers' in-memory layout in a checkpoint ----------------------------------------------
# its save_pretrained writes one tensor per expert; a state_dict saved as it is holds these
FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.)mlp\.(?:experts\.(gate_up_proj|down_proj)|gate\.weight)$")


def fused_expert_parts(name: str, shape: tuple[int, ...], nbytes: int, cfg: ModelConfig
                       ) -> list[tuple[str, tuple[int, ...], int, int]]:
    """A tensor of transformers' in-memory MoE layout (`name` matches FUSED_EXPERTS) as our
    tensors: [(our name, shape, byte offset in the stored tensor, bytes)]. `mlp.experts.
    gate_up_proj` [E, 2I, H] holds each expert's gate rows, then its up rows, and `mlp.experts.
    down_proj` [E, H, I] its down matrix: every one a contiguous range, read in place. The
    router `mlp.gate.weight` is whole (Mixtral's moves into `block_sparse_moe`)."""
    prefix, kind = FUSED_EXPERTS.match(name).groups()
    module, (gate, up, down) = moe_names(cfg.architecture)
    if kind is None:
        return [(f"{prefix}{module}.gate.weight", shape, 0, nbytes)]
    projs = (gate, up) if kind == "gate_up_proj" else (down,)
    E = cfg.num_experts
    if len(shape) != 3 or shape[0] != E or shape[1] % len(projs):
        raise ConfigError(f"shape {list(shape)} is no fused experts tensor of this config: "
                          f"[{E}, 2 x width, hidden] (gate_up_proj) or [{E}, hidden, width] (down_proj)")
    part = nbytes // (E * len(projs))
    return [(f"{prefix}{module}.experts.{i // len(projs)}.{projs[i % len(projs)]}.weight",
             (shape[1] // len(projs), shape[2]), i * part, part) for i in range(E * len(projs))]
