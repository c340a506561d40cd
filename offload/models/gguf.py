"""GGUF checkpoints in: llama.cpp's single-file format, read with its own `gguf` package.

A GGUF file holds a model's hyper-parameters and tokenizer as metadata and its tensors in
llama.cpp's layouts (plain F32/F16/BF16, or blocks of quantized values with per-block scales).
`GGUFReader` turns it into what the rest of the code already knows:
- `.hf_config`: the Hugging Face config dict of the file's architecture (llama, mistral, qwen2,
  qwen3, gemma2, gemma3, phi3, and the mixtures of experts qwen3moe, olmoe and llama with expert
  tensors = Mixtral; offload/models/gguf_names.py), and `.config`, the ModelConfig
  built from it, checked against the tensors present (count, shapes, types) before anything is
  built: a 1 KB file that claims 10^7 layers is refused at once, not after minutes of allocation;
- `.read_tensors_into({hf_name: tensor})`: the CheckpointReader interface the model builder and
  the engine fill parameters through. Each tensor is dequantized on its own into the
  destination's dtype (never the whole model at once), then given back the values Hugging Face
  stores (Llama q/k rows un-interleaved, Gemma norms minus 1, in float32). A 3-D expert tensor
  (`blk.N.ffn_{gate,up,down}_exps`, [experts, rows, cols]) is checked against the config and
  listed as one `ExpertSlice` per expert under the per-expert names transformers' save_pretrained
  writes: each is a view of that expert's own rows (whole rows of whole blocks: one byte range,
  K-quants included), dequantized on its own;
- `.tokenizer_files()`: the Hugging Face tokenizer files the metadata implies
  (offload/models/gguf_tokenizer.py), so `offload.data.tokenizer.Tokenizer` and an export treat
  it like any checkpoint.
`gguf_checkpoint_dir` converts a file once into a Hugging Face directory in a cache; the runners
use that, because the streamer reads NVMe-resident blocks as raw safetensors byte ranges.

Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K (today's Q4_K_M / Q5_K_M / Q6_K files), dequantized by `gguf.quants.dequantize`
itself, so the values are llama.cpp's own. Before the package parses the file, the tensor table
is walked here: a row length that is not a whole number of its type's blocks (256 values for K
types), a tensor whose shape needs more bytes than lie before the next tensor or the end of the
file, or a type id the package does not know is refused in one line naming the file, tensor and
type. Quantized blocks are *converted once*: `--quantize int8|int4` takes Q8_0 (int8) and
Q4_0/Q4_1 (int4) blocks as they are stored, and dequantizes every other type (K-quants, Q5) to
float32 then quantizes it into the project's own format (offload/quant/format.py). No kernel of
ours computes on K-blocks as stored. What converting costs, on Gemma 3 270M Q4_K_M's 117
Q4_K/Q6_K/Q5_0 tensors (scripts/bench_kquant.py, AMD EPYC, 2 shared cores): relative RMS error
against the file's values 0.5-0.6% for int8 group 32, 4.4-8.2% for int4 group 32, 8.5-9.5% for
int4 group 64; dequantizing 4-24 ms per MB of blocks; all 117 converted in ~3 s, once per file.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import struct
import sys
import threading
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from nvme.format import content_digest, held_lock
from offload.models.config import ConfigError, ModelConfig, parameter_shapes
from offload.models.gguf_names import (ARCHITECTURES, CONSUMED, GGUFError, expected_shapes, expert_parts,
                                       expert_shape, fix_values, hf_config, hf_name, is_expert_tensor,
                                       moe_architecture, unpermute_rows)
from offload.models.gguf_tokenizer import tokenizer_files
from offload.models.hf import CONVERTED_FROM_NAME

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


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


# ---- the tensor table, walked before the package's parse -------------------------------------------
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _tensor_table(path: str) -> tuple[int, list[tuple[str, tuple[int, ...], int, int]]] | None:
    """(where the tensor data starts, [(name, dims ne0 first, ggml type id, offset)]) read by
    skipping over the metadata without decoding it (milliseconds, where the gguf package's parse
    takes seconds). None when the header is not one this skipper follows (big-endian, an unknown
    value type, cut inside the header): the package's parse decides then."""
    import mmap
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", m, 0)
            if magic != 0x46554747 or version not in (2, 3):
                return None
            pos, alignment = 24, 32

            def string(pos: int) -> tuple[bytes, int]:
                (n,) = struct.unpack_from("<Q", m, pos)
                if pos + 8 + n > len(m):
                    raise ValueError(n)
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
            table = []
            for _ in range(n_tensors):
                name, pos = string(pos)
                (n_dims,) = struct.unpack_from("<I", m, pos)
                if n_dims > 8:
                    raise ValueError(n_dims)
                dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
                ttype, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                table.append((name.decode("utf-8", "replace"), tuple(dims), ttype, offset))
        except (struct.error, ValueError, IndexError, OverflowError):
            return None
        return -(-pos // max(alignment, 1)) * max(alignment, 1), table


def _check_table(path: str) -> None:
    """Refuse, in one line naming the tensor and its type, a file whose tensor table does not
    fit: an unknown type, rows that are not whole blocks, a shape needing more bytes than lie
    before the next tensor, or than the file holds (a download cut short)."""
    walked = _tensor_table(path)
    if walked is None:
        return
    start, table = walked
    gguf, size = _gguf(), os.path.getsize(path)
    spans = []
    for name, dims, type_id, offset in table:
        try:
            kind = gguf.GGMLQuantizationType(type_id)
            block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name} has ggml type id {type_id}, unknown to the gguf "
                            f"package (supported: {', '.join(SUPPORTED_TYPES)})") from None
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} is {kind.name} with rows of {dims[0]} values, not a "
                            f"whole number of its {block}-value blocks; the file is malformed")
        nbytes = math.prod(dims) // block * type_bytes
        spans.append((start + offset, start + offset + nbytes, name, kind.name, list(reversed(dims))))
    spans.sort()
    end = max((s[1] for s in spans), default=start)
    for k, (begin, stop, name, kind, shape) in enumerate(spans):
        if stop > size:
            raise GGUFError(f"{path}: cannot be read as GGUF (the file is {size} bytes, its tensors end "
                            f"at byte {end}; tensor {name} ({kind}, shape {shape}) needs bytes {begin} to "
                            f"{stop}); truncated or damaged? download it again")
        if k + 1 < len(spans) and stop > spans[k + 1][0]:
            raise GGUFError(f"{path}: tensor {name} ({kind}, shape {shape}) needs {stop - begin} bytes "
                            f"from byte {begin}, past the start of tensor {spans[k + 1][2]} at byte "
                            f"{spans[k + 1][0]}: its shape does not match its data; the file is malformed")


