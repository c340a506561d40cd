"""The memory plan of offloaded training: bytes per tier and kind, decided before anything is
allocated, checked against budgets, printable. The engine refuses to start on a plan that does
not fit; `runners.finetune --dry-run` prints the same plan and exits.

Per parameter (Φ) and 16-bit training, the model state is 16 bytes: 2 (weights) + 2 (grads) +
12 (fp32 master + exp_avg + exp_avg_sq). Where each part lives is the offload choice:

    offload   device           host                                  nvme
    none      2 + 2(4) + 12    -                                     -
    cpu       2                2(4) grads + 12 state                 -
    nvme      2                2(4) grads + buffers x largest block  12

(gradients are 4 bytes when accumulating micro-batches or training in fp32.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.memory.blocks import resident_weight_bytes
from offload.config import ConfigError, GradStorageName, OffloadConfig, StepPathName, format_bytes
from offload.grads.landing import GradLanding
from offload.memory.mapped import maps_frozen_rest
from offload.optim.state import NvmeState, ResidentState
from offload.memory.tiers import (TIERS, BudgetError, PlanBytes, check_fits, device_free_bytes,
                           disk_free_bytes, host_free_bytes, local_ranks, no_pinning,
                           node_share, pinned_bytes)
from offload.stream.train import TrainingStreamer
from offload.zero.group import Shards, env_world


@dataclass
class TrainingPlan:
    cfg: OffloadConfig
    device: torch.device
    num_params: int
    max_block_params: int
    num_blocks: int
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> kind -> bytes
    # NVMe-tier bytes read from where they already are (a quantized base's block files in their
    # cache), not written into nvme_dir: the disk check leaves them out
    nvme_in_place: int = 0
    # The decisions, taken here from the config once: build (offload/train/build.py) allocates
    # from them and nothing below the plan asks the config for them again.
    world: int = 1  # data-parallel ranks (offload/zero/group.py)
    step_path: StepPathName = "after"  # how the step meets backward (offload/train/paths.py)
    step_path_why: str = ""  # ... and why (the start banner says it)
    grad_storage: GradStorageName = "per_block"  # the gradient landing buffers (grads/storage.py)
    grad_pool: int = 0  # the pool buffers of "pooled" landing
    shares_masters: bool = False  # resident 16-bit weights are views of their fp32 masters
    upload_ring: int = 0  # pinned slots new weights are uploaded from (0: no upload ring)
    # mixtures of experts (offload/train/experts.py): per block, where optimizer-state units
    # end (each expert its own unit) and the expert slots, whose units an update without
    # tokens for them does not touch; how "step" experts without tokens are stepped, and why
    unit_cuts: list[list[int]] | None = None
    expert_slots: dict[int, frozenset[str]] = field(default_factory=dict)
    expert_replay: str = "none"  # "lazy" | "eager" | "none"
    expert_replay_why: str = ""
    # NVMe state, lazy replay: host RAM the replayed experts' state is held in until the step
    # (offload/optim/state.py NvmeState.hold); in bytes["host"]["buffers"]
    replay_hold_bytes: int = 0

    def total(self, tier: str) -> int:
        return sum(self.bytes.get(tier, {}).values())

    def check(self) -> None:
        """Raise BudgetError (saying what would fit) unless every tier fits its budget and what
        is free right now."""
        cfg = self.cfg
        what = f"{self.num_params / 1e6:.1f}M parameters ({cfg.dtype}, offload={cfg.offload!r})"
        n = local_ranks()  # ranks on this machine share its RAM and disks: each its 1/n (P5)
        if n > 1:
            what += f" on each of the {n} ranks of this machine (each plans against 1/{n} of it)"
        host_free = node_share(host_free_bytes())
        # delayed_update holds a second copy of the weights and gradients: say so first
        delayed = "turn off delayed_update (it doubles weights and gradients), " if cfg.delayed_update else ""
        check_fits("device", self.total("device"), cfg.budget_bytes("device"),
                   device_free_bytes(self.device) if self.device.type == "cuda" else host_free, what,
                   delayed + "use offload='cpu' or 'nvme' (optimizer state off the device), a "
                   "smaller model, or raise the device budget (--gpu-memory)")
        host_hint = delayed + ("use offload='nvme' to keep optimizer state on disk, or raise the "
                               "host budget (--cpu-memory)" if cfg.offload == "cpu" else
                               "lower buffer_count, or raise the host budget (--cpu-memory)")
        check_fits("host", self.total("host"), cfg.budget_bytes("host"), host_free,
                   what, host_hint)
        if self.device.type == "cpu":  # device and host are one RAM: both at once must fit it,
            # and the host budget (--cpu-memory) bounds that RAM whichever tier a byte is in
            check_fits("host", self.total("device") + self.total("host"), cfg.budget_bytes("host"),
                       host_free, what + " (device and host tiers share the CPU's RAM)",
                       delayed + ("a smaller model, or raise the host budget (--cpu-memory)"
                                  if cfg.offload == "nvme" else
                                  "use offload='nvme', a smaller model, or raise the host budget "
                                  "(--cpu-memory)"))
        if cfg.offload == "nvme" or cfg.offload_params == "nvme":  # what is written into nvme_dir
            check_fits("nvme", self.total("nvme") - self.nvme_in_place, cfg.budget_bytes("nvme"),
                       node_share(disk_free_bytes(cfg.nvme_dir or ".")), what,
                       f"free disk space under {cfg.nvme_dir} or choose another offload dir")

    def format(self) -> str:
        cfg = self.cfg
        lines = [f"memory plan: {self.num_params / 1e6:.2f}M trainable parameters in "
                 f"{self.num_blocks} blocks (largest {self.max_block_params / 1e6:.2f}M), "
                 f"{cfg.dtype}, offload={cfg.offload}, device={self.device}"]
        for tier in TIERS:
            kinds = self.bytes.get(tier, {})
            if not kinds:
                continue
            budget = cfg.budget_bytes(tier)
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items() if v)
            lines.append(f"  {tier:>6}: {format_bytes(self.total(tier)):>11}  ({parts})"
                         + (f"  budget {format_bytes(budget)}" if budget is not None else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one block for the planned batch: with everything kept for backward
    (`full`), and what a checkpoint keeps (`input`: the block's input hidden states)."""
    full: int
    input: int
    head: int = 0  # logits and loss outside the blocks
    # QLoRA: the dense weight a quantized projection dequantizes to compute, one at a time in
    # forward, recompute and backward (autograd keeps only its codes: review 2 P4)
    transient: int = 0


