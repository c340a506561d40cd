"""The GPU proof kit's coverage of the paths added since the first kit (issue 40, item 3), in
`pytest -m cuda` (scripts/gpu_check.py runs it): each test against a reference -- a plan, a plain
model, float64, torch's own kernels -- never against its own output.

1. LoRA and QLoRA training on the device: peak device memory within the plan (review 2 P4, P16).
2. `--quantize int8/int4` inference on the device: quantized blocks give the tokens and logits of
   a plain model holding the dequantized codes; the chunked product timed (printed, never
   asserted) against torch's bf16 product and `torch._weight_int4pack_mm` (review 2 P9).
3. `--kv-cache host` on the GPU: the host KV cache gives the device cache's logits and tokens.
4. Attention with the production SDPA backends (flash, memory-efficient, cuDNN), not only the
   math one the rest of the kit pins: against float64 and the math backend.

Without a GPU every test is skipped; OFFLOAD_TEST_CUDA_ON_CPU=1 runs 2 (the equality tests) and
3 on the CPU device, so their logic has run before a GPU run. Tests 1, 4 and the timing are
CUDA-only: they measure device memory, CUDA kernels or CUDA backends.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import offload
from offload.infer.generate import generate
from offload.infer.kv_cache import OffloadedKVCache
from offload.lora import LoraConfig, apply_lora
from offload.models import (CheckpointReader, KVCache, ModelConfig, build_model, load_streamed,
                            preset, save_pretrained)
from tests.test_cuda import (DEV, HAVE_CUDA, ON_CPU, _deterministic, cfg_for,  # noqa: F401
                             cuda_only, device_memory_mark)
from tests.test_engine import hf_loss

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAVE_CUDA or ON_CPU),
                       reason="needs a CUDA GPU (run `python scripts/gpu_check.py` on one; "
                              "OFFLOAD_TEST_CUDA_ON_CPU=1 runs the CPU-meaningful part here)"),
]

CFG = preset("tiny")
# wide enough that a dense 16-bit copy of every projection (P4) or an fp32 copy of x per
# adapter (P16) is several MB, beyond the plan's rounding; head_dim 64 with grouped queries
WIDE = ModelConfig(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2)
LORA = LoraConfig(rank=8, alpha=16, targets=("q", "v", "down"))
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43]]  # left-padded into one batch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|, in float64."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ---- 1. LoRA and QLoRA training: peak device memory within the plan ------------------------------
def _lora_setup(method: str, tmp_path):
    """(model, engine source, reader to close): LoRA over a materialised 16-bit base, or QLoRA
    over an int4 base on meta (tests/test_lora_engine.py test_qlora_over_a_streamed_int4_base,
    in bf16 here), its blocks converted on the CPU before anything reaches the device."""
    if method == "lora":
        model = build_model(WIDE, "cpu", source=0)
        apply_lora(model, LORA, seed=1)
        return model, None, None
    from offload.models.quantized import (QuantizedSource, QuantSettings, quantize_checkpoint,
                                          quantize_layers)
    save_pretrained(build_model(WIDE, "cpu", source=0), tmp_path / "base")
    reader = CheckpointReader(str(tmp_path / "base"))
    blocks = quantize_checkpoint(reader, QuantSettings("int4", 32), torch.bfloat16,
                                 cache_root=str(tmp_path / "cache"))
    model = build_model(WIDE, "meta", torch.bfloat16)
    quantize_layers(model, blocks.specs, torch.bfloat16)
    apply_lora(model, LORA, seed=1)
    return model, QuantizedSource(reader, blocks), reader


def _planned_device_bytes(engine, model, method: str, cfg, micro: int, seq: int) -> int:
    """The engine's own plan (model states, frozen base, rings) plus the activation estimate
    runners.finetune adds to it: plan_training(..., activations) is the sum of the two; for
    QLoRA with one projection's dense weight as the transient (review 2 P4)."""
    from offload.train.plan import activation_bytes, llama_activation_estimate
    from runners.finetune_lora import LoraRun

    acts = llama_activation_estimate(WIDE, micro, seq, cfg.torch_dtype)  # hf_loss: every position
    if method == "qlora":
        acts = dataclasses.replace(acts, transient=LoraRun.dense_transient_bytes(
            model, cfg.torch_dtype, DEV))
    extra = activation_bytes(acts, cfg, WIDE.num_hidden_layers, lambda n: n)
    return engine.plan.total("device") + extra[("device", "activations")]


