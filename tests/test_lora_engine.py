"""LoRA adapters (offload/lora.py) trained by the offload engine: the adapters' fp32 masters and
Adam moments live in the tier the config names (device, host RAM, NVMe swap files); the frozen
base is resident on the device or streamed from host RAM or NVMe through forward, recompute and
backward (offload/stream/frozen.py); it never gets a gradient buffer, master or moment; after
10 updates the adapters equal plain PyTorch's AdamW(fused=True) on the same model, and the
training plan equals what the engine allocated."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.memory import mapped
from offload.config import OffloadConfig
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


CASES = [  # (adapters' optimizer state, frozen base, clip, accumulation, activation checkpointing)
    ("none", "none", 0.0, 1, False), ("cpu", "none", 0.5, 2, False), ("nvme", "none", 0.0, 1, False),
    ("cpu", "cpu", 0.0, 1, False), ("cpu", "cpu", 0.5, 2, True), ("nvme", "nvme", 0.5, 2, False),
    ("cpu", "nvme", 0.0, 1, True), ("none", "cpu", 0.0, 2, True),
]


@pytest.mark.parametrize("mode,params,clip,accum,ckpt", CASES)
def test_lora_adapters_match_fused_adamw(mode, params, clip, accum, ckpt, tmp_path):
    model = _lora_llama()
    ref_model = copy.deepcopy(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    total = sum(p.numel() for p in model.parameters())
    batches = lm_batches(STEPS * accum, model.config.vocab_size)
    # the engine's default CPU AdamW kernel (not exact_optimizer, which follows torch's
    # for-each AdamW) computes what torch's fused AdamW does, to the bit
    cfg = _cfg(mode, tmp_path, grad_clip=clip, grad_accum_steps=accum, exact_optimizer=False,
               offload_params=params, nvme_dir=str(tmp_path / "swap"),
               activation_checkpointing=ckpt)
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
        if params == "none":
            for n, p in model.named_parameters():  # the base never changed
                if not p.requires_grad:
                    assert torch.equal(p.detach(), base_before[n]), n
        else:  # every layer's base came through the streamer, every update
            assert type(engine.streaming).__name__ == "FrozenBaseStreamer"
            L = len(model.model.layers)  # forward fetches each layer; backward all but the last
            assert engine.streaming.streamer.stats.fetches[params] == (2 * L - 1) * STEPS * accum
        # optimizer state for the adapters only: a few percent of the model's parameters
        assert sum(t.numel() for t in masters.values()) < 0.06 * total
    finally:
        engine.close()


def lora_state_dict_by_module(model) -> dict[str, torch.Tensor]:
    """{our parameter name: initial adapter weight} (lora_state_dict's keys carry PEFT's prefix)."""
    peft = lora_state_dict(model)
    return {k[len("base_model.model."):]: v for k, v in peft.items()}


@pytest.mark.parametrize("mode,params", [("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme"),
                                         ("none", "nvme")])
def test_lora_plan_equals_measured_allocation(mode, params, tmp_path):
    """bf16: the plan (frozen base resident or streamed, adapters' state) equals the bytes the
    engine's components held; no gradient or optimizer state exists for the base."""
    model = _lora_llama()
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = sum(p.numel() for layer in model.model.layers for p in layer.parameters()
                 if not p.requires_grad)  # counted now: streamed parameters are unbound later
    cfg = _cfg(mode, tmp_path, dtype="bf16", offload_params=params, nvme_dir=str(tmp_path / "swap"))
    engine = offload.initialize(model, cfg)
    try:
        for _ in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 16))
            engine.backward(model(ids).float().pow(2).mean())
            engine.step()
        planned = {(t, k): v for t, kinds in engine.plan.bytes.items() for k, v in kinds.items() if v}
        assert planned == engine.account.kind_peaks()
        assert mapped.is_mapped(model.model.embed_tokens.weight) == (params == "nvme")
        assert mapped.is_mapped(model.lm_head.weight) == (params == "nvme")
    finally:
        engine.close()
    state = sum(v for (t, k), v in planned.items() if k in ("masters", "moments"))
    assert state == 12 * adapters  # fp32 master + two moments, adapters only
    assert sum(v for (t, k), v in planned.items() if k == "grads") <= 4 * adapters
    frozen_device = planned.get(("device", "frozen"), 0)
    if params == "none":
        assert frozen_device == 2 * base  # the whole base, bf16, on the device
    elif params == "cpu":  # only the embeddings, final norm and head stay; the layers' base is in its tier
        assert frozen_device == 2 * (base - layers)
        assert planned[("host", "weights")] == 2 * layers
    else:  # base on NVMe, device = host: the embeddings, norm and head are mapped from swap files
        assert frozen_device == 0 and planned[("nvme", "frozen")] == 2 * (base - layers)
        assert planned[("nvme", "weights")] == 2 * layers


