"""One optimizer update as a value, what begins it, and the block stepper that applies it.

An `Update` is fixed when it begins (`Updates.begin`): its step number, learning rate and
gradient scale, the slots without a gradient, and where new 16-bit weights go. `Updates` holds
what decides it -- the counters and loss scale, the learning rate, the window's losses and
slots without a gradient -- and is what a state file saves of it. The `BlockStepper` applies
it one block at a time -- optimizer state in, one fused AdamW pass, state out, the new 16-bit
weights on to their tier -- from whichever thread the step path chose: the
main thread after backward, the step thread while backward runs (overlapped), or the step
thread during the next forward and backward (delayed). What moves between threads is the
Update and the blocks' buffers; the stepper's own rings are used by one update at a time.

Where a block's new weights go (`_target`):
  direct  the device buffer itself (the device is the CPU, or offload="none");
  ring    a pinned upload-ring slot, then uploaded on the engine's H2D stream (CUDA; also a
          stage-3 layer whose home shard is on the device while the CPU steps it);
  host    a streamed block's host buffer (cpu tier): fetched from there next forward;
  nvme    a write-behind ring slot, then the block's weight swap file (nvme tier).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.gpu import compute_stream_delay, host_event, on_stream, side_stream_delay
from offload.optim.adamw import cpu_adamw_step
from offload.memory.tiers import host_empty
from offload.train.counters import TrainingCounters
from offload.train.parts import Parts, unit_steps


@dataclass
class StepReport:
    """Where one optimizer update's time went, and the bytes it moved per link."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    grad_wait_s: float = 0.0  # waiting for device->host gradient copies after backward
    cpu_step_s: float = 0.0  # AdamW kernels
    io_wait_s: float = 0.0  # waiting for optimizer state reads/writes (nvme)
    upload_s: float = 0.0  # 16-bit weights host->device
    step_s: float = 0.0  # the whole engine.step() call that applied the update
    bytes: dict[str, int] = field(default_factory=dict)  # link -> bytes this update
    overlap_wait_s: float = 0.0  # waiting at step() for work on the step thread
    # the parts of cpu_step_s / upload_s that ran on the step thread, overlapped with forward
    # and backward (so not in this update's wall time)
    hidden_cpu_step_s: float = 0.0
    hidden_upload_s: float = 0.0
    overlapped_blocks: int = 0  # blocks stepped while backward was still running
    # the speculative step (offload/train/speculative.py): those blocks were restored to their
    # pre-step state, then stepped again with the clip coefficient (or the update skipped)
    rolled_back: bool = False
    rollback_s: float = 0.0  # restoring them: state copied back or re-read, weights rebuilt
    comm_wait_s: float = 0.0  # across ranks: waiting for gradient and weight collectives
    delayed: bool = False  # this update's CPU step runs during the next forward and backward
    applied: bool = True
    nonfinite: bool = False  # skipped: a loss or gradient was inf/nan (fp16 overflow included)
    loss_scale: float = 1.0
    grad_norm: float | None = None
    # CUDA: GPU time of the forwards and backwards whose kernels had finished when this update
    # was applied, from timing events on the compute stream (forward_s / backward_s are host
    # time: on a GPU, mostly the time to queue kernels). None on the CPU device.
    forward_gpu_s: float | None = None
    backward_gpu_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class Update:
    step: int  # this update's AdamW step number (the engine's global_step once it began)
    lr: float  # fixed for the update: a delayed one runs while the schedule moves on
    grad_scale: float  # what every gradient is multiplied by (clip coefficient / loss scale)
    io0: float  # the optimizer state's IO wait when the update began
    # block -> its slots that got no gradient in the window (known at step(); the overlapped
    # path begins before it and fills this in then)
    missing: dict[int, set[str]] = field(default_factory=dict)
    # block -> slots of "step" experts without tokens whose zero-gradient step is replayed
    # later (offload/train/replay.py): not stepped now, their step count moves on
    deferred: dict[int, set[str]] = field(default_factory=dict)
    weights_out: list[torch.Tensor] | None = None  # None: the live device buffers (flat16)
    # slot name -> (lr, weight_decay) where a parameter group differs from (lr,
    # cfg.weight_decay): torch.optim's per-group values (offload/train/torch_optim.py)
    hyper: dict[str, tuple[float, float]] = field(default_factory=dict)
    stepped: set[int] = field(default_factory=set)
    k: int = 0  # blocks stepped so far: rotates the rings

    def skipped(self) -> dict[int, set[str]]:
        """Block -> its slots this update does not step (missing or deferred)."""
        return {bi: self.missing.get(bi, set()) | self.deferred.get(bi, set())
                for bi in self.missing.keys() | self.deferred.keys()}


