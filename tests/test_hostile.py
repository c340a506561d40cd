"""Hostile inputs: safetensors headers, Hugging Face checkpoint directories, swap manifests and
training checkpoints from strangers. Each bad case is one typed error with a clear message —
never another exception, a huge allocation, a hang, an out-of-bounds read, or a file touched
outside the model / swap directory. Fixed cases first (each listed in docs/RELIABILITY.md),
then hypothesis fuzzing of the parsers."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

pytest.importorskip("hypothesis", reason="property tests need hypothesis: pip install -e '.[test]' "
                    "(the GPU machine has none; its kit is `pytest -m cuda`)")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvme.format import (MAX_HEADER_BYTES, FormatError, SafetensorsFile, read_header,
                         write_file)
from offload.models import CheckpointError, CheckpointReader, build_model, preset, save_pretrained
from offload.models.config import ConfigError, ModelConfig

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def st_file(path, header: bytes | str | dict, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else (
        header if isinstance(header, str) else json.dumps(header)).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def entry(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


# ---- safetensors headers --------------------------------------------------------------------
HEADER_CASES = {
    "too short": (b"\x01\x02", None, "too short"),
    "absurd header length": (struct.pack("<Q", 2**63), None, "impossible"),
    "header over 100 MiB": (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", None, "impossible"),
    "header past end of file": ({"a": entry()}, 10**6, "impossible"),
    "not UTF-8": (b"\xff\xfe{}", None, "not valid JSON"),
    "not JSON": (b"{'a': 1}", None, "not valid JSON"),
    "JSON list": (b"[1, 2]", None, "must be a JSON object"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    "5000-digit integer": (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], '
                           b'"data_offsets": [0, 8]}}', None, "not valid JSON"),
    "duplicate tensor name": (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                              b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
                              None, "twice"),
    "metadata not str->str": ({"__metadata__": {"k": 1}}, None, "__metadata__"),
    "metadata a list": ({"__metadata__": ["x"]}, None, "__metadata__"),
    "entry not an object": ({"a": [1, 2]}, None, "exactly dtype, shape, data_offsets"),
    "entry missing data_offsets": ({"a": {"dtype": "F32", "shape": [2]}}, None, "exactly dtype"),
    "entry with an extra key": ({"a": {**entry(), "x": 1}}, None, "exactly dtype"),
    "unknown dtype": ({"a": entry(dtype="F128")}, None, "unknown dtype"),
    "dtype not a string": ({"a": entry(dtype=["F32"])}, None, "unknown dtype"),
    "negative dimension": ({"a": entry(shape=(-2,))}, None, "shape must be"),
    "float dimension": ({"a": entry(shape=(2.0,))}, None, "shape must be"),
    "bool dimension": ({"a": entry(shape=(True,))}, None, "shape must be"),
    "offsets reversed": ({"a": entry(offs=(8, 0))}, None, "data_offsets must be"),
    "three offsets": ({"a": entry(offs=(0, 4, 8))}, None, "data_offsets must be"),
    "negative offset": ({"a": entry(offs=(-8, 0))}, None, "data_offsets must be"),
    "offsets past the end": ({"a": entry(offs=(0, 10**12), shape=(25 * 10**10,))}, None,
                             "run past the end"),
    "shape/byte-size mismatch": ({"a": entry(shape=(3,))}, None, "needs 12 bytes"),
    "overlapping tensors": ({"a": entry(offs=(0, 8)), "b": entry(offs=(4, 12))}, None, "overlap"),
    "zero-byte tensor of absurd shape": ({"a": entry(shape=(0, 2**62, 4), offs=(0, 0))}, None,
                                         "absurdly large"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_bad_safetensors_header(case, tmp_path):
    header, length, match = HEADER_CASES[case]
    path = tmp_path / "x.safetensors"
    if case in ("too short", "absurd header length", "header over 100 MiB"):
        path.write_bytes(header)
    else:
        st_file(path, header, b"\0" * 16, length)
    with pytest.raises(FormatError, match=match) as e:
        read_header(path)
    assert str(path) in str(e.value)
    with pytest.raises(FormatError, match=match):
        SafetensorsFile(path)  # and its __del__ / close have nothing to trip over


def test_fifo_and_directory_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)  # opening a FIFO read-only would wait for a writer forever
    with pytest.raises(FormatError, match="not a regular file"):
        read_header(fifo)
    with pytest.raises(FormatError, match="not a regular file"):
        SafetensorsFile(tmp_path)


def test_header_and_reads_come_from_the_same_file(tmp_path):
    """The file is opened once: replacing the path after the header was parsed cannot feed
    unchecked bytes to the reads."""
    good = {"a": torch.arange(4, dtype=torch.float32)}
    write_file(tmp_path / "a.safetensors", good)
    f = SafetensorsFile(tmp_path / "a.safetensors")
    write_file(tmp_path / "a.safetensors", {"a": torch.zeros(1000)})  # renamed over the path
    assert torch.equal(f.read("a"), good["a"])
    f.close()


# ---- fuzzing the header parser --------------------------------------------------------------
_DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "F128", "", "f32", 3, None,
           ["F32"], {"F32": 1}]
_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F8_E4M3": 1}
_small = st.integers(1, 5)
_dims = st.one_of(_small, _small, _small, _small, _small, st.integers(0, 5), st.integers(-3, 64), st.sampled_from([0, 2**31, 2**62, 2**63]),
                  st.integers(-(2**70), 2**70), st.booleans(), st.floats(0, 4))
_json_junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                    st.text(max_size=5)),
                          lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@st.composite
def _entry(draw):
    """Mostly near-valid entries: offsets that fit the shape (at a random begin), then perturbed."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(_json_junk)
    dtype = draw(st.sampled_from(_DTYPES[:3] if kind > 5 else _DTYPES))
    shape = draw(st.lists(_small if kind > 5 else _dims, max_size=3))
    begin = draw(st.integers(0, 64))
    try:
        size = _SIZES.get(dtype, 4) if isinstance(dtype, str) else 4
        n = 1
        for d in shape:
            n *= int(d)
        end = begin + n * size
    except (TypeError, ValueError, OverflowError):
        end = begin + 4
    offs = [begin, end] if kind > 5 else draw(st.sampled_from(
        [[begin, end], [begin, end + 1], [end, begin], [begin], [begin, end, end], [str(begin), end]]))
    e = {"dtype": dtype, "shape": shape, "data_offsets": offs}
    if kind == 1:
        e.pop(draw(st.sampled_from(sorted(e))))
    elif kind == 2:
        e["extra"] = 1
    return e


