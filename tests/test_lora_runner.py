"""The runners' LoRA half: `runners.finetune --lora-rank` writes a PEFT adapter that peft loads
(and with --merge a merged model transformers loads, equal to base + adapter), a stopped and
resumed LoRA run ends bit-identical to an uninterrupted one, `runners.infer --adapter` generates
the tokens transformers + peft generate on every weight tier, and every bad flag is one line.
With --offload-params the frozen base is streamed (the same adapter to the bit); with --quantize
(QLoRA) it is an int4 base streamed from its cached blocks, which runners.infer reuses.
A tiny model (hidden 64, 4 layers), a small corpus, a few updates: seconds."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from nvme.format import SafetensorsFile
from offload.models import build_model, preset, save_pretrained
from runners.common import RunnerError, run_main
from runners.finetune import main
from runners.finetune_args import build_parser, engine_config
from runners.infer import main as infer_main
from tests.test_finetune import _bad, _engine_state, _losses

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = [3, 14, 15, 92, 65, 35]
NEW = 8
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-targets", "q,v,down"]
QLORA = ["--quantize", "int4", "--group-size", "32", "--offload-params", "nvme",
         "--activation-checkpointing"]


def _base(path, seed: int) -> str:
    # a wide init: the tiny model's greedy tokens then vary with the prompt and the adapter
    cfg = preset("tiny").replace(initializer_range=0.2, eos_token_id=None)
    save_pretrained(build_model(cfg, "cpu", torch.float32, source=seed), path)
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished LoRA run with --merge: {base, other_base, data, out, fast (its flags)}."""
    root = tmp_path_factory.mktemp("lora_run")
    data = root / "corpus.txt"  # ~10 KB: 15 held-out sequences, so evaluating costs little
    data.write_text("".join(f"Line {i}: the adapter learns what the frozen base does not.\n"
                            for i in range(160)))
    fast = ["--model", _base(root / "base", 21), "--data", str(data), "--steps", "4",
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--warmup-steps", "1",
            "--lr", "1e-2", "--no-progress"] + LORA
    out = str(root / "full")
    assert main(fast + ["--output", out, "--merge"]) == 0
    return {"base": fast[1], "other_base": _base(root / "other", 22), "data": str(data),
            "out": out, "fast": fast}


def _with(flags: list[str], flag: str, value: str) -> list[str]:
    """`flags` with `flag`'s value replaced."""
    i = flags.index(flag)
    return flags[:i + 1] + [value] + flags[i + 2:]


def _tensors(path) -> dict[str, torch.Tensor]:
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f.tensors}


def _peft_model(run):
    hf = transformers.AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, os.path.join(run["out"], "adapter")).eval()


