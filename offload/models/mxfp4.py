"""gpt-oss's MXFP4 experts (the published openai/gpt-oss-20b and -120b checkpoints), dequantized on load.

Those checkpoints hold each layer's expert matrices as `mlp.experts.gate_up_proj_blocks`
[E, 2I, H/32, 16] with `gate_up_proj_scales` [E, 2I, H/32], and `down_proj_blocks` [E, H, I/32,
16] with `down_proj_scales` [E, H, I/32] (config.json: `quantization_config.quant_method` mxfp4):
rows are output features -- nn.Linear's [out, in], where the 16-bit checkpoints store [in, out] --
each cut in groups of 32 values, stored as 16 bytes of two 4-bit E2M1 codes (low nibble first)
and one E8M0 scale byte s (the group's values times 2^(s - 127)). The biases, router, attention,
norms and embeddings are ordinary 16-bit tensors.

`mxfp4_locations` gives each expert's weight a location: its rows of the blocks tensor (one
contiguous range), with its rows of the scales beside (`TensorLocation.mxfp4`). Reading one
(`read_mxfp4`) dequantizes those into [out, in] in fp32 -- exact: a code times a power of two --
and writes the transpose into our [in, out] parameter: the values transformers' own
dequantization (integrations/mxfp4.py) gives, bit for bit (tests/test_gpt_oss.py, random
blocks). So a resident load and the int8 / int4 conversion (which reads through the reader)
take these checkpoints as they are; streaming them in place is refused in one line
(`refuse_in_place`): their bytes are no tensor of ours. Stream the int8 / int4 blocks, or a
16-bit export (save_pretrained of the loaded model) instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterable

import torch

from offload.models.config import ModelConfig

# the 16 E2M1 values, by code (sign bit, 2 exponent bits, 1 mantissa bit)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
_PACKED = re.compile(r"(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`: each byte's
    low nibble, then its high one, as E2M1 codes, times 2^(scale - 127) (computed in fp32:
    every product is exact there; rounded once into `dtype`)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up "
                         f"([..., G, 16] and [..., G])")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*scales.shape, GROUP).long()
    values = torch.tensor(E2M1, dtype=torch.float32)[codes]  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * GROUP).to(dtype)


def mxfp4_locations(locations: dict, cfg: ModelConfig, error: type[Exception]) -> None:
    """Replace, in a reader's `locations` (name -> TensorLocation), each pair of gpt-oss MXFP4
    tensors (`..._blocks`, `..._scales`) by one location per expert under our weight's name
    (`mlp.experts.E.gate_up_proj.weight` [hidden, 2 x width], `down_proj.weight` [width, hidden]).
    A blocks tensor without its scales, or shapes that do not fit the config: `error`, one line."""
    packed = {n: m.groups() for n in locations if (m := _PACKED.match(n)) is not None}
    if not packed or cfg.swiglu_limit is None:
        return
    E, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for name, (prefix, proj, kind) in sorted(packed.items()):
        if kind != "blocks":
            continue
        blocks, scales = locations.pop(name), locations.pop(f"{prefix}mlp.experts.{proj}_scales", None)
        out_f, in_f = (2 * f, h) if proj == "gate_up_proj" else (h, f)
        want = (E, out_f, in_f // GROUP, GROUP // 2)
        if scales is None or blocks.shape != want or scales.shape != want[:-1] or in_f % GROUP \
                or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            got = "no scales" if scales is None else f"{list(blocks.shape)} / {list(scales.shape)}"
            raise error(f"{blocks.path}: {name}: MXFP4 experts of this config are uint8 blocks {list(want)} "
                        f"and scales {list(want[:-1])} (got {got}, dtype {blocks.dtype})")
        b_part, s_part = blocks.nbytes // E, scales.nbytes // E
        for e in range(E):
            ours = f"{prefix}mlp.experts.{e}.{proj}.weight"
            locations[ours] = dataclasses.replace(
                blocks, name=ours, shape=(in_f, out_f), dtype=torch.bfloat16, offset=blocks.offset + e * b_part,
                nbytes=b_part, part=True, mxfp4=(scales.path, scales.offset + e * s_part, s_part))
    leftover = sorted(n for n in locations if _PACKED.match(n))
    if leftover:
        raise error(f"{locations[leftover[0]].path}: {leftover[0]} has no MXFP4 blocks to go with")


def read_mxfp4(files: dict, loc, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` ([in, out], any dtype and device) with expert weight `loc` (an mxfp4_locations
    entry) dequantized; `files`: the reader's open shards by file name."""
    in_f, out_f = loc.shape
    blocks = torch.empty(out_f, in_f // GROUP, GROUP // 2, dtype=torch.uint8)
    scales = torch.empty(out_f, in_f // GROUP, dtype=torch.uint8)
    files[os.path.basename(loc.path)].read_bytes_into(loc.offset, blocks)
    spath, soffset, _ = loc.mxfp4
    files[os.path.basename(spath)].read_bytes_into(soffset, scales)
    with torch.no_grad():
        out.copy_(dequantize_mxfp4(blocks, scales).t())
    return out


def refuse_in_place(locations: Iterable, error: type[Exception]) -> None:
    """A block with MXFP4 experts cannot be streamed in place (its bytes are no tensor of ours)."""
    loc = next((loc for loc in locations if getattr(loc, "mxfp4", None) is not None), None)
    if loc is not None:
        raise error(f"{os.path.dirname(loc.path)}: its experts are MXFP4, dequantized on load; they "
                    f"cannot be streamed in place: use --quantize int8|int4 (converted once), load "
                    f"it whole, or stream a 16-bit export of it (save_pretrained)")
