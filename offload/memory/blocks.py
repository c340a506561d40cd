"""Blocks: the unit of every transfer, file and optimizer call.

A model's trainable parameters are grouped into one block per entry of its main
`nn.ModuleList` (the transformer layers; found automatically as the ModuleList holding the
most parameters) plus one block, "rest", for everything outside it (embeddings, final norm,
head). Each block gets flat contiguous buffers and its parameters become views into the
block's flat device buffer, so moving a block is one large copy, storing it is one sequential
file, and stepping it is one optimizer call.

Across data-parallel ranks each rank owns a shard of every block's flat buffers; which one is
the engine's to say (Parts.owned in offload/train/parts.py, offload/zero/group.py), not the
layout's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from offload.memory.tiers import PlanBytes


class BlockError(ValueError):
    """The model cannot be split into blocks as asked."""


@dataclass
class ParamSlot:
    name: str  # the parameter's name in model.named_parameters()
    param: nn.Parameter
    offset: int  # element offset inside the block's flat buffers
    numel: int
    shape: torch.Size
    # a byte block (quantized weights: int8/uint8 codes, fp16 scales and 16-bit norms in one
    # uint8 buffer): the parameter's own dtype, offset and numel then count bytes; None: the
    # flat buffer's dtype
    dtype: torch.dtype | None = None


@dataclass
class Block:
    index: int  # position in step order bookkeeping; layers are 0..L-1, "rest" is L
    name: str  # "layers.3"-style (the ModuleList's path + index) or "rest"
    slots: list[ParamSlot] = field(default_factory=list)
    module: nn.Module | None = None  # the ModuleList entry (None for "rest")
    numel: int = 0

    def add(self, name: str, param: nn.Parameter) -> None:
        self.slots.append(ParamSlot(name, param, self.numel, param.numel(), param.shape))
        self.numel += param.numel()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """{param name: view of `flat` shaped like the parameter}."""
        assert flat.numel() == self.numel, (flat.numel(), self.numel)
        return {s.name: (flat[s.offset:s.offset + s.numel] if s.dtype is None else
                         flat[s.offset:s.offset + s.numel].view(s.dtype)).view(s.shape)
                for s in self.slots}


def find_block_list(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's main ModuleList: the one at `path` (dotted), or the one holding the most
    parameters. None when the model has no ModuleList with parameters."""
    if path is not None:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise BlockError(f"block_list {path!r}: the model has no submodule of that name") from None
        if not isinstance(mod, nn.ModuleList):
            raise BlockError(f"block_list {path!r} is a {type(mod).__name__}, not an nn.ModuleList")
        return path, mod
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            count = sum(p.numel() for p in mod.parameters())
            # strictly greater: on ties the outermost (first visited) list wins
            if count > 0 and (best is None or count > best[0]):
                best = (count, name, mod)
    return None if best is None else (best[1], best[2])


def group_blocks(model: nn.Module, block_list: str | None = None,
                 trainable_only: bool = True) -> tuple[list[Block], str | None]:
    """Split the model's parameters into blocks (layers in ModuleList order, then "rest").
    A parameter shared by several modules (tied embeddings) appears once, in the block of its
    first name. Returns (blocks, the ModuleList's path or None)."""
    found = find_block_list(model, block_list)
    list_path, layers = found if found is not None else (None, None)
    blocks: list[Block] = []
    owner: dict[int, Block] = {}  # id(param) of every param inside a layer -> its block
    if layers is not None:
        for i, layer in enumerate(layers):
            b = Block(index=i, name=f"{list_path}.{i}" if list_path else str(i), module=layer)
            for p in layer.parameters():
                owner.setdefault(id(p), b)
            blocks.append(b)
    rest = Block(index=len(blocks), name="rest")
    for name, p in model.named_parameters():  # dedups shared params: first name wins
        if trainable_only and not p.requires_grad:
            continue
        owner.get(id(p), rest).add(name, p)
    blocks = [b for b in blocks if b.numel > 0]
    for i, b in enumerate(blocks):
        b.index = i
    if rest.numel > 0:
        rest.index = len(blocks)
        blocks.append(rest)
    if not blocks:
        raise BlockError("the model has no trainable parameters (requires_grad=True)")
    return blocks, list_path


def resident_weight_bytes(numels: list[int], itemsize: int) -> PlanBytes:
    """The device flat buffers of the blocks that stay on the device (what the engine makes and
    binds each block's parameters to as views; the plan_bytes of offload/train/build.py's
    placement)."""
    return {("device", "weights"): sum(numels) * itemsize}


