"""Mixture-of-experts families (Qwen3-MoE, OLMoE, Mixtral) against transformers, the reference:
small random checkpoints saved by transformers itself (tests/families.py MOE_FAMILIES: 8
experts, top-2, every weight random, norms too), fp32 logits within 1e-5 and greedy tokens
identical, resident, streamed from RAM and NVMe, int8 / int4 against transformers carrying our
dequantized expert weights; bit-equal to transformers' eager experts; the export read back by
transformers; transformers' fused in-memory layout read in place; presets' total and active
counts; one-line refusals of what is not built."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import (MOE_FAMILIES, VOCAB, Case, dequantized_reference, make_cases,  # noqa: E402
                      hf_logits, save_family_checkpoint)
from nvme.format import SafetensorsFile, write_file  # noqa: E402
from offload.models import (CheckpointError, CheckpointReader, ConfigError, ModelConfig,  # noqa: E402
                            block_parameter_shapes, load_model, load_streamed, num_block_params,
                            num_params, preset, projection_names, save_pretrained)
from offload.models.config import num_active_params  # noqa: E402
from offload.models.families import moe_names  # noqa: E402
from offload.models.moe import SparseMoE  # noqa: E402
from offload.models.presets import PUBLISHED_ACTIVE, PUBLISHED_PARAMS  # noqa: E402
from offload.models.quantized import (QuantLinear, QuantSettings, load_quantized_streamed,  # noqa: E402
                                      quantize_checkpoint)
from offload.quant.format import QuantSpec  # noqa: E402
from runners.common import run_main  # noqa: E402
from runners.infer import main as infer_main  # noqa: E402

NAMES = list(MOE_FAMILIES)
NEW = 6
_gen = torch.Generator().manual_seed(4321)
PROMPT = torch.randint(3, VOCAB, (12,), generator=_gen).tolist()  # crosses both windows (6, 9)
SHORT = PROMPT[:5]
LONG_IDS = torch.randint(3, VOCAB, (2, 21), generator=_gen)
ATOL = 1e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    return make_cases(tmp_path_factory, NAMES, PROMPT, SHORT, LONG_IDS, NEW, ATOL)


def experts_run(model, ids: torch.Tensor) -> list[int]:
    """How many experts got tokens in each layer for one forward of `ids`."""
    hit: dict[int, set[int]] = {}
    hooks = [expert.register_forward_hook(lambda m, i, o, key=(li, e): hit.setdefault(key[0], set()).add(key[1]))
             for li, layer in enumerate(model.model.layers)
             for e, expert in enumerate(layer.get_submodule(layer.ffn_name).experts)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [len(hit.get(i, ())) for i in range(len(model.model.layers))]


# ---- fp32: resident and streamed ----------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_resident_equals_transformers_and_eager_bit_for_bit(cases, name):
    case = cases[name]
    model = load_model(case.path)
    cfg = model.config
    assert cfg.architecture == type(case.hf).__name__ and cfg.num_experts == 8
    module, _ = moe_names(cfg.architecture)
    assert isinstance(model.model.layers[0].get_submodule(module), SparseMoE)
    assert set(model.state_dict()) | {"lm_head.weight"} >= set(SafetensorsFile(
        os.path.join(case.path, "model.safetensors")).tensors)  # the checkpoint's own names
    # the short prompt leaves some experts without tokens; the long batch runs several
    assert min(experts_run(model, torch.tensor([SHORT]))) < cfg.num_experts
    assert min(experts_run(model, LONG_IDS)) >= 4
    case.check(model, single=True)
    eager = type(case.hf)(copy.deepcopy(case.hf.config)).eval()  # its own: the setting is the config's
    eager.load_state_dict(case.hf.state_dict())
    eager.set_experts_implementation("eager")  # the loop the MoE forward follows
    with torch.no_grad():
        assert torch.equal(model(LONG_IDS), hf_logits(eager, LONG_IDS))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", NAMES)
def test_streamed_equals_transformers(cases, name, tier):
    case = cases[name]
    with CheckpointReader(case.path) as reader:
        layers = reader.config.num_hidden_layers
        model, streamer = load_streamed(reader, [tier] * layers, device="cpu", dtype=torch.float32,
                                        zero_copy_host=False, fetch_delay_s=0.002)
        try:
            case.check(model, streamer)
            assert streamer.stats.fetches[tier] >= layers
        finally:
            streamer.close()


_BLOCKS = {"qwen3_moe": (transformers.Qwen3MoeConfig, "Qwen3MoeSparseMoeBlock", "qwen3_moe"),
           "mixtral": (transformers.MixtralConfig, "MixtralSparseMoeBlock", "mixtral")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_BLOCKS))
def test_block_equals_transformers_eager_bit_for_bit_at_top4_and_in_bf16(name, dtype):
    """One MoE block against transformers' own, eager experts: 16 experts, top-4 (the order the
    k outputs are added in matters), in fp32 and bf16 (Qwen3-MoE casts the routing weights to
    bf16, Mixtral keeps them in fp32 and rounds each product)."""
    cfg_cls, block_name, module = _BLOCKS[name]
    hf_cfg = cfg_cls(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=16,
                     num_local_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                     num_attention_heads=4, num_key_value_heads=2)
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[block_name])
    theirs = getattr(mod, block_name)(hf_cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [type(theirs).__name__.replace(
        "SparseMoeBlock", "ForCausalLM")], "vocab_size": 32, "num_hidden_layers": 1})
    ours = SparseMoE(cfg).eval()
    gate, up, down = moe_names(cfg.architecture)[1]
    I = cfg.moe_intermediate_size
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, expert in enumerate(ours.experts):
            getattr(expert, gate).weight.copy_(theirs.experts.gate_up_proj[e, :I])
            getattr(expert, up).weight.copy_(theirs.experts.gate_up_proj[e, I:])
            getattr(expert, down).weight.copy_(theirs.experts.down_proj[e])
        theirs.to(dtype), ours.to(dtype)
        x = torch.randn(3, 11, 64).to(dtype)
        assert torch.equal(ours(x), theirs(x))


# ---- int8 / int4 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_equals_transformers_with_dequantized_experts(cases, name, mode, tmp_path):
    case = cases[name]
    with CheckpointReader(case.path) as reader:
        cfg = reader.config
        router = f"{moe_names(cfg.architecture)[0]}.gate"
        assert router not in projection_names(cfg) and len(projection_names(cfg)) == 4 + 3 * 8
        blocks = quantize_checkpoint(reader, QuantSettings(mode), torch.float32, cache_root=str(tmp_path))
        ref = dequantized_reference(case, blocks)
        tiers = (["device", "nvme", "cpu"] * cfg.num_hidden_layers)[:cfg.num_hidden_layers]
        model, streamer = load_quantized_streamed(reader, blocks, tiers, device="cpu",
                                                  dtype=torch.float32, zero_copy_host=False)
        try:
            quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
            assert len(quant) == len(projection_names(cfg)) * cfg.num_hidden_layers
            assert all(type(layer.get_submodule(router)) is torch.nn.Linear for layer in model.model.layers)
            case.check(model, streamer, hf=ref, tokens=case.greedy_of(ref))
        finally:
            streamer.close()


def test_runner_streams_quantized_experts_from_nvme(cases, tmp_path, capsys):
    """python -m runners.infer --weights nvme --quantize int4 on a sharded Mixtral checkpoint:
    transformers' greedy tokens over the dequantized experts the run converted."""
    ckpt = tmp_path / "ckpt"
    save_family_checkpoint("mixtral", ckpt, sharded=True)
    assert len(list(ckpt.glob("*.safetensors"))) > 1
    out = tmp_path / "out.json"
    rc = run_main(infer_main, [str(a) for a in [
        "--model", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", NEW,
        "--weights", "nvme", "--quantize", "int4", "--ignore-eos", "--probe-seconds", "0.05",
        "--offload-dir", tmp_path / "cache", "--output-json", out]])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "MixtralForCausalLM" in err and "B active" in err
    [manifest] = (tmp_path / "cache" / "quant").glob("*/manifest.json")
    specs = [{p: QuantSpec(*v) for p, v in layer.items()} for layer in json.loads(manifest.read_text())["specs"]]
    ref = dequantized_reference(cases["mixtral"], SimpleNamespace(path=str(manifest.parent), specs=specs))
    assert json.loads(out.read_text())["generated_ids"] == cases["mixtral"].greedy_of(ref)["single"]


