"""offload.quant: the round trip against a plain per-group reference written here, its error
bound on adversarial weights, the refusals, GGUF blocks against the gguf package's own
dequantization (bit for bit), and every quant_linear kernel against x @ dequantize(...)^T."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from offload import kernel_trust
from offload.quant import cpu as quant_cpu
from offload.quant import format as quant_format
from offload.quant import matmul as quant
from offload.quant.matmul import fused_applies, kernel_for, quant_linear
from offload.quant.format import QuantError, QuantSpec, dequantize, from_gguf, packed_bytes, quantize

SPECS = [QuantSpec(8, 0), QuantSpec(8, 32), QuantSpec(8, 7), QuantSpec(4, 32), QuantSpec(4, 8)]


def _f16_outward(v: float, up: bool) -> float:
    """The nearest float16 >= v (up) or <= v (down), the obvious way."""
    h = np.float16(v)
    if (up and float(h) < v) or (not up and float(h) > v):
        h = np.nextafter(h, np.float16(np.inf if up else -np.inf))
    return float(h)


def reference(w: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(q [out, in], scales [out, groups], mins [out, groups], dequantized [out, in]), one group
    at a time in float64 from the group's own columns (pad columns play no part)."""
    out_f, in_f = w.shape
    g = in_f if spec.group_size == 0 else spec.group_size
    ng = math.ceil(in_f / g)
    q, deq = np.zeros((out_f, in_f)), np.zeros((out_f, in_f))
    scales, mins = np.zeros((out_f, ng)), np.zeros((out_f, ng))
    for r in range(out_f):
        for j in range(ng):
            cols = range(j * g, min(in_f, (j + 1) * g))
            vals = [float(w[r, c]) for c in cols]
            if spec.bits == 8:
                s, m = _f16_outward(max(abs(v) for v in vals) / 127, up=True), 0.0
                lo, hi = -127, 127
            else:
                m = _f16_outward(min(vals), up=False)
                s, lo, hi = _f16_outward((max(vals) - m) / 15, up=True), 0, 15
            scales[r, j], mins[r, j] = s, m
            for c, v in zip(cols, vals):
                q[r, c] = 0 if s == 0 else min(hi, max(lo, round((v - m) / s)))
                deq[r, c] = q[r, c] * s + m
    return q, scales, mins, deq


def unpacked_q(parts: dict[str, torch.Tensor], spec: QuantSpec, in_f: int) -> np.ndarray:
    qw = parts["qweight"]
    if spec.bits == 4:  # column 2j in the low nibble of byte j, 2j + 1 in the high one
        qw = torch.stack((qw & 15, qw >> 4), -1).reshape(qw.shape[0], -1)
    return qw[:, :in_f].numpy().astype(np.float64)


def per_element(t: torch.Tensor, spec: QuantSpec, in_f: int) -> np.ndarray:
    """[out, groups] -> [out, in]: each element's group value."""
    g = spec.padded_in(in_f) // spec.groups(in_f)
    return t.double().repeat_interleave(g, 1)[:, :in_f].numpy()


def adversarial(kind: str, out_f: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64)
    if kind == "outlier":  # one huge value per group of 32: everything else rounds to few steps
        w = w * 0.01
        w[:, ::32] = 1000.0
    elif kind == "zero_groups":
        w[:, 32:64] = 0.0
        w[0] = 0.0
    elif kind == "constant":
        w[:, :32] = 0.3  # not a float16 value
        w[:, 32:64] = 0.5  # a float16 value
        w[1] = -2.0
    elif kind == "negative":
        w = -w.abs() - 1.0
    elif kind == "tiny":  # scales of ~1e-8 are float16 subnormals
        w = w * 1e-6
    return w.float()


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("kind,out_f,in_f", [("random", 7, 96), ("random", 1, 37), ("random", 3, 5),
                                             ("outlier", 4, 100), ("zero_groups", 3, 96), ("constant", 3, 70),
                                             ("negative", 4, 64), ("tiny", 5, 67)])
