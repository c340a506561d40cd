"""gpt-oss (transformers' GptOssForCausalLM, 5.24) against transformers, the reference: a small
random checkpoint saved by transformers itself (tests/families.py GPT_OSS_FAMILIES: 3 layers,
sliding and full alternating, 8 experts top-2, sinks, every bias and weight random, YaRN, a
SwiGLU limit that clamps), fp32 logits within 1e-5 and greedy tokens identical, resident and
streamed from RAM and NVMe (each expert read in place from transformers' fused tensors);
bit-equal to its eager experts; one MoE block bit-equal in fp32 and bf16; sink attention and
YaRN against transformers' own functions; int8 / int4 against transformers carrying the
dequantized experts; the export (experts fused again) read back by transformers; MXFP4
checkpoints (the published ones' experts) dequantized as transformers dequantizes them; the
presets' total and active counts; one-line refusals."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import VOCAB, Case, greedy_reference, hf_logits, run_infer  # noqa: E402
from nvme.format import SafetensorsFile, write_file  # noqa: E402
from offload.models import (CheckpointError, CheckpointReader, ConfigError, ModelConfig,  # noqa: E402
                            block_parameter_shapes, load_model, load_streamed, num_params, preset,
                            projection_names, save_pretrained)
from offload.models.config import expert_params, num_active_params, router_name  # noqa: E402
from offload.models.llama import sink_attention  # noqa: E402
from offload.models.moe import ClampedSwiGLUExpert, InputMajorLinear, SparseMoE  # noqa: E402
from offload.models.mxfp4 import dequantize_mxfp4  # noqa: E402
from offload.models.presets import PUBLISHED_ACTIVE_GPT_OSS, PUBLISHED_PARAMS  # noqa: E402
from offload.models.quantized import (QuantLinear, QuantSettings, block_file,  # noqa: E402
                                      load_quantized_streamed, quantize_checkpoint)
from offload.models.rope import rope_frequencies  # noqa: E402
from offload.quant.format import dequantize  # noqa: E402
from runners.common import run_main  # noqa: E402
from runners.infer import main as infer_main  # noqa: E402

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
mxfp4_theirs = pytest.importorskip("transformers.integrations.mxfp4")

NAME = "gpt_oss"
NEW = 6
_gen = torch.Generator().manual_seed(4321)
PROMPT = torch.randint(3, VOCAB, (12,), generator=_gen).tolist()  # crosses the window (6)
SHORT = PROMPT[:5]
LONG_IDS = torch.randint(3, VOCAB, (2, 21), generator=_gen)
ATOL = 1e-5


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    return Case(NAME, str(tmp_path_factory.mktemp(NAME)), PROMPT, SHORT, LONG_IDS, NEW, ATOL)


def eager_copy(hf):
    """transformers' model of the same weights with its eager experts (the loop ours follows)."""
    eager = type(hf)(copy.deepcopy(hf.config)).eval()
    eager.load_state_dict(hf.state_dict())
    eager.set_experts_implementation("eager")
    eager.generation_config.eos_token_id = None
    return eager