# ---- files in and out -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_with_identical_logits(cases, name, tmp_path):
    case = cases[name]
    model = load_model(case.path)
    cfg = model.config
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    save_pretrained(model, tmp_path)
    names = set(SafetensorsFile(str(tmp_path / "model.safetensors")).tensors)
    assert names == set(SafetensorsFile(os.path.join(case.path, "model.safetensors")).tensors)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(back) is type(case.hf)
    assert back.config.num_experts_per_tok == 2 and getattr(back.config, "norm_topk_prob", True) == cfg.norm_topk_prob
    for ids in (LONG_IDS, torch.tensor([SHORT])):
        assert torch.equal(hf_logits(back, ids), hf_logits(case.hf, ids))


@pytest.mark.parametrize("name", NAMES)
def test_fused_expert_tensors_are_read_in_place(cases, name, tmp_path):
    """A checkpoint holding transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I], Mixtral's router under mlp.gate): each expert read as its
    byte range, resident and streamed from NVMe, the same model bit for bit."""
    case = cases[name]
    state = {k: v.contiguous() for k, v in case.hf.state_dict().items() if k != "lm_head.weight"
             or not case.hf.config.tie_word_embeddings}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    write_file(str(tmp_path / "model.safetensors"), state, {"format": "pt"})
    (tmp_path / "config.json").write_text((Path(case.path) / "config.json").read_text())
    want = load_model(case.path)
    got = load_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    with CheckpointReader(tmp_path) as reader:
        assert not reader.unexpected
        model, streamer = load_streamed(reader, ["nvme"] * reader.config.num_hidden_layers,
                                        device="cpu", dtype=torch.float32, zero_copy_host=False)
        try:
            with torch.no_grad():
                assert torch.equal(model(LONG_IDS), want(LONG_IDS))
        finally:
            streamer.close()
    # an expert count that does not fit the config is refused in one line
    bad = dict(state)
    key = next(k for k in bad if k.endswith("experts.down_proj"))
    bad[key] = bad[key][:5].contiguous()
    write_file(str(tmp_path / "model.safetensors"), bad, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no fused experts tensor of this config") as e:
        CheckpointReader(tmp_path)
    assert "\n" not in str(e.value)


# ---- presets ----------------------------------------------------------------------------------------
MOE_PRESETS = list(PUBLISHED_ACTIVE)


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_total_and_active_counts(name):
    cfg = preset(name)
    assert abs(num_params(cfg) / PUBLISHED_PARAMS[name] - 1) < 0.01
    active, published = num_active_params(cfg), PUBLISHED_ACTIVE[name]
    if name == "qwen3-30B-A3B":  # "3.3B": 3.35B cut to two digits
        assert math.floor(active / 1e8) == round(published / 1e8)
    else:
        assert abs(active / published - 1) < 0.01
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    experts = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert sum(math.prod(s) for n, s in block_parameter_shapes(cfg).items()
               if ".experts." in n) * cfg.num_hidden_layers == experts


def test_moe_presets_plan_in_a_dry_run(tmp_path, capsys):
    for name in ("qwen3-30B-A3B", "mixtral-8x7B"):
        out = tmp_path / f"{name}.json"
        # an explicit budget: the default is what RAM is free now, which other jobs change
        rc = run_main(infer_main, ["--model", name, "--dry-run", "--offload-dir", str(tmp_path),
                                   "--cpu-memory", "20GiB", "--probe-seconds", "0",
                                   "--output-json", str(out)])
        err = capsys.readouterr().err
        assert rc == 0 and "B active" in err, err
        cfg, plan = preset(name), json.loads(out.read_text())["plan"]
        assert len(plan["residency"]) == cfg.num_hidden_layers
        # the blocks' dense parts, and every expert placed on its own (tests/test_experts.py)
        experts = plan["experts"]
        assert sum(experts["homes"].values()) == cfg.num_hidden_layers * cfg.num_experts
        placed = sum(plan["block_bytes"]) + sum(experts["homes"].values()) * experts["expert_bytes"]
        assert abs(placed / (4 * num_block_params(cfg) * cfg.num_hidden_layers) - 1) < 0.01


# ---- refusals -----------------------------------------------------------------------------------
REFUSALS = [  # (case, change to its config.json, words the one-line refusal must hold)
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
    ("qwen3_moe", {"num_experts": 6, "num_local_experts": 8}, "disagree"),
    ("olmoe", {"num_experts": 0}, "num_experts must be a positive integer"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("olmoe", {"head_dim": 32}, "head_dim must be hidden_size / num_attention_heads"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok must be an integer in [1, num_experts = 8]"),
]


@pytest.mark.parametrize("name,change,needle", REFUSALS)
def test_unsupported_moe_configs_are_refused_in_one_line(cases, name, change, needle):
    hf_cfg = json.loads((Path(cases[name].path) / "config.json").read_text())
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({**hf_cfg, **change})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_router_aux_loss_coef_is_carried_and_expert_counts_checked(cases, tmp_path):
    """router_aux_loss_coef (training's) is accepted and written back; a config.json asking for
    more experts than the weights hold is refused at once, before any name is listed."""
    path = Path(cases["olmoe"].path)
    hf_cfg = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf(hf_cfg).to_hf()["router_aux_loss_coef"] == 0.05
    (tmp_path / "config.json").write_text(json.dumps({**hf_cfg, "num_experts": 10**7,
                                                      "num_experts_per_tok": 2}))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="num_experts is 10000000, but the weights hold tensors of 8 experts"):
        CheckpointReader(tmp_path)
