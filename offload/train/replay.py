"""The lazy replay of untouched experts' zero-gradient AdamW steps (offload/train/experts.py).

With transformers' fused expert tensors an expert without tokens has a zero gradient and
torch's AdamW steps it: its moments decay, weight decay applies, its step count moves on. So
that such an expert's optimizer state is neither read nor written in that update, the update
records the step instead -- its step number, learning rate and per-parameter hyper-parameters
-- and the expert is brought up to date later, by the same fused kernel run once per recorded
update on a zero gradient: element by element the same operations in the same order as the
eager zero step, so the result is bit-identical. An expert is replayed

- when it is next routed to: the MoE module calls `before_experts(hit)` with the experts it is
  about to run, in every forward (training, recompute, evaluation), before any of them
  computes, so every forward computes with the weights torch's model would have;
- for every expert, before anything reads the whole state: a checkpoint, an export,
  master_params() or optimizer_state() (`settle`).

A replay reads the expert's state units and steps them in place. On NVMe they are then held in
RAM of their own (NvmeState.hold) until this update's step acquires them -- the expert was
routed to, so it is stepped -- and written only then: each unit is read once per update. Held
bytes are capped (cfg.replay_hold_bytes, in the plan's host buffers); past the cap a unit goes
through the staging pipeline, written back now and read again by the step (`written` counts
them). Units held but not stepped (routed only in an evaluation forward) are written at the end
of the step, and before any direct read of the state. The replay then writes the new weights wherever the model's copy of
them lives: the device buffer (or nothing, where the parameters are the masters), a streamed
layer's host buffer and, while the layer is bound, its slot; on the nvme tier the layer's
weights file is rewritten whole (from the bound slot, else read back and patched) before the
forward goes on. Writes into weights the model computes with go through `.data` aliases, whose
version counters are their own: autograd saved other parameters of the same flat buffer
earlier in this forward, and a shared counter moving would fail their backward.

Only in one process, and not with the delayed update (the plan decides: experts.py): the
replay runs on the thread that runs forward, while no step is in flight. The overlapped step
runs on the step thread during the last micro-batch's backward, where activation checkpointing
recomputes layers and so calls `before_experts` again: those are the experts the forward of the
same inputs routed to, already replayed, so the call finds nothing recorded and touches no
state (the two threads never share the staging pipeline).
"""

from __future__ import annotations

import torch

from offload.train.experts import ExpertRange
from offload.train.parts import Parts
from offload.train.stepper import Update

Recorded = tuple[int, float, dict[str, tuple[float, float]]]  # (step, lr, Update.hyper)


