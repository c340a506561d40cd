"""GGUF K-quants and Gemma 3: every tensor type read through GGUFReader bit-equal to llama.cpp's own
`gguf.quants.dequantize` (random valid blocks of each type in tiny files, and every type of the
real Gemma 3 270M Q4_K_M file), malformed K-quant tensors refused in one line, the `--quantize`
path converting K/Q5 blocks rather than taking them, and the real Gemma file against
transformers' own GGUF loading: every state_dict tensor bit for bit, the config, the tokenizer."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from offload.data.tokenizer import Tokenizer  # noqa: E402
from offload.models.gguf import SUPPORTED_TYPES, GGUFError, GGUFReader  # noqa: E402

H, F, HEADS, KV, VOCAB = 256, 512, 2, 1, 32  # rows of 256 values: whole K blocks
# Byte offsets of the float16 fields in one block of each type, as gguf/quants.py's
# dequantize_blocks splits them (GGML_QUANT_SIZES gives the block sizes): set to finite values so
# random blocks are valid; every other byte (codes, 6-bit scales, masks) is any value.
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82),  # scales[16] qs[64] d dmin
               "Q3_K": (108,),  # hmask[32] qs[64] scales[12] d
               "Q4_K": (0, 2), "Q5_K": (0, 2),  # d dmin scales[12] (qh[32]) qs
               "Q6_K": (208,)}  # ql[128] qh[64] scales[16] d
TYPES = ("F32", "F16", "BF16", *FP16_FIELDS)


def random_tensor(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random valid data of `kind` for a [rows, cols] weight, as GGUFWriter.add_tensor takes it."""
    if kind == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "F16":
        return rng.uniform(-2, 2, (rows, cols)).astype(np.float16)
    if kind == "BF16":  # the top half of finite float32 values
        top = rng.uniform(-2, 2, (rows, cols)).astype(np.float32).view(np.uint32) >> 16
        return top.astype(np.uint16).view(np.uint8).reshape(rows, cols * 2)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        scale = rng.uniform(-1, 1, (rows, cols // block)).astype(np.float16)
        raw[:, :, at:at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_model(path, kind: str, seed: int = 0) -> dict[str, tuple[np.ndarray, object]]:
    """A one-block llama GGUF whose matrices are random valid `kind` data (norms F32, the last
    tensor a matrix); returns gguf name -> (the data as stored, its GGML type)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, H),
                   (w.add_feed_forward_length, F), (w.add_head_count, HEADS), (w.add_head_count_kv, KV),
                   (w.add_vocab_size, VOCAB)):
        add(v)
    hd = H // HEADS
    shapes = {"token_embd.weight": (VOCAB, H), "output.weight": (VOCAB, H),
              "blk.0.attn_q.weight": (H, H), "blk.0.attn_k.weight": (KV * hd, H),
              "blk.0.attn_v.weight": (KV * hd, H), "blk.0.attn_output.weight": (H, H),
              "blk.0.ffn_gate.weight": (F, H), "blk.0.ffn_up.weight": (F, H), "blk.0.ffn_down.weight": (H, F)}
    stored = {"output_norm.weight": np.ones(H, np.float32), "blk.0.attn_norm.weight": np.ones(H, np.float32),
              "blk.0.ffn_norm.weight": np.ones(H, np.float32)}
    stored.update({n: random_tensor(kind, *s, rng) for n, s in shapes.items()})
    raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
    types = {}
    for name, data in stored.items():
        w.add_tensor(name, data, raw_dtype=raw if data.ndim == 2 else None)
        types[name] = gguf.GGMLQuantizationType[kind] if data.ndim == 2 else gguf.GGMLQuantizationType.F32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {name: (data, types[name]) for name, data in stored.items()}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _hf_order(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_the_listed_types_are_the_supported_ones():
    assert set(TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("kind", TYPES)
def test_random_valid_blocks_read_bit_equal_to_the_gguf_package(tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    stored = write_model(path, kind)
    with GGUFReader(str(path), model_config=False) as reader:
        assert reader.unexpected == []
        for name, (data, qtype) in stored.items():
            assert reader._by_gguf[name].tensor_type == qtype
            want = gguf.quants.dequantize(data, qtype)
            got = reader.read_raw(name)
            assert got.dtype == np.float32 and got.shape == want.shape, name
            assert np.isfinite(got).all(), name  # the fp16 fields above are the block's only floats
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=name)
        down = reader.read_array("model.layers.0.mlp.down_proj.weight")
        np.testing.assert_array_equal(bits(down), bits(reader.read_raw("blk.0.ffn_down.weight")))
        q = reader.read_array("model.layers.0.self_attn.q_proj.weight")  # llama rows un-interleaved
        np.testing.assert_array_equal(bits(q), bits(_hf_order(reader.read_raw("blk.0.attn_q.weight"), HEADS)))


def _patch_tensor_info(path, name: str, dims: tuple[int, ...] | None = None, type_id: int | None = None) -> None:
    """Rewrite tensor `name`'s dims (ne0 first) or type id in a GGUF file's tensor table."""
    data = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    for i, d in enumerate(dims or ()):
        data[at + 4 + 8 * i:at + 12 + 8 * i] = d.to_bytes(8, "little")
    if type_id is not None:
        data[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_malformed_k_quant_tensors_are_refused_in_one_line(tmp_path):
    good = tmp_path / "good.gguf"
    write_model(good, "Q4_K")

    def refused(patch, pattern: str) -> None:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(good.read_bytes())
        patch(bad)
        with pytest.raises(GGUFError, match=pattern) as e:
            GGUFReader(str(bad), model_config=False)
        assert "\n" not in str(e.value) and str(bad) in str(e.value)

    # rows that are not whole 256-value blocks
    refused(lambda p: _patch_tensor_info(p, "blk.0.ffn_gate.weight", dims=(200, F)),
            r"tensor blk\.0\.ffn_gate\.weight is Q4_K with rows of 200 values, not a whole number of its "
            r"256-value blocks")
    # a shape that needs more bytes than lie before the next tensor
    refused(lambda p: _patch_tensor_info(p, "blk.0.ffn_gate.weight", dims=(H, F + 64)),
            r"tensor blk\.0\.ffn_gate\.weight \(Q4_K, shape \[576, 256\]\) needs 82944 bytes from byte "
            r"\d+, past the start of tensor blk\.0\.ffn_up\.weight")
    # a type id the package does not know
    refused(lambda p: _patch_tensor_info(p, "blk.0.ffn_up.weight", type_id=99),
            r"tensor blk\.0\.ffn_up\.weight has ggml type id 99, unknown to the gguf package")
    # cut inside the last tensor: a download cut short, named with that tensor
    refused(lambda p: p.write_bytes(good.read_bytes()[:-1000]),
            r"cannot be read as GGUF \(the file is \d+ bytes, its tensors end at byte \d+; tensor "
            r"blk\.0\.ffn_down\.weight \(Q4_K, shape \[256, 512\]\) needs bytes \d+ to \d+\); truncated")


@pytest.mark.parametrize("kind,mode,taken", [("Q4_K", "int4", False), ("Q6_K", "int8", False),
                                             ("Q5_0", "int4", False), ("Q8_0", "int8", True),
                                             ("Q4_0", "int4", True)])
def test_quantize_converts_k_and_q5_blocks_and_takes_only_its_own(tmp_path, kind, mode, taken):
    """--quantize: Q8_0 (int8) and Q4_0/Q4_1 (int4) blocks are taken as stored (group 32); K and
    Q5 blocks are dequantized and quantized by our own format at the mode's default group."""
    from offload.models.quantized import DEFAULT_GROUP, QuantSettings, gguf_source, gguf_types, projection_specs
    path = tmp_path / f"{kind}.gguf"
    write_model(path, kind)
    with GGUFReader(str(path)) as reader:
        settings = QuantSettings(mode)
        specs = projection_specs(reader.config, settings, gguf_types(reader))[0]
        assert {s.group_size for s in specs.values()} == {32 if taken else DEFAULT_GROUP[mode]}
        dense, parts = gguf_source(reader, settings)(0)
        assert bool(parts) == taken and ("mlp.down_proj.weight" in dense) != taken
        if not taken:
            assert torch.equal(dense["mlp.down_proj.weight"], reader.read("model.layers.0.mlp.down_proj.weight"))


# ---- the real Gemma 3 270M Q4_K_M file ------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma(gemma3_reference):
    """(our reader, transformers' state_dict, config and tokenizer): transformers loading the
    file itself (the session fixture in conftest.py, shared with tests/test_gemma3_real.py)."""
    reader, model, tok = gemma3_reference
    return reader, model.state_dict(), model.config, tok


def test_every_tensor_type_of_the_gemma_file_reads_as_the_package_dequantizes(gemma):
    reader = gemma[0]
    first: dict[str, object] = {}  # the smallest tensor of each type
    for t in sorted(reader._reader.tensors, key=lambda t: int(t.n_elements)):
        first.setdefault(t.tensor_type.name, t)
    assert set(first) == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}  # what the file holds
    for kind, t in first.items():
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        got = reader.read_raw(t.name)
        assert got.shape == tuple(int(d) for d in reversed(list(t.shape))), kind
        np.testing.assert_array_equal(bits(got), bits(want.reshape(got.shape)), err_msg=f"{kind} {t.name}")


def test_gemma_state_dict_is_transformers_bit_for_bit(gemma):
    reader, state, _, _ = gemma
    names = [n for n in state if n != "lm_head.weight"]  # tied: the embedding itself
    assert reader.hf_config["tie_word_embeddings"] and sorted(names) == sorted(reader.tensors)
    assert reader.unexpected == [] and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    for name in names:
        ours = torch.from_numpy(reader.read_array(name))
        assert ours.dtype == torch.float32 and torch.equal(ours.view(torch.int32), state[name].view(torch.int32)), name


def test_gemma_config_is_transformers(gemma):
    """Our config dict, read by transformers' own config class, equals the one transformers builds
    from the file (RoPE bases per layer kind, window, layer kinds, scalar, soft-capping, ids)."""
    from transformers import AutoConfig

    reader, _, config, _ = gemma
    hf = reader.hf_config
    assert hf["architectures"] == ["Gemma3ForCausalLM"] and hf["model_type"] == "gemma3_text"
    assert (hf["rope_theta"], hf["rope_local_base_freq"], hf["sliding_window"]) == (1e6, 10000.0, 512)
    assert hf["layer_types"].count("full_attention") == 3 and hf["layer_types"][5] == "full_attention"
    ours, theirs = AutoConfig.for_model(**hf).to_dict(), config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
                "query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping",
                "attn_logit_softcapping", "hidden_activation", "use_bidirectional_attention", "model_type"):
        assert ours.get(key) == theirs.get(key), (key, ours.get(key), theirs.get(key))


def test_gemma_model_config_agrees_with_the_tensors(gemma3_gguf, gemma):
    """Where the decoder's ModelConfig takes Gemma 3, the parameters it builds are the file's."""
    from offload.models.config import ConfigError, ModelConfig, parameter_shapes
    reader = gemma[0]
    try:
        cfg = ModelConfig.from_hf(reader.hf_config, source=gemma3_gguf)
    except ConfigError as e:
        pytest.skip(f"ModelConfig does not accept Gemma 3 yet: {e}")
    shapes = parameter_shapes(cfg)
    assert list(shapes) == [n for n in shapes if n in reader.tensors] and len(shapes) == len(reader.tensors)
    assert all(tuple(int(d) for d in reversed(list(reader.tensors[n].shape))) == s for n, s in shapes.items())


def varied_texts(n: int = 150) -> list[str]:
    rng = random.Random(0)
    pieces = ["def f(x):\n\treturn x ** 2  # square", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
              "Ünïcödé façade naïve café", "日本語のテキストと中文文本、한국어", "emoji 🙂🚀👩‍💻 and ✓ marks",
              "    indented   with   runs    of spaces", "tabs\tand\ttabs\n\nand blank lines\n\n\n",
              "numbers 1234567890 3.14159 -42 1e-9 0x1F", "<start_of_turn>user\nHi there<end_of_turn>\n",
              "<start_of_turn>model\nSure!<end_of_turn>", "URL https://example.com/a?b=c&d=e#f",
              "ALL CAPS and MiXeD CaSe", "quotes 'single' \"double\" `back`", "Ελληνικά και Русский",
              "  ", " ", "\n", "a", "<bos><eos><pad>", "[multimodal]<unused7>", "x" * 40, "\u2581 lit",
              "\x00\x01 control bytes \x7f", "  leading and trailing  "]
    texts = list(pieces)
    while len(texts) < n:
        texts.append(rng.choice([" ", "", "\n", "  "]).join(rng.choice(pieces) for _ in range(rng.randint(1, 4))))
    return texts


def test_gemma_tokenizer_is_transformers(gemma):
    """The tokenizer.json we build is the one transformers builds from the file (every section), and
    offload's Tokenizer over our files encodes and decodes as transformers' tokenizer does."""
    reader, _, _, ref = gemma
    files = reader.tokenizer_files()
    assert json.loads(files["tokenizer.json"]) == json.loads(ref.backend_tokenizer.to_str())
    assert files["special_tokens_map.json"] == ref.special_tokens_map
    assert files["tokenizer_config.json"]["add_bos_token"] is True
    tok = Tokenizer(files["tokenizer.json"], files["tokenizer_config.json"], files["generation_config.json"])
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (2, 1, 262144)
    for text in varied_texts(60):  # the tokenizer.json is equal already; these spot-check it
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (False, True):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