def test_adapter_loads_in_peft_and_the_merged_model_matches(run):
    adapter = os.path.join(run["out"], "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["base_model_name_or_path"] == os.path.abspath(run["base"])
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["q_proj", "v_proj", "down_proj"])
    saved = _tensors(os.path.join(adapter, "adapter_model.safetensors"))
    assert max(t.abs().max().item() for k, t in saved.items() if ".lora_B." in k) > 1e-3  # trained
    # the checkpoint holds the same adapter, and no copy of the base
    assert sorted(os.listdir(os.path.join(run["out"], "checkpoint"))) == ["adapter", "engine",
                                                                         "trainer_state.json"]
    inner = _tensors(os.path.join(run["out"], "checkpoint", "adapter", "adapter_model.safetensors"))
    assert inner.keys() == saved.keys() and all(torch.equal(inner[k], saved[k]) for k in saved)

    model = _peft_model(run)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert {k.replace(".default", "") for k in loaded} == set(saved)
    assert all(torch.equal(v, saved[k.replace(".default", "")]) for k, v in loaded.items())
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(run["out"], "model"),
                                                               dtype=torch.float32)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        want, got = model(ids).logits, merged(ids).logits
        base = model.get_base_model()
        with model.disable_adapter():
            plain = base(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # merging rounds differently
    assert (plain - want).abs().max() > 1e-3  # the adapter changes the model


def test_resume_is_exact(run, tmp_path):
    part = str(tmp_path / "part")
    assert main(run["fast"] + ["--output", part, "--stop-after", "2"]) == 0
    assert main(run["fast"] + ["--output", part, "--resume", part]) == 0
    assert _losses(part) == _losses(run["out"])
    a = _tensors(os.path.join(run["out"], "adapter", "adapter_model.safetensors"))
    b = _tensors(os.path.join(part, "adapter", "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = _engine_state(run["out"]), _engine_state(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not os.path.exists(os.path.join(part, "model"))  # no --merge: no copy of the base


def test_infer_adapter_matches_transformers_peft(run, tmp_path, capsys):
    model = _peft_model(run)
    want = model.generate(input_ids=torch.tensor([IDS]), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(IDS):].tolist()
    for weights in ("device", "cpu", "nvme"):  # resident, and streamed from RAM and from disk
        out = tmp_path / f"{weights}.json"
        rc = run_main(infer_main, ["--model", run["base"], "--adapter", os.path.join(run["out"], "adapter"),
                                   "--prompt-ids", ",".join(map(str, IDS)), "--max-new-tokens", str(NEW),
                                   "--weights", weights, "--probe-seconds", "0.05", "--output-json", str(out)])
        err = capsys.readouterr().err
        assert rc == 0, err
        assert "not merged" in err
        with open(out) as f:
            assert json.load(f)["generated_ids"] == [want], weights


def test_bad_lora_flags_are_one_line(run, tmp_path, capsys):
    out = ["--output", str(tmp_path / "o")]
    _bad(out + ["--lora-alpha", "8"], capsys, "--lora-alpha is a LoRA setting")
    _bad(out + ["--merge"], capsys, "--merge folds trained LoRA adapters")
    _bad(out + ["--lora-rank", "-1"], capsys, "--lora-rank must be >= 1")
    _bad(out + ["--lora-rank", "4", "--lora-dropout", "1"], capsys, "--lora-dropout: LoRA dropout")
    _bad(out + ["--lora-rank", "4", "--lora-targets", "q,lm_head"], capsys, "--lora-targets: unknown")
    # QLoRA's flags: a LoRA run's base, streamed and recomputed; the settings belong to --quantize
    _bad(out + ["--quantize", "int4"], capsys, "add --lora-rank R; quantized weights are not trained")
    _bad(out + ["--group-size", "32"], capsys, "--group-size is a --quantize setting")
    _bad(out + ["--lora-rank", "4", "--cache-dir", str(tmp_path)], capsys, "--cache-dir is a --quantize setting")
    _bad(out + ["--lora-rank", "4", "--quantize", "int4", "--group-size", "7"], capsys,
         "--quantize int4 --group-size 7:")
    # across torchrun ranks: stages 0-2 (a streamed base too: tests/test_zero_runner.py), not 3
    args = build_parser().parse_args(["--lora-rank", "4", "--offload-params", "cpu", "--batch-size", "4"])
    engine_config(args, torch.device("cpu"), 2)
    args = build_parser().parse_args(["--lora-rank", "4", "--zero-stage", "3", "--batch-size", "4"])
    with pytest.raises(RunnerError, match="--zero-stage 3 with --lora-rank: .* use --zero-stage 0, 1 or 2"):
        engine_config(args, torch.device("cpu"), 2)
    # a resume must keep the LoRA settings and the base the adapters were trained on
    resume = ["--resume", run["out"], "--output", str(tmp_path / "r")]
    _bad(_with(run["fast"], "--lora-rank", "8") + resume, capsys, "LoRA (--lora-rank")
    _bad(_with(run["fast"], "--model", run["other_base"]) + resume, capsys,
         "the base model's weights differ")
    _bad(run["fast"][:-len(LORA)] + resume, capsys, "None (the checkpoint has 'rank 4, alpha 8.0")
    _bad(run["fast"] + QLORA + ["--cache-dir", str(tmp_path / "c")] + resume, capsys,
         "targets q_proj,v_proj,down_proj, base int4 group 32' (the checkpoint has")
    # runners.infer: an adapter that is not there, or made for another model's shapes
    for adapter, phrase in ((tmp_path / "none", "is not a directory"),
                            (os.path.join(run["out"], "adapter"), "made for other targets or another model")):
        rc = run_main(infer_main, ["--model", "small", "--adapter", str(adapter), "--dry-run"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err[-1].startswith("error: ") and phrase in err[-1], err


def test_dry_run_counts_the_adapters_and_the_frozen_base(tmp_path, capsys):
    assert main(["--dry-run", "--lora-rank", "8", "--output", str(tmp_path / "d")]) == 0
    text = capsys.readouterr().out
    assert "lora      rank 8, alpha 16 (scaling 2)" in text
    # per layer, rank x (in + out) of q, o (64 -> 64), k, v (64 -> 32), gate, up, down (64 <-> 176)
    trainable = 4 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 176))
    assert f"{trainable / 1e6:.3f}M trainable parameters of" in text
    assert "frozen 1.21 MiB" in text and "stays on the device" in text
    assert "memory estimator" not in text  # the ZeRO table prices a full fine-tune
    # under the plan, the methods side by side (offload/train/lora_plan.py), each base where this
    # run keeps it (a quantized base too: loaded onto the device once)
    table = text[text.index("| method |"):].splitlines()
    assert [row.split(" | ")[0] for row in table[2:5]] == ["| full", "| LoRA r=8", "| QLoRA int4 r=8"]
    assert f"| {trainable / 1e6:.3f}M |" in table[3]


def test_dry_run_plans_a_streamed_and_a_quantized_base(tmp_path, capsys):
    """The plan counts the base as the engine will (offload/train/plan.py's frozen bytes): the
    layers in their home, streamed through a few device slots; a 70B dry run stays fast (all on
    meta) and --offload auto streams the base when it does not fit the device."""
    out = ["--output", str(tmp_path / "d"), "--dtype", "bf16", "--lora-rank", "16"]
    streamed = ["--dry-run", "--offload-params", "nvme", "--gpu-memory", "80GiB",
                "--activation-checkpointing", "--batch-size", "1"] + out
    assert main(streamed + ["--model", "8B"]) == 0
    text = capsys.readouterr().out
    assert "the frozen base's layers (13.00 GiB in bf16) stream from NVMe swap files" in text
    # no GPU here: the device is the host, so the embeddings and head are mapped from NVMe too
    assert "the rest (1.96 GiB) is mapped from its swap files" in text
    assert "nvme:   14.96 GiB  (weights 13.00 GiB, frozen 1.96 GiB)" in text
    assert "| QLoRA int4 r=16 |" in text
    # 70B as int4 blocks read in place from the conversion cache: only the 1000 MiB of mapped
    # embeddings and head must fit under --offload-dir (as bf16, 128 GiB of base would)
    assert main(streamed + ["--model", "70B", "--quantize", "int4"]) == 0
    text = capsys.readouterr().out
    assert "the frozen base's layers (35.86 GiB in int4 blocks) stream from its block files" in text
    assert "nvme:   36.84 GiB  (weights 35.86 GiB, frozen 1000.02 MiB)" in text
    qlora = ["--dry-run", "--model", "8B", "--offload", "auto", "--cpu-memory", "40GiB",
             "--batch-size", "1", "--quantize", "int4"] + out
    assert main(qlora + ["--gpu-memory", "8GiB"]) == 0  # 5.61 GiB of int4 base fits: kept there
    text = capsys.readouterr().out
    assert "chose 'all on the device'" in text and "(5.61 GiB in int4 blocks) stays on the device" in text
    assert main(qlora + ["--gpu-memory", "5GiB"]) == 0
    text = capsys.readouterr().out
    assert "chose '+ frozen base streamed from host RAM'" in text
    assert "in int4 blocks) stream from host RAM" in text


def test_streamed_base_trains_the_resident_runs_adapter(run, tmp_path):
    """--offload-params cpu|nvme streams the frozen base (built on meta, filled by the engine
    layer by layer): the same adapter as the resident run to the bit, stopped on one tier and
    resumed on the other (the fingerprint is the same whatever tier read the base), and the
    merged model read back from the checkpoint the same too."""
    part = str(tmp_path / "part")
    assert main(run["fast"] + ["--output", part, "--stop-after", "2", "--offload-params", "cpu"]) == 0
    assert main(run["fast"] + ["--output", part, "--resume", part, "--offload-params", "nvme",
                               "--merge"]) == 0
    assert _losses(part) == _losses(run["out"])
    for file in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        a, b = _tensors(os.path.join(run["out"], file)), _tensors(os.path.join(part, file))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    prints = []
    for d in (run["out"], part):
        with open(os.path.join(d, "checkpoint", "trainer_state.json")) as f:
            prints.append(json.load(f)["lora_base_fingerprint"])
    assert prints[0] == prints[1]


def _dequantized_base(base: str, cache: str, out) -> str:
    """The QLoRA run's base as the dense model it computes with: a checkpoint whose projections
    hold the int4 blocks' dequantized weights (what PEFT merges a QLoRA adapter into)."""
    from offload.models import CheckpointReader
    from offload.models.quantized import QuantSettings, quantize_checkpoint
    from offload.quant.format import dequantize

    with CheckpointReader(base) as reader:  # the run's conversion, found in the cache
        blocks = quantize_checkpoint(reader, QuantSettings("int4", 32), torch.float32, cache_root=cache)
        model = build_model(reader.config, "cpu", torch.float32, source=reader)
    for i, layer in enumerate(model.model.layers):
        with SafetensorsFile(os.path.join(blocks.path, f"block_{i:05d}.safetensors")) as f:
            for proj, spec in blocks.specs[i].items():
                lin = layer.get_submodule(proj)
                parts = {k: f.read(f"{proj}.{k}") for k in ("qweight", "scales", "mins")}
                with torch.no_grad():
                    lin.weight.copy_(dequantize(parts, spec, lin.in_features, torch.float32))
    save_pretrained(model, out)
    return str(out)


def test_qlora_adapter_generates_in_infer_and_merges_as_peft(run, tmp_path, capsys):
    """--quantize int4 --offload-params nvme: the base quantized once into --cache-dir and
    streamed from its block files; the adapter is a PEFT adapter of the dequantized base
    (runners.infer --adapter --quantize int4 reuses the same blocks and generates what
    transformers + peft generate over it), and --merge folds it into the dequantized base."""
    cache, out = str(tmp_path / "cache"), str(tmp_path / "q")
    assert main(_with(run["fast"], "--steps", "2") + QLORA + ["--cache-dir", cache, "--output", out,
                                                             "--merge"]) == 0
    assert len(os.listdir(os.path.join(cache, "quant"))) == 1
    assert "int4 blocks) stream from its block files" in capsys.readouterr().out
    # the same base kept on the device (loaded once from the same blocks): the same adapter
    resident = [a if a != "nvme" else "none" for a in QLORA]
    assert main(_with(run["fast"], "--steps", "2") + resident + ["--cache-dir", cache, "--output",
                                                                str(tmp_path / "qr")]) == 0
    assert "int4 blocks) stays on the device" in capsys.readouterr().out
    adapter = os.path.join("adapter", "adapter_model.safetensors")
    streamed, kept = load_file(os.path.join(out, adapter)), load_file(str(tmp_path / "qr" / adapter))
    assert streamed.keys() == kept.keys() and all(torch.equal(streamed[k], kept[k]) for k in kept)
    dense = _dequantized_base(run["base"], cache, tmp_path / "dense")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, os.path.join(out, "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"),
                                                               dtype=torch.float32)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        want, got = model(ids).logits, merged(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    want = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(IDS):].tolist()
    rc = run_main(infer_main, ["--model", run["base"], "--adapter", os.path.join(out, "adapter"),
                               "--quantize", "int4", "--group-size", "32", "--offload-dir", cache,
                               "--prompt-ids", ",".join(map(str, IDS)), "--max-new-tokens", str(NEW),
                               "--probe-seconds", "0.05", "--output-json", str(tmp_path / "g.json")])
    assert rc == 0, capsys.readouterr().err
    with open(tmp_path / "g.json") as f:
        assert json.load(f)["generated_ids"] == [want]
    assert len(os.listdir(os.path.join(cache, "quant"))) == 1  # inference reused the conversion


def test_qlora_resume_on_a_damaged_base_is_refused(run, tmp_path, capsys):
    """A QLoRA run stopped, a byte of its int4 base damaged in the cache, then resumed: the
    resume was accepted (the base's digest was read back from a file beside the blocks); now
    the first read of the damaged block stops the run in one line."""
    from nvme.format import read_header
    cache, out = str(tmp_path / "cache"), str(tmp_path / "q")
    argv = _with(run["fast"], "--steps", "3") + QLORA + ["--cache-dir", cache, "--output", out]
    assert main(argv + ["--stop-after", "1"]) == 0
    blocks = sorted(glob.glob(os.path.join(cache, "quant", "*", "block_00000.safetensors")))
    infos, _ = read_header(blocks[0])
    codes = max(infos.values(), key=lambda t: t.nbytes)
    with open(blocks[0], "r+b") as f:
        f.seek(codes.offset + codes.nbytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    capsys.readouterr()
    assert run_main(main, argv + ["--resume", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "block_00000.safetensors" in err[-1] and "fails its checksum" in err[-1], err
