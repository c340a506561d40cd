"""Quantized blocks (offload/models/quantized.py): converted once into the cache, streamed as
byte blocks through every tier with the same results as resident, equal to a plain model whose
projection weights are the dequantized codes; GGUF tensors taken as they are; the runner."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from nvme.format import SafetensorsFile, read_header
from offload.infer.generate import generate
from offload.models import (CheckpointReader, build_model, load_model, preset, projection_names,
                            save_pretrained)
from offload.models.quantized import (PER_CHANNEL, QuantLinear, QuantSettings, block_file, cache_key,
                                      checkpoint_source, convert_blocks, load_quantized_streamed,
                                      projection_specs, quantized_block_bytes, source_identity)
from offload.quant.format import QuantSpec, dequantize

CFG = preset("tiny")


def _infer(argv, capsys) -> tuple[int, str]:
    """python -m runners.infer in this process (no interpreter start): (exit code, stderr)."""
    from runners.common import run_main
    from runners.infer import main
    rc = run_main(main, [str(a) for a in argv])
    return rc, capsys.readouterr().err
TIERS = {"device": ["device"] * 4, "cpu": ["cpu"] * 4, "nvme": ["nvme"] * 4,
         "mixed": ["device", "nvme", "cpu", "nvme"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(build_model(CFG, "cpu", torch.float32, source=5), path)
    return str(path)


def _convert(ckpt: str, qdir: str, mode: str, group: int = 0, dtype: torch.dtype = torch.float32,
             cfg=CFG):
    """The blocks of checkpoint `ckpt` (config `cfg`) quantized into `qdir`, their norms in `dtype`."""
    settings = QuantSettings(mode, group)
    with CheckpointReader(ckpt) as reader:
        files = sorted({loc.path for loc in reader.locations.values()})
        key = cache_key(source_identity(files, cfg), settings, dtype)
        specs = projection_specs(cfg, settings)
        return convert_blocks(qdir, key, cfg, specs, dtype, checkpoint_source(reader, dtype))


def _dense_reference(ckpt: str, blocks) -> torch.nn.Module:
    """A plain model whose projection weights are the dequantized codes read back from the
    block files: what a quantized forward must compute."""
    model = load_model(ckpt)
    for i, layer in enumerate(model.model.layers):
        with SafetensorsFile(block_file(blocks.path, i)) as f:
            for proj in projection_names(CFG):
                spec = blocks.specs[i][proj]
                lin = layer.get_submodule(proj)
                names = ["qweight", "scales"] + (["mins"] if spec.bits == 4 else [])
                parts = {n: f.read(f"{proj}.{n}") for n in names}
                with torch.no_grad():
                    lin.weight.copy_(dequantize(parts, spec, lin.in_features, torch.float32))
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_blocks_stream_through_every_tier_like_resident(ckpt, tmp_path, mode):
    """Byte blocks through device / host (zero-copy and slot) / NVMe tiers with a delay in every
    fetch: bit-identical logits to the all-resident quantized model, and equal (to float
    tolerance) to a plain model whose weights are the dequantized codes; greedy tokens equal."""
    blocks = _convert(ckpt, str(tmp_path / "q"), mode)
    ids = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = _dense_reference(ckpt, blocks)
    with torch.inference_mode():
        want = ref(ids)
    results = {}
    with CheckpointReader(ckpt) as reader:
        for tiers, zero_copy in [("device", None), ("cpu", True), ("cpu", False), ("nvme", None),
                                 ("mixed", False)]:
            model, streamer = load_quantized_streamed(reader, blocks, TIERS[tiers], device="cpu",
                                                      dtype=torch.float32, zero_copy_host=zero_copy,
                                                      fetch_delay_s=0.005)
            try:
                assert all(isinstance(m, QuantLinear) for layer in model.model.layers
                           for m in (layer.get_submodule(p) for p in projection_names(CFG)))
                with torch.inference_mode():
                    outs = [model(ids) for _ in range(2)]  # the second pass reuses prefetched slots
                    toks = generate(model, [[3, 4, 5]], max_new_tokens=6, streamer=streamer).tokens
                results[(tiers, zero_copy)] = (outs, toks)
                if tiers == "nvme":  # the quantized bytes are what crosses the link
                    moved = streamer.stats.moved_bytes["disk"]
                    assert moved % blocks.block_bytes[0] == 0 and moved >= 2 * sum(blocks.block_bytes)
            finally:
                streamer.close()
    base_outs, base_toks = results[("device", None)]
    for key, (outs, toks) in results.items():
        for out in outs:
            assert torch.equal(out, base_outs[0]), key
        assert toks == base_toks, key
    torch.testing.assert_close(base_outs[0], want, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        assert generate(ref, [[3, 4, 5]], max_new_tokens=6).tokens == base_toks


def test_block_bytes_planned_equal_the_files(ckpt, tmp_path):
    for mode, group in [("int8", PER_CHANNEL), ("int8", 0), ("int4", 64), ("int4", 32)]:
        blocks = _convert(ckpt, str(tmp_path / f"{mode}{group}"), mode, group)
        specs = projection_specs(CFG, QuantSettings(mode, group))
        assert blocks.block_bytes == [quantized_block_bytes(CFG, s, torch.float32) for s in specs]
        dense = sum(p.numel() for p in build_model(CFG, "meta").model.layers[0].parameters()) * 4
        # int8: ~1/4 of fp32, int4: ~1/8 (plus scales, norms and padding on this tiny model)
        assert blocks.block_bytes[0] < dense * (0.3 if mode == "int8" else 0.2)
        for i in range(CFG.num_hidden_layers):  # every tensor starts on its element size
            infos, meta = read_header(block_file(blocks.path, i))
            assert meta["key"] == blocks.key
            for t in infos.values():
                assert (t.offset - min(x.offset for x in infos.values())) % t.dtype.itemsize == 0


def test_conversion_is_reused_keyed_and_resumed(ckpt, tmp_path):
    qdir = str(tmp_path / "q")
    first = _convert(ckpt, qdir, "int4")
    mtimes = [os.stat(block_file(qdir, i)).st_mtime_ns for i in range(CFG.num_hidden_layers)]
    again = _convert(ckpt, qdir, "int4")  # finished: nothing rewritten
    assert again.key == first.key
    assert mtimes == [os.stat(block_file(qdir, i)).st_mtime_ns for i in range(CFG.num_hidden_layers)]
    # a conversion killed half way: the manifest and block 2 missing -> only block 2 is written
    os.remove(os.path.join(qdir, "manifest.json"))
    os.remove(block_file(qdir, 2))
    _convert(ckpt, qdir, "int4")
    now = [os.stat(block_file(qdir, i)).st_mtime_ns for i in range(CFG.num_hidden_layers)]
    assert [a == b for a, b in zip(mtimes, now)] == [True, True, False, True]
    # other settings: another key (the runner puts it in another directory); a stale file with
    # another key in the same directory is rewritten, never reused
    other = _convert(ckpt, qdir, "int4", 32)
    assert other.key != first.key and other.specs[0]["mlp.up_proj"].group_size == 32
    assert json.load(open(os.path.join(qdir, "manifest.json")))["key"] == other.key


def test_infer_runner_quantized_nvme_and_dry_run(tmp_path, capsys):
    """The runner end to end on the tiny preset: int4 blocks streamed from NVMe, the report's
    bytes per token are the quantized blocks; the plan counts quantized bytes; same tokens as
    all-resident int4."""
    def run(*extra):
        out = tmp_path / f"out{len(extra)}.json"
        rc, err = _infer(["--model", "tiny", "--offload-dir", tmp_path, "--quantize", "int4",
                          "--max-new-tokens", "5", "--ignore-eos", "--probe-seconds", "0",
                          "--output-json", out, *extra], capsys)
        assert rc == 0, err
        return json.load(open(out)), err

    dry, err = run("--dry-run")
    assert "int4" in err
    streamed, err = run("--weights", "nvme")
    resident, _ = run("--weights", "device")
    assert streamed["generated_ids"] == resident["generated_ids"]
    assert "blocks to int4" in err  # converted once ...
    assert "blocks to int4" not in run("--weights", "cpu")[1]  # ... and reused
    q = dry["plan"]["block_bytes"][0]
    assert streamed["plan"]["block_bytes"][0] == q
    steps = streamed["metrics"]["decode_steps"]
    # every step reads every block at its quantized size (the cyclic prefetch shifts a block or
    # two across the prefill/decode boundary)
    moved = streamed["metrics"]["bytes_per_token"]["nvme"] * steps
    assert abs(moved - q * CFG.num_hidden_layers * steps) <= 2 * q


def test_runner_refuses_group_size_without_quantize(tmp_path, capsys):
    rc, err = _infer(["--group-size", "64", "--dry-run"], capsys)
    assert rc != 0 and "--group-size" in err and "Traceback" not in err
    rc, err = _infer(["--quantize", "int4", "--group-size", "7", "--dry-run"], capsys)
    assert rc != 0 and err.strip().splitlines()[-1].startswith("error: --quantize int4 --group-size 7")
    assert len(err.strip().splitlines()) == 1


def test_int8_defaults_to_groups_of_32_and_channel_means_one_scale_per_row(tmp_path, capsys):
    """int8's default is llama.cpp's Q8_0 grouping (the faithful one: docs/benchmarks/int8.md);
    --group-size channel asks for per-row scales, which int4 cannot take."""
    assert QuantSettings("int8").spec() == QuantSpec(8, 32)
    assert QuantSettings("int8", PER_CHANNEL).spec() == QuantSpec(8, 0)
    assert QuantSettings("int4").spec() == QuantSpec(4, 64)
    rc, err = _infer(["--quantize", "int4", "--group-size", "channel", "--dry-run"], capsys)
    assert rc != 0 and "for int8" in err and "Traceback" not in err
    rc, err = _infer(["--quantize", "int8", "--group-size", "row", "--dry-run"], capsys)
    assert rc != 0 and "or channel" in err and "Traceback" not in err
    rc, err = _infer(["--model", "tiny", "--quantize", "int8", "--group-size", "channel", "--dry-run",
                      "--offload-dir", tmp_path], capsys)
    assert rc == 0, err


def test_70b_int4_plan_for_a_gpu(tmp_path, capsys):
    """--dry-run plans for a GPU this machine lacks (its size from --gpu-memory): 70B in int4
    is resident on an 80 GB GPU (in bf16 it is not); on 24 GB beside 64 GB of RAM the blocks
    that do not fit the GPU are in RAM, none on NVMe."""
    def plan(*extra):
        out = tmp_path / "plan.json"
        rc, err = _infer(["--model", "70B", "--gpu", "0", "--dry-run", "--offload-dir", tmp_path,
                          "--output-json", out, *extra], capsys)
        assert rc == 0, err
        return json.load(open(out))["plan"], err

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the runner measures it instead of planning for one")
    p, err = plan("--quantize", "int4", "--gpu-memory", "80GiB")
    assert set(p["residency"]) == {"device"} and "planned for a GPU that is not here" in err
    assert sum(p["block_bytes"]) < 40e9  # ~0.56 bytes a parameter
    p16, _ = plan("--gpu-memory", "80GiB", "--cpu-memory", "64GiB")
    assert "nvme" in p16["residency"] or "cpu" in p16["residency"]
    p, _ = plan("--quantize", "int4", "--gpu-memory", "24GiB", "--cpu-memory", "64GiB")
    assert "cpu" in p["residency"] and "nvme" not in p["residency"]
    rc, err = _infer(["--model", "70B", "--gpu", "0", "--dry-run"], capsys)
    assert rc != 0 and "--gpu-memory" in err and "Traceback" not in err


def test_real_model_quality_and_gguf_tensors_taken_as_they_are(smollm2_gguf, smollm2_hf, tmp_path):
    """SmolLM2-135M-Instruct on real text (Python's reference manual, shipped with CPython),
    teacher-forced: int8 within 1% of the reference's perplexity; int4 at group 32 and the GGUF
    Q4_1 tensors taken as they are within 10% (the file is itself Q4_1 at group 32, which both
    keep exactly); int4 at group 64 regroups 4-bit values and is only bounded loosely (the
    numbers: docs/BENCHMARKS.md, scripts/eval_quant.py). The taken tensors dequantize to exactly
    the values the fp32 conversion holds."""
    from conftest import load_script
    from offload.data.tokenizer import load_tokenizer
    ev = load_script("eval_quant")
    rows = ev.token_rows(load_tokenizer(smollm2_hf), ev.real_text("pydoc"), 2, 128)
    got = {r["label"]: r for r in ev.evaluate(smollm2_hf, smollm2_gguf, rows, str(tmp_path))}
    for label, r in got.items():
        print(f"{label}: perplexity {r['ppl']:.3f} ({r['ratio']:.4f}x), top-1 {100 * r['top1']:.1f}%")
    for int8 in ("int8 per channel", "int8 g32"):
        assert got[int8]["ratio"] < 1.01 and got[int8]["top1"] > 0.9
    assert got["int4 g32"]["ratio"] < 1.10
    assert abs(got["int4 (GGUF as is)"]["ratio"] - 1) < 1e-3 and got["int4 (GGUF as is)"]["top1"] > 0.99
    assert got["int4 g64"]["ratio"] < 1.6
    ref = got["reference (fp32)"]["block_bytes"]
    assert got["int4 (GGUF as is)"]["block_bytes"] < 0.2 * ref and got["int8 g32"]["block_bytes"] < 0.3 * ref
    # the GGUF conversion's directory holds the taken blocks: bit-exact against the fp32 values
    root = tmp_path / "quant"
    qdirs = [d for d in os.listdir(root) if os.path.isfile(root / d / "manifest.json")]
    assert len(qdirs) == 5  # int8 per channel and g32, int4 g64, int4 g32, int4 from the GGUF
    with CheckpointReader(smollm2_hf) as reader:
        for d in qdirs:
            m = json.load(open(root / d / "manifest.json"))
            if m["specs"][0]["mlp.up_proj"] != [4, 32]:
                continue
            with SafetensorsFile(block_file(str(root / d), 0)) as f:
                for proj in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
                    parts = {n: f.read(f"{proj}.{n}") for n in ("qweight", "scales", "mins")}
                    want = reader.read(f"model.layers.0.{proj}.weight", torch.float32)
                    deq = dequantize(parts, QuantSpec(4, 32), want.shape[1], torch.float32)
                    assert torch.equal(deq, want), (d, proj)


def test_a_damaged_or_stale_quantized_cache_is_never_computed_with(ckpt, tmp_path, capsys):
    """3000 bytes overwritten in a cached int8 block: every tier refuses it in one line at its
    first read (it gave different tokens and exit 0); the cache key is the source's content, so
    another checkpoint at the same path with the same size and mtime converts anew."""
    argv = ["--model", "tiny", "--offload-dir", tmp_path, "--quantize", "int8", "--max-new-tokens",
            "3", "--ignore-eos", "--probe-seconds", "0"]
    rc, err = _infer([*argv, "--weights", "nvme"], capsys)
    assert rc == 0, err
    blocks = [p for p in glob.glob(str(tmp_path / "**" / "block_00001.safetensors"), recursive=True)]
    assert len(blocks) == 1
    infos, _ = read_header(blocks[0])
    start = max(infos.values(), key=lambda t: t.nbytes).offset  # inside the largest codes
    with open(blocks[0], "r+b") as f:
        f.seek(start + 100)
        f.write(os.urandom(3000))
    for weights in ("nvme", "cpu", "device"):
        rc, err = _infer([*argv, "--weights", weights], capsys)
        line = err.strip().splitlines()[-1]
        assert rc == 2 and "block_00001.safetensors" in line and "fails its checksum" in line, err
    # the source replaced by other weights of the same size and modification time
    own = str(tmp_path / "src")  # a copy: the module's checkpoint stays as it is
    shutil.copytree(ckpt, own)
    qdir = str(tmp_path / "q")
    first = _convert(own, qdir, "int8")
    src = os.path.join(own, "model.safetensors")
    st = os.stat(src)
    with CheckpointReader(own) as r:  # another model: every value scaled, written the same way
        scaled = [(n, r.read(n) * 1.5) for n in r.locations]
    save_pretrained(scaled, own, config=CFG)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(src).st_size == st.st_size
    assert _convert(own, qdir, "int8").key != first.key


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_head_equals_its_dequantized_codes(tmp_path, tied):
    """--quantize-head int8 (runners.infer's default with --quantize): the head becomes int8
    codes in groups of 32 made at load; the logits equal a plain model whose head is those codes
    dequantized (its blocks the dequantized blocks too), the embedding stays dense (a tied
    table too), and the plan's non-block bytes count the codes."""
    from offload.models.quantized import HEAD_SPEC, head_bytes
    from offload.quant.format import packed_bytes

    cfg = CFG.replace(tie_word_embeddings=tied)
    path = tmp_path / "ckpt"
    save_pretrained(build_model(cfg, "cpu", torch.float32, source=7), path)
    blocks = _convert(str(path), str(tmp_path / "q"), "int8", cfg=cfg)
    with CheckpointReader(str(path)) as reader:
        model, streamer = load_quantized_streamed(reader, blocks, ["device"] * 4, device="cpu",
                                                  dtype=torch.float32, head=HEAD_SPEC)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    try:
        head = model.lm_head
        assert isinstance(head, QuantLinear) and head.spec == HEAD_SPEC
        ref = _dense_reference(str(path), blocks)
        torch.testing.assert_close(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
        with torch.no_grad():
            ref.lm_head.weight = torch.nn.Parameter(dequantize(
                {n: getattr(head, n) for n in head.part_names}, HEAD_SPEC, cfg.hidden_size,
                torch.float32))
            assert (ref.lm_head.weight - load_model(str(path)).lm_head.weight).abs().max() > 0
        with torch.inference_mode():
            torch.testing.assert_close(model(ids), ref(ids), rtol=1e-5, atol=1e-5)
    finally:
        streamer.close()
    codes = packed_bytes(cfg.vocab_size, cfg.hidden_size, HEAD_SPEC)
    dense = cfg.vocab_size * cfg.hidden_size * 4
    assert head_bytes(cfg, HEAD_SPEC, torch.float32) == codes - (0 if tied else dense)
    assert head_bytes(cfg, None, torch.float32) == 0


def test_real_model_with_the_int8_head(smollm2_gguf, smollm2_hf, tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct from its Q4_1 GGUF (blocks taken as they are), teacher-forced on
    real text: the int8 head runners.infer loads with --quantize against the same model with
    its dense fp32 head (the tied embedding), the reference -- perplexity within 0.5%, the same
    argmax at 98% of positions or more. The file stores that table as Q8_0, which int8 groups
    of 32 are: quantized again from its fp32 values, it comes back exactly. Batch-1 greedy
    decoding through the C loop's one-row paths (int4 blocks, int8 head) gives the tokens of
    the chunked kernel (dequantize, then torch's product) on the same weights."""
    import math

    from conftest import load_script
    from offload.data.tokenizer import load_tokenizer
    from offload.models.quantized import HEAD_SPEC, quantize_head
    ev = load_script("eval_quant")
    rows = ev.token_rows(load_tokenizer(smollm2_hf), ev.real_text("pydoc"), 2, 128)
    model, streamer, reader, _ = ev.quantized_model(smollm2_hf, smollm2_gguf, "int4", 32, str(tmp_path))
    try:
        nll_dense, count, dense = ev.teacher_forced(model, rows)
        quantize_head(model, HEAD_SPEC, torch.float32)
        head = model.lm_head
        assert isinstance(head, QuantLinear)
        values = dequantize({n: getattr(head, n) for n in head.part_names}, HEAD_SPEC,
                            head.in_features, torch.float32)
        assert torch.equal(values, model.model.embed_tokens.weight)  # the file's Q8_0, exactly
        nll_q, _, quant = ev.teacher_forced(model, rows)
        from offload.quant.matmul import kernels_run
        tokens, ran = {}, {}
        for kernel in ("c", "chunked"):
            monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", kernel)
            before = kernels_run().get(kernel, 0)
            tokens[kernel] = generate(model, ev.GREEDY_PROMPTS[:1], max_new_tokens=24).tokens
            ran[kernel] = kernels_run().get(kernel, 0) - before
        assert tokens["c"] == tokens["chunked"] and min(ran.values()) > 0, ran
    finally:
        streamer.close()
        reader.close()
    ratio = math.exp((nll_q - nll_dense) / count)
    agree = (dense == quant).float().mean().item()
    print(f"int8 head: perplexity x{ratio:.5f}, top-1 agreement {100 * agree:.2f}%")
    assert abs(ratio - 1) < 5e-3 and agree >= 0.98