def test_round_trip_matches_the_reference_and_the_error_bound(spec, kind, out_f, in_f):
    gen = torch.Generator().manual_seed(hash((kind, out_f, in_f)) % 2**31)
    w = adversarial(kind, out_f, in_f, gen)
    parts = quantize(w, spec)
    ng, p = spec.groups(in_f), spec.padded_in(in_f)
    assert parts["qweight"].shape == (out_f, p if spec.bits == 8 else p // 2)
    assert parts["qweight"].dtype == (torch.int8 if spec.bits == 8 else torch.uint8)
    assert parts["scales"].shape == (out_f, ng) and parts["scales"].dtype == torch.float16
    assert ("mins" in parts) == (spec.bits == 4)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in parts.values())
    assert packed_bytes(out_f, in_f, spec) == sum(t.numel() * t.element_size() for t in parts.values())

    deq = dequantize(parts, spec, in_f, torch.float32)
    assert deq.shape == (out_f, in_f) and deq.dtype == torch.float32
    w64, d64 = w.double().numpy(), deq.double().numpy()
    s = per_element(parts["scales"], spec, in_f)
    m = per_element(parts["mins"], spec, in_f) if spec.bits == 4 else 0.0
    # every element within half a stored step (the range was rounded outward), plus float32 rounding
    slack = 1e-6 * (np.abs(w64) + np.abs(m) + 15 * s) + 1e-30
    assert (np.abs(w64 - d64) <= s / 2 + slack).all()

    q_ref, s_ref, m_ref, d_ref = reference(w64, spec)
    s_ours = parts["scales"].double().numpy()
    # the reference divides in float64, quantize in float32: a scale may land one float16 step apart
    assert (np.abs(s_ours - s_ref) <= np.spacing(s_ref.astype(np.float16)).astype(np.float64) + 1e-300).all()
    if spec.bits == 4:
        m_ours = parts["mins"].double().numpy()
        assert (np.abs(m_ours - m_ref) <= np.spacing(np.abs(m_ref).astype(np.float16)).astype(np.float64)).all()
    assert (np.abs(d64 - d_ref) <= np.maximum(s, per_element(torch.from_numpy(s_ref), spec, in_f)) * 1.001 + slack).all()
    same = (unpacked_q(parts, spec, in_f) == q_ref).mean()
    assert same >= 0.99, f"only {same:.3f} of the codes agree with the reference"
    if kind == "zero_groups":
        zero = (w == 0).all(1)
        assert (deq[zero] == 0).all() and (parts["scales"][zero] == 0).all()
        assert (deq[:, 32:min(64, in_f)] == 0).all()
    if kind == "constant" and spec.bits == 4 and spec.group_size == 32:
        # float16 constants come back exactly, with scale 0 (row 1 is -2.0 throughout)
        assert (deq[[0, 2], 32:64] == 0.5).all() and (parts["scales"][[0, 2], 1] == 0).all()
        assert (deq[1] == -2.0).all() and (parts["scales"][1] == 0).all()


def test_quantize_chunks_rows_without_changing_the_result(monkeypatch):
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(1))
    for spec in (QuantSpec(8, 16), QuantSpec(4, 16)):
        whole = quantize(w, spec)
        monkeypatch.setattr(quant_format, "QUANTIZE_CHUNK_ELEMENTS", 200)  # 3 rows per step
        chunked = quantize(w, spec)
        monkeypatch.undo()
        assert all(torch.equal(whole[k], chunked[k]) for k in whole)
    assert quantize(w.bfloat16(), QuantSpec(8, 0))["qweight"].shape == (37, 50)


def test_dequantize_rounds_once_into_the_dtype():
    w = torch.randn(9, 40, generator=torch.Generator().manual_seed(2))
    for spec in (QuantSpec(8, 0), QuantSpec(4, 16)):
        parts = quantize(w, spec)
        d32 = dequantize(parts, spec, 40, torch.float32)
        for dt in (torch.bfloat16, torch.float16, torch.float64):
            assert torch.equal(dequantize(parts, spec, 40, dt), d32.to(dt))


@pytest.mark.parametrize("value,spec,what", [(float("nan"), QuantSpec(8, 0), "NaN or inf"),
                                             (float("inf"), QuantSpec(4, 32), "NaN or inf"),
                                             (-float("inf"), QuantSpec(8, 32), "NaN or inf"),
                                             (1e7, QuantSpec(8, 32), "65504"),
                                             (-1e5, QuantSpec(4, 32), "65504"),
                                             (1e7, QuantSpec(4, 32), "65504")])
def test_unquantizable_weights_are_refused_with_the_row(value, spec, what):
    w = torch.randn(4, 64)
    w[2, 5] = value
    with pytest.raises(QuantError, match=what) as e:
        quantize(w, spec)
    assert "row 2" in str(e.value)