LOSS_HEAD_FP32_COPIES = 4  # fp32 [b, s, vocab] tensors live when backward starts


def llama_activation_estimate(model_cfg, batch: int, seq: int, dtype: torch.dtype
                              ) -> ActivationEstimate:
    """Estimate for a decoder block: Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) bytes at 16 bits
    (attention scores counted; SDPA's fused kernels keep less), scaled to the dtype, plus what
    the families add to the Llama block: attention wider than hidden (Gemma, Qwen3), an MLP
    wider than 4h, q/k norms' inputs, Gemma's two more norms, and soft-capped scores (Gemma 2's
    composite keeps the capped scores and their tanh as well); and the loss head: logits
    [b, s, vocab] in fp32 four times at the start of backward -- log-softmax's output, the
    loss's gradient, log-softmax's gradient, and a fourth that CUDA's backward keeps (measured:
    12 b*s*vocab bytes on the CPU, tests/test_plan_measured.py; on an H200 on 2026-11-28 the
    peak-memory test of tests/test_cuda.py held ~6 b*s*vocab bytes more than the 8 planned
    until then, docs/GPU_PROOF.md)."""
    h, a = model_cfg.hidden_size, model_cfg.num_attention_heads
    q, kv, f = model_cfg.q_size, model_cfg.kv_size, model_cfg.intermediate_size
    extra = 11 * max(0, q - h) + 19 * max(0, f - 4 * h) / 4  # per token, 16-bit units
    extra += 2 * (q + 2 * kv) if model_cfg.qk_norm else 0
    extra += 4 * h if model_cfg.sandwich_norms else 0
    score_units = 9 if model_cfg.attn_logit_softcapping else 5
    scale = dtype.itemsize / 2
    full = int(seq * batch * (h * 34 + extra + score_units * a * seq) * scale)
    return ActivationEstimate(full=full, input=seq * batch * h * dtype.itemsize,
                              head=LOSS_HEAD_FP32_COPIES * batch * seq * model_cfg.vocab_size * 4)


def training_device(cfg: OffloadConfig) -> torch.device:
    """The device an engine trains on: cfg.device, or under torchrun cuda:LOCAL_RANK."""
    device = cfg.resolve_device()
    if cfg.device is None and device.type == "cuda":
        device = torch.device("cuda", env_world()[2])  # torchrun: cuda:LOCAL_RANK
    return device


