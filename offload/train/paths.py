"""How an update's CPU step meets backward: one small policy object per step path.

Every path answers the same three calls from the engine, in this order per update:
  backward_begins(last_micro)  before the backward of a micro-batch (the window's last one
                               when `last_micro`);
  block_done(bi)               block bi's final gradients have landed (only while the path has
                               set itself as the landing's `on_block_done`);
  step(rep) -> applied         at the accumulation boundary, after every gradient has landed.

  AfterBackward  the plain loop: the whole step runs in step(), after backward;
  Overlapped     each block is stepped on the step thread as soon as its gradients land, while
                 backward goes on (same math: only when nothing global -- clipping, an fp16
                 overflow check -- is needed first); across ranks, as soon as its gradient is
                 averaged over them (the step thread waits for the reduction, not backward);
  Speculative    (offload/train/speculative.py) the overlapped step with clipping or fp16: each
                 block stepped as its gradients land as if nothing clips or overflows, its
                 pre-step state kept; at step() kept, or restored and stepped again (or skipped);
  Delayed        (offload/train/delayed.py) the whole step of update t runs during the forward and
                 backward of update t+1, one step stale (ZeRO-Offload's DPU).

A path holds only its own state (the overlapped step's jobs, the delayed step's pending job
and shadow weights); the update itself is an `Update` that `Updates` begins and the
`BlockStepper` applies (offload/train/stepper.py). A path is built from those two and the
engine's `Parts` (offload/train/parts.py), never the engine; the engine picks it once, from the
plan's step_path (offload/train/plan.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from offload.train.errors import NonFiniteError
from offload.train.parts import Parts
from offload.train.stepper import BlockStepper, StepReport, Update, Updates


class AfterBackward:
    """The whole step in step(), after backward (also every path's fallback)."""
    name = "after"

    def __init__(self, parts: Parts, stepper: BlockStepper, updates: Updates):
        self.parts, self.stepper, self.updates = parts, stepper, updates

    # -- the three entry points -------------------------------------------------------------
    def backward_begins(self, last_micro: bool) -> None:
        pass

    def block_done(self, bi: int) -> None:
        raise AssertionError("the after-backward path does not step blocks during backward")

    def step(self, rep: StepReport) -> bool:
        """Norm -> clip / overflow check -> every block stepped; False when skipped (inf/nan)."""
        grad_scale = self.grad_scale(rep)
        if grad_scale is None:  # non-finite (fp16: overflow, scale lowered): nothing touched
            return False
        update = self.updates.begin(grad_scale)
        self.stepper.finish(update, rep, self.parts.step_order(), self.parts.unit_order())
        return True

    def grad_scale(self, rep: StepReport) -> float | None:
        """The update's gradient scale (Updates.grad_scale), the norm and loss scale noted in
        `rep`; None, and `rep` marked skipped, when a loss or gradient is inf/nan."""
        grad_scale, norm = self.updates.grad_scale()
        rep.loss_scale, rep.grad_norm = self.updates.counters.loss_scale, norm
        if grad_scale is None:
            rep.applied, rep.nonfinite = False, True
        return grad_scale

    # -- what anything that reads the state must wait for ------------------------------------
    @property
    def pending(self) -> bool:
        """An applied update whose weights the model does not compute with yet."""
        return False

    def join(self) -> None:
        """Wait for any step work still running (re-raising its failure)."""

    def flush(self) -> None:
        """Make pending weights live now."""


class Overlapped(AfterBackward):
    name = "overlapped"

    def __init__(self, parts: Parts, stepper: BlockStepper, updates: Updates):
        super().__init__(parts, stepper, updates)
        self.jobs: list[Future] | None = None  # one per block stepped during this backward
        self.job_rep = StepReport()  # the step thread's time split for those blocks
        self.poisoned: int | None = None  # first block with inf/nan gradients

    def backward_begins(self, last_micro: bool) -> None:
        e = self.parts
        if not last_micro:
            return
        # an update with a non-finite loss is skipped, so no block may be stepped while this
        # backward runs (the one host sync the overlapped path pays for the guard); across
        # ranks every rank must begin in backward or none: one small all-reduce agrees
        finite = self.updates.losses_finite()
        if e.zero is not None:
            finite = not e.zero.any_rank(not finite)
        if not finite:
            return
        # the update's math needs nothing global (no clipping, no overflow check), so it is
        # fixed now and each block is stepped by the step thread as its final gradients land
        # (the speculative path: assuming nothing clips or overflows, checked at step())
        self.updates.begin(self.begin_scale(), known=False)  # experts without tokens: at step()
        self.poisoned = None
        self.job_rep = StepReport()
        self.jobs = []
        # the engine unsets both when backward ends
        if e.zero is None:
            e.grads.on_block_done = self.block_done
        else:  # across ranks a block is stepped once its gradient is averaged over them
            e.reductions.on_issued = self.block_reducing

    def begin_scale(self) -> float:
        """The gradient scale of an update begun in backward: nothing global scales it."""
        return 1.0

    def block_done(self, bi: int) -> None:
        """Called when block bi's final gradients have landed (autograd thread on CPU, landing
        worker on CUDA): step it on the step thread while backward continues."""
        if self._finite(bi):
            self.jobs.append(self.parts.step_thread.submit(
                self.step_landed, self.updates.current, bi))

    def step_landed(self, u: Update, bi: int) -> None:
        """On the step thread: block bi's step in `u`, the update begun in backward."""
        self.stepper.step_block(u, bi, self.job_rep)

    def block_reducing(self, bi: int) -> None:
        """Across ranks: block bi's gradients all landed on this rank and their reduction was
        just issued (on the landing thread). Its job on the step thread first waits for the
        reduction -- the step thread waits, backward goes on -- then steps this rank's part."""
        if self._finite(bi):
            self.jobs.append(self.parts.step_thread.submit(self._step_reduced, bi))

    def _step_reduced(self, bi: int) -> None:
        self.parts.reductions.complete_through(bi)
        self.step_landed(self.updates.current, bi)

    def _finite(self, bi: int) -> bool:
        """Block bi's gradients (this rank's) are finite; else it is not stepped, nor any
        block after it, and step() stops. Orders its upload after backward's kernels."""
        if self.poisoned is not None or not self.parts.grads.block_finite(bi):
            # a finite loss with inf/nan gradients: this block is not stepped; step() stops
            if self.poisoned is None:
                self.poisoned = bi
            return False
        self._order_upload_after_backward(bi)
        return True

    def _order_upload_after_backward(self, bi: int) -> None:
        """Before block bi's new weights go up during backward: the upload may overwrite the
        device weights only after backward's kernels that read them, so the H2D stream waits on
        the block's last gradient event (GPU-side). Streamed blocks' weights are not the device
        buffers backward reads; nothing to order on the CPU."""
        e = self.parts
        if e.cuda and bi in e.grads.block_event and bi not in e.layer_of:
            e.h2d_stream.wait_event(e.grads.block_event[bi])

    def step(self, rep: StepReport) -> bool:
        if self.jobs is None:  # not begun in backward (a non-finite loss): the plain step
            return super().step(rep)
        e = self.parts
        self.join_jobs(rep)
        poisoned = self.poisoned is not None
        if e.zero is not None:  # any rank's inf/nan went into every rank's averaged gradients
            poisoned = e.zero.any_rank(poisoned)
        if poisoned:
            where = (e.blocks[self.poisoned].name if self.poisoned is not None
                     else "another rank's gradients")
            raise NonFiniteError(
                f"non-finite gradients in {where} with a finite loss, "
                f"after {rep.overlapped_blocks} blocks of this update were already stepped "
                f"(the overlapped step applies each block as its gradients land); the in-memory "
                f"state is inconsistent: resume from the last checkpoint (untouched), and set "
                f"grad_clip (--grad-clip) so every gradient is checked before any block is "
                f"stepped")
        self.finish_begun(rep)
        self.updates.counters.on_applied(e.cfg)
        return True

    def join_jobs(self, rep: StepReport) -> None:
        """Wait for the blocks stepped during backward (re-raising a failure of the step
        thread); the wait and their count into `rep`."""
        t0 = time.perf_counter()
        jobs, self.jobs = self.jobs, None
        for job in jobs:
            job.result()
        rep.overlap_wait_s = time.perf_counter() - t0
        rep.overlapped_blocks = len(jobs)

    def finish_begun(self, rep: StepReport) -> None:
        """The update begun in backward, completed: its slots without a gradient now known,
        the blocks not stepped yet stepped, the whole made durable and visible."""
        e = self.parts
        update = self.updates.current
        update.missing = self.updates.take_missing()  # blocks not stepped yet may miss slots
        update.deferred = self.updates.take_deferred()  # ... or experts without tokens
        o = self.job_rep
        rep.cpu_step_s, rep.upload_s = o.cpu_step_s, o.upload_s
        rep.hidden_cpu_step_s, rep.hidden_upload_s = o.cpu_step_s, o.upload_s
        self.stepper.finish(update, rep, e.step_order(), e.unit_order())

