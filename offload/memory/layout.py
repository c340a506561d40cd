"""Where a streamed block's bytes come from and how they lie in its flat buffer.

`layout_block` turns one block (a module of the model's ModuleList) and, optionally, the byte
ranges its parameters occupy in files into a `BlockLayout`: the `Block` whose parameters become
views of one flat buffer, the stored dtype, the contiguous file runs to read (adjacent tensors
merged into one read) and the byte shift that lines a buffer up with the first run for O_DIRECT.
The streamer (offload/stream/streamer.py) moves bytes by this layout; it does not build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nvme.format import crc_of
from nvme.io import ALIGN
from offload.memory.blocks import Block, ParamSlot


class StreamError(RuntimeError):
    """The streamer cannot do what was asked (bad residency, missing source, no free slot,
    an illegal block-state transition)."""


@dataclass(frozen=True)
class TensorRange:
    """Where one parameter's bytes are stored: a byte range of a (safetensors) file."""
    name: str  # parameter name relative to the block module, e.g. "self_attn.q_proj.weight"
    path: str
    offset: int  # absolute byte offset of the first byte in `path`
    nbytes: int
    dtype: torch.dtype  # stored dtype (converted to the compute dtype after the read)
    # (CRC kind, value) of the bytes as written, where the file carries one: checked on every read
    checksum: tuple[str, int] | None = None


@dataclass
class Run:
    """One contiguous byte range of a file, landing at `buf_offset` of the block's stored bytes."""
    path: str
    offset: int
    nbytes: int
    buf_offset: int


@dataclass
class BlockLayout:
    block: Block
    stored_dtype: torch.dtype | None  # None: the module's own values are the source
    runs: list[Run] = field(default_factory=list)
    shift: int = 0  # byte shift that lines a buffer up with the first run
    # the module's values (compute dtype, CPU), when they are the source
    host_values: dict[str, torch.Tensor] | None = None
    # the stored tensors whose files carry a checksum: checked after every read of the block
    checks: list["RangeCheck"] = field(default_factory=list)


@dataclass(frozen=True)
class RangeCheck:
    """One stored tensor of a block whose file carries its CRC: where it lands in the block's
    stored bytes, and the CRC its bytes must have (TensorRange.checksum)."""
    name: str
    path: str
    buf_offset: int
    nbytes: int
    kind: str  # "crc32c" or "crc32" (nvme.format.crc_of)
    crc: int


def _file_runs(i: int, params: dict[str, nn.Parameter], ranges: list[TensorRange],
               dtype: torch.dtype) -> tuple[list[str], torch.dtype, list[Run], int, list[RangeCheck]]:
    """(parameter order = file order, stored dtype, merged runs, shift, the checksummed tensors)
    of a file-backed block.
    `dtype` uint8 is a byte block: every range is stored as raw bytes (dtype uint8) holding the
    parameter's own dtype, which the parameter keeps (quantized blocks, offload/models/quantized.py)."""
    by_name = {r.name: r for r in ranges}
    byte_block = dtype == torch.uint8
    if set(by_name) != set(params):
        raise StreamError(f"block {i}: file ranges cover {sorted(by_name)}, the module has "
                          f"parameters {sorted(params)}")
    order = sorted(by_name, key=lambda n: (by_name[n].path, by_name[n].offset))
    dtypes = {by_name[n].dtype for n in order}
    if len(dtypes) != 1:
        raise StreamError(f"block {i}: parameters stored in several dtypes {dtypes}")
    stored = dtypes.pop()
    runs: list[Run] = []
    checks: list[RangeCheck] = []
    pos = 0
    for n in order:
        r = by_name[n]
        if r.checksum is not None:
            checks.append(RangeCheck(n, r.path, pos, r.nbytes, *r.checksum))
        # a byte block stores each parameter's own bytes (see blocks.ParamSlot.dtype)
        expect = params[n].numel() * (params[n].element_size() if byte_block else stored.itemsize)
        if r.nbytes != expect:
            raise StreamError(f"block {i}: {n} is stored as {r.nbytes} bytes, expected {expect}")
        last = runs[-1] if runs else None
        if last and last.path == r.path and last.offset + last.nbytes == r.offset:
            last.nbytes += r.nbytes  # adjacent in the file: one read
        else:
            runs.append(Run(r.path, r.offset, r.nbytes, pos))
        pos += r.nbytes
    shift = runs[0].offset % ALIGN
    # the typed view must start on an element boundary of both dtypes
    if shift % stored.itemsize or shift % dtype.itemsize:
        shift = 0
    return order, stored, runs, shift, checks


