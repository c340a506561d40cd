"""GGUF checkpoints in: the real SmolLM2-135M-Instruct Q4_1 file against `transformers`' own GGUF
loading (logits, token ids, chat template, special tokens), small synthetic files in every
supported tensor type against the `gguf` package's reference dequantization, and bad files."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import stderr_until  # noqa: E402
from offload.models import build_model  # noqa: E402
from offload.models.gguf import GGUFError, GGUFReader, gguf_checkpoint_dir  # noqa: E402
from offload.data.tokenizer import Tokenizer  # noqa: E402


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loading parses the file with the gguf package three times (tokenizer,
    config, weights: 5-9 s each here) and rebuilds gguf's tensor-name map for every module it
    maps (397 times, 11 s): 31 of this fixture's 38 s. Both are pure functions of their
    arguments, so for the fixture's loads they are memoised (the package's own reader and map,
    called once each); what transformers loads is unchanged."""
    import functools

    import gguf
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' model and tokenizer, loaded from the GGUF by transformers itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok


def varied_lines(n: int = 300) -> list[str]:
    rng = random.Random(0)
    pieces = ["def f(x):\n\treturn x ** 2  # square", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
              "Ünïcödé façade naïve café", "日本語のテキストと中文文本", "emoji 🙂🚀👩‍💻 and ✓ marks",
              "    indented   with   runs    of spaces", "tabs\tand\ttabs\n\nand blank lines\n",
              "numbers 1234567890 3.14159 -42 1e-9", "<|im_start|>user\nHi there<|im_end|>\n",
              "<|im_start|>assistant\nSure!<|im_end|>", "URL https://example.com/a?b=c&d=e#f",
              "ALL CAPS and MiXeD CaSe", "quotes 'single' \"double\" `back`", "Ελληνικά και Русский",
              "    ", "\n", "a", "<|endoftext|>", "it's we're they'll I'd", "x" * 50]
    lines = list(pieces)
    while len(lines) < n:
        k = rng.randint(1, 4)
        lines.append(rng.choice([" ", "", "\n", "  "]).join(rng.choice(pieces) for _ in range(k)))
    return lines


def test_real_model_logits_match_transformers_gguf_loading(smollm2_gguf, reference):
    ref_model, ref_tok = reference
    with GGUFReader(smollm2_gguf) as reader:
        assert reader.config.num_hidden_layers == 30 and reader.config.tie_word_embeddings
        assert reader.unexpected == []
        model = build_model(reader.config, "cpu", torch.float32, source=reader)
    for text in ("The capital of France is", "def fibonacci(n):", "<|im_start|>user\nHi<|im_end|>\n"):
        ids = torch.tensor([ref_tok(text)["input_ids"]])
        with torch.no_grad():
            ours, theirs = model(ids), ref_model(ids).logits
        assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


def test_tokenizer_ids_template_and_special_tokens_match(smollm2_gguf, reference):
    _, ref_tok = reference
    with GGUFReader(smollm2_gguf) as reader:
        files = reader.tokenizer_files()
    tok = Tokenizer(files["tokenizer.json"], files["tokenizer_config.json"], files["generation_config.json"])
    lines = varied_lines()
    assert len(lines) >= 300
    for line in lines:
        ids = tok.encode(line)
        assert ids == ref_tok(line)["input_ids"], line
        assert tok.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids, skip_special_tokens=False)
    assert tok.chat_template == ref_tok.chat_template
    assert (tok.bos_token, tok.eos_token) == (ref_tok.bos_token, ref_tok.eos_token)
    assert files["tokenizer_config.json"]["pad_token"] == ref_tok.pad_token
    assert tok.eos_id == 2 and tok.stop_ids() == [2]
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3? 🙂"}]
    for gen in (True, False):
        assert tok.render_chat(conv, gen) == ref_tok.apply_chat_template(conv, tokenize=False,
                                                                        add_generation_prompt=gen)


