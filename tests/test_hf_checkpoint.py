"""Hugging Face checkpoint directories: transformers writes, we read (and the reverse), block
reads touch only their bytes, bad checkpoints fail with one clear line."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from nvme.format import CHECKSUM_KEYS, WRITE_CHECKSUM, read_header, write_file
from offload.models import (CheckpointError, CheckpointReader, ModelConfig, build_model, load_model,
                            materialize_block, materialize_non_block, release_block, save_pretrained)

HF_CLASSES = {
    "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "MistralForCausalLM": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2)
# transformers mutates the rope dicts it is given (adds rope_theta): hand it copies.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def random_hf(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides) -> torch.nn.Module:
    """A transformers model whose every weight (norms and biases too) is random."""
    cfg_cls, model_cls = HF_CLASSES[arch]
    torch.manual_seed(seed)
    overrides = {k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()}
    hf = model_cls(cfg_cls(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return hf


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-tied-llama3-rope": ("LlamaForCausalLM", {"tie_word_embeddings": True, "rope_theta": 5e5,
                                                    "max_position_embeddings": 64, "rope_scaling": LLAMA3_ROPE}),
    "llama-bias-linear-rope": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True,
                                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-mha-yarn": ("LlamaForCausalLM", {"num_key_value_heads": 4, "max_position_embeddings": 64,
                                            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16}}),
    "qwen2-bias-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None, "head_dim": 32}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 5}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case: str, tmp_path) -> None:
    arch, overrides = CASES[case]
    hf = random_hf(arch, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) <= 1e-5
    assert ours.config.architecture == arch


def test_the_comparison_sees_rope_scaling(tmp_path) -> None:
    """Guard against a vacuous test: dropping the llama3 scaling must change the logits."""
    hf = random_hf(**CASES["llama-tied-llama3-rope"][1])
    hf.save_pretrained(tmp_path)
    with CheckpointReader(tmp_path) as reader:
        unscaled = build_model(reader.config.replace(rope_scaling=None), "cpu", source=reader)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 24))
    with torch.no_grad():
        assert max_diff(unscaled(ids), hf(ids).logits) > 1e-3


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_our_writer_loads_in_transformers(max_shard_bytes: int | None, tmp_path) -> None:
    hf = random_hf("Qwen2ForCausalLM", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "src")
    ours = load_model(tmp_path / "src")
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_pretrained(ours, tmp_path / "out", **kwargs)
    files = sorted(os.listdir(tmp_path / "out"))
    if max_shard_bytes is None:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert "lm_head.weight" not in index["weight_map"]  # tied: transformers re-ties it
    for f in files:
        if f.endswith(".safetensors"):
            infos, meta = read_header(tmp_path / "out" / f)
            # transformers' "format", and each tensor's CRC-32C (checked when we read it back)
            key = CHECKSUM_KEYS[WRITE_CHECKSUM]
            assert meta["format"] == "pt" and set(meta) == {"format", key}
            assert set(json.loads(meta[key])) == set(infos)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Qwen2ForCausalLM
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    with torch.no_grad():
        assert max_diff(back(ids).logits, ours(ids)) <= 1e-5
        assert max_diff(back(ids).logits, hf(ids).logits) <= 1e-5


def test_bf16_dtype_preserved_and_converted(tmp_path) -> None:
    hf = random_hf("LlamaForCausalLM", rope_scaling=LLAMA3_ROPE, max_position_embeddings=64).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "src", max_shard_size="60KB")  # sharded bf16
    as_fp32 = load_model(tmp_path / "src", dtype=torch.float32)  # converted while reading
    for name, p in hf.named_parameters():
        assert torch.equal(as_fp32.get_parameter(name), p.float())
    as_bf16 = load_model(tmp_path / "src", dtype=torch.bfloat16)
    save_pretrained(as_bf16, tmp_path / "out", max_shard_bytes=50_000)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["rope_parameters"]["rope_type"] == "llama3"
    infos, _ = read_header(next(p for p in (tmp_path / "out").iterdir() if p.name.startswith("model-0")))
    assert {i.dtype for i in infos.values()} == {torch.bfloat16}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, p in hf.named_parameters():
        assert torch.equal(back.get_parameter(name), p)
    # requested dtype on write
    save_pretrained(as_bf16, tmp_path / "fp32", dtype=torch.float32)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"


def test_transformers_sharded_checkpoint_read_by_block(tmp_path) -> None:
    hf = random_hf("LlamaForCausalLM")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    reader = CheckpointReader(tmp_path)
    assert len(reader.files) > 2
    # Materialise block by block from the shards and compare to the whole-model reference.
    model = build_model(reader.config)
    materialize_non_block(model, "cpu", torch.float32, reader)
    for i in range(reader.config.num_hidden_layers):
        materialize_block(model, i, "cpu", torch.float32, reader)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) <= 1e-5
    reader.close()


def _rchar() -> int | None:
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    except (OSError, StopIteration):
        return None


def test_reading_one_block_reads_only_its_bytes(tmp_path, monkeypatch) -> None:
    hf = random_hf("LlamaForCausalLM", num_hidden_layers=4)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    reader = CheckpointReader(tmp_path)
    locations = reader.block_locations(2)
    assert len({loc.path for loc in locations}) >= 1
    block_bytes = sum(loc.nbytes for loc in locations)
    for loc in locations:  # offsets are real: the bytes there are the tensor
        with open(loc.path, "rb") as f:
            f.seek(loc.offset)
            raw = torch.frombuffer(bytearray(f.read(loc.nbytes)), dtype=loc.dtype).view(loc.shape)
        assert torch.equal(raw, hf.get_parameter(loc.name))
    # Count what the OS is asked for, independently of the reader's own counter.
    asked = []
    for fn_name in ("pread", "preadv", "read", "readv"):
        real = getattr(os, fn_name)

        def counting(*args, _real=real, **kwargs):
            result = _real(*args, **kwargs)
            asked.append(result if isinstance(result, int) else len(result))
            return result
        monkeypatch.setattr(os, fn_name, counting)
    before_counter, before_rchar = reader.bytes_read, _rchar()
    out = {loc.name: torch.empty(loc.shape, dtype=loc.dtype) for loc in locations}
    reader.read_block_into(2, out)
    after_rchar = _rchar()
    monkeypatch.undo()
    assert sum(asked) == block_bytes
    assert reader.bytes_read - before_counter == block_bytes
    if before_rchar is not None:
        assert after_rchar - before_rchar <= block_bytes + 4096
    for name, t in out.items():
        assert torch.equal(t, hf.get_parameter(name))
    assert block_bytes < sum(os.path.getsize(loc.path) for loc in locations) / 2 or len(locations) > 1
    reader.close()


def test_streaming_blocks_through_hooks(tmp_path) -> None:
    """What the block streamer will do: blocks stay on meta and are fetched in a forward
    pre-hook and released after; the output is the fully loaded model's."""
    hf = random_hf("MistralForCausalLM", sliding_window=4)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    with CheckpointReader(tmp_path) as reader:
        model = build_model(reader.config)
        materialize_non_block(model, "cpu", torch.float32, reader)
        for i, block in enumerate(model.model.layers):
            block.register_forward_pre_hook(
                lambda m, args, i=i: materialize_block(model, i, "cpu", torch.float32, reader))
            block.register_forward_hook(lambda m, args, out, i=i: release_block(model, i))
        ids = torch.randint(0, SMALL["vocab_size"], (1, 10))
        with torch.no_grad():
            got = model(ids)
        assert all(p.is_meta for p in model.model.layers.parameters())
        assert max_diff(got, hf(ids).logits) <= 1e-5