# ---- fp32: resident and streamed ----------------------------------------------------------------
def test_resident_equals_transformers_and_eager_bit_for_bit(case):
    model = load_model(case.path)
    cfg = model.config
    assert (cfg.architecture, cfg.num_experts, cfg.moe_router) == ("GptOssForCausalLM", 8, "topk_softmax")
    assert cfg.attention_sinks and (cfg.swiglu_limit, cfg.swiglu_alpha) == (0.5, 1.3)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.router.bias is not None and not hasattr(moe, "gate")
    assert all(type(e) is ClampedSwiGLUExpert and type(e.gate_up_proj) is InputMajorLinear for e in moe.experts)
    assert router_name(cfg) == "mlp.router.weight"
    # transformers' file holds the experts fused; every one of ours is a byte range of them
    stored = set(SafetensorsFile(os.path.join(case.path, "model.safetensors")).tensors)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored and "model.layers.0.self_attn.sinks" in stored
    with CheckpointReader(case.path) as reader:
        assert not reader.unexpected
        loc = reader.location("model.layers.1.mlp.experts.3.gate_up_proj.weight")
        assert loc.part and loc.shape == (64, 128) and loc.nbytes == 64 * 128 * 4
    case.check(model, single=True)
    with torch.no_grad():
        assert torch.equal(model(LONG_IDS), hf_logits(eager_copy(case.hf), LONG_IDS))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_streamed_equals_transformers(case, tier):
    with CheckpointReader(case.path) as reader:
        layers = reader.config.num_hidden_layers
        model, streamer = load_streamed(reader, [tier] * layers, device="cpu", dtype=torch.float32,
                                        zero_copy_host=False, fetch_delay_s=0.002)
        try:
            case.check(model, streamer)
            assert streamer.stats.fetches[tier] >= layers
        finally:
            streamer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_equals_transformers_eager_bit_for_bit_at_top4(dtype):
    """One MoE block against transformers' GptOssMLP with eager experts: 16 experts, top-4 (the
    order the k outputs are added in matters), fp32 and bf16 (the routing softmax and the
    experts in bf16); the clamps bite on both sides."""
    hf_cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=16,
                                       num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                                       swiglu_limit=1.0)
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    theirs = gpt_oss.GptOssMLP(hf_cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"],
                               "vocab_size": 32, "num_hidden_layers": 1, "layer_types": None})
    ours = SparseMoE(cfg).eval()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        ours.router.bias.copy_(theirs.router.bias)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj[e])
            expert.gate_up_proj.bias.copy_(theirs.experts.gate_up_proj_bias[e])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
            expert.down_proj.bias.copy_(theirs.experts.down_proj_bias[e])
        theirs.to(dtype), ours.to(dtype)
        x = (3 * torch.randn(3, 11, 64)).to(dtype)
        gate_up = project_all(ours, x.reshape(-1, 64))
        assert (gate_up[..., ::2] > 1).any() and (gate_up[..., 1::2] < -1).any()  # both clamps act
        assert torch.equal(ours(x), theirs(x)[0])


