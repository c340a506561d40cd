"""The speculative step: the overlapped step (offload/train/paths.py) with gradient clipping or
fp16 loss scaling, where the update's gradient scale is known only once every gradient is.

Speculation: when the window's last backward begins, the update begins with the scale it has
when nothing clips and nothing overflows (1, or 1/loss_scale in fp16), and each block is
stepped on the step thread as soon as its final gradients land, as the overlapped step does.
Before a block is stepped, its pre-step state is kept:
  host RAM / device  `PreStepCopies`: master, exp_avg and exp_avg_sq of the block copied into
                     buffers of the same size, allocated once (the plan counts them as
                     "rollback": 12 bytes per parameter on the state's tier);
  NVMe               `CommittedFiles`: the update writes each unit's state beside its
                     committed files (NvmeState versions, write_beside), so the committed files
                     stay until the update is accepted (end_step); a rollback re-reads them
                     ("rollback" on nvme: 12 bytes per parameter of disk), and the re-step
                     writes in place, as the step after backward does.
The landing keeps every gradient until step() (per-block landing, never the pool).

Validation, at step(), with Updates.grad_scale() (the norm is taken as the gradients land):
  the same scale (and lr)  kept: the rest of the blocks stepped, the update committed;
  another scale (clipped)  rolled back: each stepped block's state restored and its weights
                           rebuilt from the restored masters, then the whole update stepped
                           again with the clip coefficient -- the same kernel on the same
                           inputs as the step after backward, so the result is bit-identical;
  inf/nan (fp16 overflow)  restored and skipped, the counters moved as the step after backward
                           moves them (the loss scale lowered).
The rollbacks are counted (`rollbacks`, StepReport.rolled_back) for the run's report.
"""

from __future__ import annotations

import time

import torch

from offload.optim.state import NvmeState
from offload.train.errors import NonFiniteError
from offload.train.parts import Parts
from offload.train.paths import AfterBackward, Overlapped
from offload.train.stepper import BlockStepper, StepReport, Update, Updates


class PreStepCopies:
    """Resident state: each stepped unit's master and moments as they were before the step."""

    def __init__(self, parts: Parts):
        self.state = parts.state
        self.copies: dict[int, tuple[torch.Tensor, ...]] = {}  # unit -> copies, made once
        nbytes = 0
        for bi in range(len(parts.blocks)):
            for unit, lo, hi in self.state.units_of(bi):
                like = self.state.acquire(unit)[0]
                self.copies[unit] = tuple(torch.empty(hi - lo, dtype=torch.float32,
                                                      device=like.device) for _ in range(3))
                nbytes += 12 * (hi - lo)
        # its bytes in the plan: offload/train/plan.py rollback_copy_bytes
        parts.account.add(self.state.tier, "rollback", nbytes)
        self.saved: list[int] = []  # units copied this update

    def begin(self) -> None:
        """A speculative update begins (main thread, before its backward)."""
        self.saved = []

    def save(self, bi: int) -> None:
        """Before block bi's speculative step (step thread)."""
        for unit, _, _ in self.state.units_of(bi):
            for copy, live in zip(self.copies[unit], self.state.acquire(unit)):
                copy.copy_(live)
            self.saved.append(unit)

    def restore(self) -> None:
        for unit in self.saved:
            for live, copy in zip(self.state.acquire(unit), self.copies[unit]):
                live.copy_(copy)
        self.saved = []

    def forget(self) -> None:
        self.saved = []


class CommittedFiles:
    """NVMe state: the committed swap files are the pre-step state (NvmeState versions)."""

    def __init__(self, state: NvmeState):
        assert state.versions, "the speculative step needs NvmeState(versions=True)"
        self.state = state

    def begin(self) -> None:
        self.state.write_beside()  # until end_step commits them, or a rollback drops them

    def save(self, bi: int) -> None:
        pass  # the step writes beside the committed files

    def restore(self) -> None:
        self.state.discard_written()

    def forget(self) -> None:
        pass  # end_step commits what was written


class Speculative(Overlapped):
    name = "speculative"

    def __init__(self, parts: Parts, stepper: BlockStepper, updates: Updates):
        super().__init__(parts, stepper, updates)
        self.pre_step = (CommittedFiles(parts.state) if isinstance(parts.state, NvmeState)
                         else PreStepCopies(parts))
        self.speculated = 0  # updates begun in backward
        self.rollbacks = 0  # ... of which the speculation was wrong (clipped, skipped, new lr)

    def begin_scale(self) -> float:
        """What Updates.grad_scale gives when nothing clips or overflows: 1/loss_scale."""
        return 1.0 / self.updates.counters.loss_scale

    def backward_begins(self, last_micro: bool) -> None:
        super().backward_begins(last_micro)
        if last_micro and self.jobs is not None:  # begun: no block lands before backward runs
            self.pre_step.begin()

    def step_landed(self, u: Update, bi: int) -> None:
        self.pre_step.save(bi)  # before the step touches the block's state
        super().step_landed(u, bi)

    def step(self, rep: StepReport) -> bool:
        # a block with inf/nan gradients was not stepped, nor any after it (Overlapped._finite):
        # the norm is non-finite, so this rolls back (where the overlapped step must refuse)
        if self.jobs is None:  # not begun in backward (a non-finite loss): the plain step
            return AfterBackward.step(self, rep)
        self.join_jobs(rep)
        self.speculated += 1
        update = self.updates.current
        try:
            grad_scale = self.grad_scale(rep)
        except NonFiniteError:  # too many skips in a row: stop with the state as it was
            self._roll_back(update, rep)
            raise
        if grad_scale == update.grad_scale and (update.lr, update.hyper) == (
                self.updates.lr, self.updates.hyper):
            self.pre_step.forget()  # validated: the speculative steps stand
            self.finish_begun(rep)
            return True
        self._roll_back(update, rep)
        if grad_scale is None:  # inf/nan (fp16: overflow, the scale lowered): skipped
            return False
        # clipped (or the lr changed since backward began): the whole update again, as the
        # step after backward makes it
        update = self.updates.begin(grad_scale)
        self.stepper.finish(update, rep, self.parts.step_order(), self.parts.unit_order())
        return True

    def _roll_back(self, update: Update, rep: StepReport) -> None:
        """Every block stepped in `update` back to its pre-step state, weights included; the
        update un-begun (its step number is the next update's again)."""
        t0 = time.perf_counter()
        self.rollbacks += 1
        rep.rolled_back = True
        o = self.job_rep  # the speculative steps' time on the step thread: spent, then undone
        rep.cpu_step_s += o.cpu_step_s
        rep.upload_s += o.upload_s
        rep.hidden_cpu_step_s, rep.hidden_upload_s = o.cpu_step_s, o.upload_s
        self.pre_step.restore()
        # the weights written from the speculative masters, rebuilt from the restored ones
        for bi in sorted(update.stepped):
            self.stepper.rewrite_weights(update, bi, rep)
        self.stepper.weights_written(rep)
        if self.parts.cuda:
            self.stepper.weights_visible(rep)
        self.updates.counters.global_step -= 1
        rep.rollback_s = time.perf_counter() - t0

    @property
    def rollback_rate(self) -> float:
        """Rolled-back updates per update begun in backward (0 before the first)."""
        return self.rollbacks / self.speculated if self.speculated else 0.0
