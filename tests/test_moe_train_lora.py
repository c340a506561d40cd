"""LoRA over a streamed mixture-of-experts base (issue 37, piece 3), against PEFT on transformers'
own model: adapters on attention (q, v) of small random Qwen3-MoE, Mixtral and OLMoE checkpoints,
the frozen base -- experts included -- streamed from host RAM or NVMe through forward and
backward (offload/stream/frozen.py), the adapters' state in RAM or NVMe; after 10 updates the
adapters equal PEFT's trained by torch's AdamW within 1e-5, and the adapter the run saves loads
in PEFT and computes what PEFT's trained model computes. (Adapters on the experts themselves, and QLoRA over
int4 experts, are not built here.)
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

from families import VOCAB  # noqa: E402
from offload.lora import LoraConfig, apply_lora, load_lora_state_dict, save_adapter  # noqa: E402
from offload.models import load_model  # noqa: E402
from test_engine import _cfg, hf_loss, lm_batches  # noqa: E402
from test_lora import max_rel, randomize_b  # noqa: E402
from test_moe_train import (BETAS, EPS, LR, SEQ, WD, checkpoint, engine_run, hf_model,  # noqa: E402,F401
                            one_thread)

UPDATES, TOLERANCE = 10, 1e-5
LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v"))
PREFIX = "base_model.model."


def with_peft(hf):
    return peft.get_peft_model(hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha,
                                                   target_modules=list(LORA.targets),
                                                   task_type="CAUSAL_LM"))


@pytest.mark.parametrize("name,mode,params", [("qwen3_moe", "cpu", "cpu"), ("mixtral", "nvme", "nvme"),
                                              ("olmoe", "cpu", "nvme")])
def test_lora_over_a_streamed_moe_base_equals_peft(name, mode, params, checkpoint, tmp_path):
    reference = with_peft(hf_model(name))
    start = randomize_b(get_peft_model_state_dict(reference))  # B != 0: A moves from update 1
    set_peft_model_state_dict(reference, start)
    model = load_model(checkpoint(name))
    apply_lora(model, LORA, seed=0)
    load_lora_state_dict(model, start)
    data = lm_batches(UPDATES, VOCAB, seq=SEQ)
    params_ref = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params_ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ref_losses = []
    for ids in data:
        loss = hf_loss(reference, ids)
        loss.backward()
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    want = get_peft_model_state_dict(reference)
    cfg = _cfg(mode, tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, offload_params=params,
               nvme_dir=str(tmp_path / "swap"))
    masters, losses, report, _ = engine_run(model, data, hf_loss, cfg)
    assert report.bytes["stream_h2d"] + report.bytes["stream_disk"] > 0  # the base streamed
    got = {PREFIX + k: v for k, v in masters.items()}
    assert max_rel(got, want) <= TOLERANCE
    assert max_rel(start, want) > 1e-3  # the updates moved the adapters
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= TOLERANCE
    # the adapter ours saves (the engine is closed: the streamed base is gone, the adapters
    # are the model's) loads in PEFT over transformers' model and computes what PEFT trained
    load_lora_state_dict(model, got)
    save_adapter(model, LORA, tmp_path / "adapter", base_model_name_or_path=name)
    loaded = peft.PeftModel.from_pretrained(hf_model(name), str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs, trained = loaded(data[0]).logits, reference(data[0]).logits
    assert (theirs - trained).abs().max().item() <= 1e-5 * trained.abs().max().item()
