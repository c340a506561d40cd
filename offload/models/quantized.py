"""Quantized decoder blocks: int8 / int4 projection weights that travel as they are stored.

`--quantize int8|int4` replaces the projections of every decoder layer (config.projection_names:
attention, MLP, every MoE expert's; not the MoE router) by `QuantLinear`s
whose weights are group-wise codes plus fp16 scales (offload/quant/format.py has the format,
offload/quant/matmul.py the matmul). The layers are converted once, block by block, into a cache directory of one
4 KiB-aligned safetensors file per block (the NVMe tier's format), and reused on later runs:

    <cache>/quant/<model>-<key>/block_00000.safetensors ... manifest.json

`key` hashes the source's content (the config, and each weight file's size, header and sampled
extents: nvme.format.content_digest) and the settings (bits, group size, compute dtype, format
version), so a changed checkpoint or setting converts again and never reuses stale codes. Each
block file is written atomically, carries the key in its metadata and each tensor's CRC-32C,
checked on every read of it (a damaged cache is refused, never computed with): a conversion
killed half way keeps the blocks it finished. The manifest (written last, atomically) lists
every projection's spec and every block's bytes.

A block file holds its tensors ordered by element size, widest first (fp32/16-bit norms and
biases, fp16 scales, then the 1-byte codes), so that every tensor starts on a multiple of its
element size and the whole block can be one uint8 buffer: the block streamer moves it as a
*byte block* (offload/memory/layout.py) from NVMe or host RAM into a device slot as it is, with
no conversion on the way, and binds each parameter as a view of its own dtype. Embeddings and
the final norm stay in the compute dtype; the head too unless it is quantized at load (`head`:
runners.infer does, in int8 groups of 32, the Q8_0 llama.cpp keeps heads in).

A GGUF source's Q8_0 tensors (for int8) and Q4_0 / Q4_1 tensors (for int4) are taken as they
are (`quant_format.from_gguf`: group size 32, the same values exactly), never round-tripped through 16
bits; every other type (the K-quants Q2_K..Q6_K, Q5_0/Q5_1, and the 16-bit ones) is converted once:
dequantized by the gguf package to float32 and quantized at the asked group size like any
checkpoint's weight (scripts/bench_kquant.py measures the error this adds on the real Gemma 3 file).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from nvme.format import (FormatError, content_digest, read_header, stored_checksums, write_file,
                         write_json_atomic)
from nvme.io import IOEngine
from offload.memory.layout import TensorRange
from offload.models.config import (ModelConfig, block_parameter_shapes, block_prefix, input_major,
                                   projection_names)
from offload.quant.cpu import ACTIVATIONS
from offload.quant.matmul import check_kernels, quant_linear
from offload.quant.format import QuantError, QuantSpec, from_gguf, packed_bytes, quantize

FORMAT_VERSION = 2  # 2: each block file carries its tensors' CRC-32C (verified on every read)
# every family's projections (a block has some of them: config.projection_names)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj",
               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.down_proj")
QUANT_MODES = ("int8", "int4")
# int8: groups of 32 (llama.cpp's Q8_0): on SmolLM2 98.1% teacher-forced top-1 agreement with
# the unquantized model against 96.7% per output channel, at 0.83-0.98x its decode speed on the
# 1B preset in RAM (docs/benchmarks/int8.md); --group-size channel takes the faster one
DEFAULT_GROUP = {"int8": 32, "int4": 64}
PER_CHANNEL = -1  # QuantSettings.group_size for one scale per output row (int8 only)
# GGUF types kept as they are; the rest (K-quants, Q5_0/Q5_1, F16...) are dequantized and quantized
GGUF_TAKEN = {"int8": ("Q8_0",), "int4": ("Q4_0", "Q4_1")}


def part_shapes(out_f: int, in_f: int, spec: QuantSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{part name: (shape, dtype)} of one quantized weight (the layout offload/quant/format.py makes)."""
    groups, padded = spec.groups(in_f), spec.padded_in(in_f)
    if spec.bits == 8:
        return {"qweight": ((out_f, padded), torch.int8), "scales": ((out_f, groups), torch.float16)}
    return {"qweight": ((out_f, padded // 2), torch.uint8), "scales": ((out_f, groups), torch.float16),
            "mins": ((out_f, groups), torch.float16)}


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W kept as group-wise codes and scales (offload/quant/format.py). The
    parts are parameters (requires_grad False) so that the block streamer binds them like any
    weight; they are made on meta and given storage by the streamer. `activations` "int8"
    (set_activations; opt-in, --activations int8): x quantized per 32 columns in the C loop
    (offload/quant/matmul.py), else "fp32" (x as given)."""

    activations = "fp32"

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, bias: bool,
                 dtype: torch.dtype, device: torch.device | str = "meta"):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.part_names = tuple(part_shapes(out_features, in_features, spec))
        for name, (shape, dt) in part_shapes(out_features, in_features, spec).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dt, device=device),
                                                       requires_grad=False))
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        parts = {n: getattr(self, n) for n in self.part_names}
        # the parts were made to part_shapes and are only ever rebound to views of those
        # shapes and dtypes (the streamer's byte blocks): no check per call
        return quant_linear(x, parts, self.spec, self.in_features, self.bias, checked=True,
                            activations=self.activations)

    def extra_repr(self) -> str:
        g = self.spec.group_size or self.in_features
        a8 = ", int8 activations" if self.activations == "int8" else ""
        return f"in={self.in_features}, out={self.out_features}, int{self.spec.bits}, group={g}{a8}"


def set_activations(model: nn.Module, activations: str) -> None:
    """Every QuantLinear of `model` (blocks and a quantized head) takes x as `activations`."""
    if activations not in ACTIVATIONS:
        raise QuantError(f"activations {activations!r}: use one of {', '.join(ACTIVATIONS)}")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.activations = activations


# ---- which projection gets which spec --------------------------------------------------------
@dataclass(frozen=True)
class QuantSettings:
    """What the user asked for: `mode` int8|int4, the group size (0: the mode's default,
    PER_CHANNEL: one scale per output row) and how the products take x: `activations` "fp32"
    (as given, the default) or "int8" (quantized per 32 columns: faster, different math, opt-in;
    not part of the stored codes, so not of the cache key)."""
    mode: str
    group_size: int = 0
    activations: str = "fp32"

    def spec(self) -> QuantSpec:
        if self.mode not in QUANT_MODES:
            raise QuantError(f"--quantize {self.mode!r}: use one of {', '.join(QUANT_MODES)}")
        if self.group_size == PER_CHANNEL and self.mode != "int8":
            raise QuantError("one scale per output channel is for int8; int4 needs groups "
                             "(e.g. --group-size 32, 64, 128)")
        if self.activations not in ACTIVATIONS:
            raise QuantError(f"--activations {self.activations!r}: use one of {', '.join(ACTIVATIONS)}")
        g = 0 if self.group_size == PER_CHANNEL else self.group_size or DEFAULT_GROUP[self.mode]
        spec = QuantSpec(bits=8 if self.mode == "int8" else 4, group_size=g)
        spec.validate()
        return spec


def projection_specs(cfg: ModelConfig, settings: QuantSettings,
                     gguf_types: dict[str, str] | None = None) -> list[dict[str, QuantSpec]]:
    """Per layer, {projection: spec}: the asked spec, or group 32 where a GGUF source's tensor is
    of a type this mode takes as it is (`gguf_types`: our weight name -> GGUF type name)."""
    spec = settings.spec()
    out = []
    for i in range(cfg.num_hidden_layers):
        specs = {}
        for proj in projection_names(cfg, i):
            kind = (gguf_types or {}).get(f"{block_prefix(i)}{proj}.weight")
            specs[proj] = QuantSpec(spec.bits, 32) if kind in GGUF_TAKEN[settings.mode] else spec
        out.append(specs)
    return out


def quantized_block_bytes(cfg: ModelConfig, specs: dict[str, QuantSpec], dtype: torch.dtype,
                          layer: int | None = None) -> int:
    """Bytes of quantized block `layer` (config.block_parameter_shapes): the projections' parts
    plus the norms and biases in `dtype`."""
    total = 0
    for name, shape in block_parameter_shapes(cfg, layer).items():
        proj = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and proj in specs:  # quantized [out, in] (gpt-oss's experts: transposed)
            total += packed_bytes(*(shape[::-1] if input_major(cfg, name) else shape), specs[proj])
        else:  # norms, biases, an MoE router (a matrix kept dense)
            total += math.prod(shape) * dtype.itemsize
    return total


def quantize_layers(model: nn.Module, specs: Sequence[dict[str, QuantSpec]], dtype: torch.dtype) -> None:
    """Replace every decoder layer's projections by QuantLinears on meta (no memory)."""
    for layer, layer_specs in zip(model.model.layers, specs):
        for proj, spec in layer_specs.items():
            owner, _, attr = proj.rpartition(".")
            parent = layer.get_submodule(owner)
            lin = getattr(parent, attr)
            setattr(parent, attr, QuantLinear(lin.in_features, lin.out_features, spec,
                                              lin.bias is not None, dtype))


# ---- conversion into the cache --------------------------------------------------------------
def source_identity(paths: Sequence[str], config: ModelConfig) -> str:
    """What a conversion depends on in its source: the config and each weight file's content
    (nvme.format.content_digest: size, header, sampled extents; not name, size and mtime, which
    another checkpoint at the same path can share)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(config.to_hf(dtype="x"), sort_keys=True).encode())
    for p in sorted(paths):
        h.update(f"{os.path.basename(p)}/{content_digest(p)}".encode())
    return h.hexdigest()


def cache_key(identity: str, settings: QuantSettings, dtype: torch.dtype) -> str:
    spec = settings.spec()
    return hashlib.blake2b(f"{identity}/{spec.bits}/{spec.group_size}/{dtype}/v{FORMAT_VERSION}".encode(),
                           digest_size=8).hexdigest()


def block_file(qdir: str, layer: int) -> str:
    return os.path.join(qdir, f"block_{layer:05d}.safetensors")


def _ordered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Widest element first, then by name: every tensor starts on a multiple of its element size."""
    return {n: tensors[n] for n in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))}


