"""runners.infer's routed experts (MoE models): the flags, the sizes the planners need (a block's
dense part apart from its experts, one expert as computed and as stored), the experts' plan
placed in what the dense plan left, and the report of what the experts cost. The mechanisms are
offload/infer/expert_plan.py and offload/stream/experts.py."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.config import format_bytes
from offload.infer.expert_plan import (EXPERT_CHOICES, ComputeCosts, ExpertPlan, choose_compute,
                                       expert_floor_bytes, plan_experts)
from offload.models import ModelConfig, block_parameter_shapes
from offload.models.config import input_major
from offload.models.families import moe_names
from offload.quant.format import packed_bytes
from offload.stream.expert_placement import ExpertStats
from runners.common import RunnerError, parse_size


def add_expert_args(p) -> None:
    p.add_argument("--experts", default="auto", choices=EXPERT_CHOICES,
                   help="MoE models: where the routed experts live, each expert on its own: auto = "
                        "the device, then host RAM, then NVMe, by the budgets; only the experts a "
                        "step routes tokens to are read or copied")
    p.add_argument("--expert-cache", default="0", metavar="SIZE",
                   help="MoE models: keep the most-used experts that do not live on the device "
                        "there after use, within SIZE (e.g. 2GiB); 0 = no cache")
    p.add_argument("--expert-prefetch", default="on", choices=["on", "off"],
                   help="MoE models: read the next layer's likely experts (its router on this "
                        "layer's input) while this layer runs")


def check_expert_flags(args, cfg: ModelConfig) -> None:
    """--experts / --expert-cache name a mixture of experts' placement: refused for a dense model."""
    asked = [f for f, v, default in (("--experts", args.experts, "auto"),
                                     ("--expert-cache", args.expert_cache, "0"),
                                     ("--expert-prefetch", args.expert_prefetch, "on")) if v != default]
    if asked and not cfg.num_experts:
        raise RunnerError(f"{asked[0]} places a mixture of experts' routed experts; {cfg.architecture} "
                          f"has none (drop the flag)")
    # parsed once, here, before anything is generated or loaded; the plan takes the bytes
    args.expert_cache_bytes = (parse_size(args.expert_cache, "--expert-cache") or 0
                               if cfg.num_experts and args.expert_cache != "0" else 0)


@dataclass(frozen=True)
class ExpertSizes:
    expert_bytes: int  # one expert as computed (compute dtype, or its quantized bytes)
    stored_expert_bytes: int  # one expert as read from its file
    dense_block_bytes: list[int]  # per layer: the block without its experts
    dense_stored_bytes: list[int]


def expert_sizes(cfg: ModelConfig, reader, dtype: torch.dtype, quant, block_bytes: list[int],
                 stored_bytes: list[int]) -> ExpertSizes | None:
    """The experts' sizes and the blocks' dense parts (None for a dense model). `block_bytes` /
    `stored_bytes`: the whole blocks' as the dense planner would take them."""
    if not cfg.num_experts:
        return None
    ffn, first = moe_names(cfg.architecture)[0], cfg.moe_layers[0]
    prefix = f"{ffn}.experts.0."
    shapes = {n: s for n, s in block_parameter_shapes(cfg, first).items() if n.startswith(prefix)}
    if quant is not None:
        specs = quant[1][first]
        # a weight stored [in, out] (gpt-oss's experts) is quantized as its transpose
        one = sum(packed_bytes(*(s[::-1] if input_major(cfg, n) else s), specs[n.rsplit(".", 1)[0]])
                  if n.endswith(".weight") and n.rsplit(".", 1)[0] in specs
                  else math.prod(s) * dtype.itemsize for n, s in shapes.items())
        stored_one = one
    else:
        one = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        stored_one = one
        if reader is not None:
            head = f"model.layers.{first}.{prefix}"
            stored_one = sum(loc.nbytes for loc in reader.block_locations(first) if loc.name.startswith(head))
    E = [cfg.num_experts if cfg.moe_layer(i) else 0 for i in range(cfg.num_hidden_layers)]  # dense layers: 0
    return ExpertSizes(one, stored_one, [b - e * one for b, e in zip(block_bytes, E)],
                       [b - e * stored_one for b, e in zip(stored_bytes, E)])


def measure_cpu_rates(hidden: int, width: int, dtype: torch.dtype, seconds: float = 0.3) -> tuple[float, float]:
    """(GB/s of weights read at one token, GFLOP/s at 64 tokens) of one expert-sized product on
    the CPU, in the compute dtype: what the copy-or-compute choice needs."""
    w = torch.randn(width, hidden).to(dtype)
    rates = []
    for n in (1, 64):
        x = torch.randn(n, hidden).to(dtype)
        F.linear(x, w)  # warm-up
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            F.linear(x, w)
            done += 1
        rates.append((time.perf_counter() - t0) / done)
    return w.numel() * w.element_size() / rates[0] / 1e9, 2 * 64 * w.numel() / rates[1] / 1e9


