"""The one-step delayed update against a plain-PyTorch reference of the same schedule.

Reference (DeepSpeed ZeRO-Offload's delayed parameter update): fp32 masters with
torch.optim.AdamW in a second copy of the model; after each window's backward the weights of the
*previous* update go live in the model the forward runs on, then the optimizer steps on this
window's gradients (clipped as clip_grad_norm_ does). The first `warmup` updates go live at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError, OffloadConfig
from offload.models import build_model, preset
from tests.test_engine import MLP, _cfg, hf_loss, lm_batches, max_rel_diff, mlp_batches, mlp_loss


def _copy_into(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for p, q in zip(dst.parameters(), src.parameters()):
            p.copy_(q)


def reference_delayed(model, batches, loss_fn, *, cfg, warmup, fused=None):
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, fused=fused)
    accum, pending, updates, losses = cfg.grad_accum_steps, False, 0, []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        (loss / accum).backward()
        losses.append(loss.item())
        if (i + 1) % accum:
            continue
        if pending:  # the previous update's weights go live after this window's backward
            _copy_into(model, master)
        for q, p in zip(master.parameters(), model.parameters()):
            q.grad, p.grad = p.grad, None
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        pending = updates >= warmup
        updates += 1
        if not pending:
            _copy_into(model, master)
    masters = {n: p.detach().clone() for n, p in master.named_parameters()}
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    return masters, live, losses


def _train(model, batches, loss_fn, cfg):
    engine = offload.initialize(model, cfg)
    losses, reports = [], []
    for batch in batches:
        loss = loss_fn(model, batch)
        engine.backward(loss)
        losses.append(loss.item())
        if engine.step():
            reports.append(engine.last_report)
    return engine, losses, reports


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("clip,accum,warmup", [(0.0, 1, 0), (0.05, 1, 2), (0.05, 2, 0), (0.0, 2, 3)])
def test_delayed_update_matches_reference(mode, clip, accum, warmup, tmp_path):
    torch.manual_seed(0)
    model = MLP(depth=4)
    ref_model = copy.deepcopy(model)
    batches = mlp_batches(8 * accum)
    cfg = _cfg(mode, tmp_path, grad_clip=clip, grad_accum_steps=accum, delayed_update=True,
               delayed_update_warmup=warmup)
    ref_masters, ref_live, ref_losses = reference_delayed(ref_model, batches, mlp_loss, cfg=cfg,
                                                          warmup=warmup)
    engine, losses, reports = _train(model, batches, mlp_loss, cfg)
    try:
        # every forward saw the same (stale) weights as the reference's
        assert losses == ref_losses
        assert max_rel_diff(engine.master_params(), ref_masters) == 0
        # before a flush the model computes with the previous update's weights, as the reference
        assert max_rel_diff(dict(model.named_parameters()), ref_live) == 0
        with engine.latest_weights():  # an evaluation sees the newest update ...
            assert max_rel_diff(dict(model.named_parameters()), ref_masters) == 0
        # ... and leaves the trajectory alone
        assert max_rel_diff(dict(model.named_parameters()), ref_live) == 0
        assert [r.delayed for r in reports] == [k >= warmup for k in range(len(reports))]
        assert all(r.overlapped_blocks == len(engine.blocks) for r in reports[warmup + 1:])
        engine.flush()
        assert max_rel_diff(dict(model.named_parameters()), ref_masters) == 0
    finally:
        engine.close()


def test_delayed_update_differs_from_synchronous(tmp_path):
    """The schedule really is delayed (a reference check that cannot pass by accident)."""
    torch.manual_seed(0)
    model = MLP(depth=2)
    plain = copy.deepcopy(model)
    batches = mlp_batches(4)
    e1, l1, _ = _train(model, batches, mlp_loss, _cfg("cpu", tmp_path, delayed_update=True))
    e2, l2, _ = _train(plain, batches, mlp_loss, _cfg("cpu", tmp_path))
    try:
        # forward 2 runs on the initial weights when delayed, on update 1's when not
        assert l1[0] == l2[0] and l1[1] != l2[1]
    finally:
        e1.close()
        e2.close()


def test_delayed_update_tiny_llama_nvme_clip_and_resume(tmp_path):
    """A language model with clipping, state on NVMe, saved while an update is pending: the
    resumed run (fresh model object, weights from the checkpoint) equals the run that went on,
    and equals the reference, which never saved (saving changes nothing)."""
    cfg_model = preset("tiny")
    batches = lm_batches(8, cfg_model.vocab_size)
    cfg = _cfg("nvme", tmp_path, grad_clip=1.0, delayed_update=True, lr=1e-3)

    def run(batches, model, state_in=None, state_out=None, at=None):
        engine = offload.initialize(model, cfg)
        if state_in:
            engine.load_state(state_in)
        losses = []
        for i, ids in enumerate(batches):
            loss = hf_loss(model, ids)
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
            if state_out and i + 1 == at:
                engine.save_state(state_out)
        masters = engine.master_params()
        engine.close()
        return masters, losses

    model = build_model(cfg_model, "cpu", torch.float32, source=3)
    second = copy.deepcopy(model)
    full, full_losses = run(batches, model, state_out=str(tmp_path / "ckpt"), at=4)
    # resume: the weights come from the saved masters (load_state), the model object is fresh
    resumed, resumed_losses = run(batches[4:], second, state_in=str(tmp_path / "ckpt"))
    assert max_rel_diff(resumed, full) == 0
    assert resumed_losses == full_losses[4:]
    ref_masters, _, ref_losses = reference_delayed(
        build_model(cfg_model, "cpu", torch.float32, source=3), batches, hf_loss, cfg=cfg, warmup=0)
    assert full_losses == ref_losses and max_rel_diff(full, ref_masters) == 0


@pytest.mark.parametrize("changes,message", [
    (dict(offload="none"), "needs offload='cpu' or 'nvme'"),
    (dict(offload="cpu", offload_params="cpu"), "offload_params='none'"),
    (dict(offload="cpu", delayed_update_warmup=-1), "delayed_update_warmup"),
])
def test_delayed_update_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(**{"delayed_update": True, "device": "cpu", **changes})


def test_delayed_update_plan_counts_the_second_copies():
    from offload.train.plan import plan_training
    blocks = [(1000, True)] * 4 + [(500, False)]
    base = OffloadConfig(offload="cpu", device="cpu", dtype="bf16", grad_clip=1.0)
    one = plan_training(blocks, base)
    two = plan_training(blocks, base.replace(delayed_update=True))
    assert two.bytes["device"]["weights"] == 2 * one.bytes["device"]["weights"]
    assert two.bytes["host"]["grads"] == 2 * one.bytes["host"]["grads"]
    assert base.replace(delayed_update=True).step_path()[0] == "delayed"


def test_delayed_job_never_touches_live_parameters(tmp_path):
    """The job writes the spare weights while autograd holds the live ones. The model is built
    on meta and materialised by the engine, as the runner does: its parameters are born as
    views of the first weight buffers and share their version counter, so a job writing
    through those buffers would bump the live parameters' versions mid-forward and fail the
    next backward ("modified by an inplace operation") whenever the timing lines up. Checked
    deterministically: no parameter's version moves while a job runs."""
    from offload.models import seeded_init
    cfg_model = preset("tiny")
    batches = lm_batches(6, cfg_model.vocab_size)
    cfg = _cfg("cpu", tmp_path, grad_clip=1.0, delayed_update=True, lr=1e-3)
    ref_model = build_model(cfg_model, "cpu", torch.float32, source=5)
    ref_masters, _, ref_losses = reference_delayed(ref_model, batches, hf_loss, cfg=cfg, warmup=0)
    model = build_model(cfg_model, "meta", torch.float32)
    engine = offload.initialize(model, cfg, source=seeded_init(5, cfg_model.initializer_range))
    losses = []
    try:
        for ids in batches:
            loss = hf_loss(model, ids)
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
            before = [p._version for p in model.parameters()]
            engine.delayed.join()  # the job this step submitted, run to completion
            assert [p._version for p in model.parameters()] == before
        assert losses == ref_losses
        assert max_rel_diff(engine.master_params(), ref_masters) == 0
    finally:
        engine.close()


