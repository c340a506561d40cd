"""Mixture-of-experts MLPs (Qwen3-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V3), computed as transformers computes them.

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

gpt-oss (`GptOssMLP`, 5.24) differs in three places, each kept in its own piece: the router is
`mlp.router` with a bias, and `route()` takes the top-k of its logits, then a softmax over those
k values in the compute dtype; each expert (`ClampedSwiGLUExpert`) has biases and the clamped
SwiGLU, its gate and up interleaved in one `gate_up_proj`; and its matrices are stored [in, out]
(`InputMajorLinear`) as gpt-oss checkpoints store them, so each expert's matrix is one
contiguous byte range of the fused checkpoint tensor, read and streamed in place
(`_gpt_oss_parts`), and written back fused (`fused_for_export`).

DeepSeek-V3 (`DeepseekV3MoE`, 5.24): the router `mlp.gate` (`GroupRouter`) holds its weight and
a per-expert score-correction bias; `route_groups` is transformers' group-limited sigmoid routing,
its weights kept in fp32; `mlp.shared_experts` (a plain `Expert` of moe_intermediate_size x
n_shared_experts) runs on every token and is added after the routed sum. Its experts are plain
`Expert`s, stored per expert or fused as Qwen3-MoE's.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from offload.models.config import ModelConfig
from offload.models.families import ConfigError, moe_names
from offload.models.projections import project


# torch's grouped product (2.9+ has a CPU kernel): the experts of a layer in one call
_GROUPED_MM = hasattr(torch, "_grouped_mm") and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)


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


class InputMajorLinear(nn.Module):
    """y = x @ weight + bias, weight stored [in, out]: the layout gpt-oss checkpoints hold each
    expert's matrices in (`mlp.experts.gate_up_proj` [E, hidden, 2 x width], `down_proj` [E,
    width, hidden]), so one expert's matrix is one contiguous byte range of the file, read or
    streamed in place, and the product is transformers' own (`x @ W[e] + b[e]`). Not an
    nn.Linear on purpose: `project` calls this forward (its nn.Linear paths assume [out, in]);
    int8/int4 conversion quantizes the transpose (config.input_major) into a QuantLinear."""
    input_major = True  # LoRA refuses it (offload/lora.py)

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return x @ self.weight + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight [in, out]"


class ClampedSwiGLUExpert(nn.Module):
    """One gpt-oss expert (`GptOssExperts._apply_gate`, 5.24): gate_up = x @ W + b holds gate
    and up interleaved (gate = [..., ::2], up = [..., 1::2]); gate clamped to <= limit, up to
    [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate) through down_proj (+ its bias)."""

    def __init__(self, hidden: int, width: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = InputMajorLinear(hidden, 2 * width)
        self.down_proj = InputMajorLinear(width, hidden)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate_up = project(self.gate_up_proj, x)  # [n, 2 x width]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return project(self.down_proj, (up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GroupRouter(nn.Module):
    """DeepSeek-V3's router (`mlp.gate`): `weight` [experts, hidden] and the per-expert
    `e_score_correction_bias` [experts], which steers the choice of experts but not their
    weights. Both are parameters (transformers keeps the bias as a buffer; it gets no gradient
    here either: it only ranks). `route_groups` is its forward."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts))