class ExpertReplay:
    """The recorded zero steps of "step" experts without tokens, and their replay."""

    def __init__(self, parts: Parts, kernel, slot_skips: dict[str, int],
                 ranges: list[ExpertRange]):
        self.p = parts
        self.kernel = kernel
        self.slot_skips = slot_skips  # steps each parameter missed (its own AdamW step count)
        self.ranges = {(r.module, r.expert): r for r in ranges if r.zero_step}
        self.pending: dict[tuple[str, int], list[Recorded]] = {}
        self.replayed = 0  # experts brought up to date (report)
        self.replayed_steps = 0  # zero steps run by replays
        self.written = 0  # units replayed past the hold cap: written back, read again by the step
        self._zeros: torch.Tensor | None = None

    # -- the engine's calls ------------------------------------------------------------------
    def defer(self, u: Update) -> None:
        """Record update u's zero step of every expert whose slots it deferred."""
        for (module, e), r in self.ranges.items():
            names = u.deferred.get(r.block)
            if names and r.slots[0].name in names:
                self.pending.setdefault((module, e), []).append((u.step, u.lr, u.hyper))

    def routed(self, module: str, hit: list[int]) -> None:
        """`module` is about to run experts `hit`: those with recorded steps are replayed."""
        todo = [self.ranges[(module, e)] for e in hit if (module, e) in self.pending]
        if todo:
            self._replay(todo)

    def settle(self) -> None:
        """Every recorded step replayed: the state is what eager stepping would hold."""
        by_block: dict[int, list[ExpertRange]] = {}
        for key in list(self.pending):
            r = self.ranges[key]
            by_block.setdefault(r.block, []).append(r)
        for rs in by_block.values():
            self._replay(rs)

    def clear(self) -> None:
        """Forget what was recorded (a state was loaded over it)."""
        self.pending.clear()

    # -- the replay --------------------------------------------------------------------------
    def _replay(self, experts: list[ExpertRange]) -> None:
        """Replay `experts` (of one block): state in, zero steps, state out, weights written."""
        p = self.p
        bi = experts[0].block
        patches: list[tuple[int, int, torch.Tensor]] = []
        with torch.no_grad():
            for r in experts:
                steps = self.pending.pop((r.module, r.expert))
                for unit, lo, hi in p.state.units_of(bi):
                    a, b = max(lo, r.lo), min(hi, r.hi)
                    if a >= b:
                        continue
                    # kept in RAM until this update's step acquires it (read once, not by
                    # the replay and again by the step); past the plan's cap, staged as usual
                    state = p.state.hold(unit)
                    held = state is not None
                    if not held:
                        self.written += 1
                        state = p.state.acquire(unit)
                    try:
                        for step, lr, hyper in steps:
                            self._zero_step(r, a, b, lo, state, step, lr, hyper)
                        patches.append((a, b, state[0][a - lo:b - lo].to(p.dtype, copy=True)))
                    finally:
                        if not held:
                            p.state.release(unit, modified=True)
                self.replayed += 1
                self.replayed_steps += len(steps)
            self._write_weights(bi, patches)

    def _experts_of(self, bi: int, patches: list[tuple[int, int, torch.Tensor]]) -> list[ExpertRange]:
        """The experts of block bi the patches (which cover each replayed expert whole) lie in."""
        starts = {a for a, _, _ in patches}
        return [r for (_, _), r in self.ranges.items()
                if r.block == bi and any(r.lo <= a < r.hi for a in starts)]

    def _zero_step(self, r: ExpertRange, a: int, b: int, lo: int, state, step: int, lr: float,
                   hyper: dict[str, tuple[float, float]]) -> None:
        """One recorded update on elements [a, b) of expert r (block offsets; the unit starts
        at `lo`), slot by slot: each its own step count, lr and weight decay."""
        cfg = self.p.cfg
        beta1, beta2 = cfg.betas
        for s in r.slots:
            sa, sb = max(s.offset, a), min(s.offset + s.numel, b)
            if sa >= sb:
                continue
            lr_s, wd = hyper.get(s.name, (lr, cfg.weight_decay))
            k = slice(sa - lo, sb - lo)
            master, exp_avg, exp_avg_sq = (t.data[k] for t in state)
            self.kernel(master, exp_avg, exp_avg_sq, self._zero(sb - sa, master.device),
                        step=step - self.slot_skips.get(s.name, 0), lr=lr_s, beta1=beta1,
                        beta2=beta2, eps=cfg.eps, weight_decay=wd)

    def _zero(self, n: int, device: torch.device) -> torch.Tensor:
        """A zero gradient of n elements (the landing's dtype, as the eager step reads)."""
        z = self._zeros
        if z is None or z.numel() < n or z.device != device:
            z = self._zeros = torch.zeros(max(n, 1 << 16), dtype=self.p.grads.landing_dtype,
                                          device=device)
        return z[:n]

    def _write_weights(self, bi: int, patches: list[tuple[int, int, torch.Tensor]]) -> None:
        """The replayed experts' new weights into every copy the model computes from."""
        p = self.p
        if bi not in p.layer_of:
            if p.plan.shares_masters:
                return  # the parameters are the masters the kernel just updated
            flat = p.weights.flat16[bi].data
            for a, b, w in patches:
                flat[a:b].copy_(w)
            return
        li, streaming = p.layer_of[bi], p.streaming
        streamer = streaming.streamer
        bound = streamer.bound_flat(li).data if streamer.in_use(li) else None
        for a, b, w in patches:
            if bound is not None:
                bound[a:b].copy_(w)
        home = streaming.weight_target(li)
        if home is not None:  # cpu tier: the host buffer the next fetch copies from
            for a, b, w in patches:
                home.data[a:b].copy_(w)
            return
        # nvme tier: a routed expert's own weights file (offload/stream/routed.py), or the
        # layer's whole file, rewritten before the forward goes on (a later fetch of this
        # layer -- recompute, backward -- reads the new file)
        units = streaming.units[li]
        if len(units) > 1:
            unit_of = {lo: k for k, (lo, _) in enumerate(units)}
            for r in self._experts_of(bi, patches):
                pieces = sorted((a, w) for a, b, w in patches if r.lo <= a < r.hi)
                streaming.write_unit(li, unit_of[r.lo], torch.cat([w for _, w in pieces]))
                p.links["nvme_write"].add((r.hi - r.lo) * p.dtype.itemsize)
            return
        if bound is not None:
            flat = bound.cpu() if bound.is_cuda else bound
        else:
            flat = torch.empty(p.blocks[bi].numel, dtype=p.dtype)
            streaming.store.read_into(streaming.name(p.blocks[bi]), flat).wait()
            p.links["weights_read"].add(flat.numel() * flat.element_size())
            for a, b, w in patches:
                flat[a:b].copy_(w)
        streaming.write_weights(li, flat).wait()
        p.links["nvme_write"].add(flat.numel() * flat.element_size())