def upload_ring_len(buffer_count: int, num_blocks: int) -> int:
    """Pinned slots new 16-bit weights are uploaded from: a block can be stepped into one while
    the previous one's upload runs."""
    return max(2, min(buffer_count, num_blocks))


def decide(blocks: list[tuple[int, bool]], cfg: OffloadConfig, device: torch.device,
           world: int = 1) -> TrainingPlan:
    """The plan's decisions for `blocks` under `cfg` (its bytes still empty): how the step
    meets backward, the gradient landing, shared masters, the upload ring."""
    sizes = [n for n, _ in blocks]
    path, why = cfg.step_path(world)
    storage, pool = cfg.grad_landing(len(blocks), device, world)
    ring = (upload_ring_len(cfg.buffer_count, len(blocks))
            if device.type == "cuda" and cfg.offload != "none" else 0)
    return TrainingPlan(cfg, device, sum(sizes), max(sizes), len(blocks), world=world,
                        step_path=path, step_path_why=why, grad_storage=storage,
                        grad_pool=pool, shares_masters=cfg.weights_share_masters(device, world),
                        upload_ring=ring)


def plan_training(blocks: list[tuple[int, bool]], cfg: OffloadConfig,
                  device: torch.device | None = None,
                  activations: ActivationEstimate | None = None, world: int = 1,
                  frozen_layer_bytes: list[int] | None = None,
                  frozen_resident_bytes: int = 0, frozen_in_place: bool = False,
                  rest_module_numel: int | None = None) -> TrainingPlan:
    """Bytes per tier for training a model whose trainable parameters form `blocks`
    ((element count, is a ModuleList layer) each), under `cfg`; activations when estimated.
    `world` > 1: one of that many data-parallel ranks (cfg.zero_stage; offload/zero/group.py) --
    flat buffers padded to equal shards, optimizer state for rank 0's shard (the largest).
    The sum of what each component says it will allocate (its plan_bytes(), beside its
    constructor; the stepper's rings and the delayed update's shadow weights below), so the plan
    cannot drift from the allocations: tests/test_plan_measured.py builds every tier combination
    and compares the two. The decisions the allocations follow are the plan's own (decide()).
    Frozen parameters (a LoRA base): `frozen_layer_bytes`, each layer's frozen parameters
    (blocks.frozen_bytes), are streamed when offload_params is set (offload/stream/frozen.py;
    the trainable blocks then stay resident), else resident on the device like
    `frozen_resident_bytes` (frozen parameters outside the layers): "frozen" weights that never
    get a gradient, master or moment. `frozen_in_place`: the layers' base is read from files
    it is already in (a quantized base's blocks), so on NVMe it takes no room in nvme_dir.
    At stage 3 the resident (non-layer) blocks keep only this rank's shard, and each module
    gathers its parameters around its forward (offload/zero/rest.py): `rest_module_numel`, the
    most elements one module gathers (zero_rest.largest_module_numel; default: the largest
    such block, an upper bound)."""
    plan = decide(blocks, cfg, device or cfg.resolve_device(), world)
    sizes = [n for n, _ in blocks]
    layers = [i for i, (_, is_layer) in enumerate(blocks) if is_layer]
    # stage 3 across ranks streams every layer from this rank's shard of it (offload/zero/group.py)
    stage3 = world > 1 and cfg.zero_stage == 3
    frozen_streamed = any(frozen_layer_bytes or []) and cfg.offload_params != "none"
    streamed = set(layers) if (cfg.offload_params != "none" and not frozen_streamed) or stage3 else set()
    # Host buffers that cross the link are pinned on a GPU, and pinned memory comes in powers
    # of two (offload/memory/tiers.py, pinned_bytes): plan what they really take (desk review H4).
    pin = pinned_bytes if plan.device.type == "cuda" and cfg.pin_memory else no_pinning
    resident = [n for i, n in enumerate(sizes) if i not in streamed]
    padded, state_sizes = sizes, sizes
    if world > 1:
        padded = [Shards(n, world).padded for n in sizes]
        if cfg.zero_stage >= 1:
            state_sizes = [min(n, Shards(n, world).size) for n in sizes]
            resident = [(Shards(sizes[i], world).size if stage3 else padded[i])
                        for i in range(len(sizes)) if i not in streamed]
    parts = _weight_bytes(plan, sizes, streamed, resident, pin, rest_module_numel)
    parts += _frozen_bytes(plan, frozen_layer_bytes or [], frozen_streamed,
                           frozen_resident_bytes, pin)
    parts += _step_bytes(plan, sizes, padded, state_sizes, resident, streamed, layers, pin)
    if activations is not None:
        parts.append(activation_bytes(activations, cfg, len(layers), pin))
    if frozen_in_place and frozen_streamed and cfg.offload_params == "nvme":
        plan.nvme_in_place = sum(frozen_layer_bytes)
    plan.bytes = {tier: {} for tier in TIERS}
    for part in parts:
        for (tier, kind), nbytes in part.items():
            plan.bytes[tier][kind] = plan.bytes[tier].get(kind, 0) + nbytes
    return plan


