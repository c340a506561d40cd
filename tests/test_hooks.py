"""After Engine.close() the model is a plain torch module again: no forward, backward or
post-accumulate-grad hook of ours remains, no block forward stays wrapped, and a second
initialize on the same model trains exactly as the first would have."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.config import OffloadConfig
from tests.test_engine import hf_loss, lm_batches


def _tiny_llama():
    from offload.models import build_model, preset
    return build_model(preset("tiny"), device="cpu", source=0)


def _cfg(tmp_path, **kw) -> OffloadConfig:
    return OffloadConfig(**{"offload": "cpu", "dtype": "fp32", "device": "cpu", "lr": 1e-2,
                            "nvme_dir": str(tmp_path / "swap"), **kw})


def hooks_left(model: torch.nn.Module) -> dict[str, int]:
    """Every hook and wrapper offload could leave on a module tree, counted."""
    out = {"forward_pre": 0, "forward": 0, "backward": 0, "backward_pre": 0, "post_accumulate": 0,
           "wrapped_forward": 0}
    for m in model.modules():
        out["forward_pre"] += len(m._forward_pre_hooks)
        out["forward"] += len(m._forward_hooks)
        out["backward"] += len(m._backward_hooks)
        out["backward_pre"] += len(m._backward_pre_hooks)
        out["wrapped_forward"] += "forward" in m.__dict__
    for p in model.parameters():
        out["post_accumulate"] += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return out


CONFIGS = {
    "cpu": dict(),
    "nvme+checkpointing+activation offload": dict(offload="nvme", activation_checkpointing=True,
                                                   offload_activations=True),
    "delayed": dict(delayed_update=True, grad_clip=1.0),
    "streamed from host RAM": dict(offload_params="cpu", activation_checkpointing=True,
                                   offload_activations=True),
    "streamed from NVMe": dict(offload="nvme", offload_params="nvme"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_close_leaves_no_hook(name, tmp_path):
    model = _tiny_llama()
    clean = hooks_left(model)
    assert not any(clean.values())
    engine = offload.initialize(model, _cfg(tmp_path, **CONFIGS[name]))
    for ids in lm_batches(2, 1024):
        engine.backward(hf_loss(model, ids))
        engine.step()
    assert any(hooks_left(model).values())  # the counter sees what the engine installs
    engine.close()
    assert hooks_left(model) == clean


@pytest.mark.parametrize("name", ["cpu", "nvme+checkpointing+activation offload", "delayed"])
def test_second_initialize_trains_as_the_first(name, tmp_path):
    """initialize + close, then initialize again on the same model: the same masters after 5
    updates as one initialize on a copy (leftover hooks would fire twice or on a dead engine)."""
    torch.manual_seed(0)
    model = _tiny_llama()
    twin = copy.deepcopy(model)
    batches = lm_batches(5, 1024)
    cfg = CONFIGS[name]
    offload.initialize(model, _cfg(tmp_path / "first", **cfg)).close()

    def train(m, where):
        engine = offload.initialize(m, _cfg(tmp_path / where, **cfg))
        for ids in batches:
            engine.backward(hf_loss(m, ids))
            engine.step()
        masters = engine.master_params()
        engine.close()
        return masters

    again, once = train(model, "again"), train(twin, "once")
    assert all(torch.equal(again[k], once[k]) for k in once)


def test_a_forward_that_raises_leaves_no_saved_tensors_hooks(tmp_path):
    """Streamed training enters a saved-tensors context before each block and leaves it after:
    a block that raises must not leave it entered (the next forward would pack through it)."""
    model = _tiny_llama()
    engine = offload.initialize(model, _cfg(tmp_path, offload_params="cpu"))
    layer = model.model.layers[1]
    real = type(layer).forward

    def broken(self, *a, **k):
        raise RuntimeError("boom")

    type(layer).forward = broken
    try:
        with pytest.raises(RuntimeError, match="boom"):
            hf_loss(model, lm_batches(1, 1024)[0])
    finally:
        type(layer).forward = real
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False)
    engine.streaming.end_backward()  # what a caller's cleanup would do after the error
    engine.close()