def test_converted_directory_loads_in_transformers(smollm2_gguf, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ref_model, ref_tok = reference
    # converted once into the cache (gguf_checkpoint_dir -> convert_gguf), then reused below
    out = gguf_checkpoint_dir(smollm2_gguf, torch.float32, cache_dir=str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == ref_tok(text)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, rtol=0, atol=1e-5)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == \
        ref_tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    # the cache converted once: a second call reuses the directory
    stamp = os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns
    assert gguf_checkpoint_dir(smollm2_gguf, torch.float32, cache_dir=str(tmp_path / "cache")) == out
    assert os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns == stamp


# ---- synthetic files ------------------------------------------------------------------------------
HIDDEN, FFN, HEADS, KV, LAYERS, VOCAB = 64, 128, 4, 2, 2, 96


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """gguf names -> fp32 arrays in GGUF (llama.cpp) row order, our shapes."""
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS
    out = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)),
           "output_norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
           "output.weight": rng.standard_normal((VOCAB, HIDDEN))}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out.update({p + "attn_q.weight": rng.standard_normal((HIDDEN, HIDDEN)),
                    p + "attn_k.weight": rng.standard_normal((KV * hd, HIDDEN)),
                    p + "attn_v.weight": rng.standard_normal((KV * hd, HIDDEN)),
                    p + "attn_output.weight": rng.standard_normal((HIDDEN, HIDDEN)),
                    p + "attn_norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
                    p + "ffn_norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
                    p + "ffn_gate.weight": rng.standard_normal((FFN, HIDDEN)),
                    p + "ffn_up.weight": rng.standard_normal((FFN, HIDDEN)),
                    p + "ffn_down.weight": rng.standard_normal((HIDDEN, FFN))})
    return {k: (0.05 * v).astype(np.float32) for k, v in out.items()}


def write_gguf(path, qtype: str, layers: int = LAYERS, tensors: dict | None = None,
               tokenizer: bool = False) -> dict[str, np.ndarray]:
    """A tiny llama GGUF whose matrices are stored as `qtype` (with `tokenizer`, a byte-level BPE
    vocabulary of single characters, so it converts and runs); returns the values a correct
    reader must produce (the gguf package's own dequantization of what was stored)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if tokenizer:
        from tokenizers import pre_tokenizers
        w.add_tokenizer_model("gpt2")
        w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet())[:VOCAB])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    expected = {}
    kind = gguf.GGMLQuantizationType[qtype]
    for name, arr in (tensors or _tensors()).items():
        if arr.ndim == 1 or qtype == "F32":
            data, k = arr, gguf.GGMLQuantizationType.F32
        elif qtype == "F16":
            data, k = arr.astype(np.float16), gguf.GGMLQuantizationType.F16
        else:
            data, k = gguf.quants.quantize(arr, kind), kind
        w.add_tensor(name, data, raw_dtype=k)
        expected[name] = np.asarray(gguf.quants.dequantize(data, k), dtype=np.float32).reshape(arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _hf_order(w: np.ndarray, heads: int) -> np.ndarray:
    """The Hugging Face row order of a q/k weight stored in llama.cpp's interleaved order."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_every_supported_type_reads_as_the_reference_dequantizes(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_gguf(path, qtype)
    with GGUFReader(str(path)) as reader:
        assert not reader.config.tie_word_embeddings and reader.config.num_hidden_layers == LAYERS
        got = reader.read_array("model.layers.1.mlp.down_proj.weight")
        np.testing.assert_array_equal(got, expected["blk.1.ffn_down.weight"])
        q = reader.read_array("model.layers.0.self_attn.q_proj.weight")
        np.testing.assert_array_equal(q, _hf_order(expected["blk.0.attn_q.weight"], HEADS))
        k = reader.read_array("model.layers.0.self_attn.k_proj.weight")
        np.testing.assert_array_equal(k, _hf_order(expected["blk.0.attn_k.weight"], KV))
        model = build_model(reader.config, "cpu", torch.float32, source=reader)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