def test_spec_validation_says_how_to_fix():
    for bad, hint in [(QuantSpec(3, 32), "use 8"), (QuantSpec(8, -1), ">= 0"), (QuantSpec(4, 0), "even group_size"),
                      (QuantSpec(4, 33), "even group_size")]:
        with pytest.raises(QuantError, match=hint):
            bad.validate()
    assert issubclass(QuantError, ValueError)
    assert QuantSpec(8, 0).groups(100) == 1 and QuantSpec(8, 0).padded_in(100) == 100
    assert QuantSpec(4, 32).groups(33) == 2 and QuantSpec(4, 32).padded_in(33) == 64
    assert QuantSpec(8, 32).groups(5) == 1 and QuantSpec(8, 32).padded_in(5) == 32
    with pytest.raises(QuantError):
        quantize(torch.randn(3, 4, 5), QuantSpec(8, 0))
    with pytest.raises(QuantError):
        quantize(torch.zeros(3, 4, dtype=torch.int32), QuantSpec(8, 0))


def test_parts_that_do_not_fit_the_spec_are_refused():
    spec = QuantSpec(4, 32)
    parts = quantize(torch.randn(6, 64), spec)
    x = torch.randn(2, 64)
    with pytest.raises(QuantError, match="mins"):
        quant_linear(x, {k: v for k, v in parts.items() if k != "mins"}, spec, 64)
    with pytest.raises(QuantError, match="scales"):
        quant_linear(x, dict(parts, scales=parts["scales"].float()), spec, 64)
    with pytest.raises(QuantError, match="qweight"):
        dequantize(parts, spec, 96, torch.float32)  # another in_features
    with pytest.raises(QuantError, match=r"\[\.\.\., 64\]"):
        quant_linear(torch.randn(2, 63), parts, spec, 64)
    with pytest.raises(QuantError, match="fused"):
        quant_linear(x.bfloat16(), parts, spec, 64, kernel="fused")  # int4: no fused kernel


# ---- GGUF --------------------------------------------------------------------------------------
def _exact(got: torch.Tensor, ref: np.ndarray) -> bool:
    """Bit-identical float32 values; +0.0 and -0.0 count as one ((q - 8) * d at q = 8 is -0.0
    for a negative d where q * d + (-8 d) is +0.0)."""
    a = (got.numpy().astype(np.float32) + np.float32(0)).view(np.uint32)
    b = (np.asarray(ref, dtype=np.float32) + np.float32(0)).view(np.uint32)
    return a.shape == b.shape and bool((a == b).all())


