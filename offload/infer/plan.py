"""Inference placement planner: where each block's weights live, decided before anything loads.

Inputs are sizes only (block bytes, the non-block weights, KV cache and workspace per sequence)
and budgets (device and host bytes), so a 70B plan costs nothing to make and is printed before a
byte is read. Two modes:

  latency     fill the device with blocks first, then host RAM, then NVMe: fewest bytes
              streamed per step, best for batch 1;
  throughput  keep device memory for the KV cache and the batch: blocks go to host RAM, then
              NVMe; the plan reports the largest batch that fits at this context.

Resident blocks are spread evenly through the layer order rather than packed at the front:
while a resident block computes, the stream keeps filling slots, so interleaving them hides
more of the transfer time than one long resident run followed by a long streamed one.

On a CPU device the device *is* host RAM: there is one pool (the smaller of the two budgets),
blocks are resident ("device") or streamed from NVMe; "cpu" only appears when forced.

A plan that does not fit raises `BudgetError` saying what would (a batch size, a budget, a flag).
An accepted plan's device need includes every allocation of the run: resident blocks, slots,
KV cache and an activation workspace estimate with margin (`workspace_bytes`).

The training planner (a later issue) will live in its own module and reuse `Links` and
`spread`; nothing here is specific to generation except the workspace estimate.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nvme.io import ALIGN, IOEngine, aligned_empty
from offload.config import format_bytes
from offload.gpu import on_stream
from offload.stream.slots import slot_raw_bytes
from offload.memory.tiers import BudgetError, host_aligned, pinned_bytes

if TYPE_CHECKING:
    from offload.infer.expert_plan import ExpertPlan

MODES = ("latency", "throughput")
FORCED = ("device", "cpu", "nvme")
WORKSPACE_FIXED_BYTES = 64 << 20  # allocator slack, rotary tables, small temporaries


def workspace_bytes(hidden: int, intermediate: int, heads: int, vocab: int, context: int,
                    batch: int, itemsize: int, score_copies: int = 1) -> int:
    """Peak activation bytes of one forward over `batch` sequences of `context` tokens (prefill
    is the peak): a few hidden-sized tensors (`hidden`: the widest of the model's hidden size and
    its attention width), the MLP's intermediate tensors, the attention scores SDPA's math path
    may materialise (`score_copies` of them live at once: 3 for soft-capped scores, which
    Gemma 2 computes in the composite), and last-position logits in fp32. 25% margin."""
    tokens = batch * context
    hidden_bytes = tokens * (6 * hidden + 3 * intermediate) * itemsize
    scores = score_copies * batch * heads * context * context * max(itemsize, 4)
    logits = batch * vocab * 4 * 2
    return int(1.25 * (hidden_bytes + scores + logits))


def spread(count: int, total: int) -> list[int]:
    """`count` indices out of range(total), evenly spaced."""
    if count <= 0:
        return []
    return sorted({min(total - 1, int((j + 0.5) * total / count)) for j in range(count)})


@dataclass
class Links:
    """Measured link bandwidths in GB/s (1e9 B/s)."""
    h2d_gbps: float  # host -> device copy (on CPU: memcpy)
    disk_gbps: float  # checkpoint read, O_DIRECT when the filesystem allows
    disk_direct: bool = True


@dataclass
class InferencePlan:
    residency: list[str]
    mode: str
    batch_size: int
    context: int
    block_bytes: list[int]  # compute dtype
    stored_block_bytes: list[int]  # checkpoint dtype (what a disk read moves)
    non_block_bytes: int
    kv_bytes: int
    workspace_bytes: int
    slot_count: int
    slot_bytes: int  # all slots together
    staging_bytes: int
    device_need: int
    host_need: int
    device_budget: int
    host_budget: int
    device_is_host: bool
    zero_copy_host: bool
    max_batch: int | None = None
    notes: list[str] = field(default_factory=list)
    # "device", or "host": the KV cache in host RAM, each layer's brought to the device before
    # it runs (offload/infer/kv_cache.py; throughput mode, when it does not fit the device)
    kv_tier: str = "device"
    kv_h2d_bytes_per_step: int = 0  # past keys/values copied in per decode step (average)
    max_batch_device_kv: int | None = None  # throughput: the largest batch with the KV on the device
    # an MoE model's routed experts, placed one by one (offload/infer/expert_plan.py); the
    # blocks above are then their dense parts
    experts: "ExpertPlan | None" = None
    reserved_bytes: int = 0  # kept free for the experts' least (expert_floor_bytes): add_experts'

    def add_experts(self, experts: "ExpertPlan") -> None:
        """Join the experts' plan, made in what this plan left: its bytes count in the needs."""
        self.experts = experts
        dev = experts.device_bytes() - self.reserved_bytes
        if self.device_is_host:
            self.device_need += dev + experts.host_bytes
            self.host_need = self.device_need
        else:
            self.device_need += dev
            self.host_need += experts.host_bytes

    def count(self, tier: str) -> int:
        return sum(r == tier for r in self.residency)

    def tier_bytes(self, tier: str) -> int:
        return sum(b for b, r in zip(self.block_bytes, self.residency) if r == tier)

    def streamed_per_step(self) -> dict[str, int]:
        """Bytes moved per forward step over each link: 'h2d' (host-tier blocks copied in) and
        'disk' (NVMe blocks read, in the checkpoint's dtype)."""
        h2d = (0 if self.zero_copy_host else self.tier_bytes("cpu")) + self.kv_h2d_bytes_per_step
        disk = sum(s for s, r in zip(self.stored_block_bytes, self.residency) if r == "nvme")
        if self.experts is not None:  # the routed experts expected per step (spread evenly)
            e = self.experts.per_step(self.batch_size)
            h2d, disk = h2d + int(e["h2d"]), disk + int(e["disk"])
        return {"h2d": h2d, "disk": disk}

    def floor_s_per_step(self, links: Links) -> float:
        """Transfer time floor of one decode step: sum over links of bytes / bandwidth. (On a
        GPU the NVMe bytes also cross PCIe, overlapped with the read and much faster, so that
        leg is not added.)"""
        s = self.streamed_per_step()
        out = 0.0
        for key, gbps in (("h2d", links.h2d_gbps), ("disk", links.disk_gbps)):
            if s[key]:  # a link measured at 0 GB/s has no finite floor
                out += s[key] / (gbps * 1e9) if gbps > 0 else float("inf")
        return out

    def _experts_on(self, tier: str) -> str:
        """" + experts N" for the device or host line (an MoE model's experts, placed apart)."""
        e = self.experts
        if e is None:
            return ""
        n = {"device": e.device_bytes() + (e.host_bytes if self.device_is_host else 0),
             "host": 0 if self.device_is_host else e.host_bytes}[tier]
        return f" + experts {format_bytes(n)}" if n else ""

    def describe(self, links: Links | None = None) -> str:
        dev = "device (= host RAM)" if self.device_is_host else "device"
        lines = [f"plan: {self.mode} mode, batch {self.batch_size}, context {self.context} tokens",
                 f"  {dev}: {self.count('device')} blocks {format_bytes(self.tier_bytes('device'))}"
                 f" + non-block {format_bytes(self.non_block_bytes)} + KV cache "
                 f"{format_bytes(self.kv_bytes)} + workspace {format_bytes(self.workspace_bytes)}"
                 f" + {self.slot_count} slots {format_bytes(self.slot_bytes)}{self._experts_on('device')}"
                 f" = {format_bytes(self.device_need)} of {format_bytes(self.device_budget)}"]
        host_extra = f" + staging {format_bytes(self.staging_bytes)}" if self.staging_bytes else ""
        host_extra += self._experts_on("host")
        if self.device_is_host:
            lines.append(f"  host:   {self.count('cpu')} blocks {format_bytes(self.tier_bytes('cpu'))}"
                         f"{host_extra} (same pool as the device)")
        else:
            lines.append(f"  host:   {self.count('cpu')} blocks {format_bytes(self.tier_bytes('cpu'))}"
                         f"{host_extra} = {format_bytes(self.host_need)} of "
                         f"{format_bytes(self.host_budget)}")
        s = self.streamed_per_step()
        what = "blocks and routed experts" if self.experts is not None else "blocks"
        lines.append(f"  nvme:   {self.count('nvme')} blocks, {format_bytes(s['disk'])} read per step "
                     f"from disk ({what}), as stored (the checkpoint's shards, or the quantized blocks)")
        if links is not None:
            floor = self.floor_s_per_step(links)
            if floor > 0:
                lines.append(f"  floor:  {floor:.3f} s per step = {floor / self.batch_size:.3f} s per token "
                             f"(h2d {format_bytes(s['h2d'])} at {links.h2d_gbps:.2f} GB/s, disk "
                             f"{format_bytes(s['disk'])} at {links.disk_gbps:.2f} GB/s)")
            else:
                lines.append("  floor:  nothing streamed per step (compute-bound)")
        if self.kv_tier == "host":
            lines.append(f"  KV cache: {format_bytes(self.kv_bytes)} in host RAM (it does not fit the "
                         f"device beside the weights), one layer at a time on the device: "
                         f"{format_bytes(self.kv_h2d_bytes_per_step)} in per step on average")
        if self.max_batch is not None:
            kv_where = " with the KV cache in host RAM" if self.kv_tier == "host" else ""
            lines.append(f"  largest batch that fits at this context{kv_where}: {self.max_batch}")
        if self.max_batch_device_kv is not None and self.kv_tier == "host":
            lines.append(f"  largest batch with the KV cache on the device: {self.max_batch_device_kv}")
        if self.experts is not None:
            lines.append(self.experts.describe())
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class _Sizes:
    """What a placement needs, per tier, for one model on one machine (plan_inference's
    arithmetic, shared by the placement search and the final check)."""
    block_bytes: list[int]
    stored_block_bytes: list[int]
    non_block_bytes: int
    kv_bytes_per_seq: int
    workspace_per_seq: int
    device_is_host: bool
    depth: dict[str, int]  # tier -> blocks in flight ahead of the running one
    staging_needed: bool
    scratch_bytes: int = 0  # transient buffers of the first forward (kernel measurement)
    reserved_bytes: int = 0  # kept free for another planner (an MoE model's experts)
    kv_tier: str = "device"  # "host": offload/infer/kv_cache.py, `kv_ahead + 1` layers on the device
    num_layers: int = 1
    kv_ahead: int = 1

    def __post_init__(self) -> None:
        # Host buffers of a GPU run are pinned, and pinned memory is handed out in powers of
        # two (offload/memory/tiers.py, pinned_bytes): plan what they really take (desk review H4).
        self.host_size = (lambda b: b) if self.device_is_host else pinned_bytes
        self.host_block_bytes = [self.host_size(b) for b in self.block_bytes]

    def kv_device_per_seq(self) -> int:
        if self.kv_tier == "device":
            return self.kv_bytes_per_seq
        layers_on_device = min(self.kv_ahead + 1, self.num_layers)
        return -(-self.kv_bytes_per_seq * layers_on_device // self.num_layers)

    def kv_host(self, batch: int) -> int:
        """The host KV cache: one buffer per layer (OffloadedKVCache), each pinned at its own
        rounded size on a GPU (review 2 P10: the total rounded once was up to 2x short)."""
        if self.kv_tier != "host":
            return 0
        return self.num_layers * self.host_size(batch * self.kv_bytes_per_seq // self.num_layers)

    def fixed(self, batch: int) -> int:
        return (self.non_block_bytes + batch * (self.kv_device_per_seq() + self.workspace_per_seq)
                + WORKSPACE_FIXED_BYTES + self.scratch_bytes + self.reserved_bytes)

    def slots_for(self, res: list[str]) -> tuple[int, int]:
        """(slot count, their bytes): the streamer's own sizing (slot_raw_bytes)."""
        zero_copy = self.device_is_host  # host-tier blocks are used in place on a CPU device
        streamed = [i for i, r in enumerate(res) if r == "nvme" or (r == "cpu" and not zero_copy)]
        if not streamed:
            return 0, 0
        count = 1 + max(self.depth[res[i]] for i in streamed)
        largest = max(self.block_bytes[i] for i in streamed)
        return count, count * slot_raw_bytes(largest, cuda=not self.device_is_host)

    def staging_for(self, res: list[str]) -> int:
        if "nvme" not in res or not self.staging_needed:
            return 0
        return self.depth["nvme"] * self.host_size(
            max(self.stored_block_bytes[i] for i, r in enumerate(res) if r == "nvme") + ALIGN)

    def needs(self, res: list[str], batch: int) -> tuple[int, int, int, int]:
        """(device bytes, host bytes, slot count, slot bytes) of placement `res` at `batch`."""
        count, slot_b = self.slots_for(res)
        dev = self.fixed(batch) + slot_b + sum(
            b for b, r in zip(self.block_bytes, res) if r == "device")
        host = self.staging_for(res) + self.kv_host(batch) + sum(
            b for b, r in zip(self.host_block_bytes, res) if r == "cpu")
        if self.device_is_host:
            dev, host = dev + host, dev + host
        return dev, host, count, slot_b

    def max_batch_for(self, res: list[str], device_budget: int, host_budget: int | None = None) -> int:
        dev, host, _, _ = self.needs(res, 0)
        per_seq = self.kv_device_per_seq() + self.workspace_per_seq
        fits = max(0, (device_budget - dev) // per_seq) if per_seq else 0
        if self.kv_tier == "host" and host_budget is not None and self.kv_bytes_per_seq:
            # the host holds every sequence's keys and values (pinned: rounded up, so search)
            room = host_budget - host
            fits = min(fits, max(0, room // self.kv_bytes_per_seq))
            while fits and self.kv_host(fits) > room:
                fits -= 1
        return fits


def plan_inference(*, block_bytes: list[int], stored_block_bytes: list[int], non_block_bytes: int,
                   batch_size: int, context: int, kv_bytes_per_seq: int, workspace_per_seq: int,
                   device_budget: int, host_budget: int, device_is_host: bool,
                   device_budget_flag: str = "--gpu-memory", host_budget_flag: str = "--cpu-memory",
                   mode: str = "latency", force: str | None = None, host_ahead: int = 1,
                   nvme_ahead: int = 2, staging_needed: bool = True,
                   scratch_bytes: int = 0, reserved_bytes: int = 0, kv_tier: str = "auto",
                   num_layers: int | None = None, kv_ahead: int = 1, kv_positions_per_step: int | None = None) -> InferencePlan:
    """Place every block. `staging_needed`: NVMe reads go through host staging (always on a GPU;
    on CPU only when the checkpoint dtype differs from the compute dtype). `scratch_bytes`:
    transient device bytes beside the workspace (offload/models/kernels.py's measurement
    buffer), counted so that an accepted plan cannot run out of memory during them.
    `reserved_bytes`: device bytes kept free for an MoE model's experts (InferencePlan.add_experts).
    `kv_tier`: "device", "host" (offload/infer/kv_cache.py: the cache in host RAM, `kv_ahead + 1`
    layers of it on the device) or "auto": the device, unless throughput mode on a GPU cannot
    fit the batch's cache there and host RAM can. `kv_positions_per_step`: the cached positions
    a decode step reads on average (prompt + half the new tokens; default the context), for the
    floor of a host-tier cache."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if force is not None and force not in FORCED:
        raise ValueError(f"force must be one of {FORCED}")
    n = len(block_bytes)
    fill_mode = mode
    if device_is_host:  # one pool: the smaller budget governs, and both modes fill it alike
        device_budget = host_budget = min(device_budget, host_budget)
        device_budget_flag = host_budget_flag
        fill_mode = "latency"
    if kv_tier not in ("auto", "device", "host"):
        raise ValueError("kv_tier must be auto, device or host")
    sizes = _Sizes(list(block_bytes), list(stored_block_bytes), non_block_bytes, kv_bytes_per_seq,
                   workspace_per_seq, device_is_host, {"cpu": host_ahead, "nvme": nvme_ahead},
                   staging_needed, scratch_bytes, reserved_bytes, kv_tier="host" if kv_tier == "host" else "device",
                   num_layers=num_layers or max(1, n), kv_ahead=kv_ahead)

    def placement(sz: _Sizes) -> list[str]:
        return [force] * n if force is not None else _place(sz, batch_size, device_budget,
                                                            host_budget, fill_mode)

    res = placement(sizes)
    device_kv_sizes, device_kv_res = sizes, res
    if kv_tier == "auto" and mode == "throughput" and not device_is_host:
        sizes, res = _kv_on_host_if_it_fits(sizes, res, placement, batch_size, device_budget,
                                            host_budget)
    plan = _new_plan(sizes, res, mode, batch_size, context, device_budget, host_budget)
    if sizes.kv_tier == "host":
        positions = min(kv_positions_per_step or context, context)
        plan.kv_h2d_bytes_per_step = batch_size * kv_bytes_per_seq * positions // max(1, context)
        plan.notes.append(f"the KV cache is in host RAM, {min(kv_ahead + 1, sizes.num_layers)} layers "
                          f"of it on the device at a time" + (" (on a CPU device this only runs "
                          "the offload path: both are host RAM)" if device_is_host else ""))

    def max_batch_for(placement: list[str]) -> int:
        return sizes.max_batch_for(placement, device_budget, host_budget)

    if mode == "throughput":
        plan.max_batch = max_batch_for(res)
        if sizes.kv_tier == "host":
            plan.max_batch_device_kv = device_kv_sizes.max_batch_for(device_kv_res, device_budget)
    if device_is_host and force == "cpu":
        plan.notes.append("on a CPU device host-tier blocks are used in place (no copy)")
    if device_is_host and mode == "throughput":
        plan.notes.append("on a CPU device the KV cache and the weights share host RAM: "
                          "throughput mode places blocks like latency mode")
    # The leanest way to run on the device: every block streamed, from host RAM when it all fits
    # there (fewer slots), else from NVMe.
    leanest = ["nvme"] * n
    if not device_is_host and sum(sizes.host_block_bytes) <= host_budget:
        leanest = ["cpu"] * n
    _check(plan, force, device_budget_flag, host_budget_flag, max(block_bytes), leanest,
           max_batch_for, sizes.needs)
    return plan


def _kv_on_host_if_it_fits(sizes: _Sizes, res: list[str], placement, batch_size: int,
                           device_budget: int, host_budget: int) -> tuple[_Sizes, list[str]]:
    """(sizes, placement) with the batch's KV cache in host RAM when it does not fit the device
    and the placement with it on the host fits; else the ones given."""
    if sizes.needs(res, batch_size)[0] <= device_budget:
        return sizes, res
    # the batch's cache does not fit the device: keep it in host RAM if that fits
    on_host = dataclasses.replace(sizes, kv_tier="host")
    host_res = placement(on_host)
    dev, host, _, _ = on_host.needs(host_res, batch_size)
    if dev <= device_budget and host <= host_budget:
        return on_host, host_res
    return sizes, res


def _new_plan(sizes: _Sizes, res: list[str], mode: str, batch_size: int, context: int,
              device_budget: int, host_budget: int) -> InferencePlan:
    """The plan of placement `res` at `batch_size`, before its notes and check."""
    dev_need, host_need, slot_count, slot_b = sizes.needs(res, batch_size)
    return InferencePlan(residency=res, mode=mode, batch_size=batch_size, context=context,
                         block_bytes=list(sizes.block_bytes),
                         stored_block_bytes=list(sizes.stored_block_bytes),
                         non_block_bytes=sizes.non_block_bytes,
                         kv_bytes=batch_size * sizes.kv_bytes_per_seq,
                         workspace_bytes=(batch_size * sizes.workspace_per_seq
                                          + WORKSPACE_FIXED_BYTES + sizes.scratch_bytes),
                         slot_count=slot_count, slot_bytes=slot_b, staging_bytes=sizes.staging_for(res),
                         device_need=dev_need, host_need=host_need, device_budget=device_budget,
                         host_budget=host_budget, device_is_host=sizes.device_is_host,
                         zero_copy_host=sizes.device_is_host, kv_tier=sizes.kv_tier, reserved_bytes=sizes.reserved_bytes)


def _place(sizes: _Sizes, batch_size: int, device_budget: int, host_budget: int,
           fill_mode: str) -> list[str]:
    """Residency per block: all on the device when it fits (latency), else the smallest blocks
    that fit on the device (latency mode only), spread over the depth, then as many of the rest
    in host RAM as fit, the others on NVMe. Streaming room (slots, staging) is reserved unless
    everything ends up resident."""
    block_bytes, n = sizes.block_bytes, len(sizes.block_bytes)
    all_dev = ["device"] * n
    if fill_mode == "latency" and sizes.needs(all_dev, batch_size)[0] <= device_budget:
        return all_dev
    dev_room = device_budget - sizes.needs(["nvme"] * n, batch_size)[0]
    res = ["nvme"] * n
    for i in _spread_within(block_bytes, dev_room) if fill_mode == "latency" else []:
        res[i] = "device"
    if not sizes.device_is_host:
        rest = [i for i in range(n) if res[i] != "device"]
        rest_bytes = [sizes.host_block_bytes[i] for i in rest]
        # all of them when nothing is left for NVMe: no staging to reserve then
        for j in (range(len(rest)) if sum(rest_bytes) <= host_budget else
                  _spread_within(rest_bytes, host_budget - sizes.staging_for(["nvme"]))):
            res[rest[j]] = "cpu"
    return res


def _spread_within(block_bytes: list[int], room: int) -> list[int]:
    """The most blocks evenly spaced over the depth (`spread`) whose bytes fit in `room` (fewer
    than the smallest would allow where sizes differ: DeepSeek-V3's dense layers are larger)."""
    k = 0
    while k < len(block_bytes) and sum(sorted(block_bytes)[:k + 1]) <= room:
        k += 1
    while k and sum(block_bytes[i] for i in spread(k, len(block_bytes))) > room:
        k -= 1
    return spread(k, len(block_bytes))


def _check(plan: InferencePlan, force: str | None, dev_flag: str, host_flag: str, biggest: int,
           streaming: list[str], max_batch_for, needs) -> None:
    """Refuse a plan that does not fit, naming what would."""
    min_dev = needs(streaming, plan.batch_size)[0]
    where = "host RAM" if plan.device_is_host else "the device"
    if plan.device_need > plan.device_budget:
        if force == "device" or force == "cpu" and plan.device_is_host:
            raise BudgetError(f"--weights {force}: needs {format_bytes(plan.device_need)} in {where}, "
                              f"more than the {format_bytes(plan.device_budget)} budget; use "
                              f"--weights auto (stream what does not fit) or raise {dev_flag}")
        if plan.device_budget < biggest:
            raise BudgetError(f"the {where} budget of {format_bytes(plan.device_budget)} is below one "
                              f"block ({format_bytes(biggest)}); at least "
                              f"{format_bytes(min_dev)} is needed: raise {dev_flag}")
        hints = []
        fits = max_batch_for(streaming)
        if fits >= 1 and fits < plan.batch_size:
            hints.append(f"--batch-size {fits}")
        hints.append(f"{dev_flag} {format_bytes(min_dev)} or more")
        hints.append("fewer --max-new-tokens or shorter prompts (smaller KV cache)")
        if plan.mode == "latency" and not plan.device_is_host and plan.kv_tier == "device":
            hints.append("--mode throughput (the KV cache in host RAM)")
        raise BudgetError(f"even streaming every block needs {format_bytes(min_dev)} in {where} "
                          f"(non-block weights {format_bytes(plan.non_block_bytes)}, KV cache "
                          f"{format_bytes(plan.kv_bytes)}, workspace {format_bytes(plan.workspace_bytes)}, "
                          f"{plan.slot_count} slots {format_bytes(plan.slot_bytes)}), more than the "
                          f"{format_bytes(plan.device_budget)} budget; try " + ", or ".join(hints))
    if not plan.device_is_host and plan.host_need > plan.host_budget:
        if force == "cpu":
            raise BudgetError(f"--weights cpu: needs {format_bytes(plan.host_need)} of host RAM, more "
                              f"than the {format_bytes(plan.host_budget)} budget; use --weights auto "
                              f"or --weights nvme, or raise {host_flag}")
        raise BudgetError(f"NVMe streaming needs {format_bytes(plan.host_need)} of pinned host staging, "
                          f"more than the host budget of {format_bytes(plan.host_budget)}; raise "
                          f"{host_flag} to at least {format_bytes(plan.host_need)}")


# ---- link probe -----------------------------------------------------------------------------------
def measure_links(device: torch.device, read_paths: list[str], seconds: float = 1.0,
                  io: IOEngine | None = None, buffer_bytes: int = 64 << 20,
                  read_ranges: list[tuple[str, int, int]] | None = None) -> Links:
    """~`seconds` of measurement: host->device copy bandwidth (pinned source on CUDA; memcpy on
    CPU) and disk read bandwidth, O_DIRECT so the page cache cannot flatter it, from
    `read_ranges` ((path, offset, bytes): the bytes that will stream, when known) or else from
    the start of `read_paths` (the checkpoint shards). Reading the very bytes that will stream
    matters where something below us caches (a VM host's page cache): other bytes can be far
    colder than the ones every decode step reads again."""
    h2d = _probe_copy(device, seconds / 3, buffer_bytes if device.type == "cuda" else buffer_bytes // 2)
    disk, direct = _probe_disk(read_paths, 2 * seconds / 3, io, buffer_bytes, ranges=read_ranges)
    return Links(h2d_gbps=h2d, disk_gbps=disk, disk_direct=direct)


def streamer_disk_gbps(streamer, min_seconds: float, max_passes: int = 4) -> tuple[float, int]:
    """(GB/s, bytes read): the disk read the way a decode step reads it -- by `streamer` itself,
    its NVMe-tier blocks in order, its own requests (whole blocks through its IO engine) and its
    own depth of blocks in flight, no compute in between -- for at least `min_seconds` and at
    least one block more than that depth (so the pipeline is measured full), going round the
    blocks again when they run out (at most `max_passes` times: a decode step re-reads them too).
    (0.0, 0) when no block is on NVMe. The start-up probe (measure_links) reads other requests
    before the model is loaded; this one is what the run's floor is computed from."""
    nvme = [i for i, r in enumerate(streamer.residency) if r == "nvme"]
    if not nvme:
        return 0.0, 0
    ahead = max(1, min(streamer.depth["nvme"], len(streamer.slots) - 1, len(nvme)))
    order = nvme * max_passes
    want = min(len(order), ahead + 2)
    moved0 = streamer.stats.moved_bytes["disk"]
    t0 = time.perf_counter()
    # The rate in steady state: timed from the first block's arrival, counting the bytes read
    # after it. A short probe timed from the first request also counts the pipeline's start
    # (measured: a 1 s probe read 1.64 GB/s where a full pass read 2.44).
    t_first, moved_first = t0, moved0
    try:
        for k in range(ahead):
            streamer.fetch(order[k])
        done = 0
        for k, i in enumerate(order):
            streamer.wait(i)
            streamer.release(i)
            done += 1
            if done == 1 and len(order) > 1:
                t_first, moved_first = time.perf_counter(), streamer.stats.moved_bytes["disk"]
            if done >= want and time.perf_counter() - t0 >= min_seconds:
                break
            if k + ahead < len(order) and order[k + ahead] != i:
                streamer.fetch(order[k + ahead])
    finally:
        streamer.release_all()  # blocks fetched ahead and not used: back to their slots
        streamer.schedule.rewind()  # the cursor from the start
    moved = streamer.stats.moved_bytes["disk"] - moved0
    seconds = time.perf_counter() - t_first
    return (streamer.stats.moved_bytes["disk"] - moved_first) / seconds / 1e9, moved


def _probe_copy(device: torch.device, seconds: float, nbytes: int) -> float:
    cuda = device.type == "cuda"
    src = host_aligned(nbytes, cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # warm-up (first touch, lazy CUDA init)
    done, t0 = 0, time.perf_counter()
    while True:
        if cuda:
            # the events go on the probed device's stream: recorded on the current device's
            # (GPU 0 in a --gpu 1 run) the wait would be on an idle GPU and the bandwidth
            # several times too high (desk review L3)
            stream = torch.cuda.current_stream(device)
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True, blocking=True)
            start.record(stream)
            with on_stream(stream):
                dst.copy_(src, non_blocking=True)
            stop.record(stream)
            stop.synchronize()  # start-up probe only: waits on its own event
        else:
            dst.copy_(src)
        done += nbytes
        if time.perf_counter() - t0 >= seconds:
            break
    return done / (time.perf_counter() - t0) / 1e9


def disk_read_gbps(paths: list[str], io: IOEngine | None = None, buffer_bytes: int = 64 << 20,
                   ranges: list[tuple[str, int, int]] | None = None) -> tuple[float, bool]:
    """(GB/s, O_DIRECT used) for one full sequential pass over `paths` (or over `ranges`:
    (path, offset, bytes)), read the way the probe reads (O_DIRECT, several requests in flight).
    Slower than the start-up probe, but it reads all of the bytes given, so whatever caches sit
    between us and the media (a VM host's page cache, a drive's DRAM) count for it as they count
    for the stream."""
    return _probe_disk(paths, float("inf"), io, buffer_bytes, one_pass=True, ranges=ranges)


def _probe_disk(paths: list[str], seconds: float, io: IOEngine | None,
                nbytes: int, one_pass: bool = False,
                ranges: list[tuple[str, int, int]] | None = None) -> tuple[float, bool]:
    pages = []  # ranges widened to whole 4 KiB pages, as the streamer reads them: all O_DIRECT
    for p, off, n in ranges or ():
        if n > 0 and os.path.isfile(p):
            start = off // ALIGN * ALIGN
            end = min(-(-(off + n) // ALIGN) * ALIGN, os.path.getsize(p) // ALIGN * ALIGN)
            if end > start:
                pages.append((p, start, end - start))
    ranges = pages
    if not ranges:
        paths = [p for p in paths if os.path.isfile(p) and os.path.getsize(p) >= ALIGN]
        ranges = [(p, 0, os.path.getsize(p) // ALIGN * ALIGN) for p in paths]
    if not ranges:
        return 0.0, False
    own = io is None
    engine = io or IOEngine()
    try:
        direct = engine.direct_supported(ranges[0][0])
        # Several requests in flight, like the streamer's block reads (one request at a time
        # would leave most IO threads idle and understate the disk).
        in_flight, piece = 16, nbytes // 16 // ALIGN * ALIGN
        buf = aligned_empty(in_flight * piece)
        # Sequential through each range in turn, like the streamer reading block after block.
        chunks = [(p, start + off, min(piece, n - off)) for p, start, n in ranges
                  for off in range(0, n, piece)]
        pending: list = []
        done, t0, k = 0, time.perf_counter(), 0
        while True:
            path, off, n = chunks[k % len(chunks)]
            if len(pending) == in_flight:
                done += pending.pop(0).wait().nbytes
            slot = k % in_flight  # the oldest request, just collected, used this part of buf
            pending.append(engine.submit_read(path, off, buf[slot * piece:slot * piece + n]))
            k += 1
            if time.perf_counter() - t0 >= seconds or (one_pass and k == len(chunks)):
                break
        for h in pending:
            done += h.wait().nbytes
        return done / (time.perf_counter() - t0) / 1e9, direct
    finally:
        if own:
            engine.close()