def route_groups(router: GroupRouter, x: torch.Tensor, top_k: int, groups: int, keep: int,
                 norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (`DeepseekV3TopkRouter.forward`, 5.24; the same operators in the
    same order, so the same ties and sums): sigmoid scores of fp32 logits; each of `groups`
    groups scored by the sum of its two best biased scores; the experts of the `keep` best
    groups eligible; the top-k of their biased scores chosen; their unbiased scores as weights,
    divided by their sum (+1e-20) when `norm`, times `scale`. Weights fp32 [N, k], ids [N, k]."""
    logits = F.linear(x.float(), router.weight.float())  # [N, E] in fp32 whatever the dtype
    scores = logits.sigmoid()
    with torch.no_grad():  # the choice only: no gradient reaches the bias
        choice = scores + router.e_score_correction_bias.float()
        n, E = choice.shape
        group_scores = choice.view(n, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
        best = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best, 1)
        eligible = group_mask.unsqueeze(-1).expand(n, groups, E // groups).reshape(n, E)
        choice = choice.masked_fill(~eligible.bool(), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class SparseMoE(nn.Module):
    """The router and the experts of one layer (see the module docstring for the order of
    operations, which is transformers'); DeepSeek-V3's shared experts (`shared_experts`, a
    SwiGLU MLP of moe_intermediate_size x n_shared_experts) added to the routed output.
    `untouched_experts`: "step" (an expert without tokens is stepped with a zero gradient, as
    torch steps transformers 5's fused expert tensors) or "skip" (no gradient, torch's
    semantics for one module per expert): offload/train/experts.py."""
    untouched_experts = "step"
    # set by a training engine that replays untouched experts' steps lazily
    # (offload/train/replay.py): called with the experts about to run, before any of them does
    before_experts = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _, names = moe_names(cfg.architecture)
        h, width, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        if cfg.swiglu_limit is not None:  # gpt-oss: the router `router`, with a bias
            self.router = nn.Linear(h, E, bias=True)
            experts = [ClampedSwiGLUExpert(h, width, cfg.swiglu_alpha, cfg.swiglu_limit) for _ in range(E)]
        else:
            self.gate = GroupRouter(h, E) if cfg.moe_router == "sigmoid_group_topk" else nn.Linear(h, E, bias=False)
            experts = [Expert(h, width, names) for _ in range(E)]
        self.experts = nn.ModuleList(experts)
        self.shared_experts = (Expert(h, width * cfg.n_shared_experts, ("gate_proj", "up_proj", "down_proj"))
                               if cfg.n_shared_experts else None)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.fp32_weights = cfg.moe_router == "softmax_topk_fp32"
        self.topk_first = cfg.moe_router == "topk_softmax"
        self.groups = ((cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
                       if cfg.moe_router == "sigmoid_group_topk" else None)
        self.store, self.layer_index = None, -1  # see use_store
        self.record_logits = None  # called with the router's logits: offload/models/router_loss.py

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (routing weights [N, k], expert ids [N, k])."""
        # F.linear, not `project`: a kernel rounding differently could change which experts run
        if self.topk_first:  # gpt-oss: top-k of the biased logits, softmax over those k values
            logits = F.linear(x, self.router.weight, self.router.bias)
            if self.record_logits is not None:
                self.record_logits(logits)
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        if self.groups is not None:  # DeepSeek-V3: weights kept in fp32, as transformers keeps them
            return route_groups(self.gate, x, self.top_k, *self.groups[:2], self.norm_topk_prob, self.groups[2])
        logits = F.linear(x, self.gate.weight)  # [N, E] in the compute dtype
        if self.record_logits is not None:  # training's load-balancing loss (router_loss.py)
            self.record_logits(logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(logits.dtype)), ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> [B, T, H]. The (token, rank) pairs are grouped by expert with one
        gather, each expert that got tokens runs on its contiguous slice (ascending order), and
        each token's k weighted outputs are added from zero in ascending expert order: the sums
        transformers' eager loop makes with index_add_, to the bit, in a few operators per layer
        instead of several per expert (prefill routes every expert)."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # [N, H]
        weights, ids = self.route(x)  # [N, k]
        n, k = ids.shape
        with torch.no_grad():
            # rank-major (j = rank * N + token), so that within an expert the rows come in
            # transformers' order (torch.where over its [k, N] mask): a GEMM's rounding of a row
            # depends on where the row sits in it
            flat = ids.T.reshape(-1)  # [k*N]
            order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
            counts = torch.bincount(flat, minlength=len(self.experts))
            hit = counts.nonzero().flatten().tolist()
            sizes = counts[hit].tolist()
        if self.before_experts is not None:
            self.before_experts(hit)
        xs = x[order % n]  # [k*N, H], grouped by expert
        grouped = self._grouped_weights()
        if grouped is not None:  # every expert in one arena: one grouped product per projection
            self.store.served_grouped(self.layer_index, hit, sizes, x)
            y = self._grouped_experts(xs, counts, grouped)
        else:
            if self.store is None:
                experts = ((e, self.experts[e], None) for e in hit)
            else:  # placed one by one (offload/stream/experts.py): each brought in as it is reached
                experts = self.store.experts(self.layer_index, hit, x, sizes)
            rows, start = {}, 0  # expert -> its slice of xs
            for e, size in zip(hit, sizes):
                rows[e], start = slice(start, start + size), start + size
            ys = {}  # the store yields what it has first: outputs kept by expert
            for e, expert, where in experts:
                xe = xs[rows[e]]
                # `where`: computed where the expert lives (host RAM), the activations go there
                ys[e] = expert(xe) if where is None else expert(xe.to(where)).to(x.device)
            y = torch.cat([ys[e] for e in hit]) if hit else xs[:0]
        y = (y * weights.T.reshape(-1)[order, None]).to(x.dtype)  # [k*N, H], grouped by expert
        with torch.no_grad():
            back = torch.empty_like(order)
            back[order] = torch.arange(order.numel(), device=order.device)  # grouped -> rank-major
            by_expert = torch.argsort(ids, dim=-1, stable=True)  # each token's ranks, ascending expert
            pick = back.reshape(k, n).T.gather(1, by_expert)  # [N, k] rows of y
        out = torch.zeros_like(x)
        for r in range(k):  # from zero, in ascending expert order per token: index_add_'s sums
            out = out + y[pick[:, r]]
        out = out.reshape(shape)
        # DeepSeek-V3: the shared experts on the same input, added after the routed ones
        return out if self.shared_experts is None else out + self.shared_experts(hidden)

    def _grouped_weights(self) -> dict[str, torch.Tensor] | None:
        """The store's [experts, ...] weight views of this layer, when it has them, the experts
        are plain SwiGLU ones (`Expert`), torch has a grouped product, the device is the CPU and
        we are not training (its gradient would reach the arena views, not the parameters)."""
        if (self.store is None or not _GROUPED_MM or type(self.experts[0]) is not Expert
                or torch.is_grad_enabled() or self.store.device.type != "cpu"):
            return None  # (CUDA's grouped product wants bf16 on recent GPUs: not yet tried there)
        return self.store.grouped_weights(self.layer_index)

    def _grouped_experts(self, xs: torch.Tensor, counts: torch.Tensor,
                         views: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every expert at once on `xs` [k*N, H] grouped by expert (`counts` rows each): one
        grouped product per projection, each group the expert's own x @ W^T (what transformers'
        default "grouped_mm" experts run; the loop's few-row kernels round differently, within
        fp32's last bits: both are checked against transformers within 1e-5)."""
        gate, up, down = (views[f"{name}.weight"] for name in self.experts[0].names)
        offs = torch.cumsum(counts, 0).to(torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # w [E, out, in]
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

        width = gate.shape[1]
        if up.storage_offset() == gate.storage_offset() + gate[0].numel():
            # up right after gate in every expert (Qwen3-MoE / OLMoE files): one product of
            # [E, 2 x width, H], as transformers' fused gate_up_proj -- wider, so faster
            fused = torch.as_strided(gate, (gate.shape[0], 2 * width, gate.shape[2]), gate.stride())
            g, u = mm(xs, fused).split(width, dim=-1)
            return mm(F.silu(g) * u, down)
        return mm(F.silu(mm(xs, gate)) * mm(xs, up), down)

    def use_store(self, store, layer_index: int) -> None:
        """Take this layer's experts from `store` (an offload.stream.experts.ExpertStore) as
        model layer `layer_index`, instead of from this module's own parameters."""
        self.store, self.layer_index = store, layer_index


# ---- transformers' in-memory layout in a checkpoint ----------------------------------------------
# its save_pretrained writes one tensor per expert (gpt-oss's: these fused ones, with biases); a
# state_dict saved as it is holds these
FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.)mlp\.(?:experts\.(gate_up_proj|down_proj)(_bias)?|gate\.weight)$")


def fused_expert_parts(name: str, shape: tuple[int, ...], nbytes: int, cfg: ModelConfig
                       ) -> list[tuple[str, tuple[int, ...], int, int]]:
    """A tensor of transformers' in-memory MoE layout (`name` matches FUSED_EXPERTS) as our
    tensors: [(our name, shape, byte offset in the stored tensor, bytes)]. `mlp.experts.
    gate_up_proj` [E, 2I, H] holds each expert's gate rows, then its up rows, and `mlp.experts.
    down_proj` [E, H, I] its down matrix: every one a contiguous range, read in place. The
    router `mlp.gate.weight` is whole (Mixtral's moves into `block_sparse_moe`). gpt-oss: see
    _gpt_oss_parts. A name this family does not fuse is given back whole, as it is."""
    prefix, kind, bias = FUSED_EXPERTS.match(name).groups()
    if cfg.swiglu_limit is not None or bias:
        if cfg.swiglu_limit is None or kind is None:
            return [(name, shape, 0, nbytes)]  # not this family's: an unexpected tensor
        return _gpt_oss_parts(prefix, kind + (bias or ""), shape, nbytes, cfg)
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


def _gpt_oss_fused(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """gpt-oss's fused expert tensors: name in a layer's `mlp.experts.` -> (our parameter in one
    expert, its shape there)."""
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_up_proj": ("gate_up_proj.weight", (h, 2 * f)), "gate_up_proj_bias": ("gate_up_proj.bias", (2 * f,)),
            "down_proj": ("down_proj.weight", (f, h)), "down_proj_bias": ("down_proj.bias", (h,))}


def _gpt_oss_parts(prefix: str, kind: str, shape: tuple[int, ...], nbytes: int, cfg: ModelConfig
                   ) -> list[tuple[str, tuple[int, ...], int, int]]:
    """gpt-oss's experts as transformers saves them: `gate_up_proj` [E, hidden, 2 x width] (gate
    and up interleaved on the last dimension), `gate_up_proj_bias` [E, 2 x width], `down_proj`
    [E, width, hidden], `down_proj_bias` [E, hidden]; each expert's slice is one contiguous byte
    range and is exactly our parameter's layout (InputMajorLinear), read in place."""
    ours, want = _gpt_oss_fused(cfg)[kind]
    E = cfg.num_experts
    if tuple(shape) != (E, *want):
        raise ConfigError(f"shape {list(shape)} is no fused experts tensor of this config: "
                          f"mlp.experts.{kind} is {[E, *want]}")
    part = nbytes // E
    return [(f"{prefix}mlp.experts.{e}.{ours}", want, e * part, part) for e in range(E)]


_EXPERT_PARAM = re.compile(r"(model\.layers\.\d+\.)mlp\.experts\.(\d+)\.(\w+\.(?:weight|bias))$")


def checkpoint_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` (config.parameter_shapes) under the names a checkpoint of this family holds:
    gpt-oss's experts as the four fused tensors per layer that transformers writes and loads
    (in the place of the layer's first expert tensor); any other family's unchanged."""
    if cfg.swiglu_limit is None:
        return shapes
    fused = {ours: kind for kind, (ours, _) in _gpt_oss_fused(cfg).items()}
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        m = _EXPERT_PARAM.match(name)
        if m is None:
            out[name] = shape
        elif m.group(2) == "0":
            out[f"{m.group(1)}mlp.experts.{fused[m.group(3)]}"] = (cfg.num_experts, *shape)
    return out


def fused_for_export(cfg: ModelConfig, pairs: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in checkpoint order with gpt-oss's per-expert tensors fused as transformers
    saves them (checkpoint_shapes): each copied into its slot of the fused CPU tensor as it comes
    (a streamed source may reuse its buffers), the fused tensor given once its last expert is in.
    One layer's experts are held at a time. Other families' pairs pass through unchanged."""
    fused = {ours: kind for kind, (ours, _) in _gpt_oss_fused(cfg).items()}
    held: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        m = _EXPERT_PARAM.match(name) if cfg.swiglu_limit is not None else None
        if m is None:
            yield name, t
            continue
        prefix, e, ours = m.groups()
        key = f"{prefix}mlp.experts.{fused[ours]}"
        if key not in held:
            held[key] = torch.empty((cfg.num_experts, *t.shape), dtype=t.dtype)
        held[key][int(e)].copy_(t.detach())
        if int(e) == cfg.num_experts - 1:
            yield key, held.pop(key)
    if held:
        raise ConfigError(f"the experts of {sorted(held)[0]} are incomplete: the last one never came")
