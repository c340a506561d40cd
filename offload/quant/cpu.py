"""The few-row quantized product on the CPU: a C loop that reads each code byte once
(offload/csrc/quant_gemv.c), its output rows split over threads.

Why: decode multiplies 1-16 rows by every weight, so the time is reading the weight. torch can
only dequantize into a float buffer and multiply there -- several passes over each element --
which made batch-1 int4 decode 2.3x slower than dense fp32 on this project's 2-core AMD EPYC.
The C loop widens one group's codes (scale and min applied) into L1 and multiplies them into up
to 8 rows at once, register-tiled. Measured (8192x2048 and 2048x8192, medians, caches flushed
between calls, 2 threads; the scales passed as their fp16 bits -- converting them with torch
first cost more than the product): int4/g64 3.2-3.3 ms at 1 row, 5.8-5.9 at 8, 12.2-12.3 at 16,
against dense fp32 4.4-4.6 / 12.8-17.5 / 11.6-32.9 and the torch chunked kernel 17-19 / 28-32 /
27-37; int8 per channel 2.2-3.3 / 5.8-9.6 / 10.6-12.9.

From 9 rows (BLOCKED_ROWS_MIN) to 64 (ROWS_MEASURED_MAX) a register-blocked loop takes over
(quant_gemv.c rows_blocked): 6 output rows widened once for all x rows, 6 x 2 tiles of fused
multiply-adds, x packed here 8 columns at a time (`_pack_x`). The 8-row tiles re-read x from L2
for every output row and widen the weight once per 8 rows; at 32-64 rows on the 1B shapes the
blocked loop is 1.4-2.9x faster than them, 0.7-1.2x the time of the dense fp32 product (docs/
BENCHMARKS.md). From 9 rows on, matmul.kernel_for still times this library against the chunked
kernel on the weight, once per shape, and keeps the faster.

With activations="int8" (opt-in) the rows go to quant_a8.c's loops instead, x quantized per 32
columns and multiplied in integer dot products, where this CPU takes them (offload_a8_taken:
AVX2, groups of a multiple of 32 columns); held to the same math in float64 (a8_reference).

Built with -O3 and reassociated sums (vectorised; not -ffast-math, see _FLAGS): results equal x @ dequantize(W)^T
to float rounding (checked against torch when the library is loaded) and do not depend on how
the rows are split. Unavailable (no compiler, failed self-check): the torch kernels run instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from offload import kernel_trust
from offload.quant.format import QuantSpec, dequantize, quantize

ROWS_MAX = {8: 16, 4: 16}  # bits -> most rows this kernel takes unmeasured (module docstring)
# beyond ROWS_MAX, up to this many rows, only where matmul.kernel_for measured it faster than the
# chunked kernel on the weight itself; the blocked loop's limit (BLOCKED_ROWS_MAX in the C file)
ROWS_MEASURED_MAX = 64
# from this many rows the register-blocked loop, where the group is a multiple of 8 columns (at
# 8 rows the 8-row tile still won on the 1B shapes, at 12 and 16 the blocked loop: BENCHMARKS)
BLOCKED_ROWS_MIN = 9
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "quant_gemv.c"
_INCLUDED = ("quant_a8.c",)  # included by quant_gemv.c: their digests go in the build's key
# Reassociated sums (vectorised), and nothing of -ffast-math beyond that: GCC links a -ffast-math
# shared object with crtfastmath.o, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads -- every subnormal in every
# later torch op became 0 (tests/test_quant.py::test_loading_the_kernels_keeps_subnormals).
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math"]
ACTIVATIONS = ("fp32", "int8")  # x as given, or quantized per 32 columns (quant_a8.c; opt-in)
A8_CHECK_TOLERANCE = 1e-5  # vs a8_reference: the same math, so float32 rounding only


def build_flags() -> list[str]:
    """_FLAGS plus the digests of the files quant_gemv.c includes (cbuild keys on its bytes)."""
    csrc = _SOURCE.parent
    digests = [hashlib.sha256((csrc / n).read_bytes()).hexdigest()[:16] for n in _INCLUDED]
    return _FLAGS + [f"-DINCLUDED_DIGEST_{i}=0x{d}ULL" for i, d in enumerate(digests)]


_state: dict[str, object] = {}
_lock = threading.Lock()  # building/loading the library
_pool_lock = threading.Lock()  # the helper threads (the self-check runs under _lock and uses them)
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


class _Lib:
    """The entry points: int8 (4 pointers) and int4 (5: + mins), each as the 8-row tiles and as
    the blocked loop, and int4's one row with x in natural column order; then rows, out, padded
    in, group, o_begin, o_end."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))

        def bind(name: str, pointers: int):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 6
            fn.restype = ctypes.c_int
            return fn
        self.q8, self.q4 = bind("offload_q8_rows", 4), bind("offload_q4_rows", 5)
        self.q8b, self.q4b = bind("offload_q8_rows_blocked", 4), bind("offload_q4_rows_blocked", 5)
        self.q4n = bind("offload_q4_row_natural", 5)
        self.q8a8, self.q4a8 = bind("offload_q8_rows_a8", 4), bind("offload_q4_rows_a8", 5)
        self.a8_taken = lib.offload_a8_taken
        self.a8_taken.argtypes = [ctypes.c_int64] * 3
        self.a8_taken.restype = ctypes.c_int