def quantize_block(dense: dict[str, torch.Tensor], specs: dict[str, QuantSpec], dtype: torch.dtype,
                   taken: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """One block's file tensors (names relative to the layer) from its dense weights (`dense`,
    names relative to the layer; a projection in `taken` already has its parts)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        proj = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and proj in specs:
            try:
                parts = quantize(w, specs[proj])
            except QuantError as e:
                raise QuantError(f"{proj}: {e}") from None
            out.update({f"{proj}.{k}": v for k, v in parts.items()})
        else:
            out[name] = w.to(dtype).contiguous()
    for proj, parts in (taken or {}).items():
        out.update({f"{proj}.{k}": v.contiguous() for k, v in parts.items()})
    return _ordered(out)


@dataclass
class QuantizedBlocks:
    """A converted cache directory: where each block's file is, and each projection's spec."""
    path: str
    key: str
    specs: list[dict[str, QuantSpec]]
    block_bytes: list[int]

    def ranges(self, layer: int) -> list[TensorRange]:
        """Block `layer`'s tensors as raw byte ranges (a byte block: dtype uint8)."""
        path = block_file(self.path, layer)
        infos, meta = read_header(path)
        kind, sums = stored_checksums(meta, path)  # every read of the range is checked against them
        if set(sums) != set(infos):
            raise QuantError(f"{path}: the block's tensors carry no complete set of CRC-32C values "
                             f"(damaged, or written by another program): delete {self.path} and "
                             f"run again (it is converted anew)")
        return [TensorRange(n, path, t.offset, t.nbytes, torch.uint8, (kind, sums[n]))
                for n, t in infos.items()]


class QuantizedSource:
    """What `offload.initialize(model, cfg, source=...)` needs to train over a quantized base
    (QLoRA): the non-block weights from `reader`, each layer's quantized base as the raw byte
    ranges of its block file (offload/stream/frozen.py streams them as they are stored)."""

    def __init__(self, reader, blocks: "QuantizedBlocks"):
        self.reader, self.blocks = reader, blocks

    def read_tensors_into(self, tensors: dict[str, torch.Tensor]) -> None:
        self.reader.read_tensors_into(tensors)

    def layer_ranges(self, layer: int) -> list[TensorRange]:
        return self.blocks.ranges(layer)


def _manifest(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_converted(path: str, key: str) -> bool:
    """A finished conversion of this key is in `path` (convert_blocks will only read it)."""
    m = _manifest(path)
    return m is not None and m.get("key") == key


def _done(path: str, layer: int, key: str) -> bool:
    try:
        _, meta = read_header(block_file(path, layer))
    except (OSError, FormatError):
        return False
    return meta.get("key") == key


BlockSource = Callable[[int], tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]]


def convert_blocks(path: str, key: str, cfg: ModelConfig, specs: list[dict[str, QuantSpec]],
                   dtype: torch.dtype, source: BlockSource,
                   progress: Callable[[int], None] | None = None) -> QuantizedBlocks:
    """Quantize every block not already in `path` under `key` (source(i) -> dense tensors and
    taken parts of block i), then write the manifest. Reuses a finished conversion at once."""
    if not is_converted(path, key):
        os.makedirs(path, exist_ok=True)
        for i in range(cfg.num_hidden_layers):
            if not _done(path, i, key):
                dense, taken = source(i)
                write_file(block_file(path, i), quantize_block(dense, specs[i], dtype, taken),
                           metadata={"key": key, "layer": str(i)}, checksums=True)
            if progress is not None:
                progress(i)
        sizes = [sum(t.nbytes for t in read_header(block_file(path, i))[0].values())
                 for i in range(cfg.num_hidden_layers)]
        write_json_atomic(os.path.join(path, "manifest.json"), {
            "key": key, "format": FORMAT_VERSION, "dtype": str(dtype).replace("torch.", ""),
            "block_bytes": sizes,
            "specs": [{p: [s.bits, s.group_size] for p, s in layer.items()} for layer in specs]})
    m = _manifest(path)
    specs_read = [{p: QuantSpec(b, g) for p, (b, g) in layer.items()} for layer in m["specs"]]
    return QuantizedBlocks(path, key, specs_read, list(m["block_bytes"]))


def checkpoint_source(reader, dtype: torch.dtype) -> BlockSource:
    """Dense fp32 block tensors read from a CheckpointReader (nothing taken as it is)."""
    def source(i: int):
        shapes = block_parameter_shapes(reader.config, i)
        dense = {n: torch.empty(s, dtype=torch.float32) for n, s in shapes.items()}
        reader.read_block_into(i, {block_prefix(i) + n: t for n, t in dense.items()})
        # a weight stored [in, out] (gpt-oss's experts) is quantized as the [out, in] it multiplies by
        return {n: t.t().contiguous() if input_major(reader.config, n) else t for n, t in dense.items()}, {}
    return source


def gguf_source(gguf_reader, settings: QuantSettings) -> BlockSource:
    """Block tensors of a GGUFReader: projections whose GGUF type this mode keeps are taken as
    they are (rows put back in Hugging Face order); the rest dequantized to fp32."""
    def source(i: int):
        cfg = gguf_reader.config
        dense, taken = {}, {}
        projections = set(projection_names(cfg, i))  # an MoE's experts too: each a slice of its 3-D tensor
        for n in block_parameter_shapes(cfg, i):
            full = block_prefix(i) + n
            t = gguf_reader.tensors[full]
            proj = n.rsplit(".", 1)[0]
            if n.endswith(".weight") and proj in projections and t.tensor_type.name in GGUF_TAKEN[settings.mode]:
                shape = tuple(int(d) for d in reversed(list(t.shape)))
                _, parts = from_gguf(t.tensor_type.name, t.data, shape)
                taken[proj] = {k: torch.from_numpy(gguf_reader.unpermute_rows(full, v.numpy()).copy())
                               for k, v in parts.items()}
            else:
                dense[n] = gguf_reader.read(full, torch.float32)
        return dense, taken
    return source


def gguf_types(gguf_reader) -> dict[str, str]:
    return {name: t.tensor_type.name for name, t in gguf_reader.tensors.items()}


def quantized_dir(cache_root: str, model_name: str, key: str) -> str:
    stem = os.path.basename(os.path.normpath(model_name)).split(".gguf")[0] or "model"
    return os.path.join(cache_root, "quant", f"{stem}-{key}")


def default_cache_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "offload")