LORA_CASES = [("lora", dict(offload="cpu")),
              ("lora", dict(offload="cpu", offload_params="cpu", activation_checkpointing=True)),
              ("qlora", dict(offload="cpu", offload_params="cpu")),
              ("qlora", dict(offload="cpu", offload_params="none", activation_checkpointing=True))]


@cuda_only
@pytest.mark.parametrize("method,kw", LORA_CASES,
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                              for m, kw in LORA_CASES])
def test_lora_peak_device_memory_within_the_plan(method, kw, tmp_path):
    """PROVES (CUDA only): LoRA (16-bit base resident or streamed from host RAM) and QLoRA (int4
    base streamed as stored, or resident) trained in bf16 on the GPU hold no more device memory
    than their plan says -- peak allocated within the plan's device total, peak reserved within
    it plus the allocator's rounding, and no allocator retries -- as
    tests/test_cuda.py test_training_peak_device_memory_within_the_plan does for full training.
    A QLoRA product that kept the dense weight for backward (P4) or unplanned fp32 copies of x
    per adapter (P16, open) show here as an excess of several MB."""
    micro, seq = 2, 64
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, WIDE.vocab_size, (micro, seq), generator=gen).to(DEV)
               for _ in range(3)]
    model, source, reader = _lora_setup(method, tmp_path)
    cfg = cfg_for(tmp_path, dtype="bf16", **kw)
    try:
        base_alloc, base_reserved, retries0 = device_memory_mark()
        engine = offload.initialize(model, cfg, source=source)
        planned = _planned_device_bytes(engine, model, method, cfg, micro, seq)
        losses = []
        try:
            for ids in batches:
                loss = hf_loss(model, ids)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            torch.cuda.synchronize()
        finally:
            engine.close()
    finally:
        if reader is not None:
            reader.close()
    used = torch.cuda.max_memory_allocated(DEV) - base_alloc
    reserved = torch.cuda.max_memory_reserved(DEV) - base_reserved
    assert all(torch.isfinite(v).item() for v in losses)
    assert used <= planned, (used, planned, engine.plan.bytes["device"])
    assert reserved <= planned + 64 * 2**20, (reserved, planned)  # 2 MiB segments and rounding
    assert torch.cuda.memory_stats(DEV).get("num_alloc_retries", 0) == retries0


# ---- 2. --quantize int8/int4 inference on the device ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(build_model(CFG, "cpu", torch.float32, source=5), path)
    return str(path)