def _self_check(lib: _Lib) -> str | None:
    gen = torch.Generator().manual_seed(7)
    # the last two span several of the blocked loop's 512-column pieces
    for spec, in_f in ((QuantSpec(8, 0), 96), (QuantSpec(8, 32), 100), (QuantSpec(4, 64), 150),
                       (QuantSpec(4, 32), 96), (QuantSpec(8, 0), 1040), (QuantSpec(4, 32), 1040)):
        w = torch.randn(37, in_f, generator=gen)
        parts = quantize(w, spec)
        # one row, a partial and a full 8-row tile, the blocked loop (odd: a half-empty x tile),
        # the most rows any caller gives it
        for rows in (1, 3, 8, 11, 17, ROWS_MEASURED_MAX):
            x = torch.randn(rows, in_f, generator=gen)
            want = x.double() @ dequantize(parts, spec, in_f, torch.float64).T
            got = _run(lib, x, parts, spec, in_f, threads=2)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            if not err < 1e-5:
                return f"self-check: int{spec.bits} rows {rows}: relative error {err:.3g} vs torch"
    return _self_check_a8(lib, gen)


def _self_check_a8(lib: _Lib, gen: torch.Generator) -> str | None:
    """The int8-activation loops (where this CPU takes them) against a8_reference, the same
    math in float64: a half chunk at the end (int4 g32, 96 columns), groups of 64 and 128,
    int8 g32 and per channel; 1 row, a partial 4-row slot, several x rows; split over threads."""
    for spec, in_f in ((QuantSpec(4, 32), 96), (QuantSpec(4, 64), 150), (QuantSpec(4, 128), 256),
                       (QuantSpec(8, 32), 100), (QuantSpec(8, 0), 128)):
        if not a8_takes(lib, spec, in_f):
            continue
        parts = quantize(torch.randn(37, in_f, generator=gen), spec)
        for rows in (1, 3, 9):
            x = torch.randn(rows, in_f, generator=gen)
            want = a8_reference(x, parts, spec, in_f)
            got = _run(lib, x, parts, spec, in_f, threads=2, activations="int8")
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            if not err < A8_CHECK_TOLERANCE:
                return (f"self-check: int{spec.bits} x int8 activations rows {rows}: relative "
                        f"error {err:.3g} vs the same math in float64")
    return None