def quantize_checkpoint(reader, settings: QuantSettings, dtype: torch.dtype, *,
                        cache_root: str | None = None, gguf_path: str | None = None,
                        name: str | None = None, progress: Callable[[int], None] | None = None,
                        before_convert: Callable[[str, int], None] | None = None) -> QuantizedBlocks:
    """The quantized blocks of an open CheckpointReader (or of `gguf_path`, whose tensors of
    this mode's width are taken as they are; `reader` is then its converted directory), in
    `cache_root`/quant (default ~/.cache/offload/quant): converted now unless a finished
    conversion of the same source and settings is there. `before_convert(dir, bytes)` is called
    only when something is converted (the runner checks the disk there)."""
    cfg = reader.config
    g = None
    try:
        if gguf_path is not None:
            from offload.models.gguf import GGUFReader
            g = GGUFReader(gguf_path)
        files = [gguf_path] if g else sorted({loc.path for loc in reader.locations.values()})
        key = cache_key(source_identity(files, cfg), settings, dtype)
        specs = projection_specs(cfg, settings, gguf_types(g) if g else None)
        qdir = quantized_dir(cache_root or default_cache_root(), name or gguf_path or reader.path, key)
        source = gguf_source(g, settings) if g else checkpoint_source(reader, dtype)
        if before_convert is not None and not is_converted(qdir, key):
            before_convert(qdir, sum(quantized_block_bytes(cfg, s, dtype, i) for i, s in enumerate(specs)))
        return convert_blocks(qdir, key, cfg, specs, dtype, source, progress)
    finally:
        if g is not None:
            g.close()