def bind_views(block: Block, flat: torch.Tensor, model: nn.Module | None = None) -> None:
    """Make every parameter of `block` a view into `flat`. Real parameters keep their identity
    (hooks, user references and state_dict names survive; only their storage changes). A
    parameter still on the meta device cannot take real storage in place, so it is replaced by
    a new Parameter in every module that holds it (`model` is then required)."""
    for s, view in zip(block.slots, block.views(flat).values()):
        if s.param.device.type != "meta":
            s.param.data = view
            continue
        if model is None:
            raise BlockError(f"parameter {s.name!r} is on meta; bind_views needs the model")
        s.param = replace_parameter(model, s.param, nn.Parameter(view, requires_grad=s.param.requires_grad))


def replace_parameter(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """`new` in place of `old` in every module that holds it (a tied one under each name);
    returns `new`. For parameters that cannot take storage in place (on the meta device)."""
    for mod in model.modules():
        for key, p in mod._parameters.items():
            if p is old:
                mod._parameters[key] = new
    return new


TensorFill = Callable[[dict[str, torch.Tensor]], None]


def gather_flat(block: Block, dtype: torch.dtype, out: torch.Tensor | None = None,
                source: TensorFill | None = None) -> torch.Tensor:
    """The block's parameter values, concatenated into one flat CPU tensor of `dtype`. Real
    parameters are copied one at a time (peak extra memory: one block); parameters on the meta
    device are filled by `source` (a checkpoint reader's read_tensors_into, a seeded
    initialiser), which receives {name: view of `out`} to fill in place."""
    if out is None:
        out = torch.empty(block.numel, dtype=dtype)
    views = block.views(out)
    missing = {}
    for s in block.slots:
        if s.param.device.type == "meta":
            missing[s.name] = views[s.name]
        else:
            views[s.name].copy_(s.param.detach())
    if missing:
        if source is None:
            raise BlockError(f"parameter {next(iter(missing))!r} is on the meta device and no "
                             f"source was given; pass source= (a checkpoint reader or an "
                             f"initialiser) or materialise the model first")
        source(missing)
    return out


def frozen_bytes(model: nn.Module, block_list: str | None, dtype: torch.dtype,
                 own_dtypes: bool = False) -> tuple[list[int], int]:
    """(bytes of each ModuleList layer's frozen parameters, bytes of the frozen parameters
    outside the layers): what a LoRA base (or any frozen part) holds, for the plan. Floating
    parameters count in the compute `dtype` (where the engine puts them), others in their own;
    `own_dtypes`: the layers' in their own dtypes too (a quantized base streamed as stored)."""
    def nbytes(p: nn.Parameter, own: bool) -> int:
        return p.numel() * (dtype.itemsize if p.is_floating_point() and not own else p.element_size())

    layers = model.get_submodule(block_list) if block_list is not None else None
    in_layers: set[int] = set()
    per_layer = []
    for layer in layers if layers is not None else []:
        frozen = [p for p in layer.parameters() if not p.requires_grad and id(p) not in in_layers]
        in_layers.update(id(p) for p in frozen)
        per_layer.append(sum(nbytes(p, own_dtypes) for p in frozen))
    rest = sum(nbytes(p, False) for p in model.parameters()
               if not p.requires_grad and id(p) not in in_layers)
    return per_layer, rest


def move_frozen_and_buffers(model: nn.Module, device: torch.device, dtype: torch.dtype,
                            trainable: set[int], source: TensorFill | None = None) -> int:
    """Frozen parameters go to the device in the compute dtype; buffers keep their dtype
    (rotary frequencies and the like must stay fp32) but move to the device. `trainable`: ids
    of the parameters already placed (trainable, or a streamed frozen base). Frozen parameters
    on the meta device are filled by `source` (see gather_flat) in the compute dtype. Returns
    the bytes of the frozen parameters now on the device."""
    moved = 0
    for name, p in list(model.named_parameters()):
        if id(p) in trainable:
            continue
        if p.device.type == "meta":
            if source is None or not p.is_floating_point():
                raise BlockError(f"frozen parameter {name!r} is on the meta device; materialise "
                                 f"frozen parameters before initialising the engine")
            value = torch.empty(p.shape, dtype=dtype)
            source({name: value})
            owner, _, attr = name.rpartition(".")
            # a meta Parameter cannot take real storage in place: replace it (as bind_views does)
            setattr(model.get_submodule(owner) if owner else model, attr,
                    nn.Parameter(value.to(device), requires_grad=False))
        else:
            p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)
        moved += p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
    for mod in model.modules():
        for key, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device and buf.device.type != "meta":
                mod._buffers[key] = buf.to(device)
    return moved