def _weight_bytes(plan: TrainingPlan, sizes: list[int], streamed: set[int], resident: list[int],
                  pin, rest_module_numel: int | None) -> list[PlanBytes]:
    """The trainable blocks' 16-bit weights: resident (none of their own when they are views of
    the masters), the stage-3 modules' gathers, the streamer's slots and homes."""
    cfg, world = plan.cfg, plan.world
    itemsize = cfg.torch_dtype.itemsize
    stage3 = world > 1 and cfg.zero_stage == 3
    parts = [resident_weight_bytes([] if plan.shares_masters else resident, itemsize)]
    rest = [sizes[i] for i in range(len(sizes)) if i not in streamed]
    if stage3 and rest:  # the modules' gathered parameters, one module at a time
        parts.append({("device", "buffers"): (rest_module_numel if rest_module_numel is not None
                                              else max(rest)) * itemsize})
    if streamed:
        parts.append(TrainingStreamer.plan_bytes(
            [sizes[i] for i in sorted(streamed)],
            "cpu" if stage3 and cfg.offload_params == "none" else cfg.offload_params,
            itemsize, cuda=plan.device.type == "cuda",
            pin=pin, host_ahead=1, nvme_ahead=cfg.prefetch_blocks, world=world if stage3 else 1,
            home="device" if stage3 and cfg.offload_params == "none" else "host"))
    return parts


def _frozen_bytes(plan: TrainingPlan, frozen_layer_bytes: list[int], frozen_streamed: bool,
                  frozen_resident_bytes: int, pin) -> list[PlanBytes]:
    """Frozen parameters: a streamed base's slots and homes, or the base on the device, and
    the frozen parameters outside the layers."""
    cfg, parts = plan.cfg, []
    if frozen_streamed:
        parts.append(TrainingStreamer.plan_bytes(  # FrozenBaseStreamer allocates the same
            [n for n in frozen_layer_bytes if n], cfg.offload_params, 1,
            cuda=plan.device.type == "cuda", pin=pin,
            host_ahead=1, nvme_ahead=cfg.prefetch_blocks))
    frozen_device = 0 if frozen_streamed else sum(frozen_layer_bytes)
    # the frozen parameters outside the layers: mapped from swap files or resident (mapped.py)
    rest_tier = "nvme" if maps_frozen_rest(cfg.offload_params, plan.device) else "device"
    for tier, nbytes in ((rest_tier, frozen_resident_bytes), ("device", frozen_device)):
        if nbytes:
            parts.append({(tier, "frozen"): nbytes})
    return parts


def _step_bytes(plan: TrainingPlan, sizes: list[int], padded: list[int], state_sizes: list[int],
                resident: list[int], streamed: set[int], layers: list[int],
                pin) -> list[PlanBytes]:
    """The optimizer state, the gradient landing, the stepper's rings and the delayed update's
    shadow weights."""
    cfg = plan.cfg
    itemsize = cfg.torch_dtype.itemsize
    if cfg.offload == "nvme":
        parts = [NvmeState.plan_bytes(state_sizes, cfg.buffer_count, cfg.sub_group_size)]
    else:
        parts = [ResidentState.plan_bytes(state_sizes, "device" if cfg.offload == "none" else "host")]
    parts.append(GradLanding.plan_bytes(
        padded, cfg.torch_dtype, cfg.grad_accum_steps, cuda=plan.device.type == "cuda",
        landing_tier="device" if cfg.offload == "none" else "host", storage=plan.grad_storage,
        pool_buffers=plan.grad_pool, pooled_blocks=set(layers) or None, pin=pin, world=plan.world))
    nvme_layers = [sizes[i] for i in sorted(streamed)] if cfg.offload_params == "nvme" else []
    parts.append(step_ring_bytes(plan.upload_ring, sizes, nvme_layers, itemsize, cfg.buffer_count, pin))
    if plan.step_path == "delayed":
        parts.append(shadow_weight_bytes(resident, itemsize))
    if plan.step_path == "speculative":  # each touched block's pre-step state, until validated
        parts.append(NvmeState.rollback_bytes(state_sizes) if cfg.offload == "nvme" else
                     rollback_copy_bytes(state_sizes, "device" if cfg.offload == "none" else "host"))
    return parts


