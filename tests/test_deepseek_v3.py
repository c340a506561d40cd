"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM, 5.24; Kimi-K2 and Moonlight are the same
class) against transformers, the reference: two small random checkpoints saved by transformers
itself (tests/families.py DEEPSEEK_FAMILIES: latent attention with and without q_lora_rank,
interleaved and plain RoPE, YaRN with mscale, a dense first layer and none, 4 groups of which 2
kept and one group, renormalised and not, shared experts, random score-correction biases): fp32
logits within 1e-5 and greedy tokens identical, resident, streamed from RAM and NVMe, with the
experts on the device, in RAM and on NVMe (the dense layer skipped by the expert store), the KV
cache in host RAM, through runners.infer; one MoE block bit-equal to transformers' eager one in
fp32 and bf16; a checkpoint in transformers' fused in-memory layout and our export; training
through offload.initialize equal to torch's AdamW; the preset's counts; one-line refusals."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import (DEEPSEEK_FAMILIES, VOCAB, Case, case_prompts, hf_logits, make_cases,  # noqa: E402
                      run_infer)
from nvme.format import write_file  # noqa: E402
from offload.models import (CheckpointReader, ConfigError, ModelConfig, block_parameter_shapes,  # noqa: E402
                            load_model, load_streamed, num_params, preset, save_pretrained)
from offload.models.config import num_active_params  # noqa: E402
from offload.models.mla import LatentAttention  # noqa: E402
from offload.models.moe import GroupRouter, SparseMoE  # noqa: E402
from offload.models.presets import PUBLISHED_ACTIVE_DEEPSEEK, PUBLISHED_PARAMS  # noqa: E402
from offload.stream.expert_placement import ExpertPlacement  # noqa: E402

deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

NAMES = list(DEEPSEEK_FAMILIES)
NEW = 6
PROMPT, SHORT, LONG_IDS = case_prompts(2718)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    return make_cases(tmp_path_factory, NAMES, PROMPT, SHORT, LONG_IDS, NEW)


# ---- fp32: resident ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_resident_equals_transformers(cases, name):
    case = cases[name]
    model = load_model(case.path)
    cfg = model.config
    dense = 1 if name == "deepseek_v3" else 0
    assert (cfg.architecture, cfg.moe_router, cfg.first_k_dense_replace) == (
        "DeepseekV3ForCausalLM", "sigmoid_group_topk", dense)
    assert (cfg.head_dim, cfg.kv_lora_rank, cfg.rope_interleave) == (8, 16, dense == 1)
    layers = model.model.layers
    assert all(type(layer.self_attn) is LatentAttention for layer in layers)
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [i >= dense for i in range(3)]
    assert isinstance(layers[2].mlp.gate, GroupRouter)
    for i, layer in enumerate(layers):  # the shapes the planners use are the modules', in order
        assert list(block_parameter_shapes(cfg, i).items()) == [
            (n, tuple(p.shape)) for n, p in layer.named_parameters()]
    bias = layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, case.hf.model.layers[2].mlp.gate.e_score_correction_bias)
    case.check(model, single=name == "deepseek_v3")


def test_moe_routing_matters_and_layers_differ(cases):
    """The correction bias changes the choice (so the test above checks it), and a config with
    dense layers refuses a layer-less shape query in one line."""
    model = load_model(cases["deepseek_v3"].path)
    moe = model.model.layers[1].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ids = moe.route(x)
        moe.gate.e_score_correction_bias.zero_()
        _, unbiased = moe.route(x)
    assert not torch.equal(ids.sort(-1).values, unbiased.sort(-1).values)
    with pytest.raises(ConfigError, match="layers differ .* name the layer"):
        block_parameter_shapes(model.config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_equals_transformers_eager_bit_for_bit(dtype):
    """One MoE block against transformers' DeepseekV3MoE with eager experts: 16 experts in 4
    groups, 2 kept, top-4, renormalised, scaled, a shared expert; fp32 and bf16 (transformers
    keeps the router and its bias in fp32: here values a bf16 copy holds exactly)."""
    hf_cfg = transformers.DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16,
                                           num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                           routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4)
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    theirs = deepseek.DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for p in [*theirs.parameters(), theirs.gate.e_score_correction_bias]:
            p.copy_((0.1 * torch.randn_like(p)).to(torch.bfloat16))
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"],
                               "vocab_size": 32, "num_hidden_layers": 1, "first_k_dense_replace": 0})
    ours = SparseMoE(cfg).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.gate.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        for e, expert in enumerate(ours.experts):
            expert.gate_proj.weight.copy_(theirs.experts.gate_up_proj[e, :32])
            expert.up_proj.weight.copy_(theirs.experts.gate_up_proj[e, 32:])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
        ours.shared_experts.load_state_dict(theirs.shared_experts.state_dict())
        theirs.to(dtype).gate.float()  # transformers' _keep_in_fp32_modules_strict
        ours.to(dtype)
        x = (3 * torch.randn(3, 11, 64)).to(dtype)
        weights, _ = ours.route(x.reshape(-1, 64))
        assert weights.dtype == torch.float32
        assert torch.equal(ours(x), theirs(x))


