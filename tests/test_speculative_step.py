"""The speculative step (offload/train/speculative.py): the overlapped step with clipping and
fp16 loss scaling, against plain PyTorch (torch.optim.AdamW + clip_grad_norm_, fp32) and against
the step after backward (bf16, fp16): bit-identical when clipping never triggers, when it is
forced at updates 2 and 5 (rolled back and stepped again), and when an fp16 overflow skips an
update (rolled back and skipped)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError, OffloadConfig
from tests.test_engine import MLP, mlp_batches, mlp_loss

UPDATES = 6
FORCED = {2: 1e-3, 5: 2e-3}  # update (1-based) -> the max norm clip_grad_norm_ is asked for
LOOSE_CLIP = 1e3  # grad_clip that never triggers on this model


def _cfg(mode, directory, **kw) -> OffloadConfig:
    base = dict(offload=mode, nvme_dir=str(directory / "swap") if mode == "nvme" else None,
                dtype="fp32", device="cpu", lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01,
                grad_clip=LOOSE_CLIP, exact_optimizer=True, buffer_count=2)
    base.update(kw)
    return OffloadConfig(**base)


def _run(cfg: OffloadConfig, forced: dict[int, float] | None = None, inf_at: int | None = None):
    """UPDATES updates of the MLP under `cfg`; `forced`: a window clip at those updates;
    `inf_at`: an inf in one gradient at that update. (losses, applied, every block's state,
    the engine's path name, rollbacks, the last reports)."""
    torch.manual_seed(0)
    model = MLP()
    engine = offload.initialize(model, cfg)
    losses, applied, reports = [], [], []
    try:
        for i, batch in enumerate(mlp_batches(UPDATES), start=1):
            handle = None
            if i == inf_at:
                victim = model.layers[1][0].weight
                handle = victim.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            loss = mlp_loss(model, batch)
            engine.backward(loss)
            losses.append(loss.item())
            if handle is not None:
                handle.remove()
            # clip_grad_norm_'s max norm for this window (what OffloadAdamW sets)
            engine.updates.window_clip = (forced or {}).get(i)
            applied.append(engine.step())
            reports.append(engine.last_report)
        state = [engine.optimizer_state(bi) for bi in range(len(engine.blocks))]
        rollbacks = getattr(engine.path, "rollbacks", 0)
        return losses, applied, state, engine.path.name, rollbacks, reports, engine.loss_scale
    finally:
        engine.close()


def _torch_reference(forced: dict[int, float]):
    """torch.optim.AdamW with clip_grad_norm_ at LOOSE_CLIP, or the forced max norm."""
    torch.manual_seed(0)
    model = copy.deepcopy(MLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.01)
    losses = []
    for i, batch in enumerate(mlp_batches(UPDATES), start=1):
        loss = mlp_loss(model, batch)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), forced.get(i, LOOSE_CLIP))
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_state(a, b):
    for bi, (x, y) in enumerate(zip(a, b)):
        for kind in x:
            assert torch.equal(x[kind], y[kind]), (bi, kind)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("forced", [{}, FORCED], ids=["never-clips", "clips-at-2-and-5"])
def test_fp32_speculation_is_torch_adamw_with_clipping(mode, forced, tmp_path):
    spec = _run(_cfg(mode, tmp_path / "spec", speculative_step=True), forced)
    losses, applied, state, path, rollbacks, reports, _ = spec
    assert path == "speculative" and all(applied)
    assert rollbacks == len(forced)
    assert [r.rolled_back for r in reports] == [i in forced for i in range(1, UPDATES + 1)]
    assert all(r.overlapped_blocks > 0 for r in reports)  # blocks did step during backward
    ref_losses, ref_params = _torch_reference(forced)
    assert losses == ref_losses
    torch.manual_seed(0)
    model = MLP()
    engine = offload.initialize(model, _cfg(mode, tmp_path / "names"))
    try:
        for bi, block in enumerate(engine.blocks):
            for name, master in block.views(state[bi]["master"]).items():
                assert torch.equal(master, ref_params[name]), name
    finally:
        engine.close()
    after = _run(_cfg(mode, tmp_path / "after", overlap_step=False), forced)
    assert after[3] == "after"
    _assert_same_state(state, after[2])


