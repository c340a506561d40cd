"""GGUF checkpoints in: llama.cpp's single-file format, read with its own `gguf` package.

A GGUF file holds a model's hyper-parameters and tokenizer as metadata and its tensors in
llama.cpp's layouts (plain F32/F16/BF16, or blocks of quantized values with per-block scales).
`GGUFReader` turns it into what the rest of the code already knows:
- `.config`: a ModelConfig, from the `<arch>.*` metadata, checked against the tensors present
  (count, shapes, types) before anything is built: a 1 KB file that claims 10^7 layers is
  refused at once, not after minutes of allocation;
- `.read_tensors_into({hf_name: tensor})`: the CheckpointReader interface the model builder and
  the engine fill parameters through. Each tensor is dequantized on its own into the
  destination's dtype (never the whole model at once); llama.cpp's converter interleaves the
  rotary halves of q_proj/k_proj rows per head, so those rows are put back in Hugging Face order;
- `.tokenizer_files()`: the Hugging Face tokenizer files the metadata implies (tokenizer.json
  built with `tokenizers`, tokenizer_config.json with the chat template, special_tokens_map.json,
  generation_config.json), so `offload.data.tokenizer.Tokenizer` and an export treat it like any
  checkpoint.
`gguf_checkpoint_dir` converts a file once into a Hugging Face directory in a cache; the runners
use that, because the streamer reads NVMe-resident blocks as raw safetensors byte ranges.

Dequantization uses `gguf.quants.dequantize` (numpy): 8-16 ms for a 1536x576 Q4_1 tensor on
this project's 2-core CPU, ~1.5 s for all of SmolLM2-135M — far below reading and converting
the rest, so no second implementation is kept.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import threading
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from nvme.format import content_digest, held_lock
from offload.models.config import ConfigError, ModelConfig, parameter_shapes
from offload.models.hf import CONVERTED_FROM_NAME, CheckpointError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
# gguf block name -> our name inside model.layers.N
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as the models' own tokenizer.json files
# write them (byte-level BPE vocabularies whose merges were learned on these splits); any other
# value gets the GPT-2 split that ByteLevel applies itself.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class GGUFError(CheckpointError):
    """A GGUF file cannot be used; the message names the file (and tensor) and what to do."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading .gguf files needs the 'gguf' package: pip install gguf") from None
    return gguf


# The gguf package parses every metadata value into numpy objects when a file is opened: ~2-5 s
# for a 49K-token vocabulary on this project's CPU, paid again by each open of the same file in
# one process (a conversion, then the quantized blocks taken from it, then the tokenizer files).
# The parsed readers of the last few files are kept, keyed by the file's identity; a file that
# changed (size, mtime, ctime, inode) is parsed again. They map the file read-only; a parsed
# vocabulary takes tens of MB, and a runner opens one file.
_PARSED_KEEP = 4
_parsed: dict[tuple, Any] = {}
_parsed_lock = threading.Lock()