def _weights_for_gguf(out_f: int, in_f: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, 32:64] = rng.uniform(-900, -100, 32)  # a large, negative-only block
    w[2, :32] = 0.25  # a constant block
    w[3] *= 1e-4
    return w


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_from_gguf_gives_exactly_the_gguf_values(kind):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[kind]
    out_f, in_f = 6, 96
    raw = gguf.quants.quantize(_weights_for_gguf(out_f, in_f), qtype)  # [out, bytes per row] uint8
    ref = gguf.quants.dequantize(raw, qtype).reshape(out_f, in_f)
    spec, parts = from_gguf(kind, raw, (out_f, in_f))
    assert spec == QuantSpec(8 if kind == "Q8_0" else 4, 32)
    assert _exact(dequantize(parts, spec, in_f, torch.float32), ref)
    _, again = from_gguf(kind, raw.tobytes(), (out_f, in_f))
    assert all(torch.equal(parts[k], again[k]) for k in parts)
    x = torch.randn(3, in_f)
    y = quant_linear(x, parts, spec, in_f)
    assert torch.allclose(y, x @ torch.from_numpy(ref).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_from_gguf_on_arbitrary_blocks(kind):
    """Blocks made by hand: every byte value of the codes, negative and subnormal scales."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(4)
    out_f, in_f = 5, 128
    nb = out_f * in_f // 32
    d = rng.uniform(-3, 3, nb).astype(np.float16)
    d[:3] = np.array([6e-8, -1e-6, 0.0], dtype=np.float16)
    m = rng.uniform(-5, 5, nb).astype(np.float16)
    codes = rng.integers(0, 256, (nb, 32 if kind == "Q8_0" else 16), dtype=np.uint8)
    head = [d.view(np.uint8).reshape(nb, 2)] + ([m.view(np.uint8).reshape(nb, 2)] if kind == "Q4_1" else [])
    raw = np.concatenate(head + [codes], axis=1).reshape(out_f, -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(out_f, in_f)
    spec, parts = from_gguf(kind, raw, (out_f, in_f))
    assert _exact(dequantize(parts, spec, in_f, torch.float32), ref)
    if kind == "Q4_0":
        assert torch.equal(parts["mins"], (parts["scales"].float() * -8).half())


def test_from_gguf_refusals():
    raw = np.zeros((2, 34), dtype=np.uint8)
    with pytest.raises(QuantError, match="Q8_0, Q4_0 and Q4_1"):
        from_gguf("Q5_K", raw, (2, 32))
    with pytest.raises(QuantError, match="truncated"):
        from_gguf("Q8_0", raw[:, :30], (2, 32))
    with pytest.raises(QuantError, match="blocks of 32"):
        from_gguf("Q8_0", raw, (2, 31))
    bad = raw.copy()
    bad[0, :2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(QuantError, match="damaged"):
        from_gguf("Q8_0", bad, (2, 32))


# ---- quant_linear ------------------------------------------------------------------------------
LINEAR_SPECS = [QuantSpec(8, 0), QuantSpec(8, 32), QuantSpec(4, 32), QuantSpec(4, 16)]


@pytest.mark.parametrize("spec", LINEAR_SPECS, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_kernel_equals_x_times_dequantized_weight(spec, rows, dtype, monkeypatch):
    monkeypatch.setattr(quant, "CPU_CHUNK_BYTES", 2048)  # several chunks and a shorter last one
    monkeypatch.setattr(quant, "CPU_CHUNK_BYTES_MANY_ROWS", 4096)
    gen = torch.Generator().manual_seed(rows)
    out_f, in_f = 45, 72  # in_features not a multiple of 32: a padded last group
    parts = quantize(torch.randn(out_f, in_f, generator=gen), spec)
    deq = dequantize(parts, spec, in_f, torch.float64)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    bias = torch.randn(out_f, generator=gen).to(dtype)
    ref = x.double() @ deq.T + bias.double()
    bound = x.double().abs() @ deq.abs().T + bias.double().abs()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    kernels = ["dense", "chunked"] + (["fused"] if fused_applies(spec, in_f, x, out_f) else [])
    if quant_cpu.applies(spec, in_f, x):
        kernels.append("c")
    for kernel in kernels + [None]:
        y = quant_linear(x, parts, spec, in_f, bias, kernel=kernel)
        assert y.shape == (rows, out_f) and y.dtype == dtype and y.is_contiguous()
        err = ((y.double() - ref).abs() / bound).max().item()
        assert err <= tol, f"kernel {kernel}: relative error {err:.2e}"
    y3 = quant_linear(x.view(1, rows, in_f), parts, spec, in_f)
    assert y3.shape == (1, rows, out_f)
    assert torch.allclose(y3[0].double(), x.double() @ deq.T, rtol=0, atol=tol * bound.max().item())


@pytest.mark.skipif(quant_cpu.library() is None, reason="the C few-row kernel was not built here")
def test_c_loop_or_chunked_is_measured_per_shape_from_nine_rows(monkeypatch):
    """From 9 to 64 rows the C loop and the chunked kernel are timed on the weight once per shape
    in inference and the faster is kept; fewer rows take the C loop unmeasured; the choice
    computes the same product."""
    monkeypatch.delenv("OFFLOAD_QUANT_KERNEL", raising=False)
    quant.reset_choices()
    spec, in_f, out_f = QuantSpec(4, 32), 512, 256
    parts = quantize(torch.randn(out_f, in_f), spec)
    deq = dequantize(parts, spec, in_f, torch.float64)
    x = torch.randn(12, in_f)
    x24 = torch.randn(24, in_f)  # beyond ROWS_MAX: the C loop only where measured faster
    with torch.inference_mode():
        y = quant_linear(x, parts, spec, in_f)
        quant_linear(x[:8], parts, spec, in_f)
        y24 = quant_linear(x24, parts, spec, in_f)
    assert torch.allclose(y24.double(), x24.double() @ deq.T, rtol=0, atol=1e-4)
    measured = quant.c_choices()
    assert sorted(measured) == [(4, 32, out_f, in_f, 12, "fp32"), (4, 32, out_f, in_f, 24, "fp32")]  # 8: C, unmeasured
    got = measured[(4, 32, out_f, in_f, 12, "fp32")]
    assert got["kernel"] in ("c", "chunked") and min(got["seconds"].values()) > 0
    assert kernel_for(spec, in_f, x, parts) == got["kernel"]  # cached: no second measurement
    assert torch.allclose(y.double(), x.double() @ deq.T, rtol=0, atol=1e-4)
    monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "c")  # forcing still forces
    assert kernel_for(spec, in_f, x, parts) == "c"
    quant.reset_choices()


def test_kernel_choice_and_override(monkeypatch):
    monkeypatch.delenv("OFFLOAD_QUANT_KERNEL", raising=False)
    ch, grouped = QuantSpec(8, 0), QuantSpec(8, 32)
    few = "c" if quant_cpu.library() is not None else "chunked"  # the C loop, where it was built
    x = torch.randn(4, 64)
    many = torch.randn(max(quant.FUSED_ROWS_MAX, quant_cpu.ROWS_MAX[8]) + 1, 64)
    w = torch.randn(20, 64)
    pch, pg = quantize(w, ch), quantize(w, grouped)
    # in_features 64 passed torch's int8pack check on every CPU measured (AVX2, AVX-512)
    assert kernel_trust.trusted(quant.FUSED_PROBE, (64, 20))
    assert kernel_for(ch, 64, x.bfloat16(), pch) == "fused"
    assert kernel_for(ch, 64, x.bfloat16()) == few  # no weight: its shape cannot be checked
    assert kernel_for(ch, 64, many.bfloat16()) == "chunked"
    assert kernel_for(ch, 64, many.bfloat16(), pch) in ("c", "chunked")  # timed: never fused beyond 16
    assert kernel_for(ch, 64, x, pch) == few  # fp32: torch's int8 kernel is scalar
    assert kernel_for(ch, 64, many) == "chunked"
    assert kernel_for(grouped, 64, x.bfloat16(), pg) == few
    p36 = quantize(torch.randn(7, 36), ch)
    assert kernel_for(ch, 36, torch.randn(4, 36).bfloat16(), p36) == few  # in % 8 != 0 crashes fused
    monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "dense")
    assert kernel_for(ch, 64, x.bfloat16(), pch) == "dense"
    monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "fused")
    assert kernel_for(ch, 64, x, pch) == "chunked" and kernel_for(ch, 64, x.bfloat16(), pch) == "fused"
    monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "chunked")
    assert kernel_for(ch, 64, x) == "chunked"
    monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "bogus")
    with pytest.raises(QuantError, match="dense, chunked, fused"):
        kernel_for(ch, 64, x)


def test_inference_mode_and_back():
    """The CPU scratch is reused across calls: made inside inference mode it must still be
    writable outside it (and the other way round)."""
    quant._tls.__dict__.pop("bufs", None)  # made afresh below, inside the mode
    for spec in (QuantSpec(8, 32), QuantSpec(4, 32)):
        parts = quantize(torch.randn(20, 64), spec)
        x = torch.randn(2, 64)
        with torch.inference_mode():
            inside = quant_linear(x, parts, spec, 64, kernel="chunked")
        with torch.no_grad():
            outside = quant_linear(x, parts, spec, 64, kernel="chunked")
        assert torch.equal(inside, outside)


def test_odd_widths_empty_batches_and_autograd():
    spec = QuantSpec(8, 0)
    parts = quantize(torch.randn(7, 36), spec)
    deq = dequantize(parts, spec, 36, torch.float32)
    xb = torch.randn(2, 36).bfloat16()
    assert torch.allclose(quant_linear(xb, parts, spec, 36).float(), xb.float() @ deq.T, rtol=2e-2, atol=2e-2)
    assert quant_linear(torch.randn(0, 36), parts, spec, 36).shape == (0, 7)
    x = torch.randn(3, 36, requires_grad=True)
    quant_linear(x, parts, spec, 36).sum().backward()
    assert torch.allclose(x.grad, deq.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [QuantSpec(8, 0), QuantSpec(8, 32), QuantSpec(4, 64), QuantSpec(4, 32)],
                         ids=lambda sp: f"int{sp.bits}g{sp.group_size}")
def test_c_rows_kernel_split_over_threads(spec, monkeypatch):
    """The C few-row kernel (offload/quant/cpu.py) split over threads (every size split here):
    equal to x @ dequantize(W)^T to float rounding, and the same bits however many threads
    share the rows; the kernel choice takes it for decode-sized inputs only."""
    if quant_cpu.library() is None:
        pytest.skip(f"C kernel unavailable: {quant_cpu.status()}")
    monkeypatch.setattr(quant_cpu, "SPLIT_MIN_ELEMENTS", {4: 1, 8: 1})
    gen = torch.Generator().manual_seed(spec.bits + spec.group_size)
    out_f, in_f = 1030, 300  # odd sizes: a padded last group, an uneven split
    parts = quantize(torch.randn(out_f, in_f, generator=gen), spec)
    deq = dequantize(parts, spec, in_f, torch.float64)
    for rows in range(1, quant_cpu.ROWS_MAX[spec.bits] + 1):
        x = torch.randn(rows, in_f, generator=gen)
        assert kernel_for(spec, in_f, x) == "c"
        ref = x.double() @ deq.T
        one = quant_cpu._run(quant_cpu.library(), x, parts, spec, in_f, threads=1)
        two = quant_cpu._run(quant_cpu.library(), x, parts, spec, in_f, threads=2)
        assert torch.equal(one, two)
        err = ((two.double() - ref).abs() / (x.double().abs() @ deq.abs().T)).max().item()
        assert err < 1e-5, (rows, err)
    x = torch.randn(quant_cpu.ROWS_MAX[spec.bits] + 1, in_f, generator=gen)
    assert kernel_for(spec, in_f, x) == "chunked"


@pytest.mark.parametrize("spec", [QuantSpec(8, 0), QuantSpec(8, 32), QuantSpec(4, 64), QuantSpec(4, 128)],
                         ids=lambda sp: f"int{sp.bits}g{sp.group_size}")
def test_c_blocked_loop_many_rows(spec):
    """From 9 to 64 rows the register-blocked C loop (quant_gemv.c rows_blocked): rows that
    are not a multiple of its 2-row tiles, output rows not a multiple of its 6-row blocks, a row
    in several 512-column pieces (a per-channel int8 row in slices of one group) -- equal to x @
    dequantize(W)^T to float rounding, to the 8-row tiles within it, and the same bits however
    many threads share the output rows."""
    if quant_cpu.library() is None:
        pytest.skip(f"C kernel unavailable: {quant_cpu.status()}")
    lib = quant_cpu.library()
    gen = torch.Generator().manual_seed(100 + spec.bits + spec.group_size)
    out_f, in_f = 611, 1104  # 1104 = 2 x 512 + 80: three pieces; 611 = 101 x 6 + 5
    parts = quantize(torch.randn(out_f, in_f, generator=gen), spec)
    deq = dequantize(parts, spec, in_f, torch.float64)
    for rows in (9, 10, 17, 32, 33, 64):
        x = torch.randn(rows, in_f, generator=gen)
        assert quant_cpu.applies(spec, in_f, x)
        ref = x.double() @ deq.T
        bound = x.double().abs() @ deq.abs().T
        one = quant_cpu._run(lib, x, parts, spec, in_f, threads=1)
        two = quant_cpu._run(lib, x, parts, spec, in_f, threads=2)
        tiles = quant_cpu._run(lib, x, parts, spec, in_f, threads=2, blocked=False)
        assert torch.equal(one, two), rows
        for name, y in (("blocked", two), ("tiles", tiles)):
            err = ((y.double() - ref).abs() / bound).max().item()
            assert err < 1e-5, (name, rows, err)
    assert not quant_cpu.applies(spec, in_f, torch.randn(quant_cpu.ROWS_MEASURED_MAX + 1, in_f))


def test_loading_the_kernels_keeps_subnormals():
    """A C library built with -ffast-math turns on flush-to-zero / denormals-are-zero for the
    whole process when it loads (GCC links crtfastmath.o into it): every later torch op then
    silently rounds subnormals to 0 (bf16 upcasts and fp16 rounding in the optimizer tests broke
    that way). Checked in a fresh process, after both kernels load, on its main thread and a
    new one."""
    import subprocess
    import sys
    code = (
        "import threading, torch\n"
        "from offload.optim import adamw as optim\nfrom offload.quant import cpu as quant_cpu\n"
        "assert quant_cpu.library() is not None, quant_cpu.status()\n"
        "optim._load_kernel()\n"
        "tiny = torch.tensor([1e-40]) * 1\n"
        "out = []\n"
        "t = threading.Thread(target=lambda: out.append((torch.tensor([1e-40]) * 1).item()))\n"
        "t.start(); t.join()\n"
        "print(tiny.item(), out[0])\n"
        "assert tiny.item() > 0 and out[0] > 0, 'subnormals flushed to zero'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
