"""cpu_adamw_step against torch.optim.AdamW (default single-tensor path), on both implementations.

"max relative difference" below is max|ours - ref| / max|ref| per tensor, the spec's 1e-6 bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from offload.optim import adamw as optim
from offload.optim.adamw import cpu_adamw_step

IMPLS = ["c", "torch"]
HYPERS = [  # lr, beta1, beta2, eps, weight_decay, grad_scale
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0),
    dict(lr=3e-2, beta1=0.3, beta2=0.6, eps=1e-6, weight_decay=0.1, grad_scale=0.37),
    dict(lr=5e-4, beta1=0.95, beta2=0.95, eps=1e-5, weight_decay=0.01, grad_scale=2.5),
]
STEPS = 20


def _need(impl: str) -> None:
    """Skip the C kernel only where there is no compiler; a compiler whose kernel fails to build
    or fails the load-time self-check is a test failure, not a skip."""
    if impl == "c" and not optim.kernel_available():
        if optim.find_compiler() is None:
            pytest.skip("no C compiler: only the torch path can run here")
        pytest.fail(f"C compiler present but kernel unusable: {optim.kernel_status()}")


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _grads(n: int, dtype: torch.dtype, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 1e-2).to(dtype) for _ in range(steps)]


def _reference(p0: torch.Tensor, grads, hp: dict) -> list[torch.Tensor]:
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False, fused=False)
    for g in grads:
        p.grad = g.float() * hp["grad_scale"]
        opt.step()
    state = opt.state[p]
    return [p.detach(), state["exp_avg"], state["exp_avg_sq"]]


def _ours(p0: torch.Tensor, grads, hp: dict, impl: str, out_dtype: torch.dtype | None):
    n = p0.numel()
    bufs = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
    for step, g in enumerate(grads, start=1):
        cpu_adamw_step(*bufs, g, step=step, out16=out, impl=impl, **hp)
        if out is not None:  # bit for bit, every step, not just the last
            assert torch.equal(out.view(torch.int16), bufs[0].to(out_dtype).view(torch.int16))
    return bufs


# Every hyper-parameter set x grad dtype at small odd sizes, and at 1_000_003 each hyper-parameter
# set once with a different dtype (the full 1M matrix would triple the file's run time).
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_CASES = [(n, dt, hp) for n in (1, 7, 100_003) for dt in _DTYPES for hp in range(len(HYPERS))]
_CASES += [(1_000_003, _DTYPES[hp], hp) for hp in range(len(HYPERS))]


@pytest.mark.parametrize("n,grad_dtype,hp_index", _CASES)
def test_matches_torch_adamw_after_20_steps(n: int, grad_dtype: torch.dtype, hp_index: int) -> None:
    hp = HYPERS[hp_index]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = _grads(n, grad_dtype, STEPS, seed=hp_index)
    ref = _reference(p0, grads, hp)
    out_dtype = {torch.float32: None, torch.bfloat16: torch.bfloat16,
                 torch.float16: torch.float16}[grad_dtype]
    for impl in IMPLS:
        _need(impl)
        ours = _ours(p0, grads, hp, impl, out_dtype)
        for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), ours, ref):
            rel = _max_rel(a, b)
            assert rel <= 1e-6, f"{impl}: {name} max relative difference {rel:.3g}"
        # The master must actually have moved, or the comparison above proves nothing.
        assert not torch.equal(ours[0], p0)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_scale_reproduces_clip_grad_norm(impl: str) -> None:
    """The engine folds clip_grad_norm_'s fp32 coefficient into grad_scale; same floats out."""
    _need(impl)
    n = 10_007
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(5)]
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.05, foreach=False)
    ours = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    for step, g in enumerate(grads, start=1):
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], max_norm=0.5, foreach=False)
        opt.step()
        clip_coef = torch.clamp(0.5 / (g.norm() + 1e-6), max=1.0)  # what clip_grad_norm_ multiplies by
        assert clip_coef.item() < 1.0
        cpu_adamw_step(*ours, g, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.05, grad_scale=clip_coef.item(), impl=impl)
    st = opt.state[p]
    assert torch.equal(ours[1], st["exp_avg"]) or _max_rel(ours[1], st["exp_avg"]) <= 1e-6
    for a, b in zip(ours, (p.detach(), st["exp_avg"], st["exp_avg_sq"])):
        assert _max_rel(a, b) <= 1e-6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_every_finite_16bit_grad_upcasts_exactly(impl: str, grad_dtype: torch.dtype) -> None:
    """beta1 = 0 makes exp_avg = g exactly (lerp with weight 1), exposing the upcast of all 65536
    bit patterns (subnormals, signed zeros, extremes) minus inf/NaN."""
    _need(impl)
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    grad = bits.view(grad_dtype)
    grad = grad[torch.isfinite(grad.float())].contiguous()
    n = grad.numel()
    bufs = [torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    cpu_adamw_step(*bufs, grad, step=1, lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, impl=impl)
    assert torch.equal(bufs[1], grad.float())
    assert torch.equal(bufs[1].view(torch.int32), grad.float().view(torch.int32))  # -0.0 too


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out16_rounds_like_tensor_to_on_edge_values(impl: str, out_dtype: torch.dtype) -> None:
    """lr = 0, weight_decay = 0 leaves master untouched, so out16 is a pure conversion of chosen
    values: random bit patterns over the whole float range, rounding ties, fp16 overflow and
    subnormal boundaries, infinities and NaN."""
    _need(impl)
    gen = torch.Generator().manual_seed(3)
    rand_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (200_000,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e5, 6e-8,
                          2.98e-8, 2.9802322e-8, 5.96e-8, 6.1035156e-05, 6.1e-05, 1e-39, -3e-40,
                          1.0000001, 1.00390625, 1.005859375, 3.0e38, float("inf"), float("-inf"),
                          float("nan")])
    # Exact halfway cases: bf16 drops 16 bits (tie = 0x8000 below the kept part); fp16 drops 13
    # in its normal range (tie = 0x1000) and more below 2^-14, where 2^-25 * odd is a tie.
    upper = torch.randint(0, 1 << 15, (4096,), generator=gen, dtype=torch.int32)
    bf16_ties = (upper << 16 | 0x8000).view(torch.float32)
    exps = torch.randint(113, 143, (4096,), generator=gen, dtype=torch.int32)
    mant = torch.randint(0, 1 << 10, (4096,), generator=gen, dtype=torch.int32)
    f16_ties = (exps << 23 | mant << 13 | 0x1000).view(torch.float32)
    f16_sub_ties = torch.arange(1, 2048, 2, dtype=torch.float32) * 2.0 ** -25
    ties = torch.cat([bf16_ties, f16_ties, f16_sub_ties])
    master = torch.cat([rand_bits.to(torch.int32).view(torch.float32), edges, ties, -ties])
    n = master.numel()
    before = master.clone()
    out = torch.empty(n, dtype=out_dtype)
    grad = torch.zeros(n)  # exp_avg stays 0, so the update is -0.0 and keeps even -0.0 masters
    cpu_adamw_step(master, torch.zeros(n), torch.zeros(n), grad, step=1, lr=0.0, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, out16=out, impl=impl)
    nan = torch.isnan(before)
    assert torch.equal(master[~nan].view(torch.int32), before[~nan].view(torch.int32))
    expected = before.to(out_dtype)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert torch.isnan(out[nan].float()).all()


