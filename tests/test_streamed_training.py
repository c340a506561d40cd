"""Training with streamed weights (ZeRO-Infinity) against the plain engine: the same masters
after 10 updates, for weights streamed from host RAM and from NVMe, with and without
activation checkpointing, activation offload and the overlapped CPU step."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.config import OffloadConfig

from test_engine import MLP, hf_loss, lm_batches, mlp_batches, mlp_loss

UPDATES = 10


def _tiny_llama():
    from offload.models import build_model, preset

    return build_model(preset("tiny"), device="cpu", source=0)


def _train(model, batches, loss_fn, cfg, setup=None):
    engine = offload.initialize(model, cfg)
    if setup is not None:
        setup(engine)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        engine.backward(loss)
        losses.append(loss.item())
        engine.step()
    masters = engine.master_params()
    report = engine.last_report
    engine.close()
    return masters, losses, report


def _cfg(tmp_path, name, **kw):
    base = dict(offload="cpu", dtype="fp32", device="cpu", lr=1e-2, weight_decay=0.01,
                nvme_dir=str(tmp_path / name))
    base.update(kw)
    return OffloadConfig(**base)


CASES = [  # (offload_params, optimizer offload, checkpointing, activation offload, clip, accum)
    ("cpu", "cpu", False, False, 0.0, 1),
    ("cpu", "cpu", True, False, 0.5, 2),
    ("nvme", "nvme", False, False, 0.5, 1),
    ("nvme", "nvme", True, False, 0.0, 2),
    ("nvme", "cpu", True, True, 0.0, 1),
    ("cpu", "nvme", True, True, 0.5, 2),
]


@pytest.mark.parametrize("params,opt,ckpt,act,clip,accum", CASES)
@pytest.mark.parametrize("model_name", ["llama", "mlp"])
def test_streamed_equals_plain_engine(model_name, params, opt, ckpt, act, clip, accum, tmp_path):
    make, loss_fn = (_tiny_llama, hf_loss) if model_name == "llama" else (MLP, mlp_loss)
    torch.manual_seed(0)
    model = make()
    ref_model = copy.deepcopy(model)
    batches = (lm_batches(UPDATES * accum, 1024) if model_name == "llama"
               else mlp_batches(UPDATES * accum))
    ref, ref_losses, _ = _train(ref_model, batches, loss_fn,
                                _cfg(tmp_path, "ref", grad_clip=clip, grad_accum_steps=accum))
    got, losses, rep = _train(model, batches, loss_fn, _cfg(
        tmp_path, "got", offload=opt, offload_params=params, activation_checkpointing=ckpt,
        offload_activations=act, grad_clip=clip, grad_accum_steps=accum))
    assert losses == ref_losses
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert rep.bytes["stream_h2d"] + rep.bytes["stream_disk"] > 0  # blocks really were streamed
    assert (rep.bytes["act_offload"] > 0) == act


def test_streamed_with_injected_fetch_delay_is_identical(tmp_path):
    torch.manual_seed(0)
    model = _tiny_llama()
    ref_model = copy.deepcopy(model)
    batches = lm_batches(4, 1024)
    ref, ref_losses, _ = _train(ref_model, batches, hf_loss, _cfg(tmp_path, "ref"))
    def late_fetches(engine):  # a fetch that is not waited for shows up as wrong numbers
        engine.streaming.streamer.fetch_delay_s = 0.02
    got, losses, _ = _train(model, batches, hf_loss, _cfg(
        tmp_path, "got", offload_params="nvme", activation_checkpointing=True), late_fetches)
    assert losses == ref_losses and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_frozen_block_params_are_streamed_and_the_rest_trains(params, tmp_path):
    """A layer with a frozen parameter (any model, not only LoRA): offload_params streams the
    frozen parameters (offload/stream/frozen.py) and the trainable ones stay resident; the
    result equals plain PyTorch's AdamW over the same batches."""
    from test_engine import reference_train
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        layer[0].weight.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    batches = mlp_batches(6)
    ref, _ = reference_train(ref_model, batches, mlp_loss, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                             wd=0.01, clip=0.0, accum=1, fused=True)
    engine = offload.initialize(model, _cfg(tmp_path, "x", offload_params=params))
    try:
        assert type(engine.streaming).__name__ == "FrozenBaseStreamer"
        for batch in batches:
            engine.backward(mlp_loss(model, batch))
            engine.step()
        got = engine.master_params()
    finally:
        engine.close()
    assert got.keys() == {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert all(torch.equal(got[n], ref[n]) for n in got)


@pytest.mark.parametrize("params,opt", [("none", "cpu"), ("none", "nvme"), ("nvme", "nvme")])
def test_overlapped_step_is_identical_and_overlaps(params, opt, tmp_path):
    torch.manual_seed(0)
    model = _tiny_llama()
    ref_model = copy.deepcopy(model)
    batches = lm_batches(2 * UPDATES, 1024)
    kw = dict(offload=opt, offload_params=params, grad_accum_steps=2)
    ref, ref_losses, ref_rep = _train(ref_model, batches, hf_loss,
                                      _cfg(tmp_path, "ref", overlap_step=False, **kw))
    got, losses, rep = _train(model, batches, hf_loss, _cfg(tmp_path, "got", **kw))
    assert ref_rep.overlapped_blocks == 0 and rep.overlapped_blocks >= 4  # the 4 layers at least
    assert losses == ref_losses and all(torch.equal(got[k], ref[k]) for k in ref)


def test_overlap_is_off_when_the_math_needs_every_gradient(tmp_path):
    for kw, why in ((dict(grad_clip=1.0), "clipping"), (dict(dtype="fp16"), "overflow")):
        engine = offload.initialize(MLP(), _cfg(tmp_path, "x" + why, **kw))
        assert not engine.overlap and why in engine.overlap_why
        engine.close()