_header = st.dictionaries(st.text(max_size=8), _entry(), max_size=3)


def _check_accepted(path: str, infos) -> None:
    """What the parser accepted must be safe to read: in bounds, no overlap, sizes agree."""
    size = os.path.getsize(path)
    spans = []
    for info in infos.values():
        assert 0 <= info.offset and info.offset + info.nbytes <= size
        assert info.nbytes == info.numel * torch.empty((), dtype=info.dtype).element_size()
        if info.nbytes:
            spans.append((info.offset, info.offset + info.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with SafetensorsFile(path) as f:
        for name in f.tensors:
            f.read(name)


@FUZZ
@given(header=_header, data_len=st.integers(0, 160), length_delta=st.sampled_from([0, 0, 0, -1, 1, 7]))
def test_fuzzed_headers_are_parsed_or_refused(tmp_path, header, data_len, length_delta):
    path = str(tmp_path / "f.safetensors")
    raw = json.dumps(header).encode()
    st_file(path, raw, b"\x11" * data_len, len(raw) + length_delta)
    try:
        infos, _ = read_header(path)
    except FormatError as e:
        assert path in str(e)
        return
    _check_accepted(path, infos)


@FUZZ
@given(blob=st.binary(max_size=64), cut=st.integers(0, 400))
def test_fuzzed_bytes_and_truncations(tmp_path, blob, cut):
    path = str(tmp_path / "g.safetensors")
    write_file(path, {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, 2)})
    raw = open(path, "rb").read()
    # either garbage, or a real file cut short / with garbage spliced into its header
    variants = [blob, raw[:cut], raw[:8 + cut % 64] + blob + raw[8 + cut % 64 + len(blob):]]
    for v in variants:
        with open(path, "wb") as f:
            f.write(v)
        try:
            infos, _ = read_header(path)
        except FormatError:
            continue
        _check_accepted(path, infos)


# ---- Hugging Face checkpoint directories ----------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A sharded tiny checkpoint (config.json, index, 3+ shards), written by save_pretrained."""
    d = tmp_path_factory.mktemp("hostile") / "good"
    model = build_model(preset("tiny"), device="cpu", source=0)
    save_pretrained(model, d, max_shard_bytes=200_000)
    (d / "tokenizer.json").write_text("{}")
    return d


def _copy(good, tmp_path) -> str:
    d = tmp_path / "ckpt"
    shutil.copytree(good, d, symlinks=True)
    return str(d)


def _index(d: str) -> dict:
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def _set_index(d: str, index) -> None:
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))