def test_bf16_model_equals_transformers_eager_bit_for_bit(tmp_path):
    """A bf16 checkpoint computed in bf16: the logits of transformers loading it (its router's
    weight and bias upcast to fp32, _keep_in_fp32_modules_strict) with its eager experts, bit
    for bit -- the latent attention, the routing in fp32, the fp32 weights times bf16 outputs."""
    from families import save_family_checkpoint
    save_family_checkpoint("deepseek_v3", tmp_path, dtype=torch.bfloat16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    theirs.set_experts_implementation("eager")
    assert theirs.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(LONG_IDS), hf_logits(theirs, LONG_IDS))


# ---- streamed, and the experts placed one by one ---------------------------------------------
def _close(reader, model, streamer) -> None:
    streamer.close()
    if getattr(model, "expert_store", None) is not None:
        model.expert_store.close()
    reader.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_streamed_equals_transformers(cases, tier):
    case = cases["deepseek_v3"]
    reader = CheckpointReader(case.path)
    model, streamer = load_streamed(reader, [tier] * 3, device="cpu", dtype=torch.float32,
                                    zero_copy_host=False)
    try:
        case.check(model, streamer)
        assert streamer.stats.fetches[tier] >= 3
    finally:
        _close(reader, model, streamer)


PLACEMENTS = {  # homes per MoE layer: the dense first layer has no experts
    "device": ExpertPlacement("device"),
    "cpu in place": ExpertPlacement("cpu"),
    "cpu copied, cache": ExpertPlacement("cpu", zero_copy_host=False, cache_slots=3),
    "nvme, prefetch, cache": ExpertPlacement("nvme", cache_slots=4),
    "mixed": ExpertPlacement([["device", "cpu", "nvme", "nvme"] * 2] * 2, cache_slots=2),
}


@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_experts_anywhere_equal_transformers(cases, where):
    case = cases["deepseek_v3"]
    reader = CheckpointReader(case.path)
    model, streamer = load_streamed(reader, ["nvme"] * 3, device="cpu", dtype=torch.float32,
                                    zero_copy_host=False, experts=PLACEMENTS[where])
    try:
        store = model.expert_store
        assert store.layers == [1, 2] and store.routers.keys() == {1, 2}
        case.check(model, streamer, single=where == "nvme, prefetch, cache")
        assert (store.stats.moved_bytes["disk"] > 0) == ("nvme" in where or where == "mixed")
        # the routed experts stay out of the streamed blocks; the shared experts are in them
        names = {s.name for b in streamer.blocks for s in b.slots}
        assert not any(".experts." in n for n in names)
        assert any("shared_experts" in n for n in names)
    finally:
        _close(reader, model, streamer)


def test_kv_cache_in_host_ram_gives_the_same_tokens(cases):
    """The latent cache (keys 16 wide, values 8) in host RAM, a layer at a time on the device."""
    from offload.infer.generate import generate
    case = cases["deepseek_v3-plain"]
    model = load_model(case.path)
    got = generate(model, [PROMPT, SHORT], max_new_tokens=NEW, kv_tier="host").tokens
    assert got == case.greedy()["batch"]


def test_runner_experts_on_nvme_give_transformers_tokens(cases, tmp_path, capsys):
    """python -m runners.infer --experts nvme: the plan places the MoE layers' experts (2 x 8;
    the dense layer's block whole) and the run gives transformers' greedy tokens."""
    case = cases["deepseek_v3"]
    res, err = run_infer(case.path, PROMPT, NEW, tmp_path, capsys, "--experts", "nvme",
                         "--offload-dir", tmp_path)
    assert res["generated_ids"] == case.greedy()["single"]
    assert "DeepseekV3ForCausalLM" in err and "B active" in err
    assert res["plan"]["experts"]["homes"]["nvme"] == 2 * 8