def rollback_copy_bytes(numels: list[int], tier: str) -> PlanBytes:
    """The speculative step's copies of the resident state (offload/train/speculative.py
    PreStepCopies): master + exp_avg + exp_avg_sq of every block, on the state's tier."""
    return {(tier, "rollback"): sum(numels) * 12}


def step_ring_bytes(upload_ring: int, numels: list[int], nvme_layer_numels: list[int],
                    itemsize: int, buffer_count: int, pin) -> PlanBytes:
    """What BlockStepper allocates (offload/train/stepper.py): the pinned upload ring
    (`upload_ring` slots of the largest block) and the write-behind ring of the blocks whose
    16-bit weights live in swap files (`nvme_layer_numels`; pageable)."""
    ring = upload_ring * pin(max(numels) * itemsize) if upload_ring else 0
    if nvme_layer_numels:
        ring += buffer_count * max(nvme_layer_numels) * itemsize
    return {("host", "buffers"): ring} if ring else {}


def shadow_weight_bytes(resident_numels: list[int], itemsize: int) -> PlanBytes:
    """The delayed update's shadow copy of the resident 16-bit weights (the job's output,
    offload/train/delayed.py)."""
    return {("device", "weights"): sum(resident_numels) * itemsize}


def activation_bytes(est: ActivationEstimate, cfg: OffloadConfig, num_layers: int,
                     pin) -> PlanBytes:
    """Estimated activations: every layer's (or, checkpointed, its input) on the device -- or
    the inputs in host RAM with offload_activations -- plus, checkpointed, one layer's full
    set while it is recomputed, and the head's logits."""
    per_layer = est.input if cfg.activation_checkpointing else est.full
    kept = 0 if cfg.offload_activations else per_layer * num_layers
    out = {("device", "activations"): kept + est.head + est.transient + (
        est.full if cfg.activation_checkpointing else 0)}
    if cfg.offload_activations:
        out["host", "activations"] = pin(est.input) * num_layers
    return out


# The configurations `choose_training_config` tries, fastest first: each step moves the
# largest remaining consumer of the scarcest tier one tier down.
CANDIDATES: list[tuple[str, dict]] = [
    ("all on the device", dict(offload="none", offload_params="none", activation_checkpointing=False)),
    ("optimizer state in host RAM", dict(offload="cpu", offload_params="none", activation_checkpointing=False)),
    ("+ activation checkpointing", dict(offload="cpu", offload_params="none", activation_checkpointing=True)),
    ("optimizer state on NVMe", dict(offload="nvme", offload_params="none", activation_checkpointing=True)),
    ("+ weights streamed from host RAM", dict(offload="nvme", offload_params="cpu", activation_checkpointing=True)),
    ("+ activations in host RAM", dict(offload="nvme", offload_params="cpu", activation_checkpointing=True,
                                       offload_activations=True)),
    ("weights streamed from NVMe", dict(offload="nvme", offload_params="nvme", activation_checkpointing=True,
                                        offload_activations=True)),
]


# With a frozen base (LoRA) the trainable state is small and the base is what fills the
# device: it is streamed (offload_params) before the adapters' state moves to NVMe.
FROZEN_BASE_CANDIDATES: list[tuple[str, dict]] = [
    ("all on the device", dict(offload="none", offload_params="none", activation_checkpointing=False)),
    ("adapters' state in host RAM", dict(offload="cpu", offload_params="none", activation_checkpointing=False)),
    ("+ activation checkpointing", dict(offload="cpu", offload_params="none", activation_checkpointing=True)),
    ("+ frozen base streamed from host RAM", dict(offload="cpu", offload_params="cpu", activation_checkpointing=True)),
    ("+ activations in host RAM", dict(offload="cpu", offload_params="cpu", activation_checkpointing=True,
                                       offload_activations=True)),
    ("frozen base streamed from NVMe", dict(offload="cpu", offload_params="nvme", activation_checkpointing=True,
                                            offload_activations=True)),
    ("+ adapters' state on NVMe", dict(offload="nvme", offload_params="nvme", activation_checkpointing=True,
                                       offload_activations=True)),
]