def _set_config(d: str, **changes) -> None:
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg.update(changes)
    json.dump(cfg, open(p, "w"))


def _first_shard(d: str) -> str:
    return sorted(f for f in os.listdir(d) if f.startswith("model-"))[0]


def _redirect_first_shard(d: str, name: str) -> None:
    index = _index(d)
    shard = _first_shard(d)
    index["weight_map"] = {k: (name if v == shard else v) for k, v in index["weight_map"].items()}
    _set_index(d, index)


def _case_config_missing(d, outside):
    os.unlink(os.path.join(d, "config.json"))


def _case_config_not_json(d, outside):
    open(os.path.join(d, "config.json"), "w").write("{not json")


def _case_config_a_list(d, outside):
    open(os.path.join(d, "config.json"), "w").write("[1, 2, 3]")


def _case_config_nested(d, outside):
    open(os.path.join(d, "config.json"), "w").write("[" * 50_000 + "]" * 50_000)


def _case_config_huge(d, outside):
    with open(os.path.join(d, "config.json"), "r+b") as f:
        f.truncate(65 << 20)  # sparse: nothing is really written, nothing may be read


def _case_config_link_to_dev_zero(d, outside):
    os.unlink(os.path.join(d, "config.json"))
    os.symlink("/dev/zero", os.path.join(d, "config.json"))


def _case_config_fifo(d, outside):
    os.unlink(os.path.join(d, "config.json"))
    os.mkfifo(os.path.join(d, "config.json"))


def _case_architecture_a_dict(d, outside):
    _set_config(d, architectures=[{"LlamaForCausalLM": 1}])


def _case_heads_a_string(d, outside):
    _set_config(d, num_attention_heads="4")


def _case_rope_type_a_list(d, outside):
    _set_config(d, rope_scaling={"rope_type": ["llama3"], "factor": 2.0})


