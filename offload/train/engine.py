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

from offload.config import ConfigError, OffloadConfig, as_config
from offload.gpu import GpuPhaseTimer
from offload.memory.tiers import BudgetError, format_report, peak_rss_bytes
from offload.train import build, state as engine_state
from offload.train.counters import TrainingCounters
from offload.train.delayed import Delayed
from offload.train.errors import NonFiniteError, StateError
from offload.train.experts import (RoutedCalls, drop_stepped, expert_ranges, untouched_experts,
                                   zero_gradient_slots)
from offload.train.parts import Parts
from offload.train.paths import AfterBackward, Overlapped
from offload.train.replay import ExpertReplay
from offload.train.speculative import Speculative
from offload.train.stepper import BlockStepper, StepReport, Updates


def _counter(name: str, doc: str) -> property:
    """An Engine attribute that is one of its TrainingCounters (the public names stay)."""
    return property(lambda self: getattr(self.counters, name),
                    lambda self, value: setattr(self.counters, name, value), doc=doc)


def _part(name: str) -> property:
    """An Engine attribute that is one of its Parts (offload/train/parts.py), read-only."""
    return property(lambda self: getattr(self.parts, name),
                    doc=f"the engine's {name} (offload/train/parts.py Parts.{name})")


class Engine:
    """Runs the training loop's calls (backward, step) on the parts built for the model from
    the plan; the step's collaborators (stepper, step path, state files) are given the parts,
    never the engine. The attributes below the counters are its parts', by their old names."""
    global_step = _counter("global_step", "optimizer updates applied")
    micro_step = _counter("micro_step", "engine.step() calls")
    loss_scale = _counter("loss_scale", "the fp16 loss scale (1.0 otherwise)")
    skipped_steps = _counter("skipped_steps", "updates skipped for inf/nan")
    nonfinite_streak = _counter("nonfinite_streak", "updates skipped in a row for inf/nan")
    slot_skips = _counter("slot_skips", "updates each parameter missed (no gradient), by name")
    blocks, block_list_path, layers = _part("blocks"), _part("block_list_path"), _part("layers")
    zero, world, device, dtype = _part("zero"), _part("world"), _part("device"), _part("dtype")
    cuda, pin, account, links = _part("cuda"), _part("pin"), _part("account"), _part("links")
    step_thread, h2d_stream = _part("step_thread"), _part("h2d_stream")
    store, state, grads, reducer = _part("store"), _part("state"), _part("grads"), _part("reducer")
    streaming, layer_of, mapped = _part("streaming"), _part("layer_of"), _part("mapped")
    rest_gathers, act_store = _part("rest_gathers"), _part("act_store")
    reductions, slot_bytes = _part("reductions"), _part("slot_bytes")
    gathers_weights, shards_weights = _part("gathers_weights"), _part("shards_weights")

    def __init__(self, model: nn.Module, cfg: OffloadConfig, source: Any = None):
        owner = getattr(model, "_offload_engine", None)
        if owner is not None and not owner._closed:
            raise RuntimeError("this model is already wrapped by an open offload engine (its "
                               "weights now live in that engine's tiers); use that engine, or "
                               "close() it first and initialize again")
        self._closed = False
        self.module = model
        self.cfg = cfg
        # the blocks and the data-parallel ranks (torchrun; offload/zero/group.py), then the
        # plan: its decisions and bytes; a configuration whose tiers do not fit is refused
        # before anything is allocated; then everything it says, built (offload/train/build.py)
        grouping = build.group(model, cfg)
        self.plan = build.plan_model(grouping, cfg, source)
        self.plan.check()
        self.parts: Parts = build.build(grouping, self.plan, source)
        self.param_names = [s.name for b in self.blocks for s in b.slots]
        self._block_of = {s.name: bi for bi, b in enumerate(self.blocks) for s in b.slots}
        self._zero_stepped = zero_gradient_slots(model) & set(self.param_names)
        # steps, micro-steps, loss-scale state and skips: one value, saved whole (counters.py)
        self.counters = TrainingCounters.start(cfg)
        # what begins each update: counters, lr, the window's losses and missing slots
        self.updates = Updates(self.parts, self.counters, cfg.lr)
        self._backward_done = False  # a backward() since the last step(): misuse checks
        self.last_report = StepReport()
        self._pending = StepReport()
        self.stepper = BlockStepper(self.parts, self.counters)
        # "step" experts without tokens: their zero steps replayed lazily (the plan's; replay.py)
        # every routed expert's element range (offload/train/experts.py ExpertRange)
        self.experts = expert_ranges(model, self.blocks)
        self.replay = (ExpertReplay(self.parts, self.stepper.kernel, self.counters.slot_skips,
                                    self.experts) if self.plan.expert_replay == "lazy" else None)
        # each MoE module's before_experts: routed experts' weights read (streamed, nvme), then
        # replayed (offload/train/experts.py RoutedCalls)
        self.routed_calls = RoutedCalls(model, self.experts, self.parts.layer_of,
                                        self.parts.streaming, self.replay)
        # how the step meets backward: a policy object (offload/train/paths.py), the plan's
        self.path: AfterBackward = {"after": AfterBackward, "overlapped": Overlapped,
                                    "speculative": Speculative,
                                    "delayed": Delayed}[self.plan.step_path](
            self.parts, self.stepper, self.updates)
        self._fwd_t0: float | None = None
        self._gpu_timer = GpuPhaseTimer(self.device) if self.cuda else None
        self._link_mark = {k: v.nbytes for k, v in self.links.items()}
        self._comm_mark: dict[str, int] = {}
        self._hooks = [model.register_forward_pre_hook(self._on_forward_start),
                       model.register_forward_hook(self._on_forward_end)]
        model._offload_engine = self

    @property
    def flat16(self) -> list[torch.Tensor | None]:
        """The live 16-bit weights: each block's device flat buffer (None when streamed)."""
        return self.parts.weights.flat16

    @property
    def flat16_padded(self) -> list[torch.Tensor | None]:
        """The (padded) buffers behind flat16 across ranks at stages 1-2 (else None)."""
        return self.parts.weights.padded

    @property
    def shares_masters(self) -> bool:
        """The resident blocks' parameters are views of their fp32 masters (the plan's)."""
        return self.plan.shares_masters

    @property
    def overlap_why(self) -> str:
        """Why the step meets backward the way it does (the plan's)."""
        return self.plan.step_path_why

    @property
    def lr(self) -> float:
        """The learning rate of the next update (set_lr; restored by load_state)."""
        return self.updates.lr

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
            self.updates.loss_finite = []
            if self.reductions is not None:
                self.reductions.new_window()
        # kept as a 0-d tensor: reading it now would make the host wait for the forward
        # (a device sync on CUDA); step() reads them all at once, where it waits anyway
        self.updates.loss_finite.append(torch.isfinite(loss.detach()))
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
        # experts without tokens that a fused layout steps with zeros (offload/train/experts.py):
        # deferred to a replay (lazy), or stepped now from the landing's zeros (eager)
        missing = self.grads.missing()
        if self.replay is not None:
            missing, self.updates.next_deferred = untouched_experts(self.experts, missing)
        self.updates.next_missing = drop_stepped(missing, self._zero_stepped)
        if self.zero is not None:  # average the gradients across ranks before anything reads them
            if self.reducer is not None:  # stages 0-1: every block's reduction issued first
                self.reducer.issue_rest()
            self.updates.next_missing = self.zero.agree_missing(
                self.param_names, self.updates.next_missing, self._block_of)
            if self.reducer is not None:  # stages 0-1: the blocks not reduced during backward
                rep.comm_wait_s += self.reducer.finish()
        applied = self.path.step(rep)
        if applied and self.replay is not None:
            self.replay.defer(self.updates.current)
        # every rank's new shard to every rank (a delayed update's when it goes live)
        if applied and self.gathers_weights and not rep.delayed:
            rep.comm_wait_s += self.zero.gather_weights(self.flat16_padded, self.parts.step_order())
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

    def apply_window(self) -> bool:
        """step() at the end of an accumulation window of any length: the torch.optim protocol
        (offload/train/torch_optim.py), where autograd's loss.backward() lands the gradients
        and the caller's loop decides how many backward passes make one update."""
        accum = self.cfg.grad_accum_steps
        self.micro_step += accum - 1 - self.micro_step % accum
        self._backward_done = True
        return self.step()

    # -- inspection -------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"lr must be a finite number >= 0, got {lr!r}")
        self.updates.lr = float(lr)

    def master_params(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 CPU tensor}: the current master weights (copies)."""
        self.join_delayed()
        self.settle_experts()
        out: dict[str, torch.Tensor] = {}
        for bi, block in enumerate(self.blocks):
            flat = self.parts.read_state(bi, "master")
            out.update({k: v.clone() for k, v in block.views(flat).items()})
        return out

    def iter_master_params(self):
        """(name, fp32 CPU tensor) one block at a time — the non-layer block first, then the
        layers in order (checkpoint order) — so exporting a model holds one block in memory."""
        self.join_delayed()
        self.settle_experts()
        order = [i for i, b in enumerate(self.blocks) if b.module is None] + \
                [i for i, b in enumerate(self.blocks) if b.module is not None]
        for bi in order:
            flat = self.parts.read_state(bi, "master")
            engine_state.check_finite({"master weights": flat}, f"block {self.blocks[bi].name}")
            yield from self.blocks[bi].views(flat).items()

    def optimizer_state(self, bi: int) -> dict[str, torch.Tensor]:
        """Copies of block bi's flat fp32 state: master, exp_avg, exp_avg_sq."""
        self.join_delayed()
        self.settle_experts()
        return {k: self.parts.read_state(bi, k) for k in engine_state.KINDS}

    @property
    def overlap(self) -> bool:
        """Blocks are stepped during backward (the overlapped step path)."""
        return self.path.name in ("overlapped", "speculative")

    @property
    def delayed(self) -> Delayed | None:
        """The delayed step path (its pending job and shadow weights), when configured."""
        return self.path if isinstance(self.path, Delayed) else None

    def settle_experts(self) -> None:
        """Replay every untouched expert's recorded zero steps (lazy replay, replay.py): the
        state is then what stepping every expert every update would hold."""
        if self.replay is not None:
            self.replay.settle()

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
        weights = self.parts.weights
        weights.bind(self.blocks, self.module, self.delayed.shadow)
        try:
            yield
        finally:
            weights.bind(self.blocks, self.module)

    # -- checkpoints (offload/train/state.py) --------------------------------------------
    def state_meta(self) -> dict[str, Any]:
        """Everything besides the tensors that a resumed run needs to continue exactly."""
        return engine_state.state_meta(self.parts, self.updates, self.path)

    def save_state(self, directory: str) -> None:
        """Write masters, moments and counters into `directory` (atomically, json last). Only
        whole updates are saved: call at an accumulation boundary."""
        self.settle_experts()
        engine_state.save_state(self.parts, self.updates, self.path, directory)

    def load_state(self, directory: str) -> None:
        """Restore what save_state wrote; refuses a state saved from a different model."""
        engine_state.load_state(self.parts, self.updates, self.path, directory)
        if self.replay is not None:
            self.replay.clear()  # a saved state holds no recorded steps (settled first)

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
        self.routed_calls.detach()
        self.parts.close(after_error=after_error)

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