@pytest.mark.parametrize("where", ["device", "cpu"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_blocks_on_the_device_equal_their_dequantized_weights(tiny_ckpt, tmp_path,
                                                                         mode, where):
    """PROVES (CUDA; the CPU device under ON_CPU): quantized blocks loaded on the device, or
    streamed to it from host RAM as byte blocks, compute in fp32 the logits (1e-4) and greedy
    tokens of a plain model on the same device whose projection weights are the dequantized codes
    (tests/test_quantized.py _dense_reference); in bf16 (blocks converted in bf16) logits as close
    to that plain model's fp32 logits as its own bf16 run is (at most twice its error), and within
    2^-4 of it. On CUDA the chunked kernel is the one that ran (review 2 P9's product)."""
    from offload.models.quantized import load_quantized_streamed
    from offload.quant.matmul import kernels_run
    from tests.test_quantized import _convert, _dense_reference

    ids = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEV)
    got, want, truth = {}, {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        blocks = _convert(tiny_ckpt, str(tmp_path / f"q-{dtype}"), mode, dtype=dtype)
        ref = _dense_reference(tiny_ckpt, blocks).to(DEV)
        with torch.inference_mode():
            truth[dtype] = ref(ids)  # fp32
            ref.to(dtype)
            want[dtype] = (ref(ids), generate(ref, PROMPTS, max_new_tokens=6, device=DEV,
                                              dtype=dtype).tokens)
        del ref
        with CheckpointReader(tiny_ckpt) as reader:
            model, streamer = load_quantized_streamed(reader, blocks, [where] * CFG.num_hidden_layers,
                                                      device=DEV, dtype=dtype,
                                                      zero_copy_host=None if HAVE_CUDA else False)
            before = kernels_run().get("chunked", 0)
            try:
                with torch.inference_mode():
                    logits = model(ids)
                    toks = generate(model, PROMPTS, max_new_tokens=6, device=DEV, dtype=dtype,
                                    streamer=streamer).tokens
            finally:
                streamer.close()
        got[dtype] = (logits, toks, kernels_run().get("chunked", 0) - before)
    logits, toks, chunked = got[torch.float32]
    torch.testing.assert_close(logits, want[torch.float32][0], rtol=1e-4, atol=1e-4)
    assert toks == want[torch.float32][1]
    # bf16: the chunked kernel adds int4's mins after the product, the reference before it
    mine, ref16, t = got[torch.bfloat16][0], want[torch.bfloat16][0], truth[torch.bfloat16]
    assert rel_err(mine, t) <= 2 * rel_err(ref16, t) + 2 ** -8, (rel_err(mine, t), rel_err(ref16, t))
    assert rel_err(mine, ref16) <= 2 ** -4
    if HAVE_CUDA:
        assert chunked > 0 and got[torch.bfloat16][2] > 0


def _cuda_ms(fn, repeats: int = 20) -> float:
    """Mean milliseconds of fn() on the GPU (CUDA events), after 3 untimed calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _int4pack(parts: dict, spec):
    """torch._weight_int4pack_mm's operands from our int4 parts, or the reason it cannot run:
    its uint8 input holds element 2j in the high nibble (ours: the low one), and it dequantizes
    (q - 8) * scale + zero with bf16 [groups, out, 2] scales and zeros (ours: q * scale + min)."""
    try:
        qw = parts["qweight"]
        swapped = ((qw & 15) << 4) | (qw >> 4)
        packed = torch._convert_weight_to_int4pack(swapped.contiguous(), 8)
        sc, mn = parts["scales"].float(), parts["mins"].float()  # [out, groups]
        sz = torch.stack([sc.T, (mn + 8 * sc).T], -1).to(torch.bfloat16).contiguous()
        return lambda x: torch._weight_int4pack_mm(x, packed, spec.group_size, sz), None
    except Exception as e:  # noqa: BLE001 - a private kernel: any failure means "unavailable"
        return None, f"unavailable: {type(e).__name__}: {str(e)[:160]}"


@cuda_only
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_product_speed_on_the_gpu(mode, capsys, record_property):
    """MEASURES, never asserts a speed (CUDA only; review 2 P9 is a speed question): the chunked
    quantized product (offload.quant.matmul.quant_linear) at 1 and 16 rows on an 8192 x 2048
    weight against torch's bf16 F.linear of the dequantized weight and, for int4,
    torch._weight_int4pack_mm ("unavailable" where it will not run). PROVES only that the
    chunked result agrees with the bf16 product of the dequantized weight (relative to
    |x| @ |W|^T, bf16 rounding: 2^-6). The timings are printed and kept in the junit file."""
    from offload.quant.format import QuantSpec, dequantize, quantize
    from offload.quant.matmul import quant_linear

    out_f, in_f = 8192, 2048
    spec = QuantSpec(8, 32) if mode == "int8" else QuantSpec(4, 64)  # the modes' default groups
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    parts = {k: v.to(DEV) for k, v in quantize(w, spec).items() if v is not None}
    w16 = dequantize(parts, spec, in_f, torch.bfloat16)  # [out, in] on the device
    int4mm, why = _int4pack(parts, spec) if mode == "int4" else (None, "not int4")
    records = []
    for rows in (1, 16):
        x = torch.randn(rows, in_f, generator=gen).to(DEV, torch.bfloat16)
        with torch.inference_mode():
            want = F.linear(x, w16)
            bound = (x.float().abs() @ w16.float().abs().T).clamp_min(1e-30)
            got = quant_linear(x, parts, spec, in_f, kernel="chunked")
            err = ((got.float() - want.float()).abs() / bound).max().item()
            rec = {"mode": mode, "rows": rows, "weight": [out_f, in_f], "chunked_err": err,
                   "chunked_ms": _cuda_ms(lambda: quant_linear(x, parts, spec, in_f, kernel="chunked")),
                   "bf16_linear_ms": _cuda_ms(lambda: F.linear(x, w16)), "int4pack_ms": why}
            if int4mm is not None:
                try:
                    y4 = int4mm(x)
                    rec["int4pack_err"] = ((y4.float() - want.float()).abs() / bound).max().item()
                    rec["int4pack_ms"] = _cuda_ms(lambda: int4mm(x))
                except Exception as e:  # noqa: BLE001
                    rec["int4pack_ms"] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
        records.append(rec)
        assert err <= 2 ** -6, rec
    record_property("quant_speed", json.dumps(records))
    with capsys.disabled():
        for rec in records:
            print(f"\nquant-speed {json.dumps(rec)}")


# ---- 3. --kv-cache host ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_kv_cache_equals_the_device_cache_step_by_step(dtype):
    """PROVES (CUDA; the CPU device under ON_CPU): a prefill and two decode steps through the KV
    cache in host RAM (OffloadedKVCache: pinned, copied one layer ahead on its own stream) give
    the logits of the cache on the device, and the host copy holds what the device cache holds,
    position for position (relative to the largest value: fp32 1e-5, bf16 2^-4 -- the attention
    reads a strided view of the slot, not the device cache's contiguous tensor, so the GPU may
    round differently; bit-equal on the CPU)."""
    model = build_model(CFG, DEV, dtype, source=3)
    B, T = 2, 6
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(4)).to(DEV)
    dev = KVCache(CFG, B, T + 2, device=DEV, dtype=dtype)
    off = OffloadedKVCache(CFG, B, T + 2, device=DEV, dtype=dtype, ahead=2)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -4  # bf16 noise here ~1e-2; a stale read O(1)
    with torch.inference_mode():
        for step in range(3):
            x = ids if step == 0 else ids[:, step:step + 1]
            a, b = model(x, kv_cache=dev), model(x, kv_cache=off)
            assert rel_err(b, a) <= tol, step
    off.sync()
    assert off.h2d_bytes > 0 and off.d2h_bytes > 0
    for i in range(CFG.num_hidden_layers):
        for host, want in ((off.host[i][0], dev.keys[i]), (off.host[i][1], dev.values[i])):
            assert rel_err(host.permute(1, 2, 0, 3).to(DEV), want) <= tol, i


@pytest.mark.parametrize("weights", ["device", "cpu"])
def test_host_kv_cache_gives_the_device_caches_tokens(weights, tmp_path):
    """PROVES (CUDA; the CPU device under ON_CPU): greedy generation of a left-padded batch with
    `kv_tier="host"` (runners.infer --kv-cache host) gives the tokens of the device cache, fp32,
    with the blocks resident or streamed from host RAM; every decode step brought the past
    positions in (kv_h2d_bytes)."""
    model = build_model(CFG, "cpu", torch.float32, source=3)
    save_pretrained(model, tmp_path)
    with torch.inference_mode():
        want = generate(model.to(DEV), PROMPTS, max_new_tokens=9, device=DEV)
    with CheckpointReader(tmp_path) as reader:
        m, streamer = load_streamed(reader, [weights] * CFG.num_hidden_layers, device=DEV,
                                    dtype=torch.float32, zero_copy_host=None if HAVE_CUDA else False)
        try:
            got = generate(m, PROMPTS, max_new_tokens=9, device=DEV, streamer=streamer,
                           kv_tier="host")
        finally:
            streamer.close()
    assert got.tokens == want.tokens
    assert got.kv_h2d_bytes > 0 and want.kv_h2d_bytes == 0


# ---- 4. attention with the production SDPA backends -----------------------------------------------
def _backends() -> dict:
    if not HAVE_CUDA:
        return {}
    from torch.nn.attention import SDPBackend
    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


BACKENDS = ["flash", "efficient", "cudnn"]
# (queries, past keys, left padding of row 1): the model's calls -- a fresh prompt (causal flag,
# no mask), a padded prompt (bool mask), a decode step over the cache (no mask / padded: mask)
SDPA_CASES = {"prefill causal": (200, 0, 0), "prefill left-padded": (200, 0, 37),
              "decode over the cache": (1, 200, 0), "decode left-padded": (1, 200, 37)}


def _sdpa_inputs(case: str, head_dim: int):
    """q [2, 8, T, D], k/v [2, 2, S, D] in bf16 on the device and the model's own mask
    (offload/models/llama.py attention_mask_for) for the case."""
    from offload.models.llama import attention_mask_for
    T, past, pad = SDPA_CASES[case]
    S = past + T
    gen = torch.Generator().manual_seed(head_dim + T)
    q, k, v = (torch.randn(2, h, n, head_dim, generator=gen).to(DEV, torch.bfloat16)
               for h, n in ((8, T), (2, S), (2, S)))
    attn = None
    if pad:
        attn = torch.ones(2, S, dtype=torch.long, device=DEV)
        attn[1, :pad] = 0
    mask = attention_mask_for(2, T, past, attn, None, DEV)
    return q, k, v, mask, mask is None and T > 1


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(SDPA_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_backend_matches_math_at_the_models_shapes(backend, case, head_dim):
    """PROVES (CUDA only): with only `backend` allowed, offload.models.attention.attend (the
    model's SDPA call: grouped queries 8/2, the causal flag or the model's bool mask) computes in
    bf16, forward and backward, within the project's fused-kernel bound against float64
    (models/attention.py _FORWARD_TOL / _BACKWARD_TOL, relative), and the math backend's result
    within twice that. A backend that does not take the shape is skipped with torch's reason."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from offload.models.attention import _BACKWARD_TOL, _FORWARD_TOL, _reference, attend
    if backend not in _backends():
        pytest.skip(f"torch {torch.__version__} has no SDPBackend for {backend}")
    q, k, v, mask, causal = _sdpa_inputs(case, head_dim)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    outs = {}
    for name, kind in ((backend, _backends()[backend]), ("math", SDPBackend.MATH)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            with sdpa_kernel([kind]):
                out = attend(*leaves, mask, is_causal=causal, enable_gqa=True)
                out.backward(dout)
                torch.cuda.synchronize()
        except RuntimeError as e:
            pytest.skip(f"{name} unavailable for {case}, head_dim {head_dim}: {str(e)[:300]}")
        outs[name] = (out.detach(), [t.grad for t in leaves])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(q64, k64, v64, mask, causal)
    ref.backward(dout.double())
    scale = max(t.grad.abs().max().item() for t in (q64, k64, v64))
    out, grads = outs[backend]
    assert rel_err(out, ref) <= _FORWARD_TOL[torch.bfloat16], "forward against float64"
    assert rel_err(out, outs["math"][0]) <= 2 * _FORWARD_TOL[torch.bfloat16], "against math"
    for name, g, g64 in zip("qkv", grads, (q64.grad, k64.grad, v64.grad)):
        err = (g.double() - g64).abs().max().item() / scale
        assert err <= _BACKWARD_TOL[torch.bfloat16], f"grad of {name}: {err:.3g} against float64"


def _model_logits(model) -> list[torch.Tensor]:
    """Logits of a fresh batch (prefill, then 3 decode steps over a KVCache) and a left-padded
    one (mask in prefill and decode): every attention call the model makes in generation."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, WIDE.vocab_size, (2, 52), generator=gen).to(DEV)
    out = []
    for pad in (0, 17):
        attn = torch.ones(2, 52, dtype=torch.long, device=DEV)
        attn[1, :pad] = 0
        cache = KVCache(WIDE, 2, 52, device=DEV, dtype=next(model.parameters()).dtype)
        for a, b in ((0, 49), (49, 50), (50, 51), (51, 52)):
            out.append(model(ids[:, a:b], attention_mask=attn[:, :b] if pad else None,
                             kv_cache=cache).float())
    return out


@cuda_only
@pytest.mark.parametrize("backend", ["all", *BACKENDS])
def test_model_forward_with_each_sdpa_backend_matches_math(backend):
    """PROVES (CUDA only): a bf16 model (head_dim 64, grouped queries) generating on the GPU with
    `backend` allowed beside math ("all": torch's own choice, what production runs) is as close
    to the fp32 model's logits (math, TF32 off) as the bf16 math-only run is (at most twice its
    error, bf16 noise being ~1e-2 of the largest logit here), and within 2^-4 of the math-only
    run -- prefill and decode, with and without left padding; a wrong mask or cache read is
    O(1). Skipped when the backend cannot take the model's causal prefill (torch's reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from offload.models.attention import attend
    allowed = list(_backends().values()) if backend == "all" else [_backends().get(backend)]
    if None in allowed:
        pytest.skip(f"torch {torch.__version__} has no SDPBackend for {backend}")
    model = build_model(WIDE, DEV, torch.bfloat16, source=2)
    if backend != "all":  # does it run the model's plainest call (the causal prefill)?
        q = torch.randn(2, 8, 49, 64, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(2, 2, 49, 64, device=DEV, dtype=torch.bfloat16)
        try:
            with sdpa_kernel(allowed):
                attend(q, k, k, None, is_causal=True, enable_gqa=True)
        except RuntimeError as e:
            pytest.skip(f"{backend} does not take the model's causal prefill: {str(e)[:300]}")
    with torch.inference_mode():
        with sdpa_kernel([SDPBackend.MATH]):
            truth = _model_logits(build_model(WIDE, DEV, torch.float32, source=2))
            want = _model_logits(model)
        with sdpa_kernel([*allowed, SDPBackend.MATH]):
            got = _model_logits(model)
    for i, (g, w, t) in enumerate(zip(got, want, truth)):
        assert torch.isfinite(g).all(), i
        assert rel_err(g, t) <= 2 * rel_err(w, t) + 2 ** -8, (i, rel_err(g, t), rel_err(w, t))
        assert rel_err(g, w) <= 2 ** -4, (i, rel_err(g, w))