def project_all(moe, x):
    return torch.cat([e.gate_up_proj(x) for e in moe.experts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_attention_equals_transformers_eager(dtype):
    """sink_attention against transformers' eager_attention_forward (its only CPU path): grouped
    heads, a causal prefill and a decode step over a longer cache, a padding mask."""
    torch.manual_seed(5)
    B, nh, kvh, D = 2, 4, 2, 16
    module = type("M", (), {"num_key_value_groups": nh // kvh, "training": False,
                            "sinks": torch.randn(nh).to(dtype)})()
    for T, S in ((9, 9), (1, 13)):
        q = torch.randn(B, nh, T, D).to(dtype)
        k, v = torch.randn(B, kvh, S, D).to(dtype), torch.randn(B, kvh, S, D).to(dtype)
        allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None].repeat(B, 1, 1, 1)
        allowed[1, :, :, :2] = False  # row 1 left-padded by two
        allowed[1, :, torch.arange(T), torch.arange(S - T, S)] = True
        additive = torch.zeros(B, 1, T, S, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        want, _ = gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=D ** -0.5)
        got = sink_attention(q, k, v, allowed, None, module.sinks)
        assert torch.equal(got.transpose(1, 2), want)
    q, k, v = q.expand(B, nh, 9, D).contiguous(), k[:, :, :9], v[:, :, :9]
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(B, 1, 9, 9)
    assert torch.equal(sink_attention(q, k, v, None, None, module.sinks),  # no mask: causal
                       sink_attention(q, k, v, causal, None, module.sinks))


def test_norm_in_bf16_equals_transformers_fp32_kept_norm():
    """gpt-oss's RMSNorm scales in fp32, its weight kept in fp32 by transformers
    (_keep_in_fp32_modules): ours ("fp32_scale"), holding the bf16 checkpoint's weight in bf16,
    gives the same bf16 output bit for bit."""
    from offload.models.llama import RMSNorm
    torch.manual_seed(7)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    theirs, ours = gpt_oss.GptOssRMSNorm(64, 1e-5), RMSNorm(64, 1e-5, "fp32_scale").to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(w.float())
        ours.weight.copy_(w)
    x = (3 * torch.randn(5, 64)).to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    llama = RMSNorm(64, 1e-5, "llama").to(torch.bfloat16)
    with torch.no_grad():
        llama.weight.copy_(w)
    assert not torch.equal(llama(x), theirs(x))  # Llama's order (cast, then scale) rounds twice


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_equal_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = preset("gpt-oss-20b")
    cfg = cfg.replace(rope_scaling={**cfg.rope_scaling, "truncate": truncate})
    hf_cfg = transformers.GptOssConfig(**{k: v for k, v in cfg.to_hf().items()
                                          if k not in ("architectures", "model_type", "rope_scaling")})
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    got, our_scale = rope_frequencies(cfg)
    assert torch.equal(got, want) and our_scale == scale


# ---- int8 / int4 ----------------------------------------------------------------------------------
def dequantized_reference(case: Case, blocks) -> torch.nn.Module:
    """transformers' model of the case with every projection replaced by our dequantized codes:
    each expert's (quantized as the [out, in] it multiplies by) written transposed into its slot
    of the fused gate_up_proj / down_proj; the routers, biases and sinks as they are."""
    hf = eager_copy(case.hf)
    cfg = ModelConfig.from_hf(json.loads((Path(case.path) / "config.json").read_text()))
    shapes = block_parameter_shapes(cfg)
    for i, layer in enumerate(hf.model.layers):
        with SafetensorsFile(block_file(blocks.path, i)) as f:
            for proj, spec in blocks.specs[i].items():
                parts = {n: f.read(f"{proj}.{n}")
                         for n in ["qweight", "scales"] + (["mins"] if spec.bits == 4 else [])}
                if not proj.startswith("mlp.experts."):
                    w = dequantize(parts, spec, shapes[f"{proj}.weight"][1], torch.float32)
                    with torch.no_grad():
                        layer.get_submodule(proj).weight.copy_(w)
                    continue
                _, _, e, p = proj.split(".")
                w = dequantize(parts, spec, shapes[f"{proj}.weight"][0], torch.float32)  # [out, in]
                with torch.no_grad():
                    getattr(layer.mlp.experts, p)[int(e)].copy_(w.t())
    return hf


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_equals_transformers_with_dequantized_experts(case, mode, tmp_path):
    with CheckpointReader(case.path) as reader:
        cfg = reader.config
        assert len(projection_names(cfg)) == 4 + 2 * 8 and "mlp.router" not in projection_names(cfg)
        blocks = quantize_checkpoint(reader, QuantSettings(mode), torch.float32, cache_root=str(tmp_path))
        ref = dequantized_reference(case, blocks)
        model, streamer = load_quantized_streamed(reader, blocks, ["device", "nvme", "cpu"], device="cpu",
                                                  dtype=torch.float32, zero_copy_host=False)
        try:
            quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
            assert len(quant) == len(projection_names(cfg)) * cfg.num_hidden_layers
            gate_up = model.model.layers[0].mlp.experts[0].gate_up_proj
            assert (gate_up.in_features, gate_up.out_features) == (64, 128)
            assert all(type(layer.mlp.router) is torch.nn.Linear for layer in model.model.layers)
            case.check(model, streamer, hf=ref, tokens=greedy_reference(ref, PROMPT, SHORT, NEW))
        finally:
            streamer.close()


# ---- files in and out -----------------------------------------------------------------------------
def test_export_loads_in_transformers_with_identical_logits(case, tmp_path):
    """save_pretrained writes the experts fused again, as transformers writes them (the same
    names and shapes as its own file), single-file and sharded; transformers loads both."""
    model = load_model(case.path)
    cfg = model.config
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    save_pretrained(model, tmp_path / "one")
    with SafetensorsFile(str(tmp_path / "one" / "model.safetensors")) as ours, \
            SafetensorsFile(os.path.join(case.path, "model.safetensors")) as theirs:
        assert {n: t.shape for n, t in ours.tensors.items()} == {n: t.shape for n, t in theirs.tensors.items()}
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    for d in ("one", "sharded"):
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / d), dtype=torch.float32).eval()
        assert type(back) is type(case.hf) and back.config.swiglu_alpha == 1.3
        for ids in (LONG_IDS, torch.tensor([SHORT])):
            assert torch.equal(hf_logits(back, ids), hf_logits(case.hf, ids))
    again = load_model(tmp_path / "sharded")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_runner_greedy_from_nvme_equals_transformers(case, tmp_path, capsys):
    """python -m runners.infer --weights nvme (its experts placed one by one when it so plans)."""
    res, err = run_infer(case.path, PROMPT, NEW, tmp_path, capsys, "--weights", "nvme",
                         "--offload-dir", tmp_path)
    assert "GptOssForCausalLM" in err and "B active" in err
    assert res["generated_ids"] == case.greedy()["single"]