def _case_rope_factor_a_string(d, outside):
    _set_config(d, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1",
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def _case_rms_eps_nan(d, outside):
    p = os.path.join(d, "config.json")
    text = open(p).read()
    open(p, "w").write(text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'))


def _case_eos_a_string(d, outside):
    _set_config(d, eos_token_id="</s>")


def _case_index_not_json(d, outside):
    _set_index(d, "{")


def _case_index_no_weight_map(d, outside):
    _set_index(d, {"metadata": {}})


def _case_index_a_list(d, outside):
    _set_index(d, [1])


def _case_weight_map_a_list(d, outside):
    _set_index(d, {"weight_map": ["model-00001-of-00003.safetensors"]})


def _case_shard_name_not_a_string(d, outside):
    index = _index(d)
    index["weight_map"][next(iter(index["weight_map"]))] = 7
    _set_index(d, index)


def _case_shard_parent_dir(d, outside):
    shutil.copy(os.path.join(d, _first_shard(d)), os.path.join(outside, "evil.safetensors"))
    _redirect_first_shard(d, "../outside/evil.safetensors")


def _case_shard_absolute_path(d, outside):
    _redirect_first_shard(d, os.path.join(outside, "evil.safetensors"))


def _case_shard_dot_dot(d, outside):
    _redirect_first_shard(d, "..")


def _case_shard_empty_name(d, outside):
    _redirect_first_shard(d, "")


def _case_shard_symlink_out(d, outside):
    shard = _first_shard(d)
    shutil.move(os.path.join(d, shard), os.path.join(outside, shard))
    os.symlink(os.path.join(outside, shard), os.path.join(d, shard))


def _case_shard_missing(d, outside):
    os.unlink(os.path.join(d, _first_shard(d)))


def _case_shard_lacks_listed_tensor(d, outside):
    index = _index(d)
    index["weight_map"]["model.layers.0.extra.weight"] = _first_shard(d)
    _set_index(d, index)


def _case_shard_corrupt_header(d, outside):
    p = os.path.join(d, _first_shard(d))
    raw = bytearray(open(p, "rb").read())
    raw[8:12] = b"\x00\x00\x00\x00"
    open(p, "wb").write(bytes(raw))


def _case_tensor_wrong_shape(d, outside):
    _set_config(d, intermediate_size=160)


def _case_tensor_integer_dtype(d, outside):
    shard = _first_shard(d)
    p = os.path.join(d, shard)
    with SafetensorsFile(p) as f:
        tensors = {n: f.read(n) for n in f.tensors}
    name = next(iter(tensors))
    tensors[name] = tensors[name].view(torch.int32)
    write_file(p, tensors, {"format": "pt"})


def _case_tokenizer_symlink_out(d, outside):
    os.unlink(os.path.join(d, "tokenizer.json"))
    open(os.path.join(outside, "secret.json"), "w").write("{}")
    os.symlink(os.path.join(outside, "secret.json"), os.path.join(d, "tokenizer.json"))


DIR_CASES = {  # case -> (how to damage a good checkpoint, part of the one-line message)
    "config.json missing": (_case_config_missing, "config.json: missing"),
    "config.json not JSON": (_case_config_not_json, "not valid JSON"),
    "config.json a JSON list": (_case_config_a_list, "must be a JSON object"),
    "config.json nested 50000 deep": (_case_config_nested, "nested too deeply"),
    "config.json of 65 MiB": (_case_config_huge, "far too large"),
    "config.json a link to /dev/zero": (_case_config_link_to_dev_zero, "outside the checkpoint"),
    "config.json a FIFO": (_case_config_fifo, "not a regular file"),
    "architectures holding a dict": (_case_architecture_a_dict, "must list names"),
    "num_attention_heads a string": (_case_heads_a_string, "num_attention_heads must be"),
    "rope_type a list": (_case_rope_type_a_list, "rope_type"),
    "rope low_freq_factor a string": (_case_rope_factor_a_string, "low_freq_factor must be"),
    "rms_norm_eps NaN": (_case_rms_eps_nan, "rms_norm_eps must be"),
    "eos_token_id a string": (_case_eos_a_string, "eos_token_id must be"),
    "index not JSON": (_case_index_not_json, "not valid JSON"),
    "index without weight_map": (_case_index_no_weight_map, "needs a 'weight_map'"),
    "index a JSON list": (_case_index_a_list, "needs a 'weight_map'"),
    "weight_map a list": (_case_weight_map_a_list, "must map tensor names to files"),
    "shard name not a string": (_case_shard_name_not_a_string, "not a file name"),
    "shard name ../outside/x": (_case_shard_parent_dir, "must be a plain file name"),
    "shard name an absolute path": (_case_shard_absolute_path, "must be a plain file name"),
    "shard name ..": (_case_shard_dot_dot, "must be a plain file name"),
    "shard name empty": (_case_shard_empty_name, "must be a plain file name"),
    "shard a symlink out of the directory": (_case_shard_symlink_out, "outside the checkpoint"),
    "shard missing": (_case_shard_missing, "does not exist"),
    "index lists a tensor the shard lacks": (_case_shard_lacks_listed_tensor, "is missing"),
    "shard header damaged": (_case_shard_corrupt_header, "re-download"),
    "tensor shape differs from config.json": (_case_tensor_wrong_shape, "implies"),
    "integer (quantised) weights": (_case_tensor_integer_dtype, "only float32/float16"),
    "tokenizer.json a symlink out": (_case_tokenizer_symlink_out, "outside the checkpoint"),
}


@pytest.mark.parametrize("case", sorted(DIR_CASES))
def test_bad_checkpoint_directory(case, good_checkpoint, tmp_path):
    damage, match = DIR_CASES[case]
    d = _copy(good_checkpoint, tmp_path)
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    damage(d, outside)
    with pytest.raises(CheckpointError, match=match) as e:
        CheckpointReader(d).close()
    assert "\n" not in str(e.value).strip()


def test_runner_reports_a_hostile_checkpoint_in_one_line(good_checkpoint, tmp_path, capsys):
    from runners.finetune import main as finetune
    from runners.common import run_main
    from runners.infer import main as infer

    d = _copy(good_checkpoint, tmp_path)
    os.makedirs(tmp_path / "outside")
    _case_shard_parent_dir(d, str(tmp_path / "outside"))
    for run in (lambda: finetune(["--model", d, "--output", str(tmp_path / "o"), "--no-progress"]),
                lambda: run_main(infer, ["--model", d])):
        rc = run()
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err[-1].startswith("error: ") and "plain file name" in err[-1]
        assert not any("Traceback" in line for line in err)


def test_hugging_face_cache_snapshot_links_are_followed(good_checkpoint, tmp_path):
    """The hub cache keeps files in <repo>/blobs and links them from <repo>/snapshots/<rev>/:
    links into the repository's own blob store are fine."""
    repo = tmp_path / "models--x--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(good_checkpoint):
        shutil.copy(good_checkpoint / name, repo / "blobs" / f"blob-{name}")
        os.symlink(f"../../blobs/blob-{name}", snap / name)
    with CheckpointReader(snap) as r:
        assert r.read("model.norm.weight").shape == (64,)
    # a link out of the repository is still refused
    os.unlink(snap / "config.json")
    os.symlink(good_checkpoint / "config.json", snap / "config.json")
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        CheckpointReader(snap)


def test_planted_index_cannot_make_a_save_delete_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "notes.txt", "b": "../x.safetensors", "c": "/etc/hostname"}}))
    save_pretrained(build_model(preset("tiny"), device="cpu", source=0), out)
    assert (out / "notes.txt").read_text() == "keep me"