def test_int8_blocks_and_experts_equal_transformers_over_the_dequantized_weights(cases, tmp_path):
    """--quantize int8: every projection of both layer kinds (the latent attention's, the dense
    MLP's, the experts' and the shared experts') quantized, the routers dense; the experts on
    NVMe, each its quantized bytes; equal to transformers carrying the dequantized weights."""
    from families import dequantized_reference
    from offload.models.quantized import QuantLinear, QuantSettings, load_quantized_streamed, quantize_checkpoint
    case = cases["deepseek_v3"]
    with CheckpointReader(case.path) as reader:
        blocks = quantize_checkpoint(reader, QuantSettings("int8"), torch.float32, cache_root=str(tmp_path))
        assert "self_attn.kv_b_proj" in blocks.specs[0] and "mlp.gate_proj" in blocks.specs[0]
        assert "mlp.shared_experts.up_proj" in blocks.specs[1] and "mlp.gate" not in blocks.specs[1]
        ref = dequantized_reference(case, blocks)
        model, streamer = load_quantized_streamed(reader, blocks, ["nvme"] * 3, device="cpu", dtype=torch.float32,
                                                  zero_copy_host=False, experts=ExpertPlacement("nvme", cache_slots=2))
        try:
            assert isinstance(model.model.layers[2].mlp.experts[7].down_proj, QuantLinear)
            case.check(model, streamer, hf=ref, tokens=case.greedy_of(ref))
            assert model.expert_store.stats.moved_bytes["disk"] > 0
        finally:
            streamer.close()
            model.expert_store.close()


