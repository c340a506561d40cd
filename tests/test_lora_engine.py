"""LoRA adapters (offload/lora.py) trained by the offload engine with the frozen base resident on
the device: the adapters' fp32 masters and Adam moments live in the tier the config names
(device, host RAM, NVMe swap files), the base weights get no gradient buffers, masters or
moments, and after 10 updates the adapters equal plain PyTorch's AdamW(fused=True) on the same
model. Streaming a frozen base (offload_params) is refused in one line until it is built."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.config import ConfigError
from offload.lora import LoraConfig, apply_lora, lora_state_dict
from offload.models import build_model, preset
from tests.test_engine import _cfg, engine_train, hf_loss, lm_batches, max_rel_diff, reference_train

STEPS = 10


def _lora_llama():
    model = build_model(preset("tiny"), device="cpu", source=0)
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("q", "v", "down")), seed=1)
    # B starts at zero (PEFT's init): give it values so the first update already moves A too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.02)
    return model


@pytest.mark.parametrize("mode", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("clip,accum", [(0.0, 1), (0.5, 2)])
def test_lora_adapters_match_fused_adamw(mode, clip, accum, tmp_path):
    model = _lora_llama()
    ref_model = copy.deepcopy(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batches = lm_batches(STEPS * accum, model.config.vocab_size)
    # the engine's default CPU AdamW kernel (not exact_optimizer, which follows torch's
    # for-each AdamW) computes what torch's fused AdamW does, to the bit
    cfg = _cfg(mode, tmp_path, grad_clip=clip, grad_accum_steps=accum, exact_optimizer=False)
    ref, ref_losses = reference_train(ref_model, batches, hf_loss, lr=cfg.lr, betas=cfg.betas,
                                      eps=cfg.eps, wd=cfg.weight_decay, clip=clip, accum=accum,
                                      fused=True)
    engine, masters, losses, applied = engine_train(model, batches, hf_loss, cfg)
    try:
        assert applied == STEPS
        # only the adapters have masters: the frozen base has no optimizer state at all
        assert set(masters) == {n for n, p in ref_model.named_parameters() if p.requires_grad}
        assert all(".lora_A." in n or ".lora_B." in n for n in masters)
        trained = {n: ref[n] for n in masters}
        assert max_rel_diff(masters, trained) <= 1e-6
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        moved = max((masters[n] - p).abs().max().item() for n, p in
                    lora_state_dict_by_module(_lora_llama()).items())
        assert moved > 1e-3, "the adapters did not train"
        for n, p in model.named_parameters():  # the base never changed
            if not p.requires_grad:
                assert torch.equal(p.detach(), base_before[n]), n
        # optimizer state for the adapters only: a few percent of the model's parameters
        assert sum(t.numel() for t in masters.values()) < 0.05 * sum(p.numel() for p in model.parameters())
    finally:
        engine.close()


def lora_state_dict_by_module(model) -> dict[str, torch.Tensor]:
    """{our parameter name: initial adapter weight} (lora_state_dict's keys carry PEFT's prefix)."""
    peft = lora_state_dict(model)
    return {k[len("base_model.model."):]: v for k, v in peft.items()}


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_streamed_frozen_base_is_refused_in_one_line(params, tmp_path):
    model = _lora_llama()
    cfg = _cfg("cpu", tmp_path, offload_params=params,
               nvme_dir=str(tmp_path / "swap"))
    with pytest.raises(ConfigError, match="frozen LoRA base") as err:
        offload.initialize(model, cfg)
    assert "\n" not in str(err.value)