@pytest.mark.parametrize("mode,params,accum", [("cpu", "none", 1), ("nvme", "none", 2),
                                                ("nvme", "cpu", 1), ("nvme", "nvme", 1)])
def test_bf16_rollback_rebuilds_the_weights(mode, params, accum, tmp_path):
    """16-bit weights apart from the masters -- on the device, or streamed from host RAM or
    weight files: a rolled-back block's weights are made again from the restored masters, so
    the next forward computes what the step after backward's does (accumulation too)."""
    kw = dict(dtype="bf16", offload_params=params, grad_accum_steps=accum)
    if params == "nvme":
        kw["nvme_dir"] = str(tmp_path / "swap")
    spec = _run(_cfg(mode, tmp_path / "spec", speculative_step=True, **kw), FORCED)
    after = _run(_cfg(mode, tmp_path / "after", overlap_step=False, **kw), FORCED)
    assert spec[3] == "speculative" and spec[1] == after[1]
    assert spec[4] == sum(i % accum == 0 for i in FORCED)  # forced at a window's end: rolled back
    assert spec[0] == after[0]  # losses: the forwards saw the same weights
    _assert_same_state(spec[2], after[2])


@pytest.mark.parametrize("mode,params", [("cpu", "none"), ("nvme", "none"), ("nvme", "nvme")])
def test_fp16_overflow_rolls_back_and_skips(mode, params, tmp_path):
    """The skipped update leaves nothing behind: state restored, 16-bit weights (on the device
    or in their swap files) rebuilt from the restored masters."""
    kw = dict(dtype="fp16", initial_scale_power=8, grad_clip=0.0, offload_params=params)
    if params == "nvme":
        kw["nvme_dir"] = str(tmp_path / "swap")
    spec = _run(_cfg(mode, tmp_path / "spec", speculative_step=True, **kw), inf_at=3)
    after = _run(_cfg(mode, tmp_path / "after", overlap_step=False, **kw), inf_at=3)
    losses, applied, state, path, rollbacks, reports, scale = spec
    assert path == "speculative" and after[3] == "after"
    assert applied == after[1] and applied[2] is False and sum(applied) == UPDATES - 1
    assert reports[2].nonfinite and reports[2].rolled_back and rollbacks == 1
    assert scale == after[6] == 2.0 ** 8 / 2
    assert losses == after[0]
    _assert_same_state(state, after[2])


def test_plan_counts_the_pre_step_copies(tmp_path):
    cfg = _cfg("cpu", tmp_path, speculative_step=True)
    engine = offload.initialize(MLP(), cfg)
    try:
        numel = sum(b.numel for b in engine.blocks)
        assert engine.plan.bytes["host"]["rollback"] == 12 * numel
        assert engine.account.kind_peaks()[("host", "rollback")] == 12 * numel
        assert "speculative_step" in engine.overlap_why
    finally:
        engine.close()
    nvme = offload.initialize(MLP(), _cfg("nvme", tmp_path / "n", speculative_step=True))
    try:
        assert nvme.plan.bytes["nvme"]["rollback"] == 12 * numel
    finally:
        nvme.close()