def test_damaged_delayed_state_is_refused_in_one_line(tmp_path):
    """A saved state's pending-update flag must be a boolean, and a state that claims a pending
    update must carry the weights that were in use."""
    import json
    from offload.train.engine import StateError
    cfg = _cfg("cpu", tmp_path, delayed_update=True)
    torch.manual_seed(0)
    model = MLP(depth=2)
    engine, _, _ = _train(model, mlp_batches(2), mlp_loss, cfg.replace(delayed_update=False))
    engine.save_state(str(tmp_path / "s"))  # no pending update: no "live" tensors
    engine.close()
    meta_path = tmp_path / "s" / "engine_state.json"
    meta = json.loads(meta_path.read_text())
    fresh = offload.initialize(copy.deepcopy(model), cfg)
    try:
        for value, match in (("yes", "'delayed_pending' must be true or false"),
                             (True, "cannot load block")):
            meta_path.write_text(json.dumps(dict(meta, delayed_pending=value)))
            with pytest.raises(StateError, match=match):
                fresh.load_state(str(tmp_path / "s"))
    finally:
        fresh.close()


def test_delayed_update_fp16_overflow_skips_and_still_applies_the_previous(tmp_path):
    """fp16 with the delayed update: an overflowing window is skipped (state untouched, scale
    halved) but the update before it still goes live on time."""
    torch.manual_seed(0)
    model = MLP()
    engine = offload.initialize(model, _cfg("cpu", tmp_path, dtype="fp16", initial_scale_power=8,
                                            delayed_update=True))
    batches = mlp_batches(3)
    try:
        live0 = [p.detach().clone() for p in model.parameters()]
        engine.backward(mlp_loss(model, batches[0]))
        assert engine.step() and engine.last_report.delayed  # update 1 submitted, not live
        assert all(torch.equal(a, p) for a, p in zip(live0, model.parameters()))
        scale = engine.loss_scale
        before = [engine.optimizer_state(i) for i in range(len(engine.blocks))]
        victim = model.layers[1][0].weight
        handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        engine.backward(mlp_loss(model, batches[1]))
        assert engine.step() is False  # skipped ...
        handle.remove()
        # ... but update 1's weights went live, and nothing else changed
        assert not all(torch.equal(a, p) for a, p in zip(live0, model.parameters()))
        live1 = [p.detach().clone() for p in model.parameters()]
        for b, a in zip(before, [engine.optimizer_state(i) for i in range(len(engine.blocks))]):
            assert all(torch.equal(b[k], a[k]) for k in b)
        assert engine.loss_scale == scale / 2 and engine.global_step == 1
        engine.backward(mlp_loss(model, batches[2]))
        assert engine.step() and engine.global_step == 2
        assert all(torch.equal(a, p) for a, p in zip(live1, model.parameters()))  # 2 pending
        engine.flush()
        assert not all(torch.equal(a, p) for a, p in zip(live1, model.parameters()))
    finally:
        engine.close()