def test_synthetic_model_matches_transformers_gguf_loading(tmp_path):
    from transformers import AutoModelForCausalLM
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "Q8_0")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    with GGUFReader(str(path)) as reader:
        model = build_model(reader.config, "cpu", torch.float32, source=reader)
    ids = torch.tensor([[5, 17, 3, 90, 42, 8]])
    with torch.no_grad():
        theirs = ref(ids).logits
        assert (model(ids) - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


def test_bad_files_are_refused_in_one_line(tmp_path):
    good = tmp_path / "good.gguf"
    write_gguf(good, "Q4_0")
    # an unsupported tensor type (an i-quant, here random blocks), named with its tensor
    tensors = _tensors()
    bad = tmp_path / "iq4.gguf"
    w = gguf.GGUFWriter(str(bad), "llama")
    for add, v in ((w.add_block_count, LAYERS), (w.add_context_length, 256), (w.add_embedding_length, HIDDEN),
                   (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV)):
        add(v)
    for name, arr in tensors.items():
        if name == "blk.0.ffn_up.weight":
            raw = np.random.default_rng(0).integers(0, 256, (FFN, HIDDEN // 32 * 18), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_up\.weight is IQ4_NL; supported: F32, F16"):
        GGUFReader(str(bad))
    # a file that claims far more blocks than it holds is refused before anything is built
    lying = tmp_path / "lying.gguf"
    write_gguf(lying, "F32", layers=10_000_000)
    with pytest.raises(GGUFError, match="block_count says 10000000 blocks but the file holds tensors for 2"):
        GGUFReader(str(lying))
    # truncated
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(GGUFError, match="truncated"):
        r = GGUFReader(str(cut))
        r.read_array("model.layers.1.mlp.down_proj.weight")
    # not a GGUF at all, and an architecture we do not run
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFReader(str(tmp_path / "x.gguf"))
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        GGUFReader(str(other))
    # Llama 3.1+'s RoPE scaling as a rope_freqs tensor: never loaded as plain RoPE
    freqs = tmp_path / "rope_freqs.gguf"
    write_gguf(freqs, "F32", tensors={**_tensors(), "rope_freqs.weight": np.ones(HIDDEN // HEADS // 2,
                                                                                   dtype=np.float32)})
    with pytest.raises(GGUFError, match="stored as the tensor rope_freqs"):
        GGUFReader(str(freqs))


def test_runners_report_a_damaged_gguf_in_one_line(smollm2_gguf, tmp_path, capsys):
    from runners import finetune, infer
    from runners.common import run_main
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        cut.write_bytes(f.read(3_000_000))  # header and metadata intact, tensor data cut short
    for main, extra in ((finetune.main, ["--dry-run"]), (infer.main, ["--prompt", "hi"])):
        assert run_main(main, ["--model", str(cut), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cut.gguf: cannot be read as GGUF" in err[0] and "download it again" in err[0], err
        # named from the header's tensor table before the slow metadata parse: what is missing
        assert "the file is 3000000 bytes, its tensors end at byte" in err[0], err


def test_the_conversion_cache_is_keyed_by_content_and_checked_on_read(tmp_path, capsys, monkeypatch):
    """Another GGUF at the same path with the same size and modification time converts anew (the
    key is its content, not name + size + mtime); a damaged byte in the converted cache is
    refused on read in one line that says to delete the cache (never computed with); two runs
    converting the same file take turns."""
    from nvme.format import held_lock
    from offload.models import CheckpointError, CheckpointReader
    from offload.models.gguf import converted_dir, gguf_checkpoint_dir
    from runners.common import run_main
    from runners.infer import main as infer_main
    path, cache = tmp_path / "m.gguf", str(tmp_path / "cache")
    monkeypatch.setenv("OFFLOAD_CACHE", cache)  # where the runner's conversions go
    write_gguf(path, "F32", tensors=_tensors(0), tokenizer=True)
    first = gguf_checkpoint_dir(str(path), torch.float32, cache)
    st = os.stat(path)
    expected = write_gguf(path, "F32", tensors=_tensors(1), tokenizer=True)  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    second = gguf_checkpoint_dir(str(path), torch.float32, cache)
    assert second != first
    with CheckpointReader(second) as r:
        got = r.read("model.norm.weight")
    assert torch.equal(got, torch.from_numpy(expected["output_norm.weight"]))
    # a byte of the cache's weights damaged: refused on read, and by the runner in one line
    shard = os.path.join(second, "model.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    with CheckpointReader(second) as r, pytest.raises(CheckpointError, match="fails its checksum"):
        r.read_tensors_into({n: torch.empty(loc.shape, dtype=loc.dtype) for n, loc in r.locations.items()})
    assert run_main(infer_main, ["--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                                 "--offload-dir", str(tmp_path / "off")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "fails its checksum" in err[-1] and "delete its directory and run again" in err[-1], err
    # a second conversion of a file another process is converting waits for it
    other = tmp_path / "n.gguf"
    write_gguf(other, "F32", tensors=_tensors(2), tokenizer=True)
    target = converted_dir(str(other), torch.float32, cache)
    script = (f"import torch; from offload.models.gguf import gguf_checkpoint_dir; "
              f"print(gguf_checkpoint_dir({str(other)!r}, torch.float32, {cache!r}))")
    with held_lock(target + ".lock", "test", 5):  # as a converting process holds it
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        seen = stderr_until(child, "is converting")  # the child says it waits
        time.sleep(0.5)
        assert child.poll() is None and not os.path.exists(target), seen  # waiting, not converting
    out, err = child.communicate(timeout=120)
    err = "".join(seen) + err
    assert child.returncode == 0 and "is converting" in err, err
    assert out.strip() == target and os.path.isfile(os.path.join(target, "config.json"))


def test_a_gguf_holding_nan_is_named_as_the_source_of_the_fault(tmp_path):
    """A NaN in the GGUF's weights: the GGUF is named as damaged (it was reported as a failed
    save into the cache's temporary path) and nothing is left in the cache."""
    tensors = _tensors(0)
    tensors["blk.1.ffn_up.weight"][3, 5] = np.nan
    write_gguf(tmp_path / "nan.gguf", "F32", tensors=tensors, tokenizer=True)
    with pytest.raises(GGUFError, match=r"nan.gguf: tensor 'model.layers.1.mlp.up_proj.weight' "
                                        r"holds inf/nan values"):
        gguf_checkpoint_dir(str(tmp_path / "nan.gguf"), torch.float32, str(tmp_path / "cache"))
    assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []


# ---- architectures beyond Llama: tiny files against transformers' own GGUF loading ----------------
# head_dim 256 for Gemma and 128 for Qwen3: transformers' GGUF config leaves query_pre_attn_scalar
# (Gemma) and head_dim (Qwen3) at its config classes' defaults, which are those; ours reads them
# off the file as llama.cpp does, so on other values only transformers' would be wrong.
ARCH_DIMS = {"gemma2": (256, 4), "gemma3": (256, 6), "qwen3": (128, 2), "phi3": (16, 2)}  # head_dim, layers
A_HIDDEN, A_FFN, A_HEADS, A_KV, A_VOCAB = 64, 96, 4, 2, 80


def write_arch_gguf(path, arch: str, seed: int = 0, extra=None) -> None:
    """A tiny GGUF of `arch` in llama.cpp's names, layouts and metadata keys (Gemma norms stored as
    1 + w, Phi-3's q/k/v and gate/up fused, its LongRoPE factors as tensors), random values;
    `extra(writer)` adds metadata."""
    rng = np.random.default_rng(seed)
    hd, layers = ARCH_DIMS[arch]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(A_HIDDEN)
    w.add_feed_forward_length(A_FFN)
    w.add_head_count(A_HEADS)
    w.add_head_count_kv(A_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_vocab_size(A_VOCAB)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    if arch != "phi3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch.startswith("gemma"):
        w.add_sliding_window(16)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if arch == "phi3":
        w.add_rope_dimension_count(hd)
        w.add_sliding_window(32)
        w.add_rope_scaling_orig_ctx_len(64)
    if extra is not None:
        extra(w)
    for name, arr in _arch_tensors(arch, rng).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _arch_tensors(arch: str, rng) -> dict[str, np.ndarray]:
    hd, layers = ARCH_DIMS[arch]
    q, kv = A_HEADS * hd, A_KV * hd

    def m(*shape):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):  # Gemma's converter stores 1 + w
        return (0.1 * rng.standard_normal(n) + (1.0 if arch.startswith("gemma") else 0.0)).astype(np.float32)
    out = {"token_embd.weight": m(A_VOCAB, A_HIDDEN), "output_norm.weight": norm(A_HIDDEN)}
    if not arch.startswith("gemma"):
        out["output.weight"] = m(A_VOCAB, A_HIDDEN)
    if arch == "phi3":
        out["rope_factors_long.weight"] = (1 + rng.random(hd // 2)).astype(np.float32)
        out["rope_factors_short.weight"] = (1 + rng.random(hd // 2)).astype(np.float32)
    for i in range(layers):
        p = f"blk.{i}."
        if arch == "phi3":
            out.update({p + "attn_qkv.weight": m(q + 2 * kv, A_HIDDEN), p + "ffn_up.weight": m(2 * A_FFN, A_HIDDEN)})
        else:
            out.update({p + "attn_q.weight": m(q, A_HIDDEN), p + "attn_k.weight": m(kv, A_HIDDEN),
                        p + "attn_v.weight": m(kv, A_HIDDEN), p + "ffn_gate.weight": m(A_FFN, A_HIDDEN),
                        p + "ffn_up.weight": m(A_FFN, A_HIDDEN)})
        out.update({p + "attn_output.weight": m(A_HIDDEN, q), p + "ffn_down.weight": m(A_HIDDEN, A_FFN),
                    p + "attn_norm.weight": norm(A_HIDDEN), p + "ffn_norm.weight": norm(A_HIDDEN)})
        if arch in ("qwen3", "gemma3"):
            out.update({p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)})
        if arch.startswith("gemma"):
            out.update({p + "post_attention_norm.weight": norm(A_HIDDEN), p + "post_ffw_norm.weight": norm(A_HIDDEN)})
    return out


# config keys transformers' GGUF loader reads from these architectures' metadata (the others it
# leaves at its config classes' defaults, e.g. Phi-3's sliding_window and LongRoPE factors)
_COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id", "model_type")
_ARCH_KEYS = {"gemma2": ("head_dim", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                         "final_logit_softcapping", "layer_types", "hidden_activation", "rope_parameters"),
              "gemma3": ("head_dim", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                         "final_logit_softcapping", "layer_types", "hidden_activation", "rope_parameters"),
              "qwen3": ("head_dim", "rope_parameters", "use_sliding_window"),
              "phi3": ("hidden_act",)}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3", "phi3"])
def test_architecture_tensors_and_config_match_transformers_gguf_loading(tmp_path, arch):
    """Every tensor of transformers' model loaded from the same GGUF, bit for bit under the same
    name (fp32), and the config: ours read back by transformers' config class agrees with the one
    transformers builds from the file, key by key."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = tmp_path / f"{arch}.gguf"
    write_arch_gguf(path, arch)
    with _gguf_parsed_once():
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    reader = GGUFReader(str(path), model_config=False)
    assert reader.config is None and reader.unexpected == []
    state = ref.state_dict()
    names = [n for n in state if not (n == "lm_head.weight" and reader.hf_config["tie_word_embeddings"])]
    assert sorted(names) == sorted(reader.tensors)
    for name in names:
        ours = torch.from_numpy(reader.read_array(name))
        assert ours.dtype == state[name].dtype and torch.equal(ours, state[name]), name
    theirs = ref.config.to_dict()
    ours_cfg = AutoConfig.for_model(**reader.hf_config).to_dict()
    for key in _COMMON_KEYS + _ARCH_KEYS[arch]:
        assert ours_cfg.get(key) == theirs.get(key), (key, ours_cfg.get(key), theirs.get(key))
    assert reader.hf_config["architectures"] == [ref.__class__.__name__]
    if arch == "phi3":  # what transformers' GGUF loader drops: the window and the LongRoPE factors
        assert reader.hf_config["sliding_window"] == 32
        factors = reader.hf_config["rope_scaling"]
        assert factors["rope_type"] == "longrope" and len(factors["long_factor"]) == ARCH_DIMS["phi3"][0] // 2
        assert reader.hf_config["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3", "phi3"])
def test_model_config_agrees_with_the_gguf_tensors(tmp_path, arch):
    """With a ModelConfig (the decoder's), the names and shapes it builds are the file's."""
    from offload.models.config import ConfigError, ModelConfig, parameter_shapes
    from offload.models.gguf_names import expected_shapes
    path = tmp_path / f"{arch}.gguf"
    write_arch_gguf(path, arch)
    hf = GGUFReader(str(path), model_config=False).hf_config
    try:
        cfg = ModelConfig.from_hf(hf, source=str(path))
    except ConfigError as e:
        pytest.skip(f"ModelConfig does not accept this {arch} config yet: {e}")
    reader = GGUFReader(str(path))
    assert reader.config == cfg
    assert parameter_shapes(cfg) == expected_shapes(arch, hf, reader.tensors)


# ---- SentencePiece ('llama') tokenizers on small vocabularies, against transformers -------------------
_SP_WORDS = ["\u2581", "t", "h", "e", "a", "n", "d", "\u2581t", "he", "\u2581the", "\u2581a", "nd", "\u2581and",
             "\u2581th", "an", "\u2581an", "c", "o", "\u2581c", "co", "de", "\u2581code", "od", "\u2581co",
             "\u2581\u2581", "\u2581\u2581\u2581\u2581", "ing", "in", "g", "i", "\u2581in", "  ", "<|user|>",
             "<|end|>", "\n"]


def write_sentencepiece_gguf(path, arch: str, merges: bool = False, **flags) -> None:
    """A one-block GGUF of `arch` whose tokenizer is SentencePiece ('llama'): byte tokens, scored
    pieces (one tie), a run of spaces spelled as spaces, a user-defined and a control token;
    Gemma-style special tokens first for the Gemma architectures, Llama 2's otherwise."""
    gemma = arch.startswith("gemma")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if gemma else ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + _SP_WORDS
    types = [3] * len(specials) + [6] * 256 + [1] * len(_SP_WORDS)
    if not gemma:
        types[0] = 2  # Llama 2's <unk> is 'unknown', not 'control'
    types[-3], types[-2] = 4, 3  # <|user|> user-defined, <|end|> control
    scores = [0.0] * (len(specials) + 256) + [float(-i) for i in range(len(_SP_WORDS))]
    scores[-6] = scores[-7]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    if merges:
        w.add_token_merges(["\u2581 t", "h e", "\u2581t he", "a n", "n d", "\u2581 a", "\u2581a nd", "c o",
                            "d e", "\u2581 c", "\u2581c o", "\u2581co de"])
    ids = {"bos": 2, "eos": 1, "unk": 3, "pad": 0} if gemma else {"bos": 1, "eos": 2, "unk": 0}
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    for key, value in flags.items():
        getattr(w, f"add_{key}")(value)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,merges,flags", [("llama", False, {}), ("llama", True, {"add_bos_token": False}),
                                               ("phi3", False, {}), ("gemma3", False, {}),
                                               ("gemma2", False, {"add_eos_token": True})])
def test_sentencepiece_tokenizers_match_transformers(tmp_path, arch, merges, flags):
    """tokenizer.json as transformers builds it from the same file (every section: merges derived
    from the scores or Gemma's listing order, or the file's; normalizer, pre-tokenizer, decoder,
    added tokens, BOS/EOS template), and the same ids and text on varied input."""
    from transformers import AutoTokenizer

    from offload.models.gguf_tokenizer import tokenizer_files
    path = tmp_path / "sp.gguf"
    write_sentencepiece_gguf(path, arch, merges, **flags)
    parsed = gguf.GGUFReader(str(path))

    def meta(key, default=None):
        return parsed.fields[key].contents() if key in parsed.fields else default
    files = tokenizer_files(meta, arch, 64, str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert json.loads(files["tokenizer.json"]) == json.loads(ref.backend_tokenizer.to_str())
    tok = Tokenizer(files["tokenizer.json"], files["tokenizer_config.json"], files["generation_config.json"])
    for text in ["the code", " the  and", "and then coding in the", "<|user|>hi<|end|>\n", "\u00e9\u00e0 \u65e5\u672c \U0001f642",
                 "    x", "", " ", "thethe\n\nand", "  lead", "tail  ", "<s></s><unk>"]:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
            assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_sentencepiece_tokenizer_without_prefix_space_is_refused(tmp_path):
    """llama.cpp honours tokenizer.ggml.add_space_prefix = false, transformers' GGUF tokenizer does
    not: no tokenizer matches both, so outside Gemma (which never prefixes) it is refused."""
    path = tmp_path / "sp.gguf"
    write_sentencepiece_gguf(path, "llama", add_space_prefix=False)
    parsed = gguf.GGUFReader(str(path))
    from offload.models.gguf_tokenizer import tokenizer_files
    with pytest.raises(GGUFError, match=r"add_space_prefix = false is not supported"):
        tokenizer_files(lambda k, d=None: parsed.fields[k].contents() if k in parsed.fields else d,
                        "llama", 64, str(path))


def test_gemma3_layer_kinds_bases_and_query_scale_follow_the_file(tmp_path):
    """What transformers' GGUF loader leaves at its defaults, read off the file as llama.cpp reads
    it: a per-layer sliding-window flag list or period, the sliding layers' own RoPE base and a
    stated query scale; a period of 0 is refused in one line."""
    flags = [True, False, True, True, False, True]
    cases = [(lambda w: w.add_sliding_window_pattern(flags), {"layer_types": [
                 "sliding_attention" if f else "full_attention" for f in flags]}),
             (lambda w: (w.add_sliding_window_pattern(3), w.add_rope_freq_base_swa(5000.0),
                         w.add_attention_scale(1 / 12)),
              {"sliding_window_pattern": 3, "rope_local_base_freq": 5000.0, "query_pre_attn_scalar": 144,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}),
             (None, {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256})]
    for k, (extra, want) in enumerate(cases):
        path = tmp_path / f"g{k}.gguf"
        write_arch_gguf(path, "gemma3", extra=extra)
        hf = GGUFReader(str(path), model_config=False).hf_config
        assert {key: hf.get(key) for key in want} == want
    write_arch_gguf(tmp_path / "bad.gguf", "gemma3", extra=lambda w: w.add_sliding_window_pattern(0))
    with pytest.raises(GGUFError, match=r"gemma3\.attention\.sliding_window_pattern = 0 is neither a period"):
        GGUFReader(str(tmp_path / "bad.gguf"), model_config=False)
