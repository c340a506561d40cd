"""Group-wise weight quantization for streamed inference: weights travel quantized and are
dequantized where the compute is.

Format (QuantSpec(bits, group_size); the planner, the streamer and the GGUF reader share it):
- int8, symmetric: w ~= q * scale, q in [-127, 127]; qweight int8 [out, padded_in], scales
  float16 [out, groups]. group_size 0 is one group per row (per output channel).
- int4, asymmetric: w ~= q * scale + min, q in [0, 15], two per byte (column 2j in the low nibble
  of byte j, 2j+1 in the high one); qweight uint8 [out, padded_in // 2], scales and mins float16
  [out, groups]. llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks are these with group_size 32 (from_gguf).
The last group of a row is padded to group_size columns; pad columns are never read back.

Scales and mins are rounded *outward* to float16 (min down, scale up, by at most one float16 step)
and q is computed from the stored values: the group's range then always fits the 15 or 127
steps, so |w - dequantized| <= stored scale / 2 (+ float32 rounding) for every element, also for
tiny groups whose scale is a float16 subnormal, where rounding to nearest can lose half the range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANTIZE_CHUNK_ELEMENTS = 1 << 22  # rows quantized per step: ~16 MB per float32 temporary
_GGUF_BLOCK = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 values


class QuantError(ValueError):
    """A weight cannot be quantized or quantized parts do not fit their spec; says how to fix."""


@dataclass(frozen=True)
class QuantSpec:
    """How one weight is quantized. Frozen and hashable: it keys the block layout and caches."""
    bits: int  # 8 or 4
    group_size: int  # input columns per scale; int8 only: 0 = one group per row

    def validate(self) -> None:
        if self.bits not in (8, 4) or isinstance(self.bits, bool):
            raise QuantError(f"bits={self.bits!r}: use 8 (int8) or 4 (packed int4)")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0:
            raise QuantError(f"group_size={self.group_size!r}: use an integer >= 0 (e.g. 32, 64, 128)")
        if self.bits == 4 and (self.group_size == 0 or self.group_size % 2):
            raise QuantError(f"4-bit quantization needs an even group_size > 0 (e.g. 32, 64, 128), "
                             f"got {self.group_size}")

    def group_width(self, in_features: int) -> int:
        """Input columns per scale for a weight of `in_features` columns."""
        if in_features < 1:
            raise QuantError(f"in_features={in_features}: a weight needs at least one input column")
        return in_features if self.group_size == 0 else self.group_size

    def groups(self, in_features: int) -> int:
        return -(-in_features // self.group_width(in_features))

    def padded_in(self, in_features: int) -> int:
        return self.groups(in_features) * self.group_width(in_features)


def packed_bytes(out_features: int, in_features: int, spec: QuantSpec) -> int:
    """Bytes of all parts of an [out, in] weight (qweight + scales (+ mins)), for the planner."""
    spec.validate()
    g, p = spec.groups(in_features), spec.padded_in(in_features)
    if spec.bits == 8:
        return out_features * (p + 2 * g)
    return out_features * (p // 2 + 4 * g)


def _fp16_outward(v: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 v -> the nearest float16 >= v (up) or <= v (down): a range never shrinks when
    stored (to nearest, a subnormal scale can lose up to half of it)."""
    h = v.to(torch.float16)
    off = h.float() < v if up else h.float() > v
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(off, torch.nextafter(h, toward), h)