def plan_fits(plan: TrainingPlan) -> str | None:
    """None when the plan fits, else why not (BudgetError's message)."""
    try:
        plan.check()
    except BudgetError as e:
        return str(e)
    return None


def choose_training_config(blocks: list[tuple[int, bool]], base: OffloadConfig,
                           device: torch.device, activations: ActivationEstimate | None = None,
                           world: int = 1, frozen_layer_bytes: list[int] | None = None,
                           frozen_resident_bytes: int = 0,
                           candidates: list[tuple[str, dict]] | None = None,
                           frozen_in_place: bool = False,
                           rest_module_numel: int | None = None) -> tuple[OffloadConfig, str]:
    """The fastest candidate configuration that fits the budgets (NVMe ones only when
    base.nvme_dir is set), and a sentence saying why. Raises BudgetError saying what would fit.
    A frozen base (plan_training's frozen_* bytes) is weighed as the plan counts it, and tried
    with FROZEN_BASE_CANDIDATES unless `candidates` are given."""
    last_error = None
    if candidates is None:
        candidates = FROZEN_BASE_CANDIDATES if any(frozen_layer_bytes or []) else CANDIDATES
    for label, changes in candidates:
        if "nvme" in (changes["offload"], changes["offload_params"]) and not base.nvme_dir:
            continue
        try:
            cfg = base.replace(**{"offload_activations": False, **changes})
        except ConfigError:  # a combination the base's other options exclude (delayed_update)
            continue
        why = plan_fits(plan_training(blocks, cfg, device, activations, world=world,
                                      frozen_layer_bytes=frozen_layer_bytes,
                                      frozen_resident_bytes=frozen_resident_bytes,
                                      frozen_in_place=frozen_in_place,
                                      rest_module_numel=rest_module_numel))
        if why is None:
            return cfg, f"chose '{label}': the fastest configuration that fits the budgets"
        last_error = why
    hint = ("" if base.nvme_dir else " (give an offload dir to let the planner use NVMe)")
    grads = ""  # (a frozen base's adapters have small gradients: not worth a word then)
    if base.replace(offload="nvme").grad_landing(len(blocks), device)[0] != "pooled" \
            and base.grad_accum_steps == 1 and not any(frozen_layer_bytes or []):
        grads = ("; gradients are held for the whole model because " +
                 ("clipping needs the global norm" if base.grad_clip > 0 else "the fp16 overflow "
                  "check needs every gradient") + " before the step — without it (--grad-clip 0, "
                 "bf16) they stream through a few block-sized buffers")
    raise BudgetError(f"no offload configuration fits{hint}; the smallest still fails: "
                      f"{last_error}{grads}; a smaller batch or sequence length, or larger budgets "
                      f"would")


def estimator_table(blocks: list[tuple[int, bool]], base: OffloadConfig, device: torch.device,
                    activations: ActivationEstimate | None = None) -> str:
    """The ZeRO paper's memory table for this model and machine: bytes per parameter on each
    tier for each configuration, the totals, and whether it fits the budgets."""
    n = sum(size for size, _ in blocks)
    lines = [f"memory estimator: {n / 1e9:.2f}B parameters, {base.dtype}, device {device}",
             f"  {'configuration':<34} {'device B/param':>14} {'host B/param':>12} "
             f"{'nvme B/param':>12} {'device':>10} {'host':>10} {'nvme':>10}  fits"]
    for label, changes in CANDIDATES:
        try:
            cfg = base.replace(**{"offload_activations": False, "nvme_dir": base.nvme_dir or ".", **changes})
        except ConfigError as e:  # excluded by the base's other options
            lines.append(f"  {label:<34} n/a: {e}")
            continue
        plan = plan_training(blocks, cfg, device, activations)
        states = {t: sum(v for k, v in plan.bytes[t].items() if k != "activations") for t in TIERS}
        fits = "yes" if plan_fits(plan) is None else "no"
        lines.append(f"  {label:<34} {states['device'] / n:14.2f} {states['host'] / n:12.2f} "
                     f"{states['nvme'] / n:12.2f} {format_bytes(plan.total('device')):>10} "
                     f"{format_bytes(plan.total('host')):>10} {format_bytes(plan.total('nvme')):>10}  {fits}")
    lines.append("  (B/param: model states only — weights, gradients, fp32 masters and moments, "
                 "buffers; the GiB columns add estimated activations)")
    return "\n".join(lines)