# ---- the vocabulary head ----------------------------------------------------------------------
# A decode step reads the whole head (vocab x hidden): for SmolLM2 in int4, 113 MB of fp32 head
# against 58 MB of blocks. llama.cpp keeps it in Q8_0 (or Q6_K); int8 in groups of 32 is Q8_0.
HEAD_SPEC = QuantSpec(bits=8, group_size=32)


def head_bytes(cfg: ModelConfig, spec: QuantSpec | None, dtype: torch.dtype) -> int:
    """What the head adds to the non-block weights as loaded: with `spec`, its codes -- beside
    the embedding table a tied head shares, in place of an untied head's dense weight."""
    if spec is None:
        return 0
    dense = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * dtype.itemsize
    return packed_bytes(cfg.vocab_size, cfg.hidden_size, spec) - dense


def quantize_head(model: nn.Module, spec: QuantSpec, dtype: torch.dtype) -> None:
    """model.lm_head becomes a QuantLinear of `spec` on the head's device, its codes made now
    from the dense head (inference only: it has no gradient). A tied head's embedding stays
    dense: a step reads one row of it per token."""
    head = model.lm_head
    w = head.weight.detach()
    parts = quantize(w.cpu(), spec)
    q = QuantLinear(head.in_features, head.out_features, spec, bias=False, dtype=dtype, device=w.device)
    for name, t in parts.items():
        getattr(q, name).data.copy_(t)
    model.lm_head = q