def test_what_turns_it_on_and_what_is_refused():
    with pytest.raises(ConfigError, match="choose one"):
        OffloadConfig(speculative_step=True, delayed_update=True)
    with pytest.raises(ConfigError, match="needs overlap_step"):
        OffloadConfig(speculative_step=True, overlap_step=False)
    with pytest.raises(ConfigError, match="one process"):
        OffloadConfig(speculative_step=True, grad_clip=1.0).step_path(world=2)
    # nothing global to wait for: the plain overlapped step, no copies
    assert OffloadConfig(speculative_step=True, dtype="bf16").step_path()[0] == "overlapped"
    # DeepSpeed's SuperOffload switch
    ds = OffloadConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "super_offload": True}}, "gradient_clipping": 1.0})
    assert ds.speculative_step and ds.step_path()[0] == "speculative"


def test_killed_during_a_rollback_resumes_exactly(tmp_path):
    """The crash campaign's harness (scripts/chaos.py): a tiny NVMe run whose max norm clips
    every update, so every update is rolled back and stepped again; SIGKILLed while a rollback
    rebuilds a block, resumed from its checkpoint, it ends bit-identical to the run never
    killed (the in-process tests above hold that run to the step after backward)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import chaos
    flags = ["--batch-size", "8", "--seq-len", "16", "--eval-every", "0", "--warmup-steps", "2",
             "--grad-clip", "0.01"]
    # 3 updates, a checkpoint after each: the kill lands in update 2's rollback
    camp = chaos.run_campaign(str(tmp_path / "spec"), kills=1, steps=3, save_every=1, seed=0,
                              extra=flags + ["--speculative-step"], rng_seed=3,
                              phases=["rollback"], launch_timeout=300, echo=lambda *a: None)
    report = chaos.table(camp) + "\n" + "\n".join(camp.problems)
    assert camp.problems == [] and camp.kills == 1, report
    assert "rollback" in camp.launches[0].killed_in, report
    assert camp.launches[-1].outcome == "completed", report
    assert camp.launches[1].resumed and camp.launches[1].from_step == 1, report  # in update 2
    with open(os.path.join(str(tmp_path / "spec"), "chaos", "metrics.jsonl")) as f:
        assert all(json.loads(line)["rolled_back"] for line in f)


@pytest.mark.parametrize("name,mode,untouched,hold", [("qwen3_moe", "nvme", "step", None),
                                                       ("qwen3_moe", "nvme", "step", "64MiB")])
def test_mixture_of_experts_rolls_back_exactly(name, mode, untouched, hold, tmp_path):
    """Experts without tokens: stepped with zeros later (lazy replay) or skipped -- units the
    speculative step stepped in backward and the re-step does not: restored all the same.
    `hold`: room for every replayed expert's state in RAM until the step (replay_hold_bytes),
    so a rolled-back update's replayed experts exist only there, never in their files."""
    pytest.importorskip("transformers")
    from families import VOCAB, save_family_checkpoint
    from offload.models import load_model
    from offload.train.experts import set_untouched_experts
    from tests.test_engine import hf_loss, lm_batches
    save_family_checkpoint(name, tmp_path / "ckpt")
    data = lm_batches(4, VOCAB, seq=8)
    runs = []
    for spec in (True, False):
        model = load_model(str(tmp_path / "ckpt"))
        set_untouched_experts(model, untouched)
        cfg = _cfg(mode, tmp_path / str(spec), grad_clip=0.5, speculative_step=spec,
                   overlap_step=spec, replay_hold_bytes=hold)
        engine = offload.initialize(model, cfg)
        try:
            losses = []
            for i, ids in enumerate(data, start=1):
                loss = hf_loss(model, ids)
                engine.backward(loss)
                losses.append(loss.item())
                engine.updates.window_clip = FORCED.get(i)
                assert engine.step()
            runs.append((losses, engine.master_params(), dict(engine.slot_skips),
                         getattr(engine.path, "rollbacks", None)))
        finally:
            engine.close()
    (losses, masters, skips, rollbacks), (ref_losses, ref_masters, ref_skips, _) = runs
    assert rollbacks >= 1 and losses == ref_losses and skips == ref_skips
    for n in ref_masters:
        assert torch.equal(masters[n], ref_masters[n]), n
