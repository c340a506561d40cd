"""LoRA over a streamed mixture-of-experts base (issue 37, piece 3), against PEFT on transformers'
own model: adapters on attention (q, v) of small random Qwen3-MoE, Mixtral and OLMoE checkpoints,
the frozen base -- experts included -- streamed from host RAM or NVMe through forward and
backward (offload/stream/frozen.py), the adapters' state in RAM or NVMe; after 10 updates the
adapters equal PEFT's trained by torch's AdamW within 1e-5, and the adapter the run saves loads
in PEFT and computes what PEFT's trained model computes. QLoRA: every projection of the base,
each expert's too, int4 blocks streamed as stored; the adapters equal LoRA over a plain base
holding the dequantized weights (1e-6). Adapters on the experts themselves are not covered.
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


@pytest.mark.parametrize("name,params", [("qwen3_moe", "cpu"), ("mixtral", "nvme")])
def test_qlora_over_int4_experts_equals_lora_over_the_dequantized_base(name, params, checkpoint,
                                                                       tmp_path):
    """Every projection of the base -- each expert's too -- int4 blocks streamed as stored and
    dequantized at each product; the adapters train exactly as over a plain base holding the
    dequantized weights."""
    from offload.models import CheckpointReader, build_model
    from offload.models.quantized import QuantizedSource, QuantSettings, quantize_checkpoint, quantize_layers
    from test_engine import engine_train, max_rel_diff, reference_train
    from test_lora_engine import dequantized_reference

    data = lm_batches(UPDATES, VOCAB, seq=SEQ)
    opt = dict(lr=LR, betas=BETAS, eps=EPS, wd=WD)
    with CheckpointReader(checkpoint(name)) as reader:
        blocks = quantize_checkpoint(reader, QuantSettings("int4", 32), torch.float32,
                                     cache_root=str(tmp_path / "cache"))
        experts = [p for p in blocks.specs[0] if ".experts." in p]
        assert len(experts) == 3 * reader.config.num_experts  # the experts are int4 too
        ref_model = dequantized_reference(reader, blocks)
        apply_lora(ref_model, LORA, seed=1)
        ref, ref_losses = reference_train(ref_model, data, hf_loss, clip=0.0, accum=1, **opt)
        model = build_model(reader.config)
        quantize_layers(model, blocks.specs, torch.float32)
        apply_lora(model, LORA, seed=1)
        cfg = _cfg("cpu", tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                   offload_params=params, nvme_dir=str(tmp_path / "swap"))
        engine, masters, losses, _ = engine_train(model, data, hf_loss, cfg,
                                                  source=QuantizedSource(reader, blocks))
        try:
            assert type(engine.streaming).__name__ == "FrozenBaseStreamer"
        finally:
            engine.close()
    assert masters.keys() == {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert max_rel_diff(masters, {n: ref[n] for n in masters}) <= 1e-6
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6