# ---- files in and out -------------------------------------------------------------------------
def test_fused_layout_and_export(cases, tmp_path):
    """transformers' in-memory layout (a state_dict saved as it is: experts fused [E, 2I, H])
    read in place; our export loaded by transformers with identical logits; MTP layers stored
    after the last (num_nextn_predict_layers) read past."""
    case = cases["deepseek_v3"]
    state = {k: v.contiguous() for k, v in case.hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    state["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer's tensor
    (tmp_path / "fused").mkdir()
    write_file(str(tmp_path / "fused" / "model.safetensors"), state, {"format": "pt"})
    hf_cfg = json.loads((Path(case.path) / "config.json").read_text())
    (tmp_path / "fused" / "config.json").write_text(json.dumps({**hf_cfg, "num_nextn_predict_layers": 1}))
    with CheckpointReader(tmp_path / "fused") as reader:
        assert reader.unexpected == ["model.layers.3.eh_proj.weight"]
        assert reader.location("model.layers.2.mlp.experts.5.up_proj.weight").part
    model = load_model(tmp_path / "fused")
    with torch.no_grad():
        torch.testing.assert_close(model(LONG_IDS), hf_logits(case.hf, LONG_IDS), rtol=0, atol=1e-5)
    assert ModelConfig.from_hf(model.config.to_hf()) == model.config
    save_pretrained(model, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    assert type(back) is type(case.hf) and back.config.n_group == 4
    assert torch.equal(hf_logits(back, LONG_IDS), hf_logits(case.hf, LONG_IDS))


# ---- training ---------------------------------------------------------------------------------
def test_training_through_the_engine_equals_torch_adamw(cases, tmp_path):
    """3 updates by offload.initialize (Adam state in RAM, the blocks streamed from host RAM: a
    dense block and two MoE blocks of other sizes) equal torch's AdamW on a copy of the same
    model (experts without tokens skipped, as torch skips them there); the first loss is transformers'; the routers' correction biases get no gradient and
    stay as they are (torch skips them too)."""
    from test_engine import _cfg, engine_train, hf_loss, lm_batches, max_rel_diff, reference_train
    case = cases["deepseek_v3"]
    model = load_model(case.path)
    # the reference is this decoder under torch's AdamW: one module per expert, so an expert
    # without tokens has no gradient and is skipped (offload/train/experts.py)
    from offload.train.experts import set_untouched_experts
    set_untouched_experts(model, "skip")
    ref_model = copy.deepcopy(model)
    data = lm_batches(3, VOCAB, seq=16)
    kw = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, wd=0.01)
    ref, ref_losses = reference_train(ref_model, data, hf_loss, clip=0.0, accum=1, **kw)
    cfg = _cfg("cpu", tmp_path, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"], weight_decay=kw["wd"],
               offload_params="cpu")
    engine, masters, losses, applied = engine_train(model, data, hf_loss, cfg)
    try:
        assert applied == 3 and engine.last_report.bytes["stream_h2d"] > 0
    finally:
        engine.close()
    assert max_rel_diff(masters, ref) <= 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    with torch.no_grad():
        assert losses[0] == pytest.approx(hf_loss(case.hf, data[0]).item(), rel=1e-6)
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(masters[bias], case.hf.model.layers[2].mlp.gate.e_score_correction_bias)
    assert not torch.equal(masters["model.layers.2.mlp.gate.weight"], case.hf.model.layers[2].mlp.gate.weight)


# ---- the preset -------------------------------------------------------------------------------
def test_preset_total_and_active_counts():
    cfg = preset("deepseek-v3")
    assert abs(num_params(cfg) / PUBLISHED_PARAMS["deepseek-v3"] - 1) < 0.01
    assert math.floor(num_active_params(cfg) / 1e9) == PUBLISHED_ACTIVE_DEEPSEEK["deepseek-v3"] / 1e9  # "37B"
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    dense, moe = (sum(math.prod(s) for s in block_parameter_shapes(cfg, i).values()) for i in (0, 3))
    assert moe - dense == 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 256 * 7168 + 256 - 3 * 7168 * 18432
    with torch.device("meta"):  # transformers' own model of the preset (its router bias: a buffer)
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{
            k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type", "rope_scaling")}))
    biases = sum(b.numel() for n, b in hf.named_buffers() if "e_score" in n)
    assert sum(p.numel() for p in hf.parameters()) + biases == num_params(cfg)


PUBLISHED = {  # deepseek-ai/DeepSeek-V3's config.json (4.x spelling, its own training keys), less
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}  # its FP8 quantization_config


def test_a_published_config_json_is_the_preset():
    assert ModelConfig.from_hf(PUBLISHED) == preset("deepseek-v3")
    kimi = ModelConfig.from_hf({**PUBLISHED, "model_type": "kimi_k2", "n_routed_experts": 384,
                                "n_group": 1, "topk_group": 1, "num_attention_heads": 64,
                                "num_key_value_heads": 64, "first_k_dense_replace": 1})
    assert (kimi.num_experts, kimi.n_group, kimi.moe_layers[0]) == (384, 1, 1)


def test_blocks_of_two_sizes_are_planned_within_the_budget():
    """DeepSeek-V3's dense layers' blocks are larger than its MoE layers' dense parts: the blocks
    spread over the depth are the ones counted, and the room kept for the experts stays free
    (the preset's dry run: tests/test_experts.py)."""
    from offload.infer.plan import plan_inference
    big, small, GiB = 3 << 30, 1 << 30, 1 << 30
    blocks = [big] * 3 + [small] * 9
    kw = dict(block_bytes=blocks, stored_block_bytes=blocks, non_block_bytes=0, batch_size=1, context=8,
              kv_bytes_per_seq=0, workspace_per_seq=0, device_budget=12 * GiB, host_budget=64 * GiB,
              device_is_host=False)
    plan = plan_inference(**kw)
    assert plan.device_need <= 12 * GiB and plan.count("device") > 0
    reserved = plan_inference(**kw, reserved_bytes=4 * GiB)
    assert reserved.device_need <= 12 * GiB and reserved.count("device") < plan.count("device")
    on_device = sum(b for b, r in zip(blocks, reserved.residency) if r == "device")
    assert reserved.reserved_bytes == 4 * GiB and reserved.device_need >= on_device + 4 * GiB


# ---- refusals ---------------------------------------------------------------------------------
REFUSALS = [  # (change to the case's config.json, words the one-line refusal must hold)
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "quantization_config 'fp8'"),
    ({"scoring_func": "softmax"}, "scoring_func = 'softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method = 'greedy'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq = 2"),
    ({"n_group": 3}, "n_group must divide the 8 routed experts"),
    ({"topk_group": 5}, "topk_group must be an integer in [1, n_group = 4]"),
    ({"n_group": None}, "n_group is null"),
    ({"num_key_value_heads": 2}, "num_key_value_heads must be num_attention_heads = 4"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace must be an integer in [0, num_hidden_layers = 3)"),
    ({"output_router_logits": True}, "output_router_logits"),
    ({"n_routed_experts": 6, "num_local_experts": 8}, "disagree"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}, "not supported"),
]


@pytest.mark.parametrize("change,needle", REFUSALS)
def test_unsupported_configs_are_refused_in_one_line(cases, change, needle):
    hf_cfg = json.loads((Path(cases["deepseek_v3"].path) / "config.json").read_text())
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({**hf_cfg, **change})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