@pytest.mark.parametrize("params", ["none", "nvme"])
def test_base_on_meta_is_filled_from_the_source(params, tmp_path):
    """A base larger than RAM is never materialised whole: built on meta, wrapped, and filled
    from `source` by its checkpoint names (`q_proj.base_layer.weight` <- `q_proj.weight`), one
    layer at a time into its swap file (or onto the device): the same training as the
    materialised model's."""
    from offload.models.llama import seeded_init
    cfg_model = preset("tiny")
    lora = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))
    want_model = build_model(cfg_model, device="cpu", source=0)
    apply_lora(want_model, lora, seed=1)
    meta_model = build_model(cfg_model)  # on meta: nothing allocated
    apply_lora(meta_model, lora, seed=1)
    batches = lm_batches(4, cfg_model.vocab_size)
    results = []
    for model, kw in ((want_model, {}), (meta_model, {"offload_params": params})):
        cfg = _cfg("cpu", tmp_path, exact_optimizer=False, nvme_dir=str(tmp_path / f"s{len(results)}"), **kw)
        engine, masters, _, _ = engine_train(model, batches, hf_loss, cfg,
                                             source=seeded_init(0, cfg_model.initializer_range))
        engine.close()
        results.append(masters)
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


def dequantized_reference(reader, blocks) -> torch.nn.Module:
    """A plain fp32 model of `reader`'s checkpoint on the CPU whose projections hold the
    dequantized weights of the quantized `blocks` (quantize_checkpoint's): what a QLoRA base
    computes, as a reference for LoRA over it."""
    from safetensors.torch import load_file

    from offload.models.quantized import block_file
    from offload.quant.format import dequantize
    model = build_model(reader.config, device="cpu", source=reader)
    for i, layer in enumerate(model.model.layers):
        stored = load_file(block_file(blocks.path, i))
        for proj, spec in blocks.specs[i].items():
            lin = layer.get_submodule(proj)
            parts = {k: stored[f"{proj}.{k}"] for k in ("qweight", "scales", "mins")}
            with torch.no_grad():
                lin.weight.copy_(dequantize(parts, spec, lin.in_features, torch.float32))
    return model