def test_threads_split_gives_identical_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several threads over unaligned sizes must give the same bits as one thread: the split may
    not drop, repeat or overlap elements."""
    _need("c")
    monkeypatch.setattr(optim, "C_MIN_PARAMS_PER_THREAD", 64)
    old = torch.get_num_threads()
    try:
        for n in (63, 4097, 3 * 4096 + 5, 100_003):  # 1, 2, 4 and 25 chunks
            gen = torch.Generator().manual_seed(n)
            p0 = torch.randn(n, generator=gen)
            grad = torch.randn(n, generator=gen).to(torch.bfloat16)
            results = []
            for threads in (1, 3, 7):
                torch.set_num_threads(threads)
                bufs = [p0.clone(), torch.zeros(n), torch.zeros(n)]
                out = torch.zeros(n, dtype=torch.bfloat16)
                for step in (1, 2):
                    cpu_adamw_step(*bufs, grad, step=step, lr=1e-2, beta1=0.9, beta2=0.99,
                                   eps=1e-8, weight_decay=0.1, out16=out, impl="c")
                results.append(bufs + [out.float()])
            for other in results[1:]:
                for a, b in zip(results[0], other):
                    assert torch.equal(a, b)
            assert torch.equal(results[0][3], results[0][0].to(torch.bfloat16).float())
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("impl", IMPLS)
def test_concurrent_calls_from_threads_are_independent(impl: str) -> None:
    """The engine may step several blocks from worker threads at once: no shared scratch/state."""
    _need(impl)
    n, blocks = 300_001, 4
    gen = torch.Generator().manual_seed(5)
    inputs = [(torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16))
              for _ in range(blocks)]
    hp = HYPERS[1]

    def run(i: int) -> list[torch.Tensor]:
        p0, g = inputs[i]
        bufs = [p0.clone(), torch.zeros(n), torch.zeros(n)]
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2, 3):
            cpu_adamw_step(*bufs, g, step=step, out16=out, impl=impl, **hp)
        return bufs + [out.float()]

    sequential = [run(i) for i in range(blocks)]
    with ThreadPoolExecutor(max_workers=blocks) as pool:
        concurrent = list(pool.map(run, range(blocks)))
    for seq, conc in zip(sequential, concurrent):
        for a, b in zip(seq, conc):
            assert torch.equal(a, b)


def test_portable_build_without_arch_flags(tmp_path: Path) -> None:
    """The variant a machine gets when -march=native is refused: no FMA/F16C/AVX assumed, so
    fmaf() and the 16-bit conversions take their generic code paths. It must agree too."""
    if optim.find_compiler() is None:
        pytest.skip("no C compiler")
    fn, why = optim._build_kernel(arch_flag_sets=[[]], cache=tmp_path)
    assert fn is not None, why            # _build_kernel already ran the load-time self-check
    n = 70_001
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(n, generator=gen)
    grads = _grads(n, torch.float16, 5, seed=11)
    hp = HYPERS[1]
    portable = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    out = torch.empty(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, start=1):
        optim._step_c(fn, *portable, g, out, optim.adamw_coefficients(step=step, **hp))
    assert torch.equal(out, portable[0].to(torch.bfloat16))
    for a, b in zip(portable, _reference(p0, grads, hp)):
        assert _max_rel(a, b) <= 1e-6
    # Every operation is correctly rounded IEEE arithmetic (fmaf, sqrtf, /) with no compiler
    # contraction, so the vectorised native build must produce the very same bits.
    if optim.kernel_available():
        native = [p0.clone(), torch.zeros(n), torch.zeros(n)]
        for step, g in enumerate(grads, start=1):
            cpu_adamw_step(*native, g, step=step, impl="c", **hp)
        for a, b in zip(portable, native):
            assert torch.equal(a, b)


def test_rejects_bad_buffers() -> None:
    n = 8
    good = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    f32 = lambda: torch.zeros(n)  # noqa: E731
    with pytest.raises(TypeError):
        cpu_adamw_step(f32().double(), f32(), f32(), f32(), **good)
    with pytest.raises(TypeError):
        cpu_adamw_step(f32(), f32(), f32(), f32().to(torch.int32), **good)
    with pytest.raises(TypeError):
        cpu_adamw_step(f32(), f32(), f32(), f32(), out16=f32(), **good)
    with pytest.raises(ValueError):
        cpu_adamw_step(f32(), f32(), torch.zeros(n + 1), f32(), **good)
    with pytest.raises(ValueError):
        cpu_adamw_step(f32(), f32(), f32(), torch.zeros(2 * n)[::2], **good)
    with pytest.raises(ValueError):
        shared = f32()
        cpu_adamw_step(f32(), shared, shared, f32(), **good)
    with pytest.raises(ValueError):
        cpu_adamw_step(f32(), f32(), f32(), f32(), **{**good, "step": 0})
    with pytest.raises(ValueError):
        cpu_adamw_step(f32(), f32(), f32(), f32(), impl="cuda", **good)  # type: ignore[arg-type]
    empty = lambda: torch.zeros(0)  # noqa: E731
    cpu_adamw_step(empty(), empty(), empty(), empty(), **good)  # no-op, no error


def test_falls_back_to_torch_without_a_compiler(tmp_path: Path) -> None:
    """No compiler on PATH: auto picks the torch path, warns once, and still steps correctly."""
    script = textwrap.dedent("""
        import warnings, torch
        from offload.optim import adamw as optim
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert optim.active_implementation() == "torch", optim._kernel_state
        assert any("C AdamW kernel unavailable" in str(w.message) for w in caught)
        p, m, v = torch.ones(5), torch.zeros(5), torch.zeros(5)
        optim.cpu_adamw_step(p, m, v, torch.ones(5), step=1, lr=0.1, beta1=0.9, beta2=0.999,
                             eps=1e-8, weight_decay=0.0)
        assert torch.allclose(p, torch.full((5,), 0.9)), p
        try:
            optim.cpu_adamw_step(p, m, v, torch.ones(5), step=2, lr=0.1, beta1=0.9,
                                 beta2=0.999, eps=1e-8, weight_decay=0.0, impl="c")
        except RuntimeError as exc:
            assert "unavailable" in str(exc)
        else:
            raise AssertionError("impl='c' must raise without a compiler")
        print("ok")
    """)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {**os.environ, "PATH": str(empty_bin), "CC": "", "OFFLOAD_KERNEL_CACHE": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("OFFLOAD_ADAM_IMPL", None)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_is_bit_identical_to_torch_adamw(grad_dtype):
    """exact=True reproduces torch.optim.AdamW's single-tensor path bit for bit (its CPU sqrt
    included), also across the piece boundaries of the exact mode."""
    if not optim.kernel_available():
        pytest.skip("no C compiler: the exact mode is a mode of the C kernel")
    gen = torch.Generator().manual_seed(7)
    n = 3 * (1 << 19) + 11  # several exact-mode pieces and a ragged tail
    p0 = torch.randn(n, generator=gen) * 0.02
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        g = (torch.randn(n, generator=gen) * 10.0 ** -step).to(grad_dtype)
        ref.grad = g.float()
        opt.step()
        cpu_adamw_step(master, m, v, g, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                       weight_decay=0.1, exact=True)
    assert torch.equal(master, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])