# ---- MXFP4 (the published checkpoints' experts) -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_equals_transformers(dtype):
    """Random blocks and every scale byte but 255 (2^128: inf times a zero code is nan in both)
    against transformers' own dequantization, which also transposes to [E, in, out]."""
    g = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 40, 4), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 127, 254, 100], dtype=torch.uint8)
    want = mxfp4_theirs.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 40]
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2), want)


def mxfp4_checkpoint(case: Case, path: Path) -> None:
    """The case's checkpoint with its expert matrices replaced by random MXFP4 blocks and
    scales, as the published gpt-oss checkpoints hold them (config.json saying so)."""
    g = torch.Generator().manual_seed(12)
    state = {k: v.contiguous() for k, v in case.hf.state_dict().items()}
    E, H, I = 8, 64, 64
    for i in range(3):
        for proj, (out_f, in_f) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            del state[f"model.layers.{i}.mlp.experts.{proj}"]
            state[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = torch.randint(
                0, 256, (E, out_f, in_f // 32, 16), dtype=torch.uint8, generator=g)
            state[f"model.layers.{i}.mlp.experts.{proj}_scales"] = torch.randint(
                118, 125, (E, out_f, in_f // 32), dtype=torch.uint8, generator=g)
    path.mkdir()
    write_file(str(path / "model.safetensors"), state, {"format": "pt"})
    hf_cfg = json.loads((Path(case.path) / "config.json").read_text())
    hf_cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(hf_cfg))


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(case, tmp_path):
    """An MXFP4 checkpoint: each expert's rows of the blocks and scales read and dequantized on
    load, the logits transformers gives loading the same directory (Mxfp4Config(dequantize=True));
    int8 conversion reads through the same dequantization; streaming it in place is refused."""
    mxfp4_checkpoint(case, tmp_path / "mx")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "mx"), dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ours = load_model(tmp_path / "mx")
    with torch.no_grad():
        torch.testing.assert_close(ours(LONG_IDS), theirs(LONG_IDS).logits, rtol=0, atol=ATOL)
        w = theirs.model.layers[2].mlp.experts.down_proj[5]
        assert torch.equal(ours.model.layers[2].mlp.experts[5].down_proj.weight, w)
    with CheckpointReader(tmp_path / "mx") as reader:
        assert not reader.unexpected
        blocks = quantize_checkpoint(reader, QuantSettings("int8"), torch.float32, cache_root=str(tmp_path))
        assert blocks.specs[0]["mlp.experts.0.gate_up_proj"].bits == 8
        with pytest.raises(CheckpointError, match="MXFP4, dequantized on load; they cannot be streamed in "
                                                  "place: use --quantize") as e:
            load_streamed(reader, ["nvme"] * 3, device="cpu", dtype=torch.float32)
        assert "\n" not in str(e.value)
    bad = SafetensorsFile(str(tmp_path / "mx" / "model.safetensors"))
    state = {n: bad.read(n) for n in bad.tensors}
    bad.close()
    state["model.layers.1.mlp.experts.down_proj_scales"] = state["model.layers.1.mlp.experts.down_proj_scales"][:, :, :1].contiguous()
    write_file(str(tmp_path / "mx" / "model.safetensors"), state, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"MXFP4 experts of this config are uint8 blocks \[8, 64, 2, 16\] "
                                              r"and scales \[8, 64, 2\] \(got \[8, 64, 2, 16\] / \[8, 64, 1\]"):
        CheckpointReader(tmp_path / "mx")


# ---- presets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PUBLISHED_ACTIVE_GPT_OSS))
def test_presets_total_and_active_counts(name):
    cfg = preset(name)
    assert abs(num_params(cfg) / PUBLISHED_PARAMS[name] - 1) < 0.01
    assert abs(num_active_params(cfg) / PUBLISHED_ACTIVE_GPT_OSS[name] - 1) < 0.01
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert expert_params(cfg) == 3 * 2880 * 2880 + 2 * 2880 + 2880
    experts = sum(math.prod(s) for n, s in block_parameter_shapes(cfg).items() if ".experts." in n)
    assert experts == cfg.num_experts * expert_params(cfg)
    # transformers' own model of the preset, counted on meta
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{
            k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type", "rope_scaling")}))
    assert sum(p.numel() for p in hf.parameters()) == num_params(cfg)


def test_a_published_style_config_json_is_the_preset():
    """openai/gpt-oss-20b's config.json keys (transformers 4.x spelling: rope_scaling beside
    rope_theta, num_local_experts, its MXFP4 quantization_config, keys transformers ignores)."""
    published = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
        "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}
    assert ModelConfig.from_hf(published) == preset("gpt-oss-20b")
    bare = {k: published[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                       "num_hidden_layers", "num_attention_heads")}
    cfg = ModelConfig.from_hf(bare)  # GptOssConfig's own defaults for the rest
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.sliding_window, cfg.head_dim, cfg.num_key_value_heads,
            cfg.num_experts, cfg.swiglu_alpha) == (150000.0, preset("gpt-oss-20b").rope_scaling, 128, 64, 8, 128, 1.702)


def test_preset_plans_in_a_dry_run(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = run_main(infer_main, ["--model", "gpt-oss-20b", "--dry-run", "--offload-dir", str(tmp_path),
                               "--cpu-memory", "20GiB", "--probe-seconds", "0", "--output-json", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and "3.61B active" in err, err
    assert len(json.loads(out.read_text())["plan"]["residency"]) == 24


# ---- refusals -----------------------------------------------------------------------------------
REFUSALS = [  # (change to the case's config.json, words the one-line refusal must hold)
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config 'gptq'"),
    ({"swiglu_limit": None}, "need swiglu_limit and swiglu_alpha"),
    ({"swiglu_alpha": -1.0}, "swiglu_alpha must be null or a finite number > 0"),
    ({"num_experts": 6, "num_local_experts": 8}, "disagree"),
    ({"sliding_window": None}, "sliding_window is null"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be an integer in [1, num_experts = 8]"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
]


@pytest.mark.parametrize("change,needle", REFUSALS)
def test_unsupported_configs_are_refused_in_one_line(case, change, needle):
    hf_cfg = json.loads((Path(case.path) / "config.json").read_text())
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({**hf_cfg, **change})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_lora_on_the_experts_is_refused_and_on_the_attention_runs(case):
    from offload.lora import LoraConfig, LoraError, apply_lora
    model = load_model(case.path)
    with pytest.raises(LoraError, match=r"LoRA on model.layers.0.mlp.experts.0.gate_up_proj is not built .* "
                                        r"--lora-targets q,k,v,o"):
        apply_lora(model, LoraConfig(rank=4))
    assert len(apply_lora(model, LoraConfig(rank=4, targets=("q", "k", "v", "o")))) == 4 * 3
    with torch.no_grad():  # B starts at zero: the same logits
        torch.testing.assert_close(model(LONG_IDS), hf_logits(case.hf, LONG_IDS), rtol=0, atol=ATOL)


def test_a_fused_experts_tensor_that_does_not_fit_is_refused_in_one_line(case, tmp_path):
    state = {k: v.contiguous() for k, v in case.hf.state_dict().items()}
    state["model.layers.1.mlp.experts.down_proj"] = state["model.layers.1.mlp.experts.down_proj"][:, :32].contiguous()
    write_file(str(tmp_path / "model.safetensors"), state, {"format": "pt"})
    (tmp_path / "config.json").write_text((Path(case.path) / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no fused experts tensor of this config: mlp.experts.down_proj "
                                              r"is \[8, 64, 64\]") as e:
        CheckpointReader(tmp_path)
    assert "\n" not in str(e.value)