def _parse(path: str):
    """gguf.GGUFReader of `path`, parsed once per version of the file (see _parsed)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    with _parsed_lock:
        reader = _parsed.pop(key, None)
        if reader is None:
            reader = _gguf().GGUFReader(path, "r")
        _parsed[key] = reader  # the newest last
        while len(_parsed) > _PARSED_KEEP:
            del _parsed[next(iter(_parsed))]
        return reader


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _bytes_needed(path: str) -> int | None:
    """The length a GGUF file must have to hold every tensor its header lists, read by skipping
    over the metadata without decoding it (milliseconds, where the gguf package's parse takes
    seconds): so a download cut short is named before that parse. None when the header is not
    one this skipper follows (big-endian, an unknown type): the package's parse decides then."""
    import mmap
    import struct
    gguf = _gguf()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", m, 0)
            if magic != 0x46554747 or version not in (2, 3):
                return None
            pos, alignment = 24, 32

            def string(pos: int) -> tuple[bytes, int]:
                (n,) = struct.unpack_from("<Q", m, pos)
                return m[pos + 8:pos + 8 + n], pos + 8 + n

            def skip(vtype: int, pos: int) -> int:
                if vtype in _SCALAR_BYTES:
                    return pos + _SCALAR_BYTES[vtype]
                if vtype == 8:
                    return string(pos)[1]
                if vtype != 9:
                    raise ValueError(vtype)
                etype, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if etype in _SCALAR_BYTES:
                    return pos + count * _SCALAR_BYTES[etype]
                for _ in range(count):
                    pos = skip(etype, pos)
                return pos

            for _ in range(n_kv):
                key, pos = string(pos)
                (vtype,) = struct.unpack_from("<I", m, pos)
                if key == b"general.alignment" and vtype == 4:
                    (alignment,) = struct.unpack_from("<I", m, pos + 4)
                pos = skip(vtype, pos + 4)
            end = 0
            for _ in range(n_tensors):
                _, pos = string(pos)
                (n_dims,) = struct.unpack_from("<I", m, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
                ttype, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
                end = max(end, offset + int(np.prod(dims, dtype=np.int64)) // block * type_bytes)
        except (struct.error, ValueError, KeyError, IndexError, OverflowError):
            return None
        return -(-pos // alignment) * alignment + end


def is_gguf(path: str) -> bool:
    """True when `path` is a regular file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return os.path.isfile(path) and f.read(4) == b"GGUF"
    except OSError:
        return False


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


class GGUFReader:
    """An open GGUF file: its config, tensors by our names, reads into buffers, tokenizer files."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        _gguf()
        if not is_gguf(self.path):
            raise GGUFError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        need, size = _bytes_needed(self.path), os.path.getsize(self.path)
        if need is not None and size < need:
            raise GGUFError(f"{self.path}: cannot be read as GGUF (the file is {size} bytes, its "
                            f"tensors end at byte {need}); truncated or damaged? download it "
                            f"again")
        try:
            self._reader = _parse(self.path)
        except Exception as e:  # noqa: BLE001 - the package raises ValueError/struct/IndexError alike
            raise GGUFError(f"{self.path}: cannot be read as GGUF ({str(e)[:200]}); truncated or "
                            f"damaged? download it again") from None
        self.metadata = {k: f for k, f in self._reader.fields.items()}
        self.tensors = {}  # our name -> gguf ReaderTensor
        self.unexpected: list[str] = []
        for t in self._reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                self.unexpected.append(t.name)
            else:
                self.tensors[name] = t
        self.config = self._read_config()
        self._check_tensors()

    # ---- metadata -----------------------------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        field = self.metadata.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception:  # noqa: BLE001 - a malformed value
            raise GGUFError(f"{self.path}: metadata {key!r} cannot be decoded") from None

    def _read_config(self) -> ModelConfig:
        arch = self.meta("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {arch!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        a = lambda key, default=None: self.meta(f"{arch}.{key}", default)  # noqa: E731
        layers = a("block_count")
        present = {int(m.group(1)) for n in self.tensors
                   for m in [re.match(r"model\.layers\.(\d+)\.", n)] if m}
        if not isinstance(layers, int) or layers < 1 or present != set(range(layers)):
            raise GGUFError(f"{self.path}: {arch}.block_count says {layers} blocks but the file holds "
                            f"tensors for {len(present)}; the file is damaged or not a complete model")
        heads = a("attention.head_count")
        hidden = a("embedding_length")
        head_dim = a("attention.key_length") or a("rope.dimension_count") or 0
        vocab = a("vocab_size") or len(self.meta("tokenizer.ggml.tokens", []) or [])
        embed = self.tensors.get("model.embed_tokens.weight")
        if not vocab and embed is not None:
            vocab = int(embed.shape[-1])
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]], "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": a("feed_forward_length"), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": a("attention.head_count_kv", heads),
            "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": a("rope.freq_base", 10000.0),
            "max_position_embeddings": a("context_length", 2048),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.meta("tokenizer.ggml.padding_token_id"),
        }
        if head_dim and heads and head_dim != hidden // heads:
            hf["head_dim"] = head_dim
        if any(n.endswith("q_proj.bias") for n in self.tensors) and arch == "llama":
            hf["attention_bias"] = True
        scaling = a("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise GGUFError(f"{self.path}: RoPE scaling {scaling!r} in GGUF metadata is not supported")
            hf["rope_scaling"] = {"rope_type": "linear", "factor": a("rope.scaling.factor")}
        if arch == "mistral" and a("attention.sliding_window"):
            hf["sliding_window"] = a("attention.sliding_window")
        self.hf_config = {k: v for k, v in hf.items() if v is not None}
        try:
            return ModelConfig.from_hf(self.hf_config, source=self.path)
        except ConfigError as e:
            raise GGUFError(str(e)) from None

    def _check_tensors(self) -> None:
        gguf = _gguf()
        expected = parameter_shapes(self.config)
        for name, shape in expected.items():
            t = self.tensors.get(name)
            if t is None:
                raise GGUFError(f"{self.path}: tensor for {name!r} is missing (a damaged or "
                                f"incomplete file?)")
            stored = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF lists ne0 first
            if stored != tuple(shape):
                raise GGUFError(f"{self.path}: tensor {t.name} has shape {list(stored)}, the metadata "
                                f"implies {list(shape)} (file and metadata do not belong together)")
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            if kind not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {t.name} is {kind}; supported: "
                                f"{', '.join(SUPPORTED_TYPES)} (re-quantize the model to one of these)")
        self.unexpected += sorted(n for n in self.tensors if n not in expected)

    # ---- tensors ------------------------------------------------------------------------------
    def unpermute_rows(self, name: str, w: np.ndarray) -> np.ndarray:
        """llama.cpp stores q/k rows of each head as interleaved (even, odd) rotary pairs;
        Hugging Face stores the two halves one after the other. w [heads*head_dim, ...]."""
        cfg = self.config
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            heads = cfg.num_attention_heads
        elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            heads = cfg.num_key_value_heads
        else:
            return w
        if cfg.architecture == "Qwen2ForCausalLM":  # llama.cpp keeps Qwen2 rows as they are
            return w
        half = w.shape[0] // heads // 2
        return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def read_array(self, name: str) -> np.ndarray:
        """Tensor `name` (our name) dequantized to float32, in our shape and row order."""
        gguf = _gguf()
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        try:
            w = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(t.tensor_type))
        except Exception as e:  # noqa: BLE001 - a short file maps fewer bytes than the header says
            raise GGUFError(f"{self.path}: tensor {t.name} cannot be read ({str(e)[:200]}); the file "
                            f"is truncated or damaged") from None
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if not w.flags.writeable:  # F32 data is a view of the read-only file mapping
            w = w.copy()
        return self.unpermute_rows(name, w)

    def read_tensors_into(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill each destination (any device and float dtype, our shape), one tensor at a time."""
        for name, out in tensors.items():
            w = torch.from_numpy(self.read_array(name))
            if tuple(out.shape) != tuple(w.shape):
                raise GGUFError(f"{self.path}: tensor {name!r} has shape {list(w.shape)}, the "
                                f"destination has {list(out.shape)}")
            with torch.no_grad():
                out.copy_(w)

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.from_numpy(self.read_array(name)).to(dtype)

    # ---- tokenizer ----------------------------------------------------------------------------
    def tokenizer_files(self) -> dict[str, str | dict]:
        """The Hugging Face tokenizer files this file's metadata describes."""
        kind = self.meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{self.path}: tokenizer type {kind!r} is not supported yet (byte-level "
                            f"BPE 'gpt2' is); convert the model with its tokenizer.json instead")
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        tokens = list(self.meta("tokenizer.ggml.tokens", []))
        types = list(self.meta("tokenizer.ggml.token_type", []) or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in self.meta("tokenizer.ggml.merges", [])]
        byte_chars = set(pre_tokenizers.ByteLevel.alphabet())
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if set(tok) <= byte_chars:
                vocab.setdefault(tok, i)
            else:  # a token written as plain text (some converters do): spell it in byte-level
                spelled = "".join(_BYTE_TO_CHAR[b] for b in tok.encode("utf-8"))
                vocab.setdefault(spelled, i)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        split = _SPLITS.get(self.meta("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                   if k == _CONTROL and set(t) <= byte_chars]
        user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                if k == _USER_DEFINED and t in vocab]
        tok.add_special_tokens(control)
        tok.add_tokens(user)
        special = {name: tokens[i] for name, key in (("bos_token", "bos_token_id"),
                                                     ("eos_token", "eos_token_id"),
                                                     ("unk_token", "unknown_token_id"),
                                                     ("pad_token", "padding_token_id"))
                   for i in [self.meta(f"tokenizer.ggml.{key}")] if isinstance(i, int) and 0 <= i < len(tokens)}
        add_bos = bool(self.meta("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(self.meta("tokenizer.ggml.add_eos_token", False))
        single = ([special["bos_token"]] if add_bos and "bos_token" in special else []) + ["$A"] + \
                 ([special["eos_token"]] if add_eos and "eos_token" in special else [])
        used = {s: vocab.get(s, tok.token_to_id(s)) for s in single if s != "$A"}
        tok.post_processor = processors.TemplateProcessing(single=single, pair=single + ["$B"],
                                                           special_tokens=list(used.items()))
        config: dict[str, Any] = dict(special, add_bos_token=add_bos, add_eos_token=add_eos,
                                      tokenizer_class="PreTrainedTokenizerFast",
                                      model_max_length=self.config.max_position_embeddings)
        template = self.meta("tokenizer.chat_template")
        if isinstance(template, str) and template:
            config["chat_template"] = template
        generation = {k: v for k, v in (("bos_token_id", self.config.bos_token_id),
                                        ("eos_token_id", self.meta("tokenizer.ggml.eos_token_id")),
                                        ("pad_token_id", self.config.pad_token_id)) if v is not None}
        return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": config,
                "special_tokens_map.json": special, "generation_config.json": generation}

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        self._reader = None

    def __enter__(self) -> "GGUFReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_chars()


# ---- conversion to a Hugging Face directory -----------------------------------------------------
def convert_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write `gguf_path` as a Hugging Face checkpoint directory `out_dir` (weights in `dtype`,
    config, tokenizer files), one tensor in memory at a time. Built in a sibling temporary
    directory and renamed into place, so a crash never leaves a half directory at `out_dir`."""
    from offload.models.hf import save_pretrained

    with GGUFReader(gguf_path) as reader:
        files = {**reader.tokenizer_files(),
                 CONVERTED_FROM_NAME: {"source": os.path.abspath(gguf_path), "dtype": str(dtype)}}
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".partial-{os.path.basename(out_dir)}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        names = list(parameter_shapes(reader.config))

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                t = reader.read(name, dtype)
                if not bool(torch.isfinite(t).all()):  # the source's fault, not the cache's
                    raise GGUFError(f"{gguf_path}: tensor {name!r} holds inf/nan values: the "
                                    f"file is damaged or not a usable model; download it again")
                yield name, t

        try:
            save_pretrained(tensors(), tmp, config=reader.config, dtype=dtype, extra_files=files)
            if os.path.isdir(out_dir):
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


CONVERT_WAIT_S = 6 * 3600.0  # another process converting the same file: wait this long at most


def _cache_key(path: str, dtype: torch.dtype) -> str:
    """The file's content (nvme.format.content_digest: size, header, sampled extents) and the
    dtype converted to: another file at the same path, of the same size and mtime, converts anew."""
    return hashlib.blake2b(f"{content_digest(path)}/{dtype}".encode(), digest_size=8).hexdigest()


def converted_dir(gguf_path: str, dtype: torch.dtype = torch.float32,
                  cache_dir: str | None = None) -> str:
    """Where `gguf_path`'s conversion to `dtype` lives in the cache (converted or not)."""
    cache_dir = cache_dir or os.environ.get("OFFLOAD_CACHE") or \
        os.path.join(os.path.expanduser("~"), ".cache", "offload", "gguf")
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    dtype_name = str(dtype).replace("torch.", "")
    return os.path.join(cache_dir, f"{stem}-{_cache_key(gguf_path, dtype)}-{dtype_name}")


def gguf_checkpoint_dir(gguf_path: str, dtype: torch.dtype = torch.float32,
                        cache_dir: str | None = None) -> str:
    """The Hugging Face directory converted from `gguf_path` (cached; converted on first use;
    every read of it checked against the CRC-32C each tensor was written with)."""
    if not is_gguf(gguf_path):
        raise GGUFError(f"{gguf_path}: not a GGUF file")
    out = converted_dir(gguf_path, dtype, cache_dir)
    marker = os.path.join(out, "config.json")
    if not os.path.isfile(marker):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        # two runs converting the same file take turns: the second finds it converted
        with held_lock(out + ".lock", "offload-gguf-convert", CONVERT_WAIT_S, on_wait=lambda pid: print(
                f"note: process {pid} is converting {gguf_path} into {out}; waiting for it",
                file=sys.stderr)):
            if not os.path.isfile(marker):
                convert_gguf(gguf_path, out, dtype)
    return out


__all__ = ["GGUFError", "GGUFReader", "SUPPORTED_TYPES", "convert_gguf", "converted_dir", "gguf_checkpoint_dir",
           "is_gguf"]
