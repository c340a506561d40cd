"""Inference of every family case in tests/families.py against transformers (the reference,
never our own output): fp32 logits within 1e-5 and identical greedy tokens with the weights
resident, streamed from RAM and from NVMe files, and through `python -m runners.infer` on a
sharded checkpoint; int8 / int4 blocks against transformers' model carrying our dequantized
projection weights; export through save_pretrained back into transformers; the presets'
parameter counts and dry-run plans; one-line refusals of what the decoder does not do.

Each case's checkpoint is written once per module. Prompts cross every case's sliding windows
(6 and 9 positions) and Phi-3 LongRoPE's switch from short to long factors (16 positions)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import FAMILIES, VOCAB, Case, hf_logits, make_cases, save_family_checkpoint  # noqa: E402
from nvme.format import SafetensorsFile  # noqa: E402
from offload.infer.generate import generate  # noqa: E402
from offload.models import (CheckpointError, CheckpointReader, ConfigError, ModelConfig,  # noqa: E402
                            load_model, load_streamed, num_block_params, num_params, preset,
                            projection_names, save_pretrained)
from offload.models.presets import PUBLISHED_PARAMS  # noqa: E402
from offload.models.quantized import (QuantLinear, QuantSettings, block_file,  # noqa: E402
                                      load_quantized_streamed, quantize_checkpoint)
from offload.quant.format import QuantSpec, dequantize  # noqa: E402
from runners.common import run_main  # noqa: E402
from runners.infer import main as infer_main  # noqa: E402

NAMES = list(FAMILIES)
# the cases every streamed and quantized path runs (the others run resident and exported)
MAIN = ["qwen3", "gemma2", "gemma3", "phi3-longrope-partial"]
NEW = 12
_gen = torch.Generator().manual_seed(1234)
PROMPT = torch.randint(3, VOCAB, (12,), generator=_gen).tolist()  # 12 + 12 > 16 (LongRoPE switch)
SHORT = PROMPT[:5]  # a second prompt inside every window and below the switch
LONG_IDS = torch.randint(3, VOCAB, (2, 21), generator=_gen)  # a teacher-forced batch past them all
ATOL = 1e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    return make_cases(tmp_path_factory, NAMES, PROMPT, SHORT, LONG_IDS, NEW, ATOL)


# ---- fp32: resident, streamed from RAM and NVMe, the runner -------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_resident_logits_and_greedy_equal_transformers(cases, name):
    """load_model's model in RAM (the device here): logits, batched and single greedy tokens."""
    case = cases[name]
    model = load_model(case.path)
    assert model.config.architecture == type(case.hf).__name__
    case.check(model, single=True)
    # the KV cache in host RAM, one layer at a time on the device (--kv-cache host)
    got = generate(model, [PROMPT, SHORT], max_new_tokens=NEW, kv_tier="host").tokens
    assert got == case.greedy()["batch"]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", MAIN)
def test_streamed_logits_and_greedy_equal_transformers(cases, name, tier):
    """Every block streamed from host RAM (through slots) or read from the checkpoint's files,
    with a delay in every fetch: a block run on stale weights would show."""
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


def _infer(argv, capsys) -> tuple[int, str]:
    """python -m runners.infer in this process: (exit code, stderr)."""
    rc = run_main(infer_main, [str(a) for a in argv])
    return rc, capsys.readouterr().err


RUNS = [("phi3-longrope-partial", "nvme", "none"), ("gemma3", "auto", "none"),
        ("qwen3", "nvme", "int4"), ("gemma2", "cpu", "int8")]


@pytest.mark.parametrize("name,weights,quantize", RUNS)
def test_runner_on_a_sharded_checkpoint_equals_transformers(cases, name, weights, quantize, tmp_path,
                                                            capsys):
    """The command as a user runs it, on a checkpoint saved by transformers in several shards:
    the tokens it generates are transformers' greedy ones (with --quantize: those of
    transformers' model carrying the dequantized weights of the blocks the run converted)."""
    ckpt = tmp_path / "ckpt"
    save_family_checkpoint(name, ckpt, sharded=True)
    assert len(glob.glob(str(ckpt / "*.safetensors"))) > 1
    out = tmp_path / "out.json"
    rc, err = _infer(["--model", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                      NEW, "--weights", weights, "--quantize", quantize, "--ignore-eos",
                      "--probe-seconds", "0.05", "--offload-dir", tmp_path / "cache",
                      "--output-json", out], capsys)
    assert rc == 0, err
    assert FAMILIES[name][1].__name__ in err
    want = cases[name].greedy()["single"]
    if quantize != "none":
        [manifest] = glob.glob(str(tmp_path / "cache" / "quant" / "*" / "manifest.json"))
        specs = [{p: QuantSpec(*s) for p, s in layer.items()}
                 for layer in json.loads(Path(manifest).read_text())["specs"]]
        assert {s.bits for layer in specs for s in layer.values()} == {int(quantize[3:])}
        blocks = SimpleNamespace(path=os.path.dirname(manifest), specs=specs)
        want = cases[name].greedy_of(dequantized_reference(cases[name], blocks))["single"]
    assert json.loads(out.read_text())["generated_ids"] == want


