"""The ZeRO-Offload training engine: 16-bit weights on the device, fp32 masters and Adam
moments in host RAM or NVMe swap files, gradients out during backward, AdamW on the CPU.

    engine = offload.initialize(model, cfg)
    loss = loss_fn(model(batch))
    engine.backward(loss)
    applied = engine.step()      # once per micro-batch; updates every grad_accum_steps calls

One update, in order:
1. backward: each parameter's gradient is copied to its block's host landing buffer as soon
   as autograd finishes it (offload/grads/landing.py); the norm accumulates as gradients land.
2. step: global norm -> clip coefficient and fp16 overflow check (no extra pass over memory).
3. blocks in the order their gradients completed (last layer first): wait for the block's
   optimizer state (NVMe: already read ahead), one fused AdamW pass writes fp32 state and the
   16-bit weights, the state is written behind, the 16-bit weights go to the device at once.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Mapping

import torch
from torch import nn

from offload.train.activations import (ActivationStore, disable_activation_checkpointing,
                                 enable_activation_checkpointing)
from offload.memory.blocks import bind_views, frozen_bytes, group_blocks
from offload.config import ConfigError, OffloadConfig, as_config
from offload.train.counters import TrainingCounters
from offload.train import state as engine_state
from offload.train import build as placement
from offload.train.delayed import Delayed
from offload.train.state import NonFiniteError, StateError
from offload.gpu import GpuPhaseTimer
from offload.memory.mapped import forget
from offload.grads.landing import GradLanding
from offload.optim.state import NvmeState, ResidentState
from offload.train.paths import AfterBackward, Overlapped
from offload.train.stepper import BlockStepper, StepReport, Update
from offload.memory.tiers import (BudgetError, LinkCounter, MemoryAccount, format_report, freeze_pin_cap,
                           peak_rss_bytes, large_frees_to_os, started_worker)
from offload.train.plan import plan_training
from offload.zero.group import BlockReducer, Reductions, ZeroGroup, env_world
from offload.zero.rest import largest_module_numel


def _counter(name: str, doc: str) -> property:
    """An Engine attribute that is one of its TrainingCounters (the public names stay)."""
    return property(lambda self: getattr(self.counters, name),
                    lambda self, value: setattr(self.counters, name, value), doc=doc)


class Engine:
    global_step = _counter("global_step", "optimizer updates applied")
    micro_step = _counter("micro_step", "engine.step() calls")
    loss_scale = _counter("loss_scale", "the fp16 loss scale (1.0 otherwise)")
    skipped_steps = _counter("skipped_steps", "updates skipped for inf/nan")
    nonfinite_streak = _counter("nonfinite_streak", "updates skipped in a row for inf/nan")
    slot_skips = _counter("slot_skips", "updates each parameter missed (no gradient), by name")

    def __init__(self, model: nn.Module, cfg: OffloadConfig, source: Any = None):
        owner = getattr(model, "_offload_engine", None)
        if owner is not None and not owner._closed:
            raise RuntimeError("this model is already wrapped by an open offload engine (its "
                               "weights now live in that engine's tiers); use that engine, or "
                               "close() it first and initialize again")
        self._closed = False
        self.module = model
        self.cfg = cfg
        self.device = cfg.resolve_device()
        if cfg.device is None and self.device.type == "cuda":
            self.device = torch.device("cuda", env_world()[2])  # torchrun: cuda:LOCAL_RANK
        self.dtype = cfg.torch_dtype
        self.cuda = self.device.type == "cuda"
        self.pin = cfg.pin_memory and self.cuda
        self.blocks, self.block_list_path = group_blocks(model, cfg.block_list)
        # data-parallel ranks (torchrun): None in one process (offload/zero/group.py)
        self.zero = self._make_zero()
        self.world = self.zero.world if self.zero is not None else 1
        self.param_names = [s.name for b in self.blocks for s in b.slots]
        self._block_of = {s.name: bi for bi, b in enumerate(self.blocks) for s in b.slots}
        # the order clip_grad_norm_ would see the parameters in: model.parameters() order
        order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        self._norm_order = sorted(self.param_names, key=order.__getitem__)
        self.account = MemoryAccount()
        self.mapped: list[torch.Tensor] = []  # frozen weights mapped from swap files (placement)
        self.rest_gathers: list = []  # stage 3: the non-layer blocks' gathers (offload/zero/rest.py)
        self.links = {k: LinkCounter() for k in ("d2h", "h2d", "nvme_read", "nvme_write",
                                                 "stream_h2d", "stream_disk", "act_offload")}
        self.lr = cfg.lr
        # steps, micro-steps, loss-scale state and skips: one value, saved whole (counters.py)
        self.counters = TrainingCounters.start(cfg)
        self._next_missing: dict[int, set[str]] = {}
        self._loss_finite: list[torch.Tensor] = []  # 0-d bools of this window's losses
        self._backward_done = False  # a backward() since the last step(): misuse checks
        self.last_report = StepReport()
        self._pending = StepReport()
        path, self.overlap_why = cfg.step_path(self.world)  # how the step meets backward, and why
        self._check_budgets(source)
        if self.pin:
            # the pinned-memory cap is fixed now, from the RAM available before this engine
            # allocates anything: measured per request, every earlier (pageable) allocation
            # would lower it and the buffers that most need pinning come last (desk review H3)
            freeze_pin_cap()
        self.step_thread = started_worker("offload-step")  # first: nothing to undo if it fails

        # optimizer state; then 16-bit weights, one block at a time so the peak extra memory
        # while initialising is one block
        self.store = self._make_store()
        self.state = self._make_state()
        smallest = min(b.numel for b in self.blocks) * self.dtype.itemsize
        with large_frees_to_os(smallest):  # RSS must not grow with the number of blocks (tiers.py)
            self._place_weights(model, source)
        self._enable_checkpointing()
        if isinstance(self.state, NvmeState):
            self.state.end_step(self.unit_order(), 0)  # init state durable + first prefetch

        # offload="none" keeps gradients on the device (the plain reference path); the delayed
        # update steps from one set while the next backward lands in the other
        storage, pool = cfg.grad_landing(len(self.blocks), self.device, self.world)
        self.grads = GradLanding(
            self.blocks, self.dtype, cfg.grad_accum_steps, self.account, self.links["d2h"],
            source_device=self.device, pin=self.pin,
            landing_tier="device" if cfg.offload == "none" else "host",
            storage=storage, pool_buffers=pool,
            pooled_blocks={i for i, b in enumerate(self.blocks) if b.module is not None} or None,
            buffer_numels=self._padded_numels(), zero=self.zero, step_order=self.step_order())
        self.grads.attach()
        # stages 0-1 across ranks: each block's gradient averaged once final (offload/zero/group.py)
        self.reducer = (BlockReducer(self.zero, self.grads.buffer, [b.numel for b in self.blocks],
                                     self.step_order())
                        if self.zero is not None and not self.grads.sharded else None)
        if self.cuda:  # updated 16-bit weights go up on this stream (stepper.py)
            self.h2d_stream = torch.cuda.Stream(self.device)
        self.stepper = BlockStepper(self)
        self.update: Update | None = None  # the update being applied, from begin_update on
        # how the step meets backward: a policy object (offload/train/paths.py)
        self.path: AfterBackward = {"after": AfterBackward, "overlapped": Overlapped,
                                    "delayed": Delayed}[path](self)
        self._fwd_t0: float | None = None
        self._gpu_timer = GpuPhaseTimer(self.device) if self.cuda else None
        self._link_mark = {k: v.nbytes for k, v in self.links.items()}
        self._comm_mark: dict[str, int] = {}
        self._hooks = [model.register_forward_pre_hook(self._on_forward_start),
                       model.register_forward_hook(self._on_forward_end)]
        model._offload_engine = self

    # -- set-up -----------------------------------------------------------------------------
    def _place_weights(self, model: nn.Module, source: Any) -> None:
        placement.place_weights(self, model, source)  # offload/train/build.py

    def _make_zero(self) -> ZeroGroup | None:
        layers = (self.module.get_submodule(self.block_list_path)
                  if self.block_list_path is not None else None)
        return placement.make_zero(self.cfg, self.device, placement.has_frozen_layers(layers))

    def _make_store(self):
        return placement.make_store(self)

    def _enable_checkpointing(self) -> None:
        cfg = self.cfg
        self.act_store: ActivationStore | None = None
        if cfg.activation_checkpointing:
            if self.layers is None:
                raise ConfigError("activation_checkpointing needs a model whose blocks are an "
                                  "nn.ModuleList (none was found)")
            self.act_store = (ActivationStore(self.device, self.pin)
                              if cfg.offload_activations else None)
            # only what this engine wrapped is unwrapped at close (a model the caller had
            # checkpointed already stays so)
            self._checkpointed = enable_activation_checkpointing(
                self.layers, self.act_store, self.device) > 0

    @property
    def reductions(self) -> Reductions | None:
        """Across ranks, the gradient reductions the step waits for: stage 0-1's BlockReducer
        or stage 2-3's sharded landing (offload/zero/group.py Reductions); None in one process."""
        if self.zero is None:
            return None
        return self.reducer if self.reducer is not None else self.grads.storage

    @property
    def gathers_weights(self) -> bool:
        """Each rank steps only its shard and the updated weights are all-gathered after the
        step (stages 1-3 across ranks; at stage 3 only the non-layer block's)."""
        return self.zero is not None and self.zero.stage >= 1

    @property
    def shards_weights(self) -> bool:
        """Stage 3 across ranks: each layer's 16-bit weights live as this rank's shard and are
        gathered from the other ranks when the layer is fetched (offload/zero/group.py ShardGather)."""
        return self.zero is not None and self.zero.stage == 3

    def _padded_numels(self) -> list[int] | None:
        """Flat buffer lengths across ranks (blocks padded to equal shards); None in one process."""
        if self.zero is None:
            return None
        return [self.zero.shards(b.numel).padded for b in self.blocks]

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's shard of each block's averaged gradient (its part of the global norm)."""
        out = []
        for bi, b in enumerate(self.blocks):
            lo, hi = self.zero.shards(b.numel).range(self.zero.rank)
            out.append(self.grads.step_pieces(bi)[lo] if self.grads.sharded
                       else self.grads.buffer(bi)[lo:hi])
        return out

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the streamer's slots, the working buffers streamed or gathered
        layers are bound to while they run; the account counts them as device weights, the
        ZeRO formulas count only the weights' homes (reports show them apart)."""
        streamer = getattr(self.streaming, "streamer", None)
        return sum(s.raw.numel() * s.raw.element_size() for s in streamer.slots) if streamer else 0

    def weight_base(self, bi: int) -> int:
        """Block offset of element 0 of block bi's 16-bit home: at stage 3 it is this rank's
        shard (lo of owned()), the layers' in their tier and the others' on the device
        (offload/zero/rest.py); else the whole block (0)."""
        return self.owned(bi)[0] if self.shards_weights else 0

    def owned(self, bi: int) -> tuple[int, int]:
        """[lo, hi) of block bi that this rank steps (the whole block in one process)."""
        if self.zero is None:
            return 0, self.blocks[bi].numel
        return self.zero.owned(self.blocks[bi].numel)

    def unit_order(self) -> list[int]:
        """Optimizer-state units (sub-groups of blocks) in the order the step consumes them."""
        return [u for bi in self.step_order() for u, _, _ in self.state.units_of(bi)]

    def step_order(self) -> list[int]:
        """Blocks in the order their gradients complete: layers last-to-first, then the rest
        block (its embedding gradient is the last one backward produces)."""
        layers = [i for i, b in enumerate(self.blocks) if b.module is not None]
        rest = [i for i, b in enumerate(self.blocks) if b.module is None]
        return layers[::-1] + rest

    def _check_budgets(self, source: Any) -> None:
        """Refuse, before allocating anything, a configuration whose tiers do not fit."""
        # a quantized base (QLoRA) streams in its stored dtypes, a 16-bit one in the compute dtype
        frozen_layers, frozen_rest = frozen_bytes(self.module, self.block_list_path, self.dtype,
                                                  own_dtypes=hasattr(source, "layer_ranges"))
        self.plan = plan_training([(b.numel, b.module is not None) for b in self.blocks],
                                  self.cfg, self.device, world=self.world,
                                  frozen_layer_bytes=frozen_layers,
                                  frozen_resident_bytes=frozen_rest,
                                  frozen_in_place=hasattr(source, "layer_ranges"),
                                  rest_module_numel=largest_module_numel(
                                      self.module, [b for b in self.blocks if b.module is None]))
        self.plan.check()

    def _make_state(self):
        cfg = self.cfg
        ranges = [self.owned(bi) for bi in range(len(self.blocks))]
        if cfg.offload == "nvme":
            return NvmeState(self.blocks, self.store, cfg.buffer_count, self.account,
                             self.links["nvme_read"], self.links["nvme_write"],
                             prefetch=cfg.prefetch_optimizer_state,
                             sub_group_params=cfg.sub_group_size, ranges=ranges)
        tier = "device" if cfg.offload == "none" else "host"
        # never pinned: the CPU kernel reads and writes masters and moments in place; they never
        # cross the link, and pinning them would spend the pinned-memory cap on them instead of
        # on the buffers that do (landing, staging, upload ring, streamed weights; review H3)
        return ResidentState(self.blocks, tier, self.device, False, self.account, ranges)

    # -- timing hooks -----------------------------------------------------------------------
    def _on_forward_start(self, module, args) -> None:
        # only training forwards count toward the update's time split (not evaluation)
        self._fwd_t0 = time.perf_counter() if torch.is_grad_enabled() else None
        if self.zero is not None:  # stage 3: an evaluation's weight gathers are counted apart
            self.zero.fetch_kind = "all_gather_fetch" if self._fwd_t0 else "all_gather_eval"
        if self._fwd_t0 is not None and self._gpu_timer is not None:
            self._gpu_timer.start("forward")

    def _on_forward_end(self, module, args, output) -> None:
        if self._fwd_t0 is not None:
            self._pending.forward_s += time.perf_counter() - self._fwd_t0
            self._fwd_t0 = None
            if self._gpu_timer is not None:
                self._gpu_timer.stop("forward")

    # -- the public loop --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, divided by grad_accum_steps (and multiplied by the
        fp16 loss scale); gradients are offloaded while it runs."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward needs the scalar loss tensor")
        if self._closed:
            raise RuntimeError("engine.backward after close()")
        if self._backward_done:
            raise RuntimeError("engine.backward called twice without engine.step() between: "
                               "call step() after every backward() (for gradient accumulation "
                               "set grad_accum_steps; step() applies the update every that many "
                               "calls)")
        self._backward_done = True
        accum = self.cfg.grad_accum_steps
        self.grads.begin_micro(self.micro_step % accum)
        if self.micro_step % accum == 0:
            self._loss_finite = []
            if self.reductions is not None:
                self.reductions.new_window()
        # kept as a 0-d tensor: reading it now would make the host wait for the forward
        # (a device sync on CUDA); step() reads them all at once, where it waits anyway
        self._loss_finite.append(torch.isfinite(loss.detach()))
        self.path.backward_begins(self.grads.is_last_micro)
        if self.reducer is not None and self.grads.is_last_micro:
            # each block's reduction starts as its final gradients land (across ranks the
            # step paths hook the reductions instead: Reductions.on_issued)
            self.grads.on_block_done = self.reducer.complete
        t0 = time.perf_counter()
        # loss / accum (not loss * (1/accum)): the same float the plain-PyTorch loop computes
        scaled = loss / accum if self.loss_scale == 1.0 else loss * self.loss_scale / accum
        if self._gpu_timer is not None:
            self._gpu_timer.start("backward")
        try:
            scaled.backward()
            self.grads.end_micro()  # stage 2: the blocks not reduced during backward
        finally:
            if self._gpu_timer is not None:
                self._gpu_timer.stop("backward")
            self.grads.on_block_done = None
            if self.reductions is not None:
                self.reductions.on_issued = None
            if self.streaming is not None:
                self.streaming.end_backward()
            if self.act_store is not None:
                self.act_store.clear()  # inputs of blocks whose backward never ran
        self._pending.backward_s += time.perf_counter() - t0

    def step(self) -> bool:
        """Call once per micro-batch. Every grad_accum_steps-th call applies the update; returns
        True when an update was applied (False between boundaries and on fp16 overflow)."""
        if self._closed:
            raise RuntimeError("engine.step after close()")
        if not self._backward_done:
            raise RuntimeError("engine.step without engine.backward(loss) first: nothing to "
                               "apply (call backward() once per micro-batch, then step())")
        self._backward_done = False
        self.micro_step += 1
        if self.micro_step % self.cfg.grad_accum_steps:
            return False
        t_step = time.perf_counter()
        rep = self._pending
        self._pending = StepReport()
        before = self._link_mark  # bytes moved since the last update (backward's d2h included)
        rep.grad_wait_s = self.grads.wait()
        t0 = time.perf_counter()
        self.grads.finish_window()
        if self.grads.sharded:  # stage 2-3: waiting for the window's last reductions
            rep.comm_wait_s += time.perf_counter() - t0
        self._next_missing = self.grads.missing()
        if self.zero is not None:  # average the gradients across ranks before anything reads them
            self._next_missing = self.zero.agree_missing(
                self.param_names, self._next_missing, self._block_of)
            if self.reducer is not None:  # stages 0-1: the blocks not reduced during backward
                rep.comm_wait_s += self.reducer.finish()
        applied = self.path.step(rep)
        # every rank's new shard to every rank (a delayed update's when it goes live)
        if applied and self.gathers_weights and not rep.delayed:
            rep.comm_wait_s += self.zero.gather_weights(self.flat16_padded, self.step_order())
        self._finish_report(rep, t_step, before)
        return applied

    def _finish_report(self, rep: StepReport, t_step: float, before: dict[str, int]) -> None:
        rep.step_s = time.perf_counter() - t_step
        if self._gpu_timer is not None:
            done = self._gpu_timer.collect()
            rep.forward_gpu_s, rep.backward_gpu_s = done["forward"], done["backward"]
        if self.act_store is not None:
            self.links["act_offload"].nbytes = self.act_store.offloaded_bytes
        if self.streaming is not None:  # the streamer counts its own fetches
            moved = self.streaming.streamer.stats.moved_bytes
            self.links["stream_h2d"].nbytes, self.links["stream_disk"].nbytes = moved["h2d"], moved["disk"]
        rep.bytes = {k: v.nbytes - before[k] for k, v in self.links.items()}
        self._link_mark = {k: v.nbytes for k, v in self.links.items()}
        if self.zero is not None:  # bytes this rank sent per collective since the last update
            sent = self.zero.comm.snapshot()
            rep.bytes.update({k: v - self._comm_mark.get(k, 0) for k, v in sent.items()})
            self._comm_mark = sent
        self.last_report = rep

    def losses_finite(self) -> bool:
        """Every loss of this window is finite (a host sync on the device's losses)."""
        return bool(torch.stack(self._loss_finite).all()) if self._loss_finite else True

    def grad_scale(self) -> tuple[float | None, float | None]:
        """(factor to multiply gradients by, global norm of the true gradients) — or (None, norm)
        when a loss or gradient is inf/nan (fp16: an overflow) and the update must be skipped.
        The per-parameter norms were taken as the gradients landed, so the check over every
        gradient costs no pass over memory, in any dtype."""
        cfg = self.cfg
        fp16 = cfg.dtype == "fp16"
        if self.zero is not None:  # of the averaged gradients, over every rank's shards
            total = self.zero.global_norm(self._owned_grads(), self.losses_finite())
        else:  # of the (loss-scaled) gradients
            total = self.grads.global_norm(self._norm_order)
        if not (self.losses_finite() and bool(torch.isfinite(total))):
            self.counters.on_nonfinite(cfg)
            return None, float(total)
        self.counters.on_applied(cfg)
        if not (cfg.grad_clip > 0 or fp16):
            return 1.0, float(total)
        inv_scale = 1.0 / self.loss_scale
        if inv_scale != 1.0:
            total = total * inv_scale
        if cfg.grad_clip <= 0:
            return inv_scale, float(total)
        # exactly clip_grad_norm_'s arithmetic: fp32 tensors, 1e-6 guard, clamp at 1
        coef = torch.clamp(cfg.grad_clip / (total + 1e-6), max=1.0)
        return float(coef) * inv_scale if inv_scale != 1.0 else float(coef), float(total)

    # -- the update ---------------------------------------------------------------------------
    def begin_update(self, grad_scale: float) -> Update:
        """The next update, fixed now (step number, lr, gradient scale); the stepper applies it
        block by block (offload/train/stepper.py), from whichever thread the step path uses."""
        self.global_step += 1
        self.update = Update(step=self.global_step, lr=self.lr, grad_scale=grad_scale,
                             io0=self.state.io_wait_s, missing=self.take_missing())
        if self.cuda:
            # the H2D stream overwrites device weights that backward's kernels may still be
            # reading: order it after everything issued so far on the compute stream
            self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        self.state.begin_step(self.unit_order())
        return self.update

    def take_missing(self) -> dict[int, set[str]]:
        """This update's slots without a gradient (found at step()): not stepped, and their
        own AdamW step count falls one further behind. Overlapped: {} when the update begins
        in backward, the real set at step()."""
        missing, self._next_missing = self._next_missing, {}
        for names in missing.values():
            for name in names:
                self.slot_skips[name] = self.slot_skips.get(name, 0) + 1
        return missing

    def order_upload_after_backward(self, bi: int) -> None:
        """Before block bi's new weights go up during backward (overlapped path): the upload may
        overwrite the device weights only after backward's kernels that read them, so the H2D
        stream waits on the block's last gradient event (GPU-side). Streamed blocks' weights
        are not the device buffers backward reads; nothing to order on the CPU."""
        if self.cuda and bi in self.grads.block_event and bi not in self.layer_of:
            self.h2d_stream.wait_event(self.grads.block_event[bi])

    # -- inspection -------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"lr must be a finite number >= 0, got {lr!r}")
        self.lr = float(lr)

    def master_params(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 CPU tensor}: the current master weights (copies)."""
        self.join_delayed()
        out: dict[str, torch.Tensor] = {}
        for bi, block in enumerate(self.blocks):
            flat = self.read_state(bi, "master")
            out.update({k: v.clone() for k, v in block.views(flat).items()})
        return out

    def iter_master_params(self):
        """(name, fp32 CPU tensor) one block at a time — the non-layer block first, then the
        layers in order (checkpoint order) — so exporting a model holds one block in memory."""
        self.join_delayed()
        order = [i for i, b in enumerate(self.blocks) if b.module is None] + \
                [i for i, b in enumerate(self.blocks) if b.module is not None]
        for bi in order:
            flat = self.read_state(bi, "master")
            engine_state.check_finite({"master weights": flat}, f"block {self.blocks[bi].name}")
            yield from self.blocks[bi].views(flat).items()

    def optimizer_state(self, bi: int) -> dict[str, torch.Tensor]:
        """Copies of block bi's flat fp32 state: master, exp_avg, exp_avg_sq."""
        self.join_delayed()
        return {k: self.read_state(bi, k) for k in ("master", "exp_avg", "exp_avg_sq")}

    def read_state(self, bi: int, kind: str) -> torch.Tensor:
        """A CPU copy of block bi's whole flat fp32 state of `kind`; across ranks at stages
        1-2 gathered from every rank's shard (a collective: every rank must call it)."""
        flat = self.state.read(bi, kind)
        if self.gathers_weights:
            flat = self.zero.gather_full(flat, self.blocks[bi].numel)
        return flat

    @property
    def overlap(self) -> bool:
        """Blocks are stepped during backward (the overlapped step path)."""
        return self.path.name == "overlapped"

    @property
    def delayed(self) -> Delayed | None:
        """The delayed step path (its pending job and shadow weights), when configured."""
        return self.path if isinstance(self.path, Delayed) else None

    def join_delayed(self) -> None:
        """Wait for step work still running on the step thread (a delayed update's job)."""
        self.path.join()

    def flush(self) -> None:
        """Make a delayed update's pending weights the live ones now: a synchronisation point
        that changes what the next forward computes with (to look without changing anything,
        use `latest_weights()`). A no-op without delayed_update."""
        self.path.flush()

    @contextlib.contextmanager
    def latest_weights(self):
        """Inside, the model computes with the latest update's weights — a pending delayed
        update's too — and afterwards with the same weights as before, so evaluating does not
        change the training trajectory. Plain inside without delayed_update."""
        if self.delayed is None or not self.delayed.pending:
            yield
            return
        self.delayed.join()
        self.delayed.gather()  # across ranks: every rank's part of them (a collective)
        if self.cuda:  # the job's uploads into those buffers ran on the H2D stream
            torch.cuda.current_stream(self.device).wait_stream(self.h2d_stream)
        for bi, block in enumerate(self.blocks):
            bind_views(block, self.delayed.shadow[bi], self.module)
        try:
            yield
        finally:
            for bi, block in enumerate(self.blocks):
                bind_views(block, self.flat16[bi], self.module)

    # -- checkpoints (offload/train/state.py) --------------------------------------------
    def state_meta(self) -> dict[str, Any]:
        """Everything besides the tensors that a resumed run needs to continue exactly."""
        return engine_state.state_meta(self)

    def save_state(self, directory: str) -> None:
        """Write masters, moments and counters into `directory` (atomically, json last). Only
        whole updates are saved: call at an accumulation boundary."""
        engine_state.save_state(self, directory)

    def load_state(self, directory: str) -> None:
        """Restore what save_state wrote; refuses a state saved from a different model."""
        engine_state.load_state(self, directory)

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes per tier by kind (weights, masters, moments, grads, buffers), with peaks, plus
        the process's peak RSS and (CUDA) peak device allocation."""
        rep: dict[str, Any] = self.account.report()
        rep["process"] = {"peak_rss": peak_rss_bytes()}
        if self.cuda:
            rep["process"]["peak_device_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return rep

    def format_memory_report(self) -> str:
        return format_report({k: v for k, v in self.account.report().items()})

    def close(self, *, after_error: bool = False) -> None:
        """Finish IO, release the swap directory's lock and every thread (idempotent). Every
        part is closed even when one fails; the first failure is raised then — unless
        `after_error` (cleaning up after an exception the caller is raising: that first error,
        with its advice, is the one the user must see, not a consequence of it)."""
        if self._closed:
            return
        self._closed = True
        if getattr(self.module, "_offload_engine", None) is self:
            del self.module._offload_engine
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        parts = [self.grads.close, lambda: self.step_thread.shutdown(wait=True)]
        parts += [g.close for g in self.rest_gathers]
        if getattr(self, "_checkpointed", False):  # the model's own forwards back, hooks gone
            parts.append(lambda: disable_activation_checkpointing(self.layers))
        if self.cuda:
            # device buffers (weights, a delayed job's shadow set) may be freed after this while
            # uploads into them or gradient copies out of them are queued on the side streams:
            # the caching allocator would hand the memory to the compute stream at once, so
            # the compute stream waits for both first (GPU-side; desk review M3/L8)
            parts.append(self._order_after_side_streams)
        if self.streaming is not None:
            parts.append(self.streaming.close)
        parts.append(self.state.close)
        # mapped frozen weights (offload/memory/mapped.py) stay usable; their maps are no longer tracked
        parts += [lambda t=t: forget(t) for t in self.mapped]
        if self.store is not None:
            # the store was given the engine: it does not close it
            parts += [self.store.close, self.store.engine.close]
        first: BaseException | None = None
        for close_part in parts:
            try:
                close_part()
            except Exception as e:  # noqa: BLE001 - the rest must still be released
                first = first or e
        if first is not None and not after_error:
            raise first

    def _order_after_side_streams(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.h2d_stream)
        if self.grads.cuda:
            compute.wait_stream(self.grads.stream)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def initialize(model: nn.Module, config: OffloadConfig | Mapping[str, Any] | None = None,
               *, source: Any = None, **overrides: Any) -> Engine:
    """Wrap `model` for offloaded training. `config` is an OffloadConfig, our flat dict, or a
    DeepSpeed-style dict; keyword overrides replace single fields. A model built on the meta
    device is materialised block by block from `source` (e.g. offload.models.CheckpointReader),
    so the full fp32 model never exists in memory at once."""
    cfg = as_config(config)
    if overrides:
        unknown = sorted(set(overrides) - set(OffloadConfig.field_names()))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(OffloadConfig.field_names())}")
        cfg = cfg.replace(**overrides)
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize needs an nn.Module, got {type(model).__name__}")
    return Engine(model, cfg, source)


__all__ = ["Engine", "StepReport", "StateError", "NonFiniteError", "initialize", "BudgetError"]