@FUZZ
@given(weight_map=st.dictionaries(st.text(max_size=12), st.one_of(
    st.sampled_from(["..", ".", "", "/", "/etc/passwd", "../good/config.json", "config.json",
                     "model-00001-of-00004.safetensors", "x\0y", "nested/dir.safetensors"]),
    st.text(max_size=12), st.integers(), st.none()), max_size=4))
def test_fuzzed_index_files(good_checkpoint, tmp_path, weight_map):
    d = tmp_path / "fuzz-index"
    if not d.exists():
        shutil.copytree(good_checkpoint, d)
    _set_index(str(d), {"weight_map": weight_map})
    try:
        CheckpointReader(d).close()
    except CheckpointError:
        pass


_hf_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                       st.text(max_size=6), st.lists(st.integers(0, 4), max_size=2),
                       st.dictionaries(st.sampled_from(["rope_type", "factor", "type",
                                                        "low_freq_factor", "high_freq_factor",
                                                        "original_max_position_embeddings"]),
                                       st.one_of(st.floats(), st.text(max_size=6), st.integers())))
_HF_KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "hidden_act",
            "max_position_embeddings", "tie_word_embeddings", "sliding_window", "eos_token_id",
            "bos_token_id", "initializer_range", "attention_bias", "partial_rotary_factor"]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(_HF_KEYS), _hf_values, max_size=4),
       top=st.sampled_from(["dict", "dict", "dict", "list", "string"]))
def test_fuzzed_config_json(changes, top):
    base = preset("tiny").to_hf()
    base.update(changes)
    raw = base if top == "dict" else ([base] if top == "list" else "config")
    try:
        cfg = ModelConfig.from_hf(raw)
    except ConfigError as e:
        assert str(e).startswith("config.json: ")
        return
    cfg.validate()
    build_model(cfg, device="meta")  # what was accepted can be built


def test_the_header_fuzzer_reaches_both_outcomes(tmp_path):
    """Guard against a vacuous fuzzer: its headers are sometimes accepted, sometimes refused."""
    outcomes = set()

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(header=_header, data_len=st.integers(0, 160))
    def probe(header, data_len):
        path = str(tmp_path / "p.safetensors")
        raw = json.dumps(header).encode()
        st_file(path, raw, b"\x11" * data_len)
        try:
            infos, _ = read_header(path)
            outcomes.add("accepted with tensors" if any(i.nbytes for i in infos.values())
                         else "accepted")
        except FormatError:
            outcomes.add("refused")
    probe()
    assert outcomes == {"accepted", "accepted with tensors", "refused"}
