"""Where an MoE model's routed experts live, one by one, decided before anything loads.

The block planner (plan.py) places each layer's dense part (attention, norms, router) as it
places any block; this module places the experts with what the budgets have left, each expert a
unit of its own (offload/stream/experts.py serves them):

  auto    the device first (fewest bytes moved per token), spread evenly over the layers, then
          host RAM, then NVMe. On a CPU device the device *is* host RAM: experts are in RAM
          (computed where they are) until the budget is spent, the rest on NVMe;
  device | cpu | nvme   every expert there (refused in one line when it does not fit).

Experts that are not on the device travel through one pool of buffers, allocated once: `window`
read ahead for the running layer, `prefetch_slots` for the next layer's predicted experts and
`cache_slots` for the expert cache (`--expert-cache` bytes). Host-RAM experts take what
`host_arenas` allocates (pinned memory rounds up to powers of two).

Under CUDA an expert not on the device is either copied there or computed where it lives, on the
CPU, with only its tokens' activations crossing the link. `choose_compute` compares, for n tokens
per routed expert, the copy (its bytes over the measured host->device link) with the CPU
(its bytes over the CPU's memory bandwidth, or its FLOPs at the CPU's rate, whichever is longer,
plus the activations both ways): below the crossover n the CPU computes it. Decode routes about
one token per expert, prefill many; the plan reports both choices and the crossover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.config import format_bytes
from offload.memory.tiers import BudgetError, pinned_bytes
from offload.stream.expert_placement import EXPERT_HOMES, ExpertPlacement, host_arenas
from offload.stream.slots import slot_raw_bytes

EXPERT_CHOICES = ("auto",) + EXPERT_HOMES


@dataclass(frozen=True)
class ComputeCosts:
    """Measured rates the copy-or-compute choice is made from (GB/s = 1e9 B/s)."""
    h2d_gbps: float  # host -> device
    cpu_gbps: float  # the CPU reading weights from RAM (one expert's product at one token)
    cpu_gflops: float  # the CPU's matrix-product rate at many tokens


def choose_compute(expert_bytes: int, expert_params: int, hidden: int, itemsize: int,
                   costs: ComputeCosts) -> tuple[float, str]:
    """(the most tokens per routed expert computed on the CPU, why): the crossover n where
    copying the expert (expert_bytes / h2d) costs what computing it on the CPU does
    (max(expert_bytes / cpu_gbps, 2 * n * params / cpu_gflops) + activations 2 * n * hidden)."""
    copy_s = expert_bytes / (costs.h2d_gbps * 1e9)

    def cpu_s(n: float) -> float:
        return (max(expert_bytes / (costs.cpu_gbps * 1e9), 2 * n * expert_params / (costs.cpu_gflops * 1e9))
                + 2 * n * hidden * itemsize / (costs.h2d_gbps * 1e9))

    if cpu_s(1) >= copy_s:
        return 0.0, (f"copy: one token on the CPU {cpu_s(1) * 1e3:.2f} ms >= the copy "
                     f"{copy_s * 1e3:.2f} ms per expert")
    lo, hi = 1.0, 1.0
    while cpu_s(hi) < copy_s and hi < 1 << 20:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cpu_s(mid) < copy_s else (lo, mid)
    return lo, (f"CPU up to {lo:.1f} tokens per expert (1 token {cpu_s(1) * 1e3:.2f} ms on the CPU "
                f"vs {copy_s * 1e3:.2f} ms to copy it at {costs.h2d_gbps:.1f} GB/s), copied above")


@dataclass
class ExpertPlan:
    homes: list[list[str]]  # per MoE layer, per expert
    expert_bytes: int  # one expert as computed (compute dtype, or its quantized bytes)
    stored_expert_bytes: int  # one expert as read from its file
    top_k: int
    window: int
    prefetch_slots: int
    cache_slots: int
    pool_bytes: int  # the buffers travelling experts are computed in (device, or host RAM)
    host_bytes: int  # host RAM of the experts living there (arenas)
    device_is_host: bool
    where_max_tokens: float = 0.0  # under CUDA: computed on the CPU up to this many tokens
    why: str = ""
    router_bytes: int = 0  # the copy of every router the prediction uses, on the device
    notes: list[str] = field(default_factory=list)

    def count(self, tier: str) -> int:
        return sum(h == tier for layer in self.homes for h in layer)

    def device_bytes(self) -> int:
        """Device memory of the experts: those living there, the buffer pool (on a GPU), the
        routers' copies (on a CPU device this is host RAM, beside host_bytes)."""
        return self.count("device") * self.expert_bytes + self.pool_bytes + self.router_bytes

    def total(self) -> int:
        return sum(len(layer) for layer in self.homes)

    def per_step(self, batch: int = 1) -> dict[str, float]:
        """Expected bytes one decode step at `batch` touches per tier, routing spread evenly
        (each token's top-k drawn from a layer's E experts: E(1 - (1 - k/E)^batch) distinct
        experts per layer): 'device' read in place on the device, 'host' experts computed in
        host RAM, 'h2d' copied over, 'disk' read from NVMe. The expert cache lowers the moved
        ones by its hit rate, not assumed here."""
        out = {"device": 0.0, "host": 0.0, "h2d": 0.0, "disk": 0.0}
        for layer in self.homes:
            E = len(layer)
            distinct = E * (1 - (1 - self.top_k / E) ** batch)
            on_cpu = self.device_is_host or batch * self.top_k / distinct <= self.where_max_tokens
            for tier in EXPERT_HOMES:
                share = distinct * sum(h == tier for h in layer) / E
                if tier == "device":
                    out["host" if self.device_is_host else "device"] += share * self.expert_bytes
                elif tier == "cpu":
                    out["host" if on_cpu else "h2d"] += share * self.expert_bytes
                else:
                    out["disk"] += share * self.stored_expert_bytes
                    if not on_cpu:
                        out["h2d"] += share * self.expert_bytes
        return out

    def placement(self, prefetch: bool = True, zero_copy_host: bool | None = None) -> ExpertPlacement:
        return ExpertPlacement(self.homes, window=self.window,
                               prefetch_slots=self.prefetch_slots if prefetch else 0,
                               cache_slots=self.cache_slots, compute="auto",
                               where_max_tokens=self.where_max_tokens, zero_copy_host=zero_copy_host)

    def describe(self) -> str:
        n, dev = self.total(), "RAM (the device)" if self.device_is_host else "device"
        counts = ", ".join(f"{self.count(t)} {'in ' + dev if t == 'device' else 'in host RAM' if t == 'cpu' else 'on NVMe'}"
                           for t in EXPERT_HOMES if self.count(t))
        per = self.per_step(1)
        lines = [f"  experts: {n} of {format_bytes(self.expert_bytes)} each (stored "
                 f"{format_bytes(self.stored_expert_bytes)}), top-{self.top_k} per token: {counts}"]
        if self.pool_bytes:
            lines.append(f"  experts' buffers: {self.window} read ahead + {self.prefetch_slots} prefetch"
                         f" + {self.cache_slots} cache = {format_bytes(self.pool_bytes)}"
                         f"{'' if self.device_is_host else ' on the device'}; host RAM of experts "
                         f"{format_bytes(self.host_bytes)}")
        lines.append("  experts per decoded token (batch 1, routing spread evenly): "
                     + ", ".join(f"{k} {format_bytes(int(v))}" for k, v in per.items() if v))
        if self.why:
            lines.append(f"  experts off the device: {self.why}")
        lines += [f"  note: {x}" for x in self.notes]
        return "\n".join(lines)