def a8_takes(lib: _Lib, spec, in_features: int) -> bool:
    """The int8-activation loops take this weight on this CPU (quant_a8.c offload_a8_taken)."""
    p = spec.padded_in(in_features)
    return bool(lib.a8_taken(spec.bits, p, p // spec.groups(in_features)))


def a8_reference(x2d: torch.Tensor, parts: dict[str, torch.Tensor], spec, in_features: int) -> torch.Tensor:
    """x2d [rows, in] @ W^T with x quantized per 32 columns as quant_a8.c does (in float32:
    d = max|x| / 127, q = round-half-even(x * (127 / max|x|))), the integer dot of each 32-column
    block in float64, then scale * d per block, plus (int4) min * the fp32 sum of x per group:
    float64 [rows, out]. The kernels must match it to float32 rounding (A8_CHECK_TOLERANCE)."""
    ng, p = spec.groups(in_features), spec.padded_in(in_features)
    g, rows = p // ng, x2d.shape[0]
    x = F.pad(x2d.float(), (0, p - in_features)).numpy().reshape(rows, p // 32, 32)
    top = np.abs(x).max(-1, keepdims=True)  # float32 throughout, as the kernel
    d = top / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    xq = torch.from_numpy(np.rint(x * inv)).double()  # [rows, blocks, 32]
    qw = parts["qweight"]
    if spec.bits == 4:  # codes [out, p]: column 2b of a group in byte b's low nibble
        codes = torch.stack((qw & 15, qw >> 4), -1).reshape(qw.shape[0], p).double()
    else:
        codes = qw.double()
    dots = torch.einsum("rbj,obj->rob", xq, codes.reshape(-1, p // 32, 32))  # exact integers
    block_scale = parts["scales"].double().repeat_interleave(g // 32, dim=1)  # [out, blocks]
    y = (dots * block_scale * torch.from_numpy(d[..., 0]).double()[:, None, :]).sum(-1)
    if spec.bits == 4:
        xsum = torch.from_numpy(x.reshape(rows, ng, g).sum(-1, dtype=np.float32)).double()
        y = y + xsum @ parts["mins"].double().T
    return y


LIBRARY_PROBE = "offload.quant.cpu:check_library"  # the self-check, run in a child first


def check_library(case: tuple[str]) -> str | None:
    """kernel_trust's probe: load the built library at `case[0]` and self-check it (a child)."""
    return _self_check(_Lib(Path(case[0])))


def library() -> _Lib | None:
    """The loaded kernel, or None (why: `status()`); built at most once per process."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = kernel_trust.build_library(
                "quant_gemv", _SOURCE, build_flags(), _Lib, _self_check, LIBRARY_PROBE)
        return _state["lib"]


def status() -> str:
    library()
    return str(_state["why"])


def applies(spec, in_features: int, x2d: torch.Tensor) -> bool:
    """This kernel computes x2d [rows, in] @ W^T for a weight of `spec` (and was built)."""
    return (x2d.device.type == "cpu" and 1 <= x2d.shape[0] <= ROWS_MEASURED_MAX
            and library() is not None)


def helper_pool(threads: int) -> ThreadPoolExecutor:
    """threads - 1 helper threads for a product split over the cores (the calling thread runs
    one part itself); made once, remade if the count changes. Shared by this kernel and
    offload/models/kernels.py's split projection."""
    global _pool, _pool_threads
    with _pool_lock:
        if _pool is None or _pool_threads != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="offload-gemv")
            _pool_threads = threads
        return _pool


def rows_product(x2d: torch.Tensor, parts: dict[str, torch.Tensor], spec, in_features: int,
                 activations: str = "fp32") -> torch.Tensor:
    """x2d [rows, in] (any float dtype) @ W^T -> [rows, out] float32, W the quantized weight;
    activations "int8": x quantized per 32 columns where takes_a8 (else as given)."""
    lib = library()
    assert lib is not None, "rows_product without the library: check applies() first"
    return _run(lib, x2d, parts, spec, in_features, threads=torch.get_num_threads(),
                activations=activations)


def takes_a8(spec, in_features: int) -> bool:
    """The built library's int8-activation loops take this weight (callers count them)."""
    lib = library()
    return lib is not None and a8_takes(lib, spec, in_features)


# Multiply-adds per thread below which the C loop runs on the calling thread alone. Measured
# at one row, 2-core AMD EPYC (AVX-512), 2026-11-28 (1 thread / 2 threads, us): int4 g64
# 576x192 34/94, 576x576 76/115, 1536x576 158/160, 2048x2048 705/435; int8 g32 576x576 23/84,
# 1536x576 55/102, 2048x2048 235/192, 8192x2048 957/537. The old rule (split from 512 output
# rows) handed SmolLM2's 576-row projections to a helper for a loss.
SPLIT_MIN_ELEMENTS = {4: 1 << 20, 8: 3 << 20}
Q4_ONE_ROW_MAX_GROUPS = 4096  # quant_gemv.c's: groups of one row its one-row int4 loop takes
TILE_X_ROWS = 2  # RB in quant_gemv.c: x rows per register tile of the blocked loop
TILE_OUT_ROWS = 6  # OB there: output rows widened per block


def _pack_x(x: torch.Tensor) -> torch.Tensor:
    """x [rows, p] -> [tiles, p / 8, RB, 8]: the blocked kernel's x layout (rows past `rows` 0)."""
    rows, p = x.shape
    tiles = -(-rows // TILE_X_ROWS)
    if tiles * TILE_X_ROWS > rows:
        x = F.pad(x, (0, 0, 0, tiles * TILE_X_ROWS - rows))
    return x.reshape(tiles, TILE_X_ROWS, p // 8, 8).transpose(1, 2).contiguous()


def _run(lib: _Lib, x2d: torch.Tensor, parts: dict[str, torch.Tensor], spec, in_features: int,
         threads: int, blocked: bool | None = None, activations: str = "fp32") -> torch.Tensor:
    qw = parts["qweight"].contiguous()
    out_f, rows = qw.shape[0], x2d.shape[0]
    ng, p = spec.groups(in_features), spec.padded_in(in_features)
    g = p // ng
    a8 = activations == "int8" and a8_takes(lib, spec, in_features)
    if a8:  # x in natural order; the kernel quantizes it (each part the same, so no split matters)
        blocked = False
    if blocked is None:  # (tests pass it to compare the two loops)
        blocked = BLOCKED_ROWS_MIN <= rows <= ROWS_MEASURED_MAX and g % 8 == 0
    x = x2d.float()
    xp = F.pad(x, (0, p - in_features)) if p > in_features else x  # [rows, p], zeros in the pad
    # [out, groups] fp16, passed as stored: the kernel widens one per group (torch's
    # half->float of the whole tensor cost more than the int4 product itself)
    scales = parts["scales"].contiguous()
    y = torch.empty(rows, out_f, dtype=torch.float32)  # [rows, out]
    if spec.bits == 4:
        mins = parts["mins"].contiguous()
        if a8:
            xin, fn = xp.contiguous(), lib.q4a8
        elif rows == 1 and not blocked and g % 16 == 0 and ng <= Q4_ONE_ROW_MAX_GROUPS:
            xin, fn = xp.contiguous(), lib.q4n  # the kernel splits even and odd columns itself
        else:
            xg = xp.reshape(rows, ng, g)
            xin = torch.cat((xg[..., 0::2], xg[..., 1::2]), -1).reshape(rows, p)  # per group [even | odd]
            xin = _pack_x(xin) if blocked else xin.contiguous()
            fn = lib.q4b if blocked else lib.q4

        def part(a: int, b: int) -> int:
            return fn(qw.data_ptr(), scales.data_ptr(), mins.data_ptr(), xin.data_ptr(),
                      y.data_ptr(), rows, out_f, p, g, a, b)
    else:
        xin = _pack_x(xp) if blocked else xp.contiguous()
        fn = lib.q8a8 if a8 else lib.q8b if blocked else lib.q8

        def part(a: int, b: int) -> int:
            return fn(qw.data_ptr(), scales.data_ptr(), xin.data_ptr(), y.data_ptr(), rows,
                      out_f, p, g, a, b)
    # Threads only for work that outweighs the hand-off to a helper (~65 us per call measured:
    # submit, wake, result): one thread below SPLIT_MIN_ELEMENTS[bits] multiply-adds per thread
    n = max(1, min(threads, rows * out_f * p // SPLIT_MIN_ELEMENTS[spec.bits]))
    step = -(-out_f // n)
    if blocked:  # whole blocks of output rows per thread: a part's last block is a slower edge
        step = -(-step // TILE_OUT_ROWS) * TILE_OUT_ROWS
    bounds = [(a, min(a + step, out_f)) for a in range(0, out_f, step)]
    futures = [helper_pool(n).submit(part, a, b) for a, b in bounds[1:]] if n > 1 else []
    rcs = [part(*bounds[0])] + [f.result() for f in futures]
    if any(rcs):
        raise RuntimeError(f"quant_gemv rejected its arguments ({rcs}): rows {rows}, group {g}")
    return y