def verify_ranges(i: int, checks: list[RangeCheck], stored: torch.Tensor) -> None:
    """Check block i's stored bytes just read (`stored`: uint8, the block's byte layout) against
    the CRC each tensor's file carries: a damaged cache or checkpoint is refused, never computed
    with (CRC-32C: ~13 GB/s on one core, measured in docs/RELIABILITY.md)."""
    for c in checks:
        got = crc_of(stored[c.buf_offset:c.buf_offset + c.nbytes], c.kind)
        if got != c.crc:
            raise StreamError(
                f"{c.path}: tensor {c.name!r} of block {i} fails its checksum (CRC written "
                f"{c.crc:08x}, read {got:08x}): the file is damaged; if it is a cache (a quantized "
                f"or converted model), delete its directory and run again (it is rebuilt), else "
                f"download or restore it again")


def streamed_params(layer: nn.Module, frozen_only: bool = False,
                    skip: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
    """The parameters of `layer` a streamed block holds, module order: all of them, or with
    `frozen_only` those that need no gradient (a LoRA model's frozen base: the adapters beside
    it stay where they are, trained by the engine); none whose name starts with one of `skip`
    (placed by someone else: an MoE layer's routed experts, offload/stream/experts.py)."""
    return {n: p for n, p in layer.named_parameters()
            if not (frozen_only and p.requires_grad) and not n.startswith(skip)}


def layout_block(i: int, layer: nn.Module, ranges: list[TensorRange] | None, *, residency: str,
                 adopted: bool, device: torch.device, dtype: torch.dtype,
                 empty: torch.Tensor, frozen_only: bool = False,
                 skip: tuple[str, ...] = ()) -> BlockLayout:
    """Block i's flat layout: parameters in file order when a file source is given (so a block
    stored contiguously is one read), else in module order. `adopted`: the caller owns the
    block's flat host buffer already (no other source needed). Parameters that cannot take
    device storage in place (meta, another device or dtype) are replaced once by ones pointing at
    `empty`; from then on only their `.data` changes. `frozen_only`, `skip`: see streamed_params."""
    params = streamed_params(layer, frozen_only, skip)
    if ranges is not None:
        order, stored, runs, shift, checks = _file_runs(i, params, ranges, dtype)
        out = BlockLayout(Block(index=i, name=str(i), module=layer), stored, runs, shift,
                          checks=checks)
    else:
        if residency == "nvme":
            raise StreamError(f"block {i} is placed on nvme but has no file source")
        meta = [n for n, p in params.items() if p.device.type == "meta"]
        if meta and not adopted:
            raise StreamError(f"block {i}: parameter {meta[0]} is on meta and no file source was given")
        order = list(params)
        out = BlockLayout(Block(index=i, name=str(i), module=layer), None,
                          host_values=None if adopted else {})
    block = out.block
    byte_block = dtype == torch.uint8
    if byte_block and ranges is None:
        raise StreamError(f"block {i}: a byte block (dtype uint8) streams from files only")
    for n in order:
        p = params[n]
        if out.host_values is not None:  # the module's values are the source
            out.host_values[n] = p.detach().to("cpu", dtype).clone()
        if p.device.type == "meta" or p.device != device or p.dtype != dtype:
            owner, _, attr = n.rpartition(".")
            # a byte block is inference-only: a uint8 placeholder cannot require gradients
            new = nn.Parameter(empty, requires_grad=p.requires_grad and not byte_block)
            setattr(layer.get_submodule(owner) if owner else layer, attr, new)
        else:
            new = p
        size = p.numel() * p.element_size() if byte_block else p.numel()
        if byte_block and block.numel % p.element_size():
            raise StreamError(f"block {i}: {n} ({p.dtype}) starts at byte {block.numel}, not a "
                              f"multiple of its element size; store wider dtypes first")
        block.slots.append(ParamSlot(n, new, block.numel, size, p.shape,
                                     dtype=p.dtype if byte_block else None))
        block.numel += size
    return out