def expert_floor_bytes(*, experts: int, expert_bytes: int, stored_expert_bytes: int, top_k: int,
                       device_is_host: bool, cache_bytes: int = 0, prefetch: bool = True,
                       staging_needed: bool = True, router_bytes: int = 0) -> int:
    """The device bytes plan_experts needs at least (every expert on NVMe): the buffer pool, the
    routers' copies, and on a CPU device the host staging too (one pool). The dense plan keeps
    them free (plan_inference's reserved_bytes) so that its blocks cannot leave the experts no
    room to run -- DeepSeek-V3's dense parts alone are larger than a 24 GB GPU."""
    buffers = min(experts, max(2, top_k)) + (min(experts, top_k) if prefetch else 0) + (
        cache_bytes // expert_bytes if cache_bytes > 0 else 0)
    floor = buffers * slot_raw_bytes(expert_bytes, cuda=not device_is_host) + router_bytes
    if device_is_host and staging_needed:
        floor += buffers * (stored_expert_bytes + 4096)
    return floor


def plan_experts(*, layers: int, experts: int, expert_bytes: int, stored_expert_bytes: int,
                 top_k: int, device_room: int, host_room: int, device_is_host: bool,
                 force: str | None = None, cache_bytes: int = 0, prefetch: bool = True,
                 device_flag: str = "--gpu-memory", host_flag: str = "--cpu-memory",
                 where_max_tokens: float = 0.0, why: str = "", staging_needed: bool = True,
                 router_bytes: int = 0) -> ExpertPlan:
    """Place `layers` x `experts` experts with `device_room` / `host_room` bytes left by the dense
    plan (on a CPU device both are the one host pool). `cache_bytes`: the expert cache's budget,
    on the device. `staging_needed`: NVMe reads land in host staging first (always under CUDA;
    on a CPU device when the file's dtype is not the compute dtype). Raises BudgetError naming
    what would fit."""
    if force is not None and force not in EXPERT_HOMES:
        raise ValueError(f"force must be one of {EXPERT_HOMES}")
    total = layers * experts
    window = min(experts, max(2, top_k))
    pre = min(experts, top_k) if prefetch else 0
    cache = min(total, cache_bytes // expert_bytes) if cache_bytes > 0 else 0
    one = slot_raw_bytes(expert_bytes, cuda=not device_is_host)
    pool = (window + pre + cache) * one
    # host staging per buffer: where NVMe reads land under CUDA, or to be converted on a CPU
    buffers, stored_one = window + pre + cache, stored_expert_bytes + 4096
    staging = (buffers * (stored_one if device_is_host else pinned_bytes(stored_one))
               if staging_needed else 0)

    def host_need(n_host: int, n_dev: int = 0) -> int:  # arenas per layer, staging if any on NVMe
        per_layer = _spread(n_host, layers)
        arenas = sum(a for k in per_layer for a, _ in host_arenas([expert_bytes] * k, not device_is_host))
        return arenas + (staging if n_host + n_dev < total else 0)

    if device_is_host:  # one pool: in RAM (computed in place) or on NVMe
        room = min(device_room, host_room) - router_bytes
        if force in ("device", "cpu") or (force is None and host_need(total) <= room):
            n_ram = total
        elif force == "nvme":
            n_ram = 0
        else:
            n_ram = total
            while n_ram > 0 and host_need(n_ram) + pool > room:
                n_ram -= max(1, (host_need(n_ram) + pool - room) // (expert_bytes + 8192))
            n_ram = max(0, n_ram)
        homes = _homes(layers, experts, 0, n_ram)
        plan = ExpertPlan(homes, expert_bytes, stored_expert_bytes, top_k, window, pre, cache,
                          pool if n_ram < total else 0, host_need(n_ram), True, router_bytes=router_bytes)
        need = plan.host_bytes + plan.pool_bytes + router_bytes
        if need > room + router_bytes:
            raise BudgetError(f"--experts {force or 'auto'}: the experts need {format_bytes(need)} of "
                              f"host RAM beside the rest of the model, {format_bytes(room + router_bytes)} is left; "
                              f"use --experts nvme (or auto), a smaller --expert-cache, or raise {host_flag}")
        return plan
    if force == "device" or (force is None and total * expert_bytes <= device_room):
        n_dev, n_host = total, 0
    elif force == "cpu":
        n_dev, n_host = 0, total
    elif force == "nvme":
        n_dev, n_host = 0, 0
    else:
        n_dev = max(0, min(total, (device_room - pool - router_bytes) // expert_bytes))
        n_host = total - n_dev
        while n_host and host_need(n_host, n_dev) > host_room:
            n_host -= max(1, (host_need(n_host, n_dev) - host_room) // (pinned_bytes(expert_bytes) + 8192))
        n_host = max(0, n_host)
    homes = _homes(layers, experts, n_dev, n_host)
    moving = n_dev < total
    plan = ExpertPlan(homes, expert_bytes, stored_expert_bytes, top_k, window, pre, cache,
                      pool if moving else 0, host_need(n_host, n_dev), False, where_max_tokens, why,
                      router_bytes=router_bytes)
    dev_need = plan.device_bytes()
    if dev_need > device_room:
        raise BudgetError(f"--experts {force or 'auto'}: the experts need {format_bytes(dev_need)} on the "
                          f"device beside the dense parts, {format_bytes(max(0, device_room))} is left; "
                          f"use --experts auto, a smaller --expert-cache, or raise {device_flag}")
    if plan.host_bytes > host_room:
        raise BudgetError(f"--experts {force}: the experts need {format_bytes(plan.host_bytes)} of "
                          f"host RAM, {format_bytes(max(0, host_room))} is left; use --experts auto "
                          f"or nvme, or raise {host_flag}")
    return plan


def _spread(n: int, layers: int) -> list[int]:
    """n experts over `layers` layers as evenly as possible (the first layers one more)."""
    return [n // layers + (1 if i < n % layers else 0) for i in range(layers)]


def _homes(layers: int, experts: int, n_dev: int, n_host: int) -> list[list[str]]:
    """Per layer: its share of the device experts first, then of host RAM, the rest NVMe."""
    # host RAM's share from the last layers up, so that a layer's two shares never overlap
    dev, host = _spread(n_dev, layers), _spread(n_host, layers)[::-1]
    out = []
    for i in range(layers):
        d = min(experts, dev[i])
        h = min(experts - d, host[i])
        out.append(["device"] * d + ["cpu"] * h + ["nvme"] * (experts - d - h))
    return out