class Updates:
    """What begins each update, and the bookkeeping a state file saves with it: the counters
    (steps, loss scale, skips), the learning rate, this window's losses and the slots that got no
    gradient. The step paths ask it for the gradient scale and to begin the update; the engine
    feeds it (each backward's loss, the window's missing slots at step())."""

    def __init__(self, parts: Parts, counters: TrainingCounters, lr: float):
        self.parts = parts
        self.counters = counters
        self.lr = lr
        self.current: Update | None = None  # the update being applied, from begin() on
        self.next_missing: dict[int, set[str]] = {}
        self.next_deferred: dict[int, set[str]] = {}  # Update.deferred of the next update
        self.loss_finite: list[torch.Tensor] = []  # 0-d bools of this window's losses
        # per-slot (lr, weight_decay) for the next update (Update.hyper); {}: every slot the same
        self.hyper: dict[str, tuple[float, float]] = {}
        # max gradient norm of this window asked by the caller (clip_grad_norm_ through
        # offload/train/torch_optim.py); None: cfg.grad_clip
        self.window_clip: float | None = None
        # the order clip_grad_norm_ would see the parameters in: model.parameters() order
        order = {name: i for i, (name, _) in enumerate(parts.module.named_parameters())}
        self.norm_order = sorted((s.name for b in parts.blocks for s in b.slots),
                                 key=order.__getitem__)

    def state_dict(self) -> dict[str, Any]:
        """The counters and the learning rate, as the state file's json holds them."""
        return {**self.counters.to_meta(), "lr": self.lr}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Take what state_dict() gave (validated by the caller)."""
        self.counters.load_meta(meta)
        self.lr = meta["lr"]

    def losses_finite(self) -> bool:
        """Every loss of this window is finite (a host sync on the device's losses)."""
        return bool(torch.stack(self.loss_finite).all()) if self.loss_finite else True

    def grad_scale(self) -> tuple[float | None, float | None]:
        """(factor to multiply gradients by, global norm of the true gradients) — or (None, norm)
        when a loss or gradient is inf/nan (fp16: an overflow) and the update must be skipped.
        The per-parameter norms were taken as the gradients landed, so the check over every
        gradient costs no pass over memory, in any dtype."""
        p, counters = self.parts, self.counters
        cfg = p.cfg
        fp16 = cfg.dtype == "fp16"
        if p.zero is not None:  # of the averaged gradients, over every rank's shards
            total = p.zero.global_norm(self._owned_grads(), self.losses_finite())
        else:  # of the (loss-scaled) gradients
            total = p.grads.global_norm(self.norm_order)
        if not (self.losses_finite() and bool(torch.isfinite(total))):
            counters.on_nonfinite(cfg)
            return None, float(total)
        counters.on_applied(cfg)
        clip = cfg.grad_clip if self.window_clip is None else self.window_clip
        if not (clip > 0 or fp16):
            return 1.0, float(total)
        inv_scale = 1.0 / counters.loss_scale
        if inv_scale != 1.0:
            total = total * inv_scale
        if clip <= 0:
            return inv_scale, float(total)
        # exactly clip_grad_norm_'s arithmetic: fp32 tensors, 1e-6 guard, clamp at 1
        coef = torch.clamp(clip / (total + 1e-6), max=1.0)
        return float(coef) * inv_scale if inv_scale != 1.0 else float(coef), float(total)

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's shard of each block's averaged gradient (its part of the global norm)."""
        p, out = self.parts, []
        for bi, b in enumerate(p.blocks):
            lo, hi = p.zero.shards(b.numel).range(p.zero.rank)
            out.append(p.grads.step_pieces(bi)[lo] if p.grads.sharded
                       else p.grads.buffer(bi)[lo:hi])
        return out

    def begin(self, grad_scale: float, known: bool = True) -> Update:
        """The next update, fixed now (step number, lr, gradient scale); the stepper applies it
        block by block, from whichever thread the step path uses. `known`: the slots without a
        gradient are (not when begun in backward): only then are the experts' state units
        that will be stepped read ahead."""
        p = self.parts
        self.counters.global_step += 1
        self.current = Update(step=self.counters.global_step, lr=self.lr, grad_scale=grad_scale,
                              io0=p.state.io_wait_s, missing=self.take_missing(),
                              deferred=self.take_deferred(), hyper=self.hyper)
        if p.cuda:
            # the H2D stream overwrites device weights that backward's kernels may still be
            # reading: order it after everything issued so far on the compute stream
            p.h2d_stream.wait_stream(torch.cuda.current_stream(p.device))
        p.state.begin_step(p.unit_order(self.current.skipped() if known else None))
        return self.current

    def take_deferred(self) -> dict[int, set[str]]:
        deferred, self.next_deferred = self.next_deferred, {}
        return deferred

    def take_missing(self) -> dict[int, set[str]]:
        """This update's slots without a gradient (found at step()): not stepped, and their
        own AdamW step count falls one further behind. Overlapped: {} when the update begins
        in backward, the real set at step()."""
        missing, self.next_missing = self.next_missing, {}
        skips = self.counters.slot_skips
        for names in missing.values():
            for name in names:
                skips[name] = skips.get(name, 0) + 1
        return missing


def torch_adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     grad: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                     eps: float, weight_decay: float, grad_scale: float = 1.0,
                     out16: torch.Tensor | None = None) -> None:
    """torch.optim.AdamW's single-tensor math with plain tensor ops, for state that lives on a
    CUDA device (offload="none"); CPU state uses the fused kernel in offload/optim/adamw.py."""
    compute_stream_delay(master.device)  # test knob (offload/gpu.py): a late step (review 2 P2)
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if out16 is not None:
        out16.copy_(master)


def _gaps(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi) outside the sorted, disjoint `covered` ranges."""
    out, at = [], lo
    for a, b in covered:
        if a > at:
            out.append((at, min(a, hi)))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return [(a, b) for a, b in out if b > a]


class BlockStepper:
    """Applies Updates block by block to `parts` (their state, gradients, weights and links);
    `counters`: the updates each slot missed (their own AdamW step numbers)."""

    def __init__(self, parts: Parts, counters: TrainingCounters):
        self.p = parts
        self.counters = counters
        cfg = parts.cfg
        self.kernel = (torch_adamw_step if (cfg.offload == "none" and parts.cuda) else
                       functools.partial(cpu_adamw_step, exact=cfg.exact_optimizer))
        self.weight_writes: list = []  # nvme-tier weight writes of the current update
        self.weight_ring: list[torch.Tensor] = []  # made at the first nvme-tier block
        self.ring_writes: dict[int, Any] = {}
        # nvme tier, per-expert weight units (offload/stream/routed.py): block -> the units
        # _fill_unstepped found changed (absent: all of them), read by _send
        self.changed_units: dict[int, list[int]] = {}
        self.pending_io_s = 0.0
        self.upload_ring: list[torch.Tensor] = []
        self.upload_done: list = []
        ring = parts.plan.upload_ring  # CUDA, state off the device ("none" steps on the device)
        if ring:  # its bytes: offload/train/plan.py step_ring_bytes
            max_numel = max(b.numel for b in parts.blocks)
            self.upload_ring = [host_empty(max_numel, parts.dtype, parts.pin) for _ in range(ring)]
            self.upload_done = [None] * ring
            parts.account.add("host", "buffers", sum(t.nbytes for t in self.upload_ring))

    def step_block(self, u: Update, bi: int, rep: StepReport,
                   pieces: dict[int, torch.Tensor] | None = None) -> None:
        """AdamW on block bi: state in, fused step, state out, new 16-bit weights to their tier.
        `pieces`: the block's gradient as GradLanding.step_pieces gives it (default: where it
        landed in this backward; the delayed update passes the set it swapped out)."""
        e, cfg = self.p, self.p.cfg
        beta1, beta2 = cfg.betas
        out16, where = self._target(u, bi)
        # block offset of out16[0]: this rank's shard at stage 3 is the home of its weights
        out_base = e.weight_base(bi)
        # the gradient as (first block offset, flat tensor) pieces: the whole block's, or one
        # per slot where they were adopted as autograd made them (grad_storage.Adopted)
        # (or this rank's shard of it, ZeRO stage 2: keyed by the shard's first offset)
        per_slot = pieces is None and e.grads.adopted
        pieces = e.grads.step_pieces(bi) if pieces is None else pieces
        whole_base = next(iter(pieces))
        segments = self._segments(u, bi, per_slot)
        fp32 = e.dtype == torch.float32
        skipped = u.missing.get(bi, set()) | u.deferred.get(bi, set())
        # a unit with nothing to step is left unread only where out16 already holds its weights
        # or _fill_unstepped fills them; a delayed update's shadow set (weights_out) lags by an
        # update, so there the unit is read and its masters copied out as before
        if u.weights_out is not None and where[0] in ("direct", "shared", "host"):
            skipped = set()
        units = [(unit, lo, hi) for unit, lo, hi in e.state.units_of(bi)
                 if unit_steps(e.blocks[bi], lo, hi, skipped)]
        if len(units) < len(e.state.units_of(bi)):  # experts without tokens: state untouched
            self._fill_unstepped(u, bi, out16, where, units)
        for unit, lo, hi in units:  # sub-groups of a large block (and experts), in order
            master, exp_avg, exp_avg_sq = e.state.acquire(unit)
            t0 = time.perf_counter()
            for begin, end, step, lr, wd in segments or [(lo, hi, u.step, u.lr, cfg.weight_decay)]:
                a, b = max(begin, lo), min(end, hi)  # block offsets, inside this unit
                if a >= b:
                    continue
                m = slice(a - lo, b - lo)
                if step is None:  # no gradient this window: left as it is (torch skips it)
                    if not fp32:
                        out16[a - out_base:b - out_base].copy_(master[m])
                    continue
                base = begin if per_slot else whole_base
                g = pieces[base][a - base:b - base]
                self.kernel(master[m], exp_avg[m], exp_avg_sq[m], g, step=step, lr=lr,
                            beta1=beta1, beta2=beta2, eps=cfg.eps, weight_decay=wd,
                            grad_scale=u.grad_scale,
                            out16=None if fp32 else out16[a - out_base:b - out_base])
            # weights that are views of the masters themselves were updated in place
            if fp32 and where[0] != "shared":
                out16[lo - out_base:hi - out_base].copy_(master)
            rep.cpu_step_s += time.perf_counter() - t0
            e.state.release(unit, modified=True)
        e.grads.release_buffer(bi)
        t0 = time.perf_counter()
        self._send(u, bi, out16, where)
        rep.upload_s += time.perf_counter() - t0
        u.stepped.add(bi)

    def _segments(self, u: Update, bi: int, per_slot: bool = False
                  ) -> list[tuple[int, int, int | None, float, float]] | None:
        """Block bi's slots as (begin, end, AdamW step number or None = not stepped, lr, weight
        decay), when its slots do not all share the update's step number and hyper-parameters
        or `per_slot` asks for them (neighbours that agree merged but for `per_slot`); None
        (one kernel call) otherwise."""
        missing = u.missing.get(bi, set()) | u.deferred.get(bi, set())
        skips = self.counters.slot_skips
        slots = self.p.blocks[bi].slots
        if not per_slot and not missing and not any(
                s.name in skips or s.name in u.hyper for s in slots):
            return None
        default = (u.lr, self.p.cfg.weight_decay)
        out: list[tuple[int, int, int | None, float, float]] = []
        for s in slots:
            seg = (None if s.name in missing else u.step - skips.get(s.name, 0),
                   *u.hyper.get(s.name, default))
            if not per_slot and out and out[-1][1] == s.offset and out[-1][2:] == seg:
                out[-1] = (out[-1][0], s.offset + s.numel, *seg)
            else:
                out.append((s.offset, s.offset + s.numel, *seg))
        return out

    def finish(self, u: Update, rep: StepReport, order: list[int], unit_order: list[int],
               sync_compute: bool = True) -> None:
        """Blocks not stepped yet (in `order`), then make the update durable and visible to the
        next forward (sync_compute: order the compute stream after the uploads now)."""
        e = self.p
        for bi in order:
            if bi not in u.stepped:
                self.step_block(u, bi, rep)
        self.weights_written(rep)
        e.state.end_step(unit_order, u.step)
        if e.cuda and sync_compute:
            self.weights_visible(rep)
        rep.io_wait_s += e.state.io_wait_s - u.io0

    def weights_written(self, rep: StepReport) -> None:
        """Wait for this update's nvme-tier weight writes: the next forward reads the files."""
        t0 = time.perf_counter()
        for h in self.weight_writes:
            h.wait()
        self.weight_writes = []
        self.ring_writes = {}
        rep.io_wait_s += time.perf_counter() - t0 + self.pending_io_s
        self.pending_io_s = 0.0

    def weights_visible(self, rep: StepReport) -> None:
        """CUDA: the next forward runs on the compute stream; it must see the new weights, so
        the compute stream waits for the uploads queued on the H2D stream (GPU-side)."""
        e = self.p
        t0 = time.perf_counter()
        torch.cuda.current_stream(e.device).wait_stream(e.h2d_stream)
        shards = getattr(e.streaming, "shards", None)
        if shards is not None:  # stage 3: the next fetches copy out of the homes just written
            shards.homes_written(e.device)
        rep.upload_s += time.perf_counter() - t0

    def rewrite_weights(self, u: Update, bi: int, rep: StepReport) -> None:
        """Block bi's 16-bit weights made again from its masters as they are now, on their
        tier (a speculative step rolled back: offload/train/speculative.py). Weights that are
        views of the masters need nothing."""
        e = self.p
        out16, where = self._target(u, bi)
        if where[0] == "shared":
            return
        base = e.weight_base(bi)
        for unit, lo, hi in e.state.units_of(bi):
            master, _, _ = e.state.acquire(unit)
            out16[lo - base:hi - base].copy_(master)
            e.state.release(unit, modified=False)
        t0 = time.perf_counter()
        self._send(u, bi, out16, where)
        rep.upload_s += time.perf_counter() - t0

    def _fill_unstepped(self, u: Update, bi: int, out16: torch.Tensor, where: tuple[str, int],
                        stepped: list[tuple[int, int, int]]) -> None:
        """Where the new weights go out whole from a ring slot, the elements of the units not
        stepped (experts without tokens: their state is not read) hold their current weights:
        the layer's weights file read back (nvme tier), the device's copy (upload ring). The
        device buffer, a streamed block's host buffer and shared masters already hold them."""
        e = self.p
        kind = where[0]
        if kind == "nvme" and len(e.streaming.units[e.layer_of[bi]]) > 1:
            # the block's weights are several files (each routed expert its own): only those
            # with a stepped element are written; a unit stepped in part is read back first
            li, done = e.layer_of[bi], [(a, b) for _, a, b in stepped]
            changed = []
            for k, (lo, hi) in enumerate(e.streaming.units[li]):
                gaps = _gaps(lo, hi, done)
                if gaps == [(lo, hi)]:
                    continue  # nothing stepped: its file stays as it is, unread
                if gaps:
                    e.streaming.read_unit(li, k, out16[lo:hi])
                    e.links["weights_read"].add((hi - lo) * out16.element_size())
                changed.append(k)
            self.changed_units[bi] = changed
        elif kind == "nvme":  # the file holds the block (stage 3: this rank's padded shard)
            streaming = e.streaming
            name = streaming.name(e.blocks[bi])
            stored = streaming.store.info(name).nbytes // out16.element_size()
            into = out16[:stored] if stored <= out16.numel() else torch.empty(stored, dtype=out16.dtype)
            streaming.store.read_into(name, into).wait()
            if into.data_ptr() != out16.data_ptr():
                out16.copy_(into[:out16.numel()])
            e.links["weights_read"].add(stored * out16.element_size())
        elif kind == "ring":
            base = e.weight_base(bi)
            lo, hi = e.owned(bi)
            done = [(a, b) for _, a, b in stepped]
            device = self._device_weights(u, bi)
            for a, b in _gaps(lo, hi, done):
                out16[a - base:b - base].copy_(device[a - base:b - base])

    def _target(self, u: Update, bi: int) -> tuple[torch.Tensor, tuple[str, int]]:
        """Where the step writes block bi's new weights (compute dtype), and how they move on
        (see the module docstring); rotates the rings by u.k."""
        e = self.p
        k, u.k = u.k, u.k + 1
        numel = e.blocks[bi].numel
        if bi in e.layer_of:
            target = e.streaming.weight_target(e.layer_of[bi])
            if target is not None and not (self.upload_ring and target.is_cuda):
                return target, ("host", -1)
            if target is not None:  # a device home (stage 3, offload_params="none") and the
                # CPU kernel: it writes a pinned ring slot, the H2D stream sends it home (review 2 P1)
                return self._ring_slot(k, numel)
            if not self.weight_ring:  # aligned: O_DIRECT writes go straight out of it
                from nvme import aligned_empty
                largest = max(e.blocks[b].numel for b in e.layer_of)
                self.weight_ring = [aligned_empty(largest, e.dtype)
                                    for _ in range(e.cfg.buffer_count)]
                e.account.add("host", "buffers", sum(t.nbytes for t in self.weight_ring))
            r = k % len(self.weight_ring)
            if r in self.ring_writes:  # the slot's previous write must be out before reuse
                t0 = time.perf_counter()
                self.ring_writes.pop(r).wait()
                self.pending_io_s += time.perf_counter() - t0
            return self.weight_ring[r][:numel], ("nvme", r)
        if not self.upload_ring:  # the device is the CPU, or offload="none"
            # weights that are views of the masters: the step updated them, nothing moves
            kind = "shared" if e.plan.shares_masters and u.weights_out is None else "direct"
            return (u.weights_out or e.weights.flat16)[bi], (kind, -1)
        return self._ring_slot(k, numel)

    def _ring_slot(self, k: int, numel: int) -> tuple[torch.Tensor, tuple[str, int]]:
        """Upload-ring slot k (mod its length), once its previous upload has left: a host wait
        on that one (blocking) event, on the thread that steps."""
        r = k % len(self.upload_ring)
        done = self.upload_done[r]
        if done is not None:
            done.synchronize()
        return self.upload_ring[r][:numel], ("ring", r)

    def _device_weights(self, u: Update, bi: int) -> torch.Tensor:
        """Block bi's 16-bit weights on the device, where an upload writes them: the live (or
        shadow) flat buffer, or a stage-3 layer's home shard on the device."""
        if bi in self.p.layer_of:
            return self.p.streaming.weight_target(self.p.layer_of[bi])
        return (u.weights_out or self.p.weights.flat16)[bi]

    def _send(self, u: Update, bi: int, out16: torch.Tensor, where: tuple[str, int]) -> None:
        e = self.p
        kind, r = where
        nbytes = out16.numel() * out16.element_size()
        if kind == "ring":
            lo, hi = e.owned(bi)  # across ranks only this rank's shard was stepped
            lo, hi = lo - e.weight_base(bi), hi - e.weight_base(bi)  # in the home and the ring
            nbytes = (hi - lo) * out16.element_size()
            with on_stream(e.h2d_stream):
                side_stream_delay(e.h2d_stream)  # test knob (offload/gpu.py): a late upload
                out = self._device_weights(u, bi)
                out[lo:hi].copy_(out16[lo:hi], non_blocking=True)
                ev = host_event()
                ev.record(e.h2d_stream)
            self.upload_done[r] = ev
        elif kind == "nvme":
            li, changed = e.layer_of[bi], self.changed_units.pop(bi, None)
            h = e.streaming.write_weights(li, out16, changed)
            self.ring_writes[r] = h
            self.weight_writes.append(h)
            if changed is not None:
                units = e.streaming.units[li]
                nbytes = sum(units[k][1] - units[k][0] for k in changed) * out16.element_size()
            e.links["nvme_write"].add(nbytes)
            return
        elif kind == "host":
            return  # written in place by the kernel; the streamer fetches it next forward
        elif kind == "shared":
            return  # the weights are the masters the kernel just updated
        e.links["h2d"].add(nbytes)