@pytest.mark.parametrize("params,ckpt", [("cpu", True), ("nvme", False), ("none", True)])
def test_qlora_over_a_streamed_int4_base(params, ckpt, tmp_path):
    """QLoRA: the base's projections are int4 blocks (offload/models/quantized.py), streamed as
    the byte blocks they are stored as (from RAM or straight from their files) through forward,
    recompute and backward, or loaded once onto the device (offload_params "none"), dequantized
    at each product; the adapters train exactly as over a plain base holding the dequantized
    weights, with torch's AdamW(fused=True)."""
    from offload.models import CheckpointReader, save_pretrained
    from offload.models.quantized import QuantizedSource, QuantSettings, quantize_checkpoint, quantize_layers

    cfg_model = preset("tiny")
    lora = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))
    save_pretrained(build_model(cfg_model, device="cpu", source=0), tmp_path / "base")
    batches = lm_batches(4, cfg_model.vocab_size)
    with CheckpointReader(str(tmp_path / "base")) as reader:
        blocks = quantize_checkpoint(reader, QuantSettings("int4", 32), torch.float32,
                                     cache_root=str(tmp_path / "cache"))
        # the reference: a plain model whose projections hold the dequantized int4 weights
        ref_model = dequantized_reference(reader, blocks)
        apply_lora(ref_model, lora, seed=1)
        ref, ref_losses = reference_train(ref_model, batches, hf_loss, lr=1e-2, betas=(0.9, 0.99),
                                          eps=1e-8, wd=0.01, clip=0.0, accum=1, fused=True)
        # ours: built on meta with int4 projections, wrapped, base streamed from its block files
        model = build_model(cfg_model)
        quantize_layers(model, blocks.specs, torch.float32)
        apply_lora(model, lora, seed=1)
        cfg = _cfg("cpu", tmp_path, exact_optimizer=False, offload_params=params,
                   nvme_dir=str(tmp_path / "swap"), activation_checkpointing=ckpt)
        engine, masters, losses, _ = engine_train(model, batches, hf_loss, cfg,
                                                  source=QuantizedSource(reader, blocks))
        try:
            assert type(engine.streaming).__name__ == "FrozenBaseStreamer"
            # the plan counts the int4 base as stored (codes, fp16 scales) and equals what was made
            planned = {(t, k): v for t, kinds in engine.plan.bytes.items() for k, v in kinds.items() if v}
            assert planned == engine.account.kind_peaks()
            stored = sum(r.nbytes for i in range(cfg_model.num_hidden_layers) for r in blocks.ranges(i))
            if params == "none":  # resident: the int4 layers beside the fp32 embeddings and head
                rest = sum(p.numel() * 4 for n, p in model.named_parameters()
                           if not p.requires_grad and not n.startswith("model.layers."))
                assert planned[("device", "frozen")] == stored + rest
                assert ("device", "weights") not in planned  # no slots: nothing streams
            else:
                assert planned[("host" if params == "cpu" else "nvme", "weights")] == stored
        finally:
            engine.close()
    assert masters.keys() == {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert max_rel_diff(masters, {n: ref[n] for n in masters}) <= 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("params", ["none", "nvme"])
def test_methods_table_plans_what_the_engine_plans(params, tmp_path):
    """The dry run's full / LoRA / QLoRA table (offload/train/lora_plan.py) is planned on meta models;
    its LoRA row is the plan the engine makes for the same model and settings, and the rows
    order as they must: far fewer trainable parameters, no optimizer state for the base, and
    a smaller base for QLoRA."""
    from offload.train.lora_plan import format_methods, plan_methods
    lora = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))
    cfg = _cfg("cpu", tmp_path, dtype="bf16", offload_params=params, nvme_dir=str(tmp_path / "swap"))
    full, lora_row, qlora = plan_methods(preset("tiny"), cfg, lora)
    model = build_model(preset("tiny"), device="cpu", source=0)
    apply_lora(model, lora, seed=1)
    engine = offload.initialize(model, cfg)
    try:
        assert lora_row.plan.bytes == engine.plan.bytes
    finally:
        engine.close()
    assert lora_row.trainable == qlora.trainable < 0.1 * full.trainable
    assert lora_row.plan.bytes["host"]["masters"] < 0.1 * full.plan.bytes["host"]["masters"]
    base_tier = ("device", "frozen") if params == "none" else ("nvme", "weights")
    # on the device the frozen embeddings and head (16-bit in both) are most of a tiny model
    ratio = 0.75 if params == "none" else 0.5
    assert qlora.plan.bytes[base_tier[0]][base_tier[1]] < ratio * lora_row.plan.bytes[base_tier[0]][base_tier[1]]
    table = format_methods([full, lora_row, qlora])
    assert table.count("\n") == 4 and "QLoRA int4 r=4" in table


def test_disk_check_counts_only_what_is_written_into_the_offload_dir(tmp_path):
    """A base streamed from NVMe is written into nvme_dir (checked against its budget and free
    space even when the optimizer state stays in RAM); a quantized base read from its block
    files in place takes no room there."""
    from offload.memory.tiers import BudgetError
    from offload.train.plan import plan_training

    cfg = OffloadConfig(offload="cpu", offload_params="nvme", nvme_dir=str(tmp_path),
                        nvme_budget="2MiB", dtype="bf16")
    blocks = [(1000, False)] + [(1000, True)] * 4
    with pytest.raises(BudgetError, match="needs 4.00 MiB on the nvme tier, more than the nvme budget"):
        plan_training(blocks, cfg, frozen_layer_bytes=[1 << 20] * 4).check()
    plan = plan_training(blocks, cfg, frozen_layer_bytes=[1 << 20] * 4, frozen_in_place=True)
    assert plan.bytes["nvme"]["weights"] == 4 << 20 and plan.nvme_in_place == 4 << 20
    plan.check()