def router_copy_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Every MoE layer's router copied for the prediction (its bias: gpt-oss)."""
    return len(cfg.moe_layers) * cfg.num_experts * (cfg.hidden_size + 1) * dtype.itemsize


def experts_reserve(args, cfg: ModelConfig, sizes: ExpertSizes | None, device: torch.device,
                    dtype: torch.dtype, staging_needed: bool) -> int:
    """Device bytes the dense plan keeps free for the experts' least (expert_floor_bytes)."""
    if sizes is None:
        return 0
    return expert_floor_bytes(experts=cfg.num_experts, expert_bytes=sizes.expert_bytes,
                              stored_expert_bytes=sizes.stored_expert_bytes, top_k=cfg.num_experts_per_tok,
                              device_is_host=device.type != "cuda", cache_bytes=args.expert_cache_bytes,
                              prefetch=args.expert_prefetch == "on", staging_needed=staging_needed,
                              router_bytes=router_copy_bytes(cfg, dtype))


def plan_model_experts(args, cfg: ModelConfig, plan, sizes: ExpertSizes, device: torch.device,
                       dtype: torch.dtype, links, staging_needed: bool) -> ExpertPlan:
    """The experts' plan in what the dense `plan` left (with what it kept free for them,
    plan.reserved_bytes), joined to it (plan.experts, and its device and host need)."""
    where, why = 0.0, ""
    if device.type == "cuda" and not getattr(args, "planned_gpu", False):
        gbps, gflops = measure_cpu_rates(cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        where, why = choose_compute(sizes.expert_bytes, params, cfg.hidden_size, dtype.itemsize,
                                    ComputeCosts(links.h2d_gbps, gbps, gflops))
    elif device.type == "cuda":
        why = "copy or CPU: chosen on the machine from its measured link and CPU rates"
    else:
        why = "the device is the CPU: experts in RAM are computed in place, NVMe ones read into RAM"
    eplan = plan_experts(layers=len(cfg.moe_layers), experts=cfg.num_experts,
                         expert_bytes=sizes.expert_bytes, stored_expert_bytes=sizes.stored_expert_bytes,
                         top_k=cfg.num_experts_per_tok,
                         device_room=plan.device_budget - plan.device_need + plan.reserved_bytes,
                         host_room=plan.host_budget - plan.host_need
                         + (plan.reserved_bytes if plan.device_is_host else 0),
                         device_is_host=plan.device_is_host,
                         force=None if args.experts == "auto" else args.experts,
                         cache_bytes=args.expert_cache_bytes,
                         prefetch=args.expert_prefetch == "on", where_max_tokens=where, why=why,
                         staging_needed=staging_needed, router_bytes=router_copy_bytes(cfg, dtype))
    plan.add_experts(eplan)
    return eplan


def expert_metrics(results, plan: ExpertPlan, store) -> dict:
    """What the experts cost over the run's decode steps (and prefill), for the report and JSON."""
    dec = [r.decode_experts for r in results if r.decode_experts is not None]
    pre = [r.prefill_experts for r in results if r.prefill_experts is not None]
    tokens = sum(r.decode_tokens for r in results)
    total, ptotal = ExpertStats(), ExpertStats()
    for s in dec:
        total = total.plus(s)
    for s in pre:
        ptotal = ptotal.plus(s)
    per = (lambda v: v / tokens) if tokens else (lambda v: 0.0)
    return {
        "homes": {t: plan.count(t) for t in ("device", "cpu", "nvme")},
        "decode_bytes_per_token": {k: per(v) for k, v in total.moved_bytes.items()},
        "decode_routed_per_token": per(total.routed),
        "prefill_bytes": dict(ptotal.moved_bytes),
        "cache_hit_rate": total.hit_rate(), "prefetch_precision": total.precision(),
        "prefetch_recall": total.recall(), "wasted_prefetch_bytes": total.wasted_bytes,
        "imbalance": store.imbalance() if store is not None else None,
        "wait_s": total.wait_s + ptotal.wait_s,
    }


def expert_report(m: dict) -> str:
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.0f}%"
    b = m["decode_bytes_per_token"]
    imb = "n/a" if m["imbalance"] is None else f"{m['imbalance']:.2f}x the mean"
    return (f"experts: {m['decode_routed_per_token']:.1f} routed per decoded token, read per token "
            f"nvme {format_bytes(int(b['disk']))}, host->device {format_bytes(int(b['h2d']))} | cache "
            f"hit rate {pct(m['cache_hit_rate'])} | prefetch precision {pct(m['prefetch_precision'])}, "
            f"recall {pct(m['prefetch_recall'])} | busiest expert {imb} | waited {m['wait_s']:.2f} s")