# ---- int8 / int4 --------------------------------------------------------------------------------
def dequantized_reference(case: Case, blocks) -> torch.nn.Module:
    """transformers' model of the case with every projection weight replaced by the dequantized
    codes of our block files (Phi-3's fused qkv_proj / gate_up_proj as whole projections)."""
    hf = FAMILIES[case.name][1](case.hf.config).eval()
    hf.load_state_dict(case.hf.state_dict())
    hf.generation_config.eos_token_id = None
    for i, layer in enumerate(hf.model.layers):
        with SafetensorsFile(block_file(blocks.path, i)) as f:
            for proj, spec in blocks.specs[i].items():
                lin = layer.get_submodule(proj)
                parts = {n: f.read(f"{proj}.{n}")
                         for n in ["qweight", "scales"] + (["mins"] if spec.bits == 4 else [])}
                with torch.no_grad():
                    lin.weight.copy_(dequantize(parts, spec, lin.in_features, torch.float32))
    return hf


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", MAIN)
def test_quantized_equals_transformers_with_dequantized_weights(cases, name, mode, tmp_path):
    """Blocks converted to int8 / int4 and streamed from every tier (resident, RAM, NVMe): the
    logits of transformers' model whose projections are our dequantized weights, and its tokens."""
    case = cases[name]
    with CheckpointReader(case.path) as reader:
        cfg = reader.config
        blocks = quantize_checkpoint(reader, QuantSettings(mode), torch.float32,
                                     cache_root=str(tmp_path))
        assert all(set(s) == set(projection_names(cfg)) for s in blocks.specs)
        ref = dequantized_reference(case, blocks)
        tokens = case.greedy_of(ref)
        tiers = (["device", "nvme", "cpu"] * cfg.num_hidden_layers)[:cfg.num_hidden_layers]
        model, streamer = load_quantized_streamed(reader, blocks, tiers, device="cpu",
                                                  dtype=torch.float32, zero_copy_host=False)
        try:
            quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
            assert len(quant) == len(projection_names(cfg)) * cfg.num_hidden_layers
            assert {m.spec.bits for m in quant} == {8 if mode == "int8" else 4}
            case.check(model, streamer, hf=ref, tokens=tokens)
        finally:
            streamer.close()
    if mode == "int4":  # the codes are not the weights: the reference itself moved
        assert not torch.equal(hf_logits(ref, LONG_IDS), hf_logits(case.hf, LONG_IDS))


# ---- export -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_with_identical_logits(cases, name, tmp_path):
    case = cases[name]
    model = load_model(case.path)
    cfg = model.config
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    save_pretrained(model, tmp_path)
    with CheckpointReader(tmp_path) as reader:
        assert reader.config == cfg
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(back) is type(case.hf)
    for ids in (LONG_IDS, torch.tensor([SHORT])):
        assert torch.equal(hf_logits(back, ids), hf_logits(case.hf, ids))


# ---- presets ------------------------------------------------------------------------------------
NEW_PRESETS = ["qwen3-8B", "qwen3-32B", "gemma3-27B", "phi4-14B", "gemma3-270M"]


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_preset_parameter_counts_match_the_published_ones(name):
    cfg = preset(name)
    assert abs(num_params(cfg) / PUBLISHED_PARAMS[name] - 1) < 0.01
    # through config.json and back: the same model
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_new_presets_plan_in_a_dry_run(tmp_path, capsys):
    """--dry-run plans the new presets' shapes without writing or allocating their weights."""
    for name in NEW_PRESETS:
        out = tmp_path / f"{name}.json"
        # an explicit budget: the default is what RAM is free now, which other jobs change
        rc, err = _infer(["--model", name, "--dry-run", "--offload-dir", tmp_path, "--cpu-memory", "20GiB",
                          "--probe-seconds", "0", "--output-json", out], capsys)
        assert rc == 0, err
        cfg = preset(name)
        assert cfg.architecture in err and "RANDOM weights" in err
        plan = json.loads(out.read_text())["plan"]
        assert len(plan["residency"]) == cfg.num_hidden_layers
        fp32 = 4 * num_block_params(cfg) * cfg.num_hidden_layers  # dtype auto on a CPU
        assert abs(sum(plan["block_bytes"]) / fp32 - 1) < 0.01
    assert not glob.glob(str(tmp_path / "*" / "*.safetensors"))  # nothing generated


# ---- refusals -----------------------------------------------------------------------------------
REFUSALS = [  # (case, change to its config.json, words the one-line refusal must hold)
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "Gemma3ForConditionalGeneration"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop"),
    ("qwen3", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_act 'gelu'"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
               "rope_scaling": None}, "'dynamic'"),
    ("phi3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),  # 4.x spelling
    ("phi3-longrope-partial", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 5,
                                                "long_factor": [2.0] * 6}}, "must list 6"),
]


@pytest.mark.parametrize("name,change,needle", REFUSALS)
def test_unsupported_configs_are_refused_in_one_line(cases, name, change, needle, tmp_path, capsys):
    hf_cfg = json.loads((Path(cases[name].path) / "config.json").read_text())
    bad = {**hf_cfg, **change}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(bad)
    assert needle in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)
    rc, err = _infer(["--model", tmp_path, "--dry-run", "--probe-seconds", "0"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