def is_gguf(path: str) -> bool:
    """True when `path` is a regular file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return os.path.isfile(path) and f.read(4) == b"GGUF"
    except OSError:
        return False


class ExpertSlice:
    """One expert's matrix inside a 3-D expert tensor ([experts, rows, cols] in torch order), with
    the fields of the package's ReaderTensor that are read here and by the `--quantize` path
    (name, tensor_type, shape ne0 first, data): `data` is a view of that expert's rows in the
    file mapping -- whole rows of whole blocks, one contiguous byte range -- so each expert is
    dequantized (or its Q8_0 / Q4_0 / Q4_1 blocks taken) on its own, read only when used."""

    def __init__(self, stacked, expert: int, first_row: int, rows: int):
        cols = int(stacked.shape[0])
        self.source, self.expert = stacked.name, expert
        fused = "" if rows == int(stacked.shape[1]) else f", rows {first_row}-{first_row + rows - 1}"
        self.name = f"{stacked.name} (expert {expert}{fused})"
        self.tensor_type = stacked.tensor_type
        self.shape = np.array([cols, rows], dtype=np.uint64)
        self.data = stacked.data[expert, first_row:first_row + rows]
        self.n_elements, self.n_bytes = cols * rows, self.data.nbytes


class GGUFReader:
    """An open GGUF file: its config, tensors by our names, reads into buffers, tokenizer files.
    `model_config=False` stops at the Hugging Face config dict (`.config` is None; the tensors
    are checked against the shapes that dict implies): for architectures ModelConfig refuses."""

    def __init__(self, path: str | os.PathLike, model_config: bool = True):
        self.path = os.fspath(path)
        _gguf()
        if not is_gguf(self.path):
            raise GGUFError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        _check_table(self.path)
        try:
            self._reader = _parse(self.path)
        except Exception as e:  # noqa: BLE001 - the package raises ValueError/struct/IndexError alike
            raise GGUFError(f"{self.path}: cannot be read as GGUF ({str(e)[:200]}); truncated or "
                            f"damaged? download it again") from None
        self.metadata = {k: f for k, f in self._reader.fields.items()}
        self.arch = self.meta("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.arch!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        self._by_gguf = {t.name: t for t in self._reader.tensors}
        self.moe = moe_architecture(self.arch, self._by_gguf, self.path)  # the MoE class, or None
        self.tensors = {}  # our name -> gguf ReaderTensor (or one expert of a 3-D one: ExpertSlice)
        self.unexpected: list[str] = []
        stacked = []  # 3-D expert tensors, split once the config says how many experts
        for t in self._reader.tensors:
            name = hf_name(self.arch, t.name, self.moe)
            if name is not None:
                self.tensors[name] = t
            elif self.moe and is_expert_tensor(t.name):
                stacked.append(t)
            elif t.name not in CONSUMED.get(self.arch, ()):
                self.unexpected.append(t.name)
        if "rope_freqs.weight" in self._by_gguf:
            # llama.cpp stores Llama 3.1+'s RoPE scaling as per-dimension factors in this tensor
            # (no rope.scaling metadata): ignoring it would load the model with plain RoPE
            raise GGUFError(f"{self.path}: its RoPE scaling is stored as the tensor rope_freqs "
                            f"(Llama 3.1+ GGUFs), which is not supported; use the model's Hugging "
                            f"Face directory instead")
        self.hf_config = hf_config(self.arch, self.meta, set(self._by_gguf), self._layers(),
                                   self._vocab_size(), self.read_raw, self.path)
        self._split_experts(stacked)
        self.config: ModelConfig | None = None
        if model_config:
            try:
                self.config = ModelConfig.from_hf(self.hf_config, source=self.path)
            except ConfigError as e:
                raise GGUFError(str(e)) from None
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

    def _layers(self) -> int:
        layers = self.meta(f"{self.arch}.block_count")
        present = {int(m.group(1)) for n in self.tensors
                   for m in [re.match(r"model\.layers\.(\d+)\.", n)] if m}
        if type(layers) is not int or layers < 1 or present != set(range(layers)):
            raise GGUFError(f"{self.path}: {self.arch}.block_count says {layers} blocks but the file "
                            f"holds tensors for {len(present)}; the file is damaged or not a complete model")
        return layers

    def _vocab_size(self) -> int:
        vocab = self.meta(f"{self.arch}.vocab_size")
        if not vocab and "tokenizer.ggml.tokens" in self.metadata:
            vocab = len(self.metadata["tokenizer.ggml.tokens"].data)
        embed = self.tensors.get("model.embed_tokens.weight")
        if not vocab and embed is not None:
            vocab = int(embed.shape[-1])
        return vocab

    def _split_experts(self, stacked: list) -> None:
        """Each 3-D expert tensor checked against the config ([experts, rows, cols]) and listed
        as one ExpertSlice per expert (and per projection, for a fused gate_up tensor)."""
        for t in stacked:
            stored = tuple(int(d) for d in reversed(list(t.shape)))
            want = expert_shape(self.hf_config, t.name)
            if stored != want:
                count = f"{self.arch}.expert_count says {want[0]}"
                raise GGUFError(
                    f"{self.path}: expert tensor {t.name} holds {stored[0]} experts where {count}; the "
                    f"file is damaged" if len(stored) == 3 and stored[0] != want[0] else
                    f"{self.path}: expert tensor {t.name} has shape {list(stored)}, the metadata implies "
                    f"{list(want)} ([experts, rows, cols]; {count}): file and metadata do not belong together")
            for name, expert, row, rows in expert_parts(self.moe, t.name, want):
                self.tensors[name] = ExpertSlice(t, expert, row, rows)

    def _check_tensors(self) -> None:
        gguf = _gguf()
        expected = parameter_shapes(self.config) if self.config is not None else \
            expected_shapes(self.arch, self.hf_config, self.tensors)
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
        """Rows of q/k tensor `name` (our name) in Hugging Face order (gguf_names.unpermute_rows)."""
        return unpermute_rows(self.arch, self.hf_config, name, w)

    def read_raw(self, gguf_name: str) -> np.ndarray:
        """Tensor `gguf_name` (the file's name) as `gguf.quants.dequantize` gives it, float32 in
        PyTorch's dimension order: llama.cpp's values, nothing undone."""
        t = self._by_gguf.get(gguf_name)
        if t is None:
            raise GGUFError(f"{self.path}: no tensor {gguf_name!r}")
        return self._dequantize(t)

    def _dequantize(self, t) -> np.ndarray:
        """`t` (a ReaderTensor or an ExpertSlice) as float32 in PyTorch's dimension order."""
        gguf = _gguf()
        kind = gguf.GGMLQuantizationType(t.tensor_type)
        dims = [int(d) for d in t.shape]
        block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        data = np.asarray(t.data)
        need = math.prod(dims) // block * type_bytes
        if dims[0] % block or data.nbytes != need:
            raise GGUFError(f"{self.path}: tensor {t.name} ({kind.name}, shape {dims[::-1]}) holds "
                            f"{data.nbytes} bytes where its shape needs {need} in whole "
                            f"{block}-value blocks; the file is truncated or malformed")
        try:
            w = gguf.quants.dequantize(data, kind)
        except Exception as e:  # noqa: BLE001 - a short file maps fewer bytes than the header says
            raise GGUFError(f"{self.path}: tensor {t.name} ({kind.name}) cannot be read "
                            f"({str(e)[:200]}); the file is truncated or damaged") from None
        w = np.asarray(w, dtype=np.float32).reshape(dims[::-1])
        if not w.flags.writeable:  # F32 data is a view of the read-only file mapping
            w = w.copy()
        return w

    def read_array(self, name: str) -> np.ndarray:
        """Tensor `name` (our name) dequantized to float32, with the values and row order
        Hugging Face stores (gguf_names.fix_values)."""
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        return fix_values(self.arch, self.hf_config, t.name, name, self._dequantize(t))

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
        return tokenizer_files(self.meta, self.arch, self.hf_config.get("max_position_embeddings"),
                               self.path)

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        self._reader = None

    def __enter__(self) -> "GGUFReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
