"""A decoder block's batch-1 decode step as one C call, for quantized Llama blocks on the CPU.

Why: at batch 1 a SmolLM2-135M block does ~3 MFLOP and reads ~0.5 MB of int4 codes, a few tens
of microseconds of work; through torch it was some 60 ops (norms, reshapes, RoPE's chunks and
concatenations, the cache writes and slices, SDPA's dispatch, the SwiGLU, each projection's
wrapper), about half of the decode step's time outside the projection kernels (issue 36).
`offload/csrc/decode_block.c` computes the whole block -- RMSNorm, the q/k/v projections, RoPE,
the cache write, attention over the cache, o_proj, the residual, RMSNorm, the gated MLP -- in
one ctypes call, with the same one-row projection loops the unfused path runs
(offload/quant/cpu.py; included in that file, so a projection's output is the same bits for the
same input) and the rest in float32 to rounding.

Taken by DecoderLayer.forward only where it computes what the layer computes: one row (batch 1,
one new token), float32 on the CPU, no gradient, no mask (no padding, no window in reach), a KV
cache of float32 [1, kv heads, positions, head_dim] in memory; a plain Llama block (RMSNorm
"llama" style, no q/k norms, clamps, soft-capping, sinks, sandwich norms or biases; SwiGLU;
separate q/k/v and gate/up projections; RoPE over the whole head) whose seven projections are
QuantLinear int8 / int4 weights the C one-row loops take; where the unfused path would run them
on one thread (quant/cpu.py SPLIT_MIN_ELEMENTS: SmolLM2's sizes; a 1B model's projections split
over the cores and stay on the unfused path), and where $OFFLOAD_QUANT_KERNEL does not force
another kernel. $OFFLOAD_DECODE_STEP=off turns it off (tests compare the two).
With int8 activations (QuantLinear.activations, `--activations int8`) each projection's
proj_t carries act_bits 8 and the block runs quant_a8.c's loops where the unfused path would
(the same offload_a8_taken answer): a projection gives the unfused path's bits for the same x.

The library is built with -march=native and runs only where a child process checked it on this
CPU (offload/kernel_trust.py: `check_block_library` runs the fused block on random int4 and int8
blocks against the block in float64 over the dequantized weights), then checked again in this
process; tests/test_decode_step.py holds it to llama.py's DecoderLayer itself.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import os
import struct
import threading
from pathlib import Path

import torch

from offload import kernel_trust
from offload.quant import cpu as quant_cpu
from offload.quant.format import QuantSpec, dequantize, quantize
from offload.quant.matmul import _override as forced_kernel

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCE = _CSRC / "decode_block.c"
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # block_t's order
LIBRARY_PROBE = "offload.models.decode_step:check_block_library"
CHECK_TOLERANCE = 1e-4  # relative to the largest output: float32 rounding over a whole block
# int8 activations, the whole block: against the block in float64 whose products quantize their
# x as the kernel does (quant_cpu.a8_reference) -- but from x computed in float64, so a code of
# x is now and then one step off where the float32 and float64 x round to different sides, and
# attention carries it on: measured 2e-5 to 1.6e-3 (int4), 1e-7 (int8) on the self-check's
# blocks, against 6e-3 to 1.8e-2 for the fp32-activation block. Each projection as the block
# runs it is held to the same math from the same float32 x at quant_cpu.A8_CHECK_TOLERANCE
# (_check_a8_projections), and the fused block equals the unfused one bit for bit
# (tests/test_decode_step.py).
CHECK_TOLERANCE_A8 = 5e-3
_state: dict[str, object] = {}
_lock = threading.Lock()
_scratch = threading.local()  # per thread: one float32 buffer, grown as needed
counts = {"blocks": 0}  # blocks computed by this path in this process (tests, reports)


def _flags() -> list[str]:
    # decode_block.c includes quant_gemv.c (which includes quant_a8.c): its digest in the flags
    # puts it in the build's key, and build_flags adds the files it includes
    digest = hashlib.sha256((_CSRC / "quant_gemv.c").read_bytes()).hexdigest()[:16]
    return quant_cpu.build_flags() + [f"-DQUANT_GEMV_DIGEST=0x{digest}ULL"]


class _Lib:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.fn = lib.offload_decode_block
        self.fn.argtypes = [ctypes.c_void_p]
        self.fn.restype = ctypes.c_int
        self.a8_taken = lib.offload_a8_taken  # quant_a8.c's, as built into this library
        self.a8_taken.argtypes = [ctypes.c_int64] * 3
        self.a8_taken.restype = ctypes.c_int
        self.project = lib.offload_block_project  # (proj_t *, x, xpad, y): one projection
        self.project.argtypes = [ctypes.c_void_p] * 4
        self.project.restype = ctypes.c_int


def library() -> _Lib | None:
    """The checked library, or None (why: `status()`); built at most once per process."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = kernel_trust.build_library(
                "decode_block", _SOURCE, _flags(), _Lib, _self_check, LIBRARY_PROBE)
        return _state["lib"]