def quantize(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """w [out, in] (any float dtype; CPU) -> contiguous CPU parts (see the module docstring).
    Rows are processed QUANTIZE_CHUNK_ELEMENTS at a time in float32, so the temporaries stay
    small: 0.10-0.15 s per 8192x2048 weight here, 7-11 s for the 1.24B weights of a 1B model."""
    spec.validate()
    if w.dim() != 2 or not w.is_floating_point():
        raise QuantError(f"quantize takes a 2-D float weight [out, in], got {tuple(w.shape)} {w.dtype}")
    out_f, in_f = w.shape
    if out_f == 0:
        raise QuantError("quantize: the weight has no rows")
    ng, p = spec.groups(in_f), spec.padded_in(in_f)
    g = p // ng
    q_out = torch.empty(out_f, p if spec.bits == 8 else p // 2, dtype=torch.int8 if spec.bits == 8 else torch.uint8)
    scales = torch.empty(out_f, ng, dtype=torch.float16)
    mins = torch.empty(out_f, ng, dtype=torch.float16) if spec.bits == 4 else None
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // p)
    for a in range(0, out_f, step):
        b = min(out_f, a + step)
        wc = w[a:b].detach().to("cpu", torch.float32)  # [c, in]
        finite = torch.isfinite(wc).all(1)
        if not bool(finite.all()):
            row = a + int((~finite).nonzero()[0])
            raise QuantError(f"weight row {row} holds NaN or inf: fix the checkpoint (or keep this tensor unquantized)")
        if p > in_f:  # pad with the row's last value: the last group's range stays its own
            wc = torch.cat([wc, wc[:, -1:].expand(-1, p - in_f)], 1)  # [c, p]
        wg = wc.view(b - a, ng, g)  # [c, groups, g]
        if spec.bits == 8:
            s = _fp16_outward(wg.abs().amax(-1) / 127, up=True)  # [c, groups]
            _check_fp16(s, a, "an int8 scale (max |w| / 127)")
            sf = torch.where(s > 0, s.float(), 1.0).unsqueeze(-1)  # [c, groups, 1]; all-zero group -> q 0
            q_out[a:b] = torch.div(wg, sf).round_().clamp_(-127, 127).to(torch.int8).view(b - a, p)
        else:
            m = _fp16_outward(wg.amin(-1), up=False)  # [c, groups]
            _check_fp16(m, a, "an int4 min (the group's minimum)")
            s = _fp16_outward((wg.amax(-1) - m.float()) / 15, up=True)
            _check_fp16(s, a, "an int4 scale ((max - min) / 15)")
            sf = torch.where(s > 0, s.float(), 1.0).unsqueeze(-1)
            q = torch.div(wg - m.float().unsqueeze(-1), sf).round_().clamp_(0, 15).to(torch.uint8).view(b - a, p)
            q_out[a:b] = q[:, 0::2] | (q[:, 1::2] << 4)  # [c, p // 2]
            mins[a:b] = m
        scales[a:b] = s
    parts = {"qweight": q_out, "scales": scales}
    if mins is not None:
        parts["mins"] = mins
    return parts


def _check_fp16(v: torch.Tensor, row0: int, what: str) -> None:
    bad = ~torch.isfinite(v).all(1)
    if bool(bad.any()):
        row = row0 + int(bad.nonzero()[0])
        raise QuantError(f"weight row {row}: {what} exceeds float16's 65504: |w| is too large for "
                         f"float16 scales; rescale the weight or keep this tensor unquantized")


def check_parts(parts: dict[str, torch.Tensor], spec: QuantSpec, in_features: int) -> tuple:
    """(qweight, scales, mins or None), checked against spec and in_features."""
    spec.validate()
    ng, p = spec.groups(in_features), spec.padded_in(in_features)
    need = ("qweight", "scales", "mins") if spec.bits == 4 else ("qweight", "scales")
    missing = [k for k in need if k not in parts]
    if missing:
        raise QuantError(f"quantized parts lack {missing}: pass what quantize() returned for {spec}")
    qw, sc = parts["qweight"], parts["scales"]
    mn = parts.get("mins") if spec.bits == 4 else None
    out_f = qw.shape[0] if qw.dim() == 2 else -1
    want = [("qweight", qw, (out_f, p if spec.bits == 8 else p // 2), torch.int8 if spec.bits == 8 else torch.uint8),
            ("scales", sc, (out_f, ng), torch.float16)] + ([("mins", mn, (out_f, ng), torch.float16)] if mn is not None else [])
    for name, t, shape, dtype in want:
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != qw.device:
            raise QuantError(f"{name} is {t.dtype} {tuple(t.shape)} on {t.device}, {spec} with in_features="
                             f"{in_features} needs {dtype} {shape} on {qw.device}: quantize with the same spec")
    return qw, sc, mn


def _dequant_rows(qw: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None, spec: QuantSpec,
                  a: int, b: int) -> torch.Tensor:
    """Rows a:b as float32 [b - a, padded_in] in column order. q * scale is exact in float32
    (11 x 8 bits) and + min rounds once: the values are llama.cpp's own, to the bit."""
    n, ng = b - a, sc.shape[1]
    if spec.bits == 8:
        q = qw[a:b].float()  # [n, p]
    else:
        byte = qw[a:b]  # [n, p // 2]
        q = torch.stack((byte & 15, byte >> 4), -1).float()  # [n, p // 2, 2]
    w = q.view(n, ng, -1).mul_(sc[a:b].float().unsqueeze(-1))  # [n, groups, g]
    if mn is not None:
        w.add_(mn[a:b].float().unsqueeze(-1))
    return w.view(n, -1)


def dequantize(parts: dict[str, torch.Tensor], spec: QuantSpec, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in `dtype` on the parts' device (float32 values, rounded once)."""
    qw, sc, mn = check_parts(parts, spec, in_features)
    out = torch.empty(qw.shape[0], in_features, dtype=dtype, device=qw.device)
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // spec.padded_in(in_features))
    for a in range(0, qw.shape[0], step):
        b = min(qw.shape[0], a + step)
        out[a:b] = _dequant_rows(qw, sc, mn, spec, a, b)[:, :in_features]
    return out


def from_gguf(kind: str, raw: np.ndarray | bytes, shape: tuple[int, int]) -> tuple[QuantSpec, dict[str, torch.Tensor]]:
    """llama.cpp tensor data (Q8_0 / Q4_0 / Q4_1, blocks of 32) of a weight of PyTorch shape
    (out, in) -> (spec, parts) that dequantize to exactly gguf's float32 values. Q4_0's value
    (q - 8) * d becomes q * d + (-8 d): both products are exact, so the float32 sums agree."""
    if kind not in _GGUF_BLOCK:
        raise QuantError(f"GGUF type {kind!r}: only Q8_0, Q4_0 and Q4_1 map onto this format")
    out_f, in_f = (int(d) for d in shape)
    if out_f < 1 or in_f < 1 or in_f % 32:
        raise QuantError(f"GGUF {kind} weight of shape {shape}: rows must hold whole blocks of 32 values")
    data = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) \
        else np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    nb, size = in_f // 32, _GGUF_BLOCK[kind]
    if data.size != out_f * nb * size:
        raise QuantError(f"GGUF {kind} data of {data.size} bytes, shape {shape} needs {out_f * nb * size}: "
                         f"the tensor is truncated or its shape is wrong")
    blocks = data.reshape(out_f, nb, size)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0]  # [out, nb]
    if not np.isfinite(d).all():
        raise QuantError(f"GGUF {kind} data holds a NaN/inf block scale: the file is damaged")
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(out_f, in_f)
        return QuantSpec(8, 32), {"qweight": torch.from_numpy(q.copy()), "scales": torch.from_numpy(d.copy())}
    if kind == "Q4_0":
        nibbles, m = blocks[:, :, 2:], (d.astype(np.float32) * -8).astype(np.float16)
        if not np.isfinite(m).all():
            raise QuantError("GGUF Q4_0 block scale above 8188: its min (-8 d) overflows float16")
    else:
        nibbles = blocks[:, :, 4:]
        m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0]
        if not np.isfinite(m).all():
            raise QuantError("GGUF Q4_1 data holds a NaN/inf block min: the file is damaged")
    e = np.concatenate((nibbles & 15, nibbles >> 4), axis=2)  # [out, nb, 32]: gguf's element order
    packed = (e[:, :, 0::2] | (e[:, :, 1::2] << 4)).astype(np.uint8).reshape(out_f, in_f // 2)
    return QuantSpec(4, 32), {"qweight": torch.from_numpy(packed), "scales": torch.from_numpy(d.copy()),
                              "mins": torch.from_numpy(np.ascontiguousarray(m))}
