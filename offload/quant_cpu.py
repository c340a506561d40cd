"""The few-row quantized product on the CPU: a C loop that reads each code byte once
(offload/csrc/quant_gemv.c), its output rows split over threads.

Why: decode multiplies 1-4 rows by every weight, so the time is reading the weight. torch can
only dequantize into a float buffer and multiply there -- several passes over each element --
which made batch-1 int4 decode 2.3x slower than dense fp32 on this project's 2-core AMD EPYC.
The C loop widens one group's codes into registers/L1 and takes one dot product per row. Measured
(8192x2048 and 2048x8192, medians, caches flushed between calls; docs/BENCHMARKS.md): 1 row,
int4/g64 4.3-4.7 ms against 8.5-8.9 for the torch chunked kernel and 4.6-6.4 for dense fp32;
int8 per channel 3.4 ms against 6.0 (chunked) and 5.7-6.0 (dense). At 4+ rows torch's chunked
GEMM wins for int8 (11.3 vs 8.0 ms at 4 rows) while int4 stays ahead to 8 rows
(22.3 vs 24.0 ms, 8192x2048), hence ROWS_MAX.

Built with -O3 -ffast-math (vectorised, reassociated sums): results equal x @ dequantize(W)^T
to float rounding (checked against torch when the library is loaded) and do not depend on how
the rows are split. Unavailable (no compiler, failed self-check): the torch kernels run instead.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from offload import cbuild

ROWS_MAX = {8: 2, 4: 8}  # bits -> most rows this kernel takes (see the module docstring)
MAX_GROUP = 8192  # quant_gemv.c's MAX_GROUP: int4 groups wider than this take the torch kernel
_SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_gemv.c"
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffast-math"]
_state: dict[str, object] = {}
_lock = threading.Lock()  # building/loading the library
_pool_lock = threading.Lock()  # the helper threads (the self-check runs under _lock and uses them)
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


class _Lib:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.q8 = lib.offload_q8_rows
        self.q8.argtypes = [p, p, p, p, i, i, i, i, i, i]
        self.q8.restype = ctypes.c_int
        self.q4 = lib.offload_q4_rows
        self.q4.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i]
        self.q4.restype = ctypes.c_int


def _self_check(lib: _Lib) -> str | None:
    from offload.quant import QuantSpec, dequantize, quantize
    gen = torch.Generator().manual_seed(7)
    for spec, in_f in ((QuantSpec(8, 0), 96), (QuantSpec(8, 32), 100), (QuantSpec(4, 64), 150)):
        w = torch.randn(37, in_f, generator=gen)
        parts = quantize(w, spec)
        for rows in (1, 3):
            x = torch.randn(rows, in_f, generator=gen)
            want = x.double() @ dequantize(parts, spec, in_f, torch.float64).T
            got = _run(lib, x, parts, spec, in_f, threads=2)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            if not err < 1e-5:
                return f"self-check: int{spec.bits} rows {rows}: relative error {err:.3g} vs torch"
    return None


def library() -> _Lib | None:
    """The loaded kernel, or None (why: `status()`); built at most once per process."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["why"] = cbuild.build("quant_gemv", _SOURCE, _FLAGS, _Lib,
                                                            _self_check)
            except OSError as exc:
                _state["lib"], _state["why"] = None, f"cannot build: {exc}"
        return _state["lib"]


def status() -> str:
    library()
    return str(_state["why"])


def applies(spec, in_features: int, x2d: torch.Tensor) -> bool:
    """This kernel computes x2d [rows, in] @ W^T for a weight of `spec` (and was built)."""
    return (x2d.device.type == "cpu" and 1 <= x2d.shape[0] <= ROWS_MAX[spec.bits]
            and (spec.bits == 8 or spec.group_width(in_features) <= MAX_GROUP)
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


def rows_product(x2d: torch.Tensor, parts: dict[str, torch.Tensor], spec, in_features: int) -> torch.Tensor:
    """x2d [rows, in] (any float dtype) @ W^T -> [rows, out] float32, W the quantized weight."""
    lib = library()
    assert lib is not None, "rows_product without the library: check applies() first"
    return _run(lib, x2d, parts, spec, in_features, threads=torch.get_num_threads())


def _run(lib: _Lib, x2d: torch.Tensor, parts: dict[str, torch.Tensor], spec, in_features: int,
         threads: int) -> torch.Tensor:
    qw = parts["qweight"].contiguous()
    out_f, rows = qw.shape[0], x2d.shape[0]
    ng, p = spec.groups(in_features), spec.padded_in(in_features)
    g = p // ng
    x = x2d.float()
    xp = F.pad(x, (0, p - in_features)) if p > in_features else x  # [rows, p], zeros in the pad
    scales = parts["scales"].float().contiguous()  # [out, groups]
    y = torch.empty(rows, out_f, dtype=torch.float32)  # [rows, out]
    if spec.bits == 4:
        xg = xp.reshape(rows, ng, g)
        xsum = xg.sum(-1).contiguous()  # [rows, groups]: what each group's min multiplies
        xin = torch.cat((xg[..., 0::2], xg[..., 1::2]), -1).contiguous()  # per group [even | odd]
        mins = parts["mins"].float().contiguous()

        def part(a: int, b: int) -> int:
            return lib.q4(qw.data_ptr(), scales.data_ptr(), mins.data_ptr(), xin.data_ptr(),
                          xsum.data_ptr(), y.data_ptr(), rows, out_f, p, g, a, b)
    else:
        xin = xp.contiguous()

        def part(a: int, b: int) -> int:
            return lib.q8(qw.data_ptr(), scales.data_ptr(), xin.data_ptr(), y.data_ptr(), rows,
                          out_f, p, g, a, b)
    n = max(1, min(threads, out_f // 256 or 1))  # small weights: the hand-off costs more
    step = -(-out_f // n)
    bounds = [(a, min(a + step, out_f)) for a in range(0, out_f, step)]
    futures = [helper_pool(n).submit(part, a, b) for a, b in bounds[1:]] if n > 1 else []
    rcs = [part(*bounds[0])] + [f.result() for f in futures]
    if any(rcs):
        raise RuntimeError(f"quant_gemv rejected its arguments ({rcs}): rows {rows}, group {g}")
    return y