def status() -> str:
    library()
    return str(_state["why"])


def check_block_library(case: tuple[str]) -> str | None:
    """kernel_trust's probe: load the built library at `case[0]` and self-check it (a child)."""
    return _self_check(_Lib(Path(case[0])))


# ---- which layers, which calls -----------------------------------------------------------------
class _Plan:
    """A layer's fixed fields (block_t minus the pointers) and the tensors whose pointers go in."""

    def __init__(self, layer, projections: list):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.projections = layer, projections
        self.hidden, self.inter = layer.input_layernorm.weight.shape[0], mlp.gate_proj.out_features
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = layer.input_layernorm.eps
        self.scale = attn.scale if attn.scale is not None else self.head_dim ** -0.5
        # proj_t's int64 fields: bits, out, in, padded in, group (then activation bits, read
        # on every call: set_activations may change them after the plan is made)
        self.shapes = [(p.spec.bits, p.out_features, p.in_features, p.spec.padded_in(p.in_features),
                        p.spec.padded_in(p.in_features) // p.spec.groups(p.in_features)) for p in projections]
        # the unfused path's thread rule (quant/cpu.py _run): one thread below 2x the threshold
        self.one_thread = all(o * pin < 2 * quant_cpu.SPLIT_MIN_ELEMENTS[b] for b, o, _, pin, _ in self.shapes)
        self.max_padded = max(s[3] for s in self.shapes)
        self.tail = [self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim]
        self.doubles = [_double_bits(self.eps), _double_bits(self.scale)]

        # the dicts the parameters and submodules live in, read directly on every call:
        # nn.Module.__getattr__ cost ~2 us per name, 70 us per block (SmolLM2, 1 thread)
        self._parts = [(_members(p, "_parameters"), p.spec.bits) for p in projections]
        self._norms = [_members(n, "_parameters") for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self._children = [(_members(m, "_modules"), n.rpartition(".")[2], p)
                          for n, p in zip(PROJECTIONS, projections) for m in [attn if n.startswith("self_attn") else mlp]]

    def current(self) -> bool:
        """The layer still holds these projections (not since wrapped, by LoRA say)."""
        return all(children[name] is proj for children, name, proj in self._children)

    def activation_bits(self) -> list[int]:
        """Per projection, proj_t's act_bits: 8 where it takes x as int8 (QuantLinear.activations)."""
        return [8 if getattr(p, "activations", "fp32") == "int8" else 32 for p in self.projections]

    def pointers(self) -> list[int]:
        """The parts' and norms' addresses now (the streamer rebinds them between steps)."""
        out = []
        for parts, bits in self._parts:
            out += [parts["qweight"].data_ptr(), parts["scales"].data_ptr(),
                    parts["mins" if bits == 4 else "scales"].data_ptr()]
        return out + [n["weight"].data_ptr() for n in self._norms]


def _members(obj, table: str) -> dict:
    """A module's _parameters / _modules dict (the self-check's namespaces: their __dict__)."""
    return getattr(obj, table, None) if isinstance(getattr(obj, table, None), dict) else vars(obj)


def _double_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _is_quant_linear(proj) -> bool:
    """models/quantized.py's QuantLinear, by name: that module imports llama.py, which imports
    this one (the import ladder allows no cycle), and a wrapper of it (LoRA) is not one."""
    kind = type(proj)
    return kind.__name__ == "QuantLinear" and kind.__module__ == "offload.models.quantized"


def _takes(proj) -> bool:
    """A projection the C one-row loops take as the unfused path does (quant/cpu.py _run)."""
    if not _is_quant_linear(proj) or proj.bias is not None or proj.spec.bits not in (4, 8):
        return False
    g = proj.spec.padded_in(proj.in_features) // proj.spec.groups(proj.in_features)
    if proj.spec.bits == 8:
        return True
    return g % 16 == 0 and proj.spec.groups(proj.in_features) <= quant_cpu.Q4_ONE_ROW_MAX_GROUPS


def plan_for(layer) -> _Plan | None:
    """The layer's plan if it is a block this path computes exactly (module docstring), else
    None; decided once per layer (its structure does not change, only its tensors' storage)."""
    if "_decode_plan" in layer.__dict__:
        return layer.__dict__["_decode_plan"]
    plan = None
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    plain = (type(attn).__name__ == "Attention" and type(mlp).__name__ == "MLP"
             and not layer.sandwich and not mlp.gelu and not hasattr(attn, "qkv_proj")
             and not hasattr(attn, "q_norm") and attn.clip is None and attn.softcap is None
             and attn.sinks is None and not hasattr(mlp, "gate_up_proj")
             and all(not n.offset and not n.fp32_scale and n.weight.dtype == torch.float32
                     for n in (layer.input_layernorm, layer.post_attention_layernorm)))
    if plain:
        projections = [layer.get_submodule(n) for n in PROJECTIONS]
        if all(_takes(p) for p in projections):
            plan = _Plan(layer, projections)
    layer.__dict__["_decode_plan"] = plan
    return plan


def _enabled() -> bool:
    return os.environ.get("OFFLOAD_DECODE_STEP", "").strip().lower() not in ("off", "0", "false")


def fused_forward(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask, kv, kv_start: int) -> torch.Tensor | None:
    """DecoderLayer.forward for one token in one C call, or None where this path does not apply
    (the caller then runs the torch ops)."""
    if (mask is not None or kv is None or hidden.shape[0] != 1 or hidden.shape[1] != 1
            or hidden.dtype != torch.float32 or hidden.device.type != "cpu" or torch.is_grad_enabled()):
        return None
    plan = plan_for(layer)
    if plan is None or not plan.current() or not _enabled() or forced_kernel() not in (None, "c"):
        return None
    k_cache, v_cache = kv
    d = plan.head_dim
    if (cos.shape[-1] != d or cos.dtype != torch.float32 or k_cache.dtype != torch.float32
            or v_cache.dtype != torch.float32 or k_cache.device.type != "cpu"
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous()
                    and sin.is_contiguous())
            or not (plan.one_thread or torch.get_num_threads() == 1)
            or quant_cpu.library() is None or library() is None):
        return None
    max_len = k_cache.shape[2]
    if not 0 <= kv_start < max_len:
        return None
    out = hidden.contiguous().clone()  # [1, 1, H], updated in place by the call
    scratch = _scratch_for(plan.hidden + 2 * plan.heads * d + 2 * plan.kv_heads * d + 2 * plan.inter
                           + max_len + plan.max_padded)
    run(library(), plan, out, cos, sin, k_cache, v_cache, scratch, kv_start, max_len)
    counts["blocks"] += 1
    return out


def _scratch_for(floats: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _scratch.buf = torch.empty(floats, dtype=torch.float32)
    return buf


def run(lib: _Lib, plan: _Plan, hidden: torch.Tensor, cos, sin, k_cache, v_cache, scratch,
        pos: int, max_len: int) -> None:
    """Fill block_t (all 8-byte fields, in decode_block.c's order) and call the block."""
    ptrs, act_bits = plan.pointers(), plan.activation_bits()
    fields: list[int] = []
    for i, shape in enumerate(plan.shapes):
        fields += ptrs[3 * i:3 * i + 3]
        fields += shape
        fields.append(act_bits[i])
    fields += ptrs[-2:] + [cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           hidden.data_ptr(), scratch.data_ptr()]
    fields += plan.tail + [max_len, pos] + plan.doubles
    args = array.array("q", fields)  # kept alive across the call
    if lib.fn(args.buffer_info()[0]) != 0:
        raise RuntimeError(f"decode_block rejected its arguments: {plan.shapes}, position {pos} of {max_len}")


# ---- the self-check ------------------------------------------------------------------------------
def _namespace_block(spec: QuantSpec, gen: torch.Generator, activations: str = "fp32"):
    """A random block as the attributes a _Plan reads (no modules: this file cannot import
    llama.py), and its float64 weights: hidden 64, MLP 176 (groups of 32: down_proj's last
    padded), 4 query heads on 2 kv heads of 16."""
    from types import SimpleNamespace as NS
    hidden, inter, heads, kv_heads, d = 64, 176, 4, 2, 16
    shapes = dict(zip(PROJECTIONS, [(heads * d, hidden), (kv_heads * d, hidden), (kv_heads * d, hidden),
                                    (hidden, heads * d), (inter, hidden), (inter, hidden), (hidden, inter)]))
    proj, dense = {}, {}
    for name, (out_f, in_f) in shapes.items():
        parts = quantize(torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5, spec)
        proj[name] = NS(spec=spec, in_features=in_f, out_features=out_f, **parts, bias=None,
                        activations=activations)
        proj[name].mins = parts.get("mins")
        dense[name] = dequantize(parts, spec, in_f, torch.float64)
    norms = [NS(weight=1 + 0.2 * torch.randn(hidden, generator=gen), eps=1e-5) for _ in range(2)]
    attn = NS(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, scale=None,
              **{n.split(".")[1]: proj[n] for n in PROJECTIONS[:4]})
    mlp = NS(**{n.split(".")[1]: proj[n] for n in PROJECTIONS[4:]})
    layer = NS(self_attn=attn, mlp=mlp, input_layernorm=norms[0], post_attention_layernorm=norms[1])
    return layer, dense


def _a8_products(layer):
    """name -> x float64 [in] -> y float64 [out]: the products with x quantized as quant_a8.c does."""
    def product(name: str):
        p = getattr(layer.self_attn if name.startswith("self_attn") else layer.mlp, name.split(".")[1])
        parts = {"qweight": p.qweight, "scales": p.scales, **({"mins": p.mins} if p.mins is not None else {})}
        return lambda x: quant_cpu.a8_reference(x.float()[None], parts, p.spec, p.in_features)[0]
    return {n: product(n) for n in PROJECTIONS}


def _reference(layer, dense, h, cos, sin, cache, pos: int) -> torch.Tensor:
    """The block in float64 (plain torch, llama.py's order of operations); writes cache[pos].
    `dense`: name -> the float64 weight, or -> a function of x (int8 activations)."""
    attn, d = layer.self_attn, layer.self_attn.head_dim
    dense = {n: (w if callable(w) else w.__matmul__) for n, w in dense.items()}

    def norm(x, n):
        return n.weight.double() * (x * torch.rsqrt(x.pow(2).mean() + n.eps))

    def rotate(x):  # [heads, D]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    x = norm(h, layer.input_layernorm)
    q, k, v = (dense[n](x) for n in PROJECTIONS[:3])
    q, k = rotate(q.reshape(-1, d)), rotate(k.reshape(-1, d))
    cache[0][:, pos], cache[1][:, pos] = k, v.reshape(-1, d)
    group = attn.num_heads // attn.num_kv_heads
    keys, values = (c[:, :pos + 1].repeat_interleave(group, dim=0) for c in cache)  # [heads, S, D]
    p = torch.softmax((keys @ q[:, :, None])[..., 0] * d ** -0.5, dim=-1)  # [heads, S]
    h = h + dense["self_attn.o_proj"]((p[:, None, :] @ values)[:, 0].reshape(-1))
    x = norm(h, layer.post_attention_layernorm)
    g, u = dense["mlp.gate_proj"](x), dense["mlp.up_proj"](x)
    return h + dense["mlp.down_proj"](g * torch.sigmoid(g) * u)


def _check_a8_projections(lib: _Lib, layer, gen: torch.Generator) -> str | None:
    """Each projection of `layer`, int8 activations, through the block's own project()
    (offload_block_project) against quant_cpu.a8_reference from the same float32 x."""
    for name in PROJECTIONS:
        p = getattr(layer.self_attn if name.startswith("self_attn") else layer.mlp, name.split(".")[1])
        pin = p.spec.padded_in(p.in_features)
        fields = array.array("q", [p.qweight.data_ptr(), p.scales.data_ptr(),
                                   (p.mins if p.mins is not None else p.scales).data_ptr(), p.spec.bits,
                                   p.out_features, p.in_features, pin, pin // p.spec.groups(p.in_features), 8])
        x, xpad, y = torch.randn(p.in_features, generator=gen), torch.empty(pin), torch.empty(p.out_features)
        if lib.project(fields.buffer_info()[0], x.data_ptr(), xpad.data_ptr(), y.data_ptr()) != 0:
            return f"self-check: {name} (int8 activations) refused its arguments"
        parts = {"qweight": p.qweight, "scales": p.scales, **({"mins": p.mins} if p.mins is not None else {})}
        want = quant_cpu.a8_reference(x[None], parts, p.spec, p.in_features)[0]
        err = ((y.double() - want).abs().max() / want.abs().max()).item()
        if not err < quant_cpu.A8_CHECK_TOLERANCE:
            return f"self-check: int{p.spec.bits} {name} (int8 activations): relative error {err:.3g} vs the same math"
    return None


def _self_check(lib: _Lib) -> str | None:
    """The fused block on random int4 and int8 blocks (a padded last group in down_proj, grouped
    queries, a cache of several positions) against the block in float64 over the dequantized
    weights: the output and the keys/values written, within CHECK_TOLERANCE (the tests hold it
    to llama.py's DecoderLayer as well)."""
    gen = torch.Generator().manual_seed(11)
    pos, max_len = 5, 9
    for spec, act in ((QuantSpec(4, 32), "fp32"), (QuantSpec(8, 32), "fp32"), (QuantSpec(4, 32), "int8"),
                      (QuantSpec(8, 32), "int8")):
        layer, dense = _namespace_block(spec, gen, act)
        if act == "int8":
            if not all(lib.a8_taken(spec.bits, p, 32) for p in (64, 192)):
                continue  # this build keeps x in fp32 (no AVX2): the cases above
            dense = _a8_products(layer)
            why = _check_a8_projections(lib, layer, gen)
            if why is not None:
                return why
        plan, d = _Plan(layer, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                layer.mlp.down_proj]), layer.self_attn.head_dim
        h = torch.randn(1, 1, plan.hidden, generator=gen)
        angle = torch.rand(d // 2, generator=gen) * 6
        cos, sin = (torch.cat([f(angle)] * 2).reshape(1, 1, d) for f in (torch.cos, torch.sin))
        cache = [torch.randn(1, plan.kv_heads, max_len, d, generator=gen) for _ in range(2)]
        ref_cache = [c[0].double() for c in cache]
        want = _reference(layer, dense, h.double().reshape(-1), cos.double().reshape(-1),
                          sin.double().reshape(-1), ref_cache, pos)
        got = h.clone()
        run(lib, plan, got, cos, sin, cache[0], cache[1], torch.empty(4096), pos, max_len)
        for what, mine, ref in (("output", got.reshape(-1), want), ("keys", cache[0][0], ref_cache[0]),
                                ("values", cache[1][0], ref_cache[1])):
            err = ((mine.double() - ref).abs().max() / ref.abs().max()).item()
            if not err < (CHECK_TOLERANCE if act == "fp32" else CHECK_TOLERANCE_A8):
                return f"self-check: int{spec.bits} ({act} activations) {what}: relative error {err:.3g} vs float64"
    return None
