"""Hugging Face checkpoint directories: read them a block at a time, write them back.

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json` (`weight_map`:
tensor name -> shard file). Reading goes through `nvme.format`: only headers are parsed when
the directory is opened, and each tensor is then read with pread straight into the caller's
buffer (the parameter's own storage when device and dtype match), so loading one block touches
only that block's bytes and nothing is converted to another format. `location()` exposes each
tensor's file and absolute byte offset for the streamer, which reads them with O_DIRECT itself.

Writing produces what transformers writes: config.json, generation_config.json, shards of at
most `max_shard_bytes` plus the index (or a single model.safetensors when everything fits),
`__metadata__ = {"format": "pt"}`, tensors in their own dtype unless one is requested, and a
tied lm_head left out. Shards are written one at a time, each atomically, and the index last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from nvme.format import (FormatError, SafetensorsFile, fsync_dir, open_regular, write_file,
                         write_json_atomic, write_text_atomic)
from offload.models.config import (ConfigError, ModelConfig, block_parameter_shapes, block_prefix,
                                   parameter_shapes)
from offload.models.families import moe_names
from offload.models.moe import FUSED_EXPERTS, checkpoint_shapes, fused_expert_parts, fused_for_export
from offload.models.llama import LlamaForCausalLM, build_model
from offload.models.mxfp4 import mxfp4_locations, read_mxfp4
from offload.memory.tiers import all_finite

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# written into a directory this program converted from another file (a GGUF cache entry): what
# it came from, so a damaged read can say the directory is a cache to delete, not a checkpoint
CONVERTED_FROM_NAME = "offload_converted_from.json"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default shard size (5 GB)
# config.json and the index are a few KB to a few MB; a bigger one is not a checkpoint's
MAX_JSON_BYTES = 64 << 20
# Files besides the weights that loaders read from a checkpoint directory: checked on open like
# the shards (regular files, no links out of the directory).
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "generation_config.json", "special_tokens_map.json", CONVERTED_FROM_NAME)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


class CheckpointError(ValueError):
    """A checkpoint directory cannot be used; the message names the file and tensor, says what
    is wrong and how to fix it."""


@dataclass(frozen=True)
class TensorLocation:
    name: str  # our (= Hugging Face CausalLM) name
    stored_name: str  # the name inside the file
    path: str  # the shard file
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first byte in `path`
    nbytes: int
    part: bool = False  # a byte range of the stored tensor (one expert of a fused experts tensor)
    mxfp4: tuple[str, int, int] | None = None  # MXFP4 blocks: their scales' (file, offset, bytes) (mxfp4.py)


def _canonical_name(stored: str) -> str | None:
    """Our name for a stored tensor name (they are the same: our modules mirror transformers'),
    or None for tensors we deliberately ignore."""
    if stored.endswith("rotary_emb.inv_freq"):  # old checkpoints saved this derived buffer
        return None
    return stored


def allowed_roots(path: str) -> list[str]:
    """Directories whose files a checkpoint at `path` may be made of: the directory itself, and
    for a Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>/`, whose files are symlinks
    to `<repo>/blobs/<hash>`) the repository's blob store. Anything a link leads to outside
    these is refused."""
    real = os.path.realpath(path)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return roots


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class CheckpointReader:
    """An open checkpoint directory: its config, where every tensor lives, reads into buffers."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.files: dict[str, SafetensorsFile] = {}
        self._roots = allowed_roots(self.path)
        self.config = self._read_config()
        self.locations: dict[str, TensorLocation] = {}
        self.unexpected: list[str] = []  # stored tensors that the model has no use for
        try:
            for aux in AUX_FILES:
                if os.path.lexists(os.path.join(self.path, aux)):
                    self._confined(aux, os.path.join(self.path, aux))
            self._index()
            self._check_against_config()
        except BaseException:
            self.close()
            raise

    # ---- opening ----------------------------------------------------------------------------
    def _confined(self, filename: str, referrer: str) -> str:
        """The resolved path of `filename` in the checkpoint directory; refused when it is not a
        plain name, or when a symlink leads out of the directory."""
        if (not isinstance(filename, str) or os.path.basename(filename) != filename
                or filename in ("", ".", "..") or "\0" in filename):
            raise CheckpointError(f"{referrer}: file name {str(filename)[:200]!r} must be a plain "
                                  f"file name inside the checkpoint directory")
        full = os.path.join(self.path, filename)
        real = os.path.realpath(full)
        if not any(real != root and os.path.commonpath([real, root]) == root
                   for root in self._roots):
            raise CheckpointError(f"{referrer}: {full} is a link to {real}, outside the checkpoint "
                                  f"directory; refusing to read it")
        return full

    def _load_json(self, filename: str, referrer: str):
        full = self._confined(filename, referrer)
        try:
            fd = open_regular(full)
        except FormatError as e:
            raise CheckpointError(str(e)) from None
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if size > MAX_JSON_BYTES:
                raise CheckpointError(f"{full}: {size} bytes is far too large for a "
                                      f"{filename} (limit {MAX_JSON_BYTES}); not a checkpoint file")
            data = f.read(MAX_JSON_BYTES + 1)
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:  # also bad UTF-8, too-long integers
            what = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            raise CheckpointError(f"{full}: not valid JSON ({what})") from None

    def _read_config(self) -> ModelConfig:
        path = os.path.join(self.path, CONFIG_NAME)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a directory (expected a Hugging Face checkpoint "
                                  f"directory with {CONFIG_NAME} and *.safetensors)")
        if not os.path.lexists(path):
            raise CheckpointError(f"{path}: missing; a checkpoint directory needs its config.json")
        raw = self._load_json(CONFIG_NAME, path)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: must be a JSON object, got {type(raw).__name__}")
        try:
            return ModelConfig.from_hf(raw, source=path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None

    def _open(self, filename: str, referrer: str) -> SafetensorsFile:
        if filename not in self.files:
            full = self._confined(filename, referrer)
            if not os.path.isfile(full):
                raise CheckpointError(f"{referrer}: lists {filename!r}, which does not exist in "
                                      f"{self.path} (incomplete download?)")
            try:
                self.files[filename] = SafetensorsFile(full)
            except FormatError as e:
                raise CheckpointError(f"{e} (re-download or re-save this shard)") from None
        return self.files[filename]

    def _index(self) -> None:
        index_path = os.path.join(self.path, INDEX_NAME)
        single_path = os.path.join(self.path, SINGLE_NAME)
        stored_by_file: dict[str, list[str]] = {}
        if os.path.lexists(index_path):
            index = self._load_json(INDEX_NAME, index_path)
            if not isinstance(index, dict) or "weight_map" not in index:
                raise CheckpointError(f"{index_path}: not a valid index, needs a 'weight_map' object")
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to files")
            for stored, filename in weight_map.items():
                if not isinstance(filename, str):
                    raise CheckpointError(f"{index_path}: tensor {stored[:200]!r} maps to "
                                          f"{str(filename)[:200]!r}, not a file name")
                stored_by_file.setdefault(filename, []).append(stored)
            referrer = index_path
        elif os.path.lexists(single_path):
            stored_by_file[SINGLE_NAME] = list(self._open(SINGLE_NAME, single_path).tensors)
            referrer = single_path
        else:
            others = sorted(f for f in os.listdir(self.path) if f.endswith((".bin", ".pt", ".pth")))
            hint = (f" (found {', '.join(others)}: convert to safetensors, e.g. load with "
                    f"transformers and save_pretrained)") if others else ""
            raise CheckpointError(f"{self.path}: neither {SINGLE_NAME} nor {INDEX_NAME} found{hint}")
        for filename, stored_names in stored_by_file.items():
            shard = self._open(filename, referrer)
            for stored in stored_names:
                if stored not in shard.tensors:
                    raise CheckpointError(f"{shard.path}: tensor {stored!r} is missing, but "
                                          f"{referrer} says it is there (incomplete or mixed-up shards)")
                name = _canonical_name(stored)
                if name is None:
                    continue
                info = shard.tensors[stored]
                self.locations[name] = TensorLocation(name, stored, shard.path, info.dtype,
                                                      info.shape, info.offset, info.nbytes)
        self._split_fused_experts()

    def _split_fused_experts(self) -> None:
        """A checkpoint in transformers' in-memory MoE layout (moe.fused_expert_parts): each
        expert's matrix is a byte range of a fused tensor, given its own location under our
        (= save_pretrained's) name and read in place."""
        if not self.config.num_experts:
            return
        mxfp4_locations(self.locations, self.config, CheckpointError)  # gpt-oss's published experts
        for name in [n for n in self.locations if FUSED_EXPERTS.match(n)]:
            loc = self.locations.pop(name)
            try:
                parts = fused_expert_parts(name, loc.shape, loc.nbytes, self.config)
            except ConfigError as e:
                raise CheckpointError(f"{loc.path}: tensor {loc.stored_name!r}: {e}") from None
            for new, shape, offset, nbytes in parts:
                self._add_location(dataclasses.replace(loc, name=new, shape=shape, offset=loc.offset + offset,
                                                       nbytes=nbytes, part=nbytes != loc.nbytes))

    def _add_location(self, loc: TensorLocation) -> None:
        if loc.name in self.locations:
            raise CheckpointError(f"{loc.path}: tensor {loc.name!r} is stored twice (once in a fused "
                                  f"experts tensor {loc.stored_name!r}); the checkpoint mixes two layouts")
        self.locations[loc.name] = loc

    def _check_against_config(self) -> None:
        cfg, config_path = self.config, os.path.join(self.path, CONFIG_NAME)
        # counted before the expected names are listed: a 700-byte config.json asking for 10^7
        # layers must not make us build 10^8 names (or a model) before saying no
        layers = {int(m.group(1)) for n in self.locations  # DeepSeek's MTP layers after the last: unused
                  if (m := _LAYER_NAME.match(n)) is not None and int(m.group(1)) not in cfg.mtp_layer_indices}
        if cfg.num_hidden_layers != len(layers):
            raise CheckpointError(f"{config_path}: num_hidden_layers is {cfg.num_hidden_layers}, but "
                                  f"the weights hold tensors of {len(layers)} layers (config.json "
                                  f"and weights do not belong together, or the checkpoint is "
                                  f"truncated)")
        if cfg.num_experts:  # counted before the names are listed too (a config asking 10^7)
            pattern = re.compile(rf"model\.layers\.\d+\.{moe_names(cfg.architecture)[0]}\.experts\.(\d+)\.")
            experts = {m.group(1) for n in self.locations if (m := pattern.match(n)) is not None}
            if cfg.num_experts != len(experts):
                raise CheckpointError(f"{config_path}: num_experts is {cfg.num_experts}, but the weights "
                                      f"hold tensors of {len(experts)} experts (config.json and weights "
                                      f"do not belong together)")
        expected = parameter_shapes(cfg)
        for name, shape in expected.items():
            loc = self.locations.get(name)
            if loc is None:
                where = INDEX_NAME if SINGLE_NAME not in self.files else SINGLE_NAME
                raise CheckpointError(f"{os.path.join(self.path, where)}: tensor {name!r} is missing; "
                                      f"{config_path} ({cfg.architecture}, {cfg.num_hidden_layers} layers) "
                                      f"needs it (truncated checkpoint or wrong config.json?)")
            if loc.shape != shape:
                raise CheckpointError(f"{loc.path}: tensor {loc.stored_name!r} has shape {list(loc.shape)}, "
                                      f"but {config_path} implies {list(shape)} (config.json and weights "
                                      f"do not belong together)")
            if loc.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{loc.path}: tensor {loc.stored_name!r} is {loc.dtype}; only "
                                      f"float32/float16/bfloat16/float64 weights can be loaded "
                                      f"(quantised checkpoints are not supported)")
        self.unexpected = sorted(n for n in self.locations if n not in expected)

    # ---- queries ----------------------------------------------------------------------------
    def location(self, name: str) -> TensorLocation:
        try:
            return self.locations[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this checkpoint") from None

    def block_tensor_names(self, layer: int) -> list[str]:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise IndexError(f"layer {layer} out of range (model has {self.config.num_hidden_layers})")
        return [block_prefix(layer) + n for n in block_parameter_shapes(self.config, layer)]

    def non_block_tensor_names(self) -> list[str]:
        return [n for n in parameter_shapes(self.config) if not n.startswith("model.layers.")]

    def block_locations(self, layer: int) -> list[TensorLocation]:
        """The block's tensors in (file, offset) order: reading them in this order is sequential."""
        return sorted((self.location(n) for n in self.block_tensor_names(layer)),
                      key=lambda loc: (loc.path, loc.offset))

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far, over all shards (headers not counted)."""
        return sum(f.bytes_read for f in self.files.values())

    # ---- reads ------------------------------------------------------------------------------
    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (any device and float dtype, the tensor's shape) with tensor `name`.
        Straight into `out` when it is a contiguous CPU tensor of the stored dtype; otherwise
        through one CPU staging buffer and a converting copy."""
        loc = self.location(name)
        if tuple(out.shape) != loc.shape:
            raise CheckpointError(f"{loc.path}: tensor {loc.stored_name!r} has shape {list(loc.shape)}, "
                                  f"the destination has {list(out.shape)}")
        if loc.mxfp4 is not None:  # dequantized as it is read
            return read_mxfp4(self.files, loc, out)
        shard = self.files[os.path.basename(loc.path)]

        def fill(buf: torch.Tensor) -> None:
            if loc.part:  # one expert's range of a fused tensor (no CRC of its own)
                shard.read_bytes_into(loc.offset, buf)
            else:
                shard.read_into(loc.stored_name, buf)

        try:  # every read checked against the CRC-32C the file carries, where it carries one
            if out.device.type == "cpu" and out.dtype == loc.dtype and out.is_contiguous():
                fill(out.detach())  # detach: a Parameter's own storage
            else:
                staging = torch.empty(loc.shape, dtype=loc.dtype)
                fill(staging)
                with torch.no_grad():
                    out.copy_(staging)
        except FormatError as e:
            raise CheckpointError(f"{e}; {self.damage_advice()}") from None
        return out

    def checksum(self, name: str) -> tuple[str, int] | None:
        """(CRC kind, value) tensor `name`'s shard carries for it, or None (a checkpoint written
        by another program)."""
        loc = self.location(name)
        if loc.part:  # the file's CRC covers the whole fused tensor
            return None
        shard = self.files[os.path.basename(loc.path)]
        crc = shard.checksums.get(loc.stored_name)
        return None if crc is None else (shard.checksum_kind, crc)

    def damage_advice(self) -> str:
        """What to do about a damaged file of this directory: a conversion cache is deleted and
        converted again from its source; a checkpoint is fetched or restored again."""
        try:
            with open(os.path.join(self.path, CONVERTED_FROM_NAME)) as f:
                source = json.load(f).get("source")
        except (OSError, ValueError, AttributeError):
            source = None
        if isinstance(source, str):
            return (f"{self.path} is a cache converted from {source}: delete it and run again "
                    f"(it is converted anew)")
        return "download or restore the checkpoint again"

    def read_tensors_into(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill several tensors, reading in file order."""
        for name in sorted(tensors, key=lambda n: (self.location(n).path, self.location(n).offset)):
            self.read_into(name, tensors[name])

    def read_block_into(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill exactly the block's tensors (keys: checkpoint names, `block_tensor_names(layer)`)."""
        names = set(self.block_tensor_names(layer))
        if set(tensors) != names:
            raise KeyError(f"layer {layer}: expected tensors {sorted(names)}, got {sorted(tensors)}")
        self.read_tensors_into(tensors)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        loc = self.location(name)
        return self.read_into(name, torch.empty(loc.shape, dtype=dtype or loc.dtype))

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the checkpoint's model on meta and fill it block by block (one block in flight)."""
    with CheckpointReader(path) as reader:
        return build_model(reader.config, device, dtype, source=reader)


# ---- writing ----------------------------------------------------------------------------------
StateSource = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _named_tensors(source: StateSource, expected: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in checkpoint order, each checked against the config's shapes."""
    if isinstance(source, nn.Module):
        params = dict(source.named_parameters(remove_duplicate=False))
        pairs: Iterable[tuple[str, torch.Tensor]] = ((n, params[n]) for n in expected if n in params)
        given: set[str] | None = set(params)
    elif isinstance(source, Mapping):
        pairs, given = ((n, source[n]) for n in expected if n in source), set(source)
    else:
        pairs, given = source, None
    seen: set[str] = set()
    for name, t in pairs:
        if name == "lm_head.weight" and name not in expected:
            continue  # tied: the embedding already holds it
        if name not in expected:
            raise CheckpointError(f"save_pretrained: unexpected tensor {name!r} for this config")
        if name in seen:
            raise CheckpointError(f"save_pretrained: tensor {name!r} given twice")
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"save_pretrained: tensor {name!r} has shape {list(t.shape)}, "
                                  f"config implies {list(expected[name])}")
        if t.device.type == "meta":
            raise CheckpointError(f"save_pretrained: tensor {name!r} is on the meta device; "
                                  f"materialise the model before saving")
        seen.add(name)
        yield name, t
    missing = [n for n in expected if n not in seen]
    if missing:
        what = "source" if given is None else "model/state"
        raise CheckpointError(f"save_pretrained: {what} lacks {len(missing)} tensors, first {missing[0]!r}")


def _write_json(path: str, obj: object) -> None:
    write_json_atomic(path, obj, indent=2, sort_keys=True)


def _is_leftover(name: str) -> bool:
    """A temporary file of an earlier save_pretrained that was killed before cleaning up."""
    return name.startswith(".partial-") or (
        ".json.tmp." in name and name.rsplit(".", 1)[-1].isdigit())


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def save_pretrained(source: StateSource, path: str | os.PathLike, *, config: ModelConfig | None = None,
                    dtype: torch.dtype | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    extra_files: Mapping[str, str | dict] | None = None) -> list[str]:
    """Write a Hugging Face checkpoint directory that `transformers` loads.

    source: our model, a state dict, or an iterable of (name, tensor) in checkpoint order
    (embeddings, layers 0..L-1, norm, lm_head) so a streamer can hand over one block at a time.
    dtype: convert every tensor to this dtype (default: keep each tensor's own).
    extra_files: file name -> text or JSON object written beside the weights (the tokenizer's
    files, `Tokenizer.files()`); a generation_config.json among them replaces the one derived
    from the config (the source checkpoint's own says which ids end generation).
    Only one shard (<= max_shard_bytes) is held in memory at a time. Returns the files written."""
    path = os.fspath(path)
    if config is None:
        if not isinstance(source, LlamaForCausalLM):
            raise CheckpointError("save_pretrained: pass config= when saving a state dict or iterable")
        config = source.config
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"save_pretrained: dtype {dtype} is not a float dtype")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if _is_leftover(name) and os.path.isfile(os.path.join(path, name)):
            os.unlink(os.path.join(path, name))
    previous_shards = _indexed_files(os.path.join(path, INDEX_NAME))
    ours = parameter_shapes(config)  # gpt-oss's experts are written fused, as transformers writes them
    shards, total_bytes, seen_dtype = _write_shards(fused_for_export(config, _named_tensors(source, ours)),
                                                    checkpoint_shapes(config, ours), path, dtype, max_shard_bytes)
    written = _publish_shards(path, shards, total_bytes)
    written += _write_side_files(path, config, seen_dtype, extra_files)
    for stale in previous_shards - {os.path.basename(w) for w in written}:
        if os.path.isfile(os.path.join(path, stale)):  # shards of an earlier save, now unreferenced
            os.unlink(os.path.join(path, stale))
    fsync_dir(path)
    return written


def _export_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None, path: str) -> torch.Tensor:
    """`t` on the CPU in the export dtype, contiguous; refused when it is not a float tensor or
    holds inf/nan (before or after the conversion)."""
    t = t.detach()
    if t.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"save_pretrained: tensor {name!r} is {t.dtype}, not a float dtype")
    source = t
    t = t.to(device="cpu", dtype=dtype or t.dtype).contiguous()
    if not all_finite(t):
        # a checkpoint transformers would load and compute inf/nan with: never written
        why = (f"values past {t.dtype}'s range (largest {torch.finfo(t.dtype).max:g}); "
               f"export in bf16 or fp32" if all_finite(source) else "inf/nan values")
        raise CheckpointError(f"save_pretrained: tensor {name!r} holds {why}; nothing "
                              f"was written to {path}")
    return t


Shard = tuple[str, list[str], int]  # (temporary file, tensor names, bytes)


def _write_shards(source: StateSource, expected: dict[str, tuple[int, ...]], path: str,
                  dtype: torch.dtype | None, max_shard_bytes: int
                  ) -> tuple[list[Shard], int, torch.dtype | None]:
    """Every tensor into temporary shard files of at most max_shard_bytes (one shard in memory
    at a time): ([(temporary file, names, bytes)], total bytes, the first tensor's dtype). On any
    failure the temporaries are removed and nothing final has been touched."""
    metadata = {"format": "pt"}
    shards: list[Shard] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes, total_bytes, seen_dtype = 0, 0, None

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            tmp = os.path.join(path, f".partial-{len(shards):05d}.safetensors")
            write_file(tmp, current, metadata, atomic=True, checksums=True)  # verified on read
            shards.append((tmp, list(current), current_bytes))
            current, current_bytes = {}, 0

    try:
        for name, t in _named_tensors(source, expected):
            t = _export_tensor(name, t, dtype, path)
            seen_dtype = seen_dtype or t.dtype
            nbytes = t.numel() * t.element_size()
            if current and current_bytes + nbytes > max_shard_bytes:
                flush()
            current[name] = t
            current_bytes += nbytes
            total_bytes += nbytes
        flush()
    except BaseException:
        for tmp, _, _ in shards:  # nothing final was touched yet: leave the directory as it was
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    return shards, total_bytes, seen_dtype


def _publish_shards(path: str, shards: list[Shard], total_bytes: int) -> list[str]:
    """Rename the temporary shards to their final names (one file, or numbered shards and an
    index), removing whichever of the single file / index would shadow them."""
    written: list[str] = []
    index_path, single_path = os.path.join(path, INDEX_NAME), os.path.join(path, SINGLE_NAME)
    if len(shards) == 1:
        os.replace(shards[0][0], single_path)
        written.append(single_path)
        if os.path.exists(index_path):  # a leftover index would make loaders read old shards
            os.unlink(index_path)
        return written
    weight_map: dict[str, str] = {}
    for i, (tmp, names, _) in enumerate(shards, start=1):
        final = os.path.join(path, _shard_name(i, len(shards)))
        os.replace(tmp, final)
        written.append(final)
        weight_map.update({n: os.path.basename(final) for n in names})
    if os.path.exists(single_path):
        os.unlink(single_path)  # would shadow the index
    _write_json(index_path, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    written.append(index_path)
    return written


def _write_side_files(path: str, config: ModelConfig, seen_dtype: torch.dtype | None,
                      extra_files: Mapping[str, str | dict] | None) -> list[str]:
    """config.json, generation_config.json and the tokenizer's files beside the weights."""
    written: list[str] = []
    dtype_name = _DTYPE_NAMES.get(seen_dtype) if seen_dtype is not None else None
    config_path = os.path.join(path, CONFIG_NAME)
    _write_json(config_path, config.to_hf(dtype=dtype_name))
    written.append(config_path)
    generation = {k: v for k, v in (("bos_token_id", config.bos_token_id),
                                     ("eos_token_id", config.to_hf()["eos_token_id"]),
                                     ("pad_token_id", config.pad_token_id)) if v is not None}
    extra = dict(extra_files or {})
    generation = {**generation, **extra.pop("generation_config.json", {})}
    if generation:
        gen_path = os.path.join(path, "generation_config.json")
        _write_json(gen_path, generation)
        written.append(gen_path)
    for name, content in extra.items():
        if name not in AUX_FILES:
            raise CheckpointError(f"save_pretrained: {name!r} is not a tokenizer or generation file")
        target = os.path.join(path, name)
        if isinstance(content, str):
            write_text_atomic(target, content)
        else:
            _write_json(target, content)
        written.append(target)
    return written


def _indexed_files(index_path: str) -> set[str]:
    """Plain file names an existing index refers to (empty when there is none or it is bad)."""
    try:
        with open(index_path) as f:
            files = json.load(f)["weight_map"].values()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return set()
    # only our kind of file: an index planted in the output directory must not make a save
    # delete anything else there
    return {f for f in files if isinstance(f, str) and os.path.basename(f) == f
            and f.endswith(".safetensors")}

