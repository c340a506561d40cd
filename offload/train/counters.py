"""The training counters of one engine -- update and micro-batch counts, the loss-scale state,
skips -- as one value: the engine owns it, the loss-scale rules change it, and the state file
saves it whole (offload/train/state.py). Nothing else of a run's bookkeeping is needed, besides
the tensors and the learning rate, to resume it exactly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from offload.config import OffloadConfig
from offload.train.errors import NonFiniteError

# the counters a state file holds (nonfinite_streak is not: a resumed run starts a new streak)
SAVED = ("global_step", "micro_step", "loss_scale", "clean_steps", "hysteresis_left",
         "skipped_steps", "slot_skips")


@dataclass
class TrainingCounters:
    global_step: int = 0  # optimizer updates applied
    micro_step: int = 0  # engine.step() calls
    loss_scale: float = 1.0  # what the loss is multiplied by before backward (fp16)
    clean_steps: int = 0  # fp16: finite updates since the scale last changed
    hysteresis_left: int = 2  # fp16: overflows still tolerated before the scale halves
    skipped_steps: int = 0  # updates skipped for inf/nan (fp16 overflows included)
    nonfinite_streak: int = 0  # updates skipped in a row (reset by an applied one)
    # PyTorch's AdamW skips a parameter whose .grad is None (no gradient in a whole window):
    # updates each such slot missed, for the slots that ever missed one
    slot_skips: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, cfg: OffloadConfig) -> "TrainingCounters":
        scale = (cfg.loss_scale or 2.0 ** cfg.initial_scale_power) if cfg.dtype == "fp16" else 1.0
        return cls(loss_scale=scale, hysteresis_left=cfg.hysteresis)

    def to_meta(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in SAVED}
        out["slot_skips"] = dict(self.slot_skips)
        return out

    def load_meta(self, meta: dict[str, Any]) -> None:
        """Take the saved counters (validated by the caller)."""
        for k in SAVED:
            setattr(self, k, dict(meta[k]) if k == "slot_skips" else meta[k])
        self.nonfinite_streak = 0

    # -- the loss-scale and skip rules (DeepSpeed's dynamic loss scaler) ------------------------
    def on_applied(self, cfg: OffloadConfig) -> None:
        """An update with finite gradients: the streak ends; fp16 grows the scale after
        loss_scale_window of them."""
        self.nonfinite_streak = 0
        if cfg.dtype != "fp16" or cfg.loss_scale > 0:  # a fixed scale never changes
            return
        self.clean_steps += 1
        if self.clean_steps >= cfg.loss_scale_window:
            self.loss_scale *= 2
            self.clean_steps = 0
            self.hysteresis_left = cfg.hysteresis

    def on_nonfinite(self, cfg: OffloadConfig) -> None:
        """Skip this update (like an fp16 overflow, in any dtype); stop after
        max_nonfinite_skips in a row -- for fp16 only those the loss scale can no longer absorb."""
        if cfg.dtype == "fp16":
            absorbable = cfg.loss_scale == 0 and self.loss_scale > cfg.min_loss_scale
            self._on_overflow(cfg)
            if absorbable:
                return
        else:
            self.skipped_steps += 1
        self.nonfinite_streak += 1
        if self.nonfinite_streak >= cfg.max_nonfinite_skips:
            raise NonFiniteError(
                f"{self.nonfinite_streak} updates in a row skipped for a non-finite loss or "
                f"gradient (update {self.global_step + 1}); training has diverged or the data "
                f"holds bad values: lower the learning rate or add gradient clipping, and resume "
                f"from the last checkpoint (saved state is never non-finite)")

    def _on_overflow(self, cfg: OffloadConfig) -> None:
        self.skipped_steps += 1
        self.clean_steps = 0
        if cfg.loss_scale > 0:  # a fixed scale never changes
            return
        self.hysteresis_left -= 1
        if self.hysteresis_left <= 0:
            self.loss_scale = max(self.loss_scale / 2, cfg.min_loss_scale)
            self.hysteresis_left = cfg.hysteresis