# ---- errors ---------------------------------------------------------------------------------
def _write_state(tmp_path, state: dict, config: dict) -> None:
    write_file(tmp_path / "model.safetensors", state, {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))


def test_missing_and_misshaped_tensors_name_file_and_tensor(tmp_path) -> None:
    hf = random_hf("LlamaForCausalLM")
    config = json.loads(hf.config.to_json_string()) | {"architectures": ["LlamaForCausalLM"]}
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    _write_state(tmp_path, missing, config)
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(tmp_path)
    assert "model.safetensors" in str(err.value) and "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "missing" in str(err.value)
    wrong = dict(state)
    wrong["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    _write_state(tmp_path, wrong, config)
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(tmp_path)
    message = str(err.value)
    assert "model.safetensors" in message and "model.layers.2.self_attn.k_proj.weight" in message
    assert "[64, 64]" in message and "[32, 64]" in message


def test_unsupported_and_incomplete_directories(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], **SMALL}))
    with pytest.raises(CheckpointError, match=r"config.json: architecture GPT2LMHeadModel is not supported "
                                                  r"\(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                                  r"Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, "
                                                  r"Qwen3MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM, "
                                                  r"DeepseekV3ForCausalLM\)"):
        CheckpointReader(tmp_path)
    hf = random_hf("LlamaForCausalLM")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shard = sorted(p for p in (tmp_path / "sharded").iterdir() if p.name.startswith("model-"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: lists '{shard.name}', which does not exist"):
        CheckpointReader(tmp_path / "sharded")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(hf.config.to_json_string())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin: convert to safetensors"):
        CheckpointReader(tmp_path / "bin")
    truncated = tmp_path / "trunc"
    hf.save_pretrained(truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*(truncated|end of the file)"):
        CheckpointReader(truncated)


def test_config_json_written_loads_in_transformers_with_both_rope_forms(tmp_path) -> None:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **SMALL, "rope_theta": 5e5,
                               "max_position_embeddings": 64, "rope_scaling": LLAMA3_ROPE})
    model = build_model(cfg, "cpu", source=3)
    save_pretrained(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 5e5}
    assert written["rope_scaling"] == LLAMA3_ROPE and written["rope_theta"] == 5e5
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 5e5}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 20))
    with torch.no_grad():
        assert max_diff(back(ids).logits, model(ids)) <= 1e-5


def test_save_from_block_stream_and_refusals(tmp_path) -> None:
    """A streamer hands (name, tensor) pairs one at a time; a bad stream leaves no files."""
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **SMALL})
    model = build_model(cfg, "cpu", source=5)
    pairs = list(model.named_parameters())
    save_pretrained(iter(pairs), tmp_path / "ok", config=cfg, dtype=torch.float16, max_shard_bytes=30_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ok", dtype="auto")
    assert back.lm_head.weight.dtype == torch.float16
    assert torch.equal(back.lm_head.weight, model.lm_head.weight.half())
    with pytest.raises(CheckpointError, match="lacks 1 tensors, first 'model.norm.weight'"):
        save_pretrained(iter([p for p in pairs if p[0] != "model.norm.weight"]), tmp_path / "bad",
                        config=cfg, max_shard_bytes=30_000)
    assert os.listdir(tmp_path / "bad") == []
    with pytest.raises(CheckpointError, match="'model.norm.weight' has shape \\[3\\]"):
        save_pretrained({**dict(pairs), "model.norm.weight": torch.ones(3)}, tmp_path / "bad", config=cfg)