def load_quantized_streamed(reader, blocks: QuantizedBlocks, residency: Sequence[str], *,
                            device: torch.device | str, dtype: torch.dtype, host_ahead: int = 1,
                            nvme_ahead: int = 2, io: IOEngine | None = None,
                            zero_copy_host: bool | None = None, fetch_delay_s: float = 0.0,
                            progress: Callable[[int], None] | None = None, experts=None,
                            head: QuantSpec | None = None, activations: str = "fp32"):
    """(model, attached streamer): non-block weights from `reader` in `dtype` on the device, the
    quantized blocks streamed as byte blocks from `blocks`' files per `residency`; `experts`
    (offload.stream.experts.ExpertPlacement): an MoE model's experts placed one by one, each its
    quantized bytes (see offload.models.streaming.load_streamed); `head`: the vocabulary head
    quantized too (HEAD_SPEC: what runners.infer --quantize does), else dense; `activations`:
    set_activations for every quantized projection (and the head)."""
    from offload.models.llama import build_model, materialize_non_block
    from offload.models.streaming import stream_blocks

    model = build_model(reader.config, "meta", dtype)
    quantize_layers(model, blocks.specs, dtype)
    cfg = reader.config
    shapes = [(m.spec, m.in_features, m.out_features) for m in model.modules()
              if isinstance(m, QuantLinear)]
    check_kernels(shapes + ([(head, cfg.hidden_size, cfg.vocab_size)] if head else []), dtype, device)
    materialize_non_block(model, device, dtype, reader)
    if head is not None:
        quantize_head(model, head, dtype)
    set_activations(model, activations)
    files = [blocks.ranges(i) for i in range(reader.config.num_hidden_layers)]
    return stream_blocks(model, reader, files, residency, torch.uint8, experts, device=device,
                         dtype=torch.uint8, host_ahead=host_ahead, nvme_ahead=nvme_ahead, io=io,
                         zero_copy_host=zero_copy_host, fetch_delay_s=fetch_delay_s,
                         progress=progress)

