"""One-step delayed parameter update (ZeRO-Offload's DPU): the CPU step of update t runs on the
engine's step thread while the micro-batches of update t+1 go through forward and backward.

The overlapped step in engine.py steps each block as its gradients land, which keeps the math
of the plain loop but is only possible when nothing global is needed first (no clipping, no
fp16 overflow check). The delayed update overlaps the *whole* step with everything, whatever
the math needs, at a price the user opts into: the gradients of update t+1 are computed on the
weights from before update t (one step stale), as in DeepSpeed's delayed parameter update.

The order, per optimizer update (what `Delayed.step` does in `engine.step()`):
  1. wait for update t-1's job and make its weights live: the block's parameters are re-pointed
     at the buffers the job wrote (the next forward reads them), the old ones become the next
     job's output buffers — two device copies of the 16-bit weights, swapped, never copied;
  2. clip / overflow-check update t's gradients (they have all landed);
  3. hand update t's gradient set to a job and switch gradient landing to the second set, so
     the next backward never writes what the job reads;
  4. return: forward and backward of update t+1 run on update t-1's weights meanwhile.
So update t+1's forward sees the weights of update t-1, and the update applied after it uses
gradients taken there: exactly the reference loop in tests/test_delayed.py.

Anything that looks at state waits for the job first (`join`). A checkpoint saved while an
update is pending holds the masters (which include it) and the weights in use beside them, so
a resumed run computes with the same stale weights and makes the update live at the same step
as the run that went on. `Engine.latest_weights()` lets an evaluation see the newest weights
without changing the trajectory. The first `delayed_update_warmup` updates are synchronous.

Across ranks (ZeRO stages 0-2) the gradients handed to the job are already averaged (and the
clip coefficient agreed) at step 2; the job steps this rank's part only and issues no
collective; `gather()` all-gathers every rank's part of the shadow on the main thread when it
goes live (step 1) or an evaluation asks for it, the same point on every rank.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from offload.train.parts import Parts
from offload.train.paths import AfterBackward
from offload.train.stepper import BlockStepper, StepReport, Update, Updates


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s memory (same offset, shape, strides) with a fresh version counter."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class Delayed(AfterBackward):
    """The delayed step path (offload/train/paths.py): step() hands the update to a job."""
    name = "delayed"

    def __init__(self, parts: Parts, stepper: BlockStepper, updates: Updates):
        live = parts.weights
        assert all(f is not None for f in live.flat16), "delayed_update needs resident weights"
        super().__init__(parts, stepper, updates)
        # the job's output: a second device copy of every block's 16-bit weights (across
        # ranks at stages 1-2, padded as the live ones are: each rank's job writes its shard,
        # all-gathered when the weights go live); its bytes: plan.py shadow_weight_bytes
        self.shadow_padded = [torch.empty_like(p if p is not None else f)
                              for f, p in zip(live.flat16, live.padded)]
        self.shadow = [t[:f.numel()] for t, f in zip(self.shadow_padded, live.flat16)]
        for t in self.shadow_padded:
            parts.account.add("device", "weights", t.numel() * t.element_size())
        self._job: tuple[Future, StepReport] | None = None
        self.gathered = True  # the shadow holds every rank's part (trivially so in one process)

    def active(self) -> bool:
        """Past the warm-up: this update is delayed."""
        return self.updates.counters.global_step >= self.parts.cfg.delayed_update_warmup

    def step(self, rep: StepReport) -> bool:
        if not self.active():  # a warm-up update: synchronous
            return super().step(rep)
        e = self.parts
        self.apply(rep)
        grad_scale = self.grad_scale(rep)
        if grad_scale is None:  # fp16 overflow: this update is skipped, nothing is submitted
            return False
        grads = e.grads.swap_sets()  # the next backward lands in the other set
        update = self.updates.begin(grad_scale)  # step number, lr and grad scale are fixed here
        job_rep = StepReport()
        self._job = (e.step_thread.submit(self._run, update, grads, job_rep), job_rep)
        self.gathered = not e.gathers_weights
        rep.delayed = True
        return True

    def _run(self, update: Update, grads: list[dict[int, torch.Tensor]], rep: StepReport) -> None:
        """On the step thread: every block stepped from `grads` into the shadow weights."""
        e = self.parts
        # The update writes its new weights to the shadow buffers (the main thread computes
        # with the live ones meanwhile), through aliases with version counters of their own: a
        # parameter keeps the version counter it was born with (`.data =` does not replace
        # it), and one born as a view of a buffer shares that buffer's, so writing the buffer
        # itself would "modify" live parameters that autograd saved in this very forward.
        update.weights_out = [_alias(t) for t in self.shadow]
        order = e.step_order()
        for bi in order:
            self.stepper.step_block(update, bi, rep, grads[bi])
        # no compute-stream wait from this thread: apply() orders the compute stream after the
        # uploads, on the main thread, when the weights go live
        self.stepper.finish(update, rep, order, e.unit_order(), sync_compute=False)

    @property
    def pending(self) -> bool:
        """An update whose weights are not live yet (its job may still run)."""
        return self._job is not None

    def mark_pending(self) -> None:
        """Resume: the shadow buffers hold an update's weights that the saved run had not made
        live yet; the next step() does, as it would have."""
        done: Future = Future()
        done.set_result(None)
        self._job = (done, StepReport())
        self.gathered = not self.parts.gathers_weights  # load_state filled this rank's part

    def join(self) -> None:
        """Wait for the pending job (re-raising its failure); its weights stay pending."""
        if self._job is not None:
            self._job[0].result()

    def flush(self) -> None:
        self.apply(StepReport())

    def gather(self) -> float:
        """Across ranks (stages 1-2): every rank's part of the pending weights to every rank,
        once, after the job (a collective: every rank calls it at the same point -- the step,
        or an evaluation's latest_weights). Seconds waited."""
        if self.gathered:
            return 0.0
        e = self.parts
        self.join()
        if e.cuda:  # the job's uploads into the shadow ran on the H2D stream
            torch.cuda.current_stream(e.device).wait_stream(e.h2d_stream)
        waited = e.zero.gather_weights(self.shadow_padded, e.step_order())
        self.gathered = True
        return waited

    def apply(self, rep: StepReport) -> None:
        """Wait for the pending job and make its weights the ones the model computes with."""
        if self._job is None:
            return
        e = self.parts
        t0 = time.perf_counter()
        fut, job_rep = self._job
        self._job = None
        fut.result()
        rep.overlap_wait_s += time.perf_counter() - t0
        rep.comm_wait_s += self.gather()
        # the job's own split, hidden behind this update's forward and backward
        rep.cpu_step_s += job_rep.cpu_step_s
        rep.upload_s += job_rep.upload_s
        rep.hidden_cpu_step_s += job_rep.cpu_step_s
        rep.hidden_upload_s += job_rep.upload_s
        rep.overlapped_blocks = len(e.blocks)
        # the shadow goes live, and with it the (padded) buffers behind it, which the gathers
        # across ranks run on; the old live ones are the next job's output
        self.shadow, self.shadow_padded = e.weights.swap(self.shadow, self.shadow_padded)
        e.weights.bind(e.blocks, e.module)
        if e.cuda:
            # the next forward's kernels must see the uploads: the compute stream waits for the
            # H2D stream (a GPU-side wait, no host sync)
            torch.cuda.current_stream(e.device).wait_stream(e.h2d_stream)

    def drop(self) -> None:
        """Forget the pending job after waiting for it (load_state overwrites everything)."""
        self.join()
        self._job = None
        self.gathered = True  # nothing pending
        e = self.parts
        if e.cuda:
            # join() waited for the job on the host, not for its uploads on the H2D stream:
            # what overwrites the shadow buffers next (load_state's copies, on the compute
            # stream) must come after them (desk review L8; GPU-side wait)
            torch.cuda.current_stream(e.device).wait_stream(e.h2d_stream)
