"""offload.kernel_trust: a fast kernel runs only where a child process checked it on this CPU.
The crash class of issue 31 (torch's `_weight_int8pack_mm` segfaulting or returning garbage for
in_features % 16 == 8 on AVX-512) and the checks that keep it out of the caller's process."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from offload import cbuild, kernel_trust
from offload.quant import cpu as quant_cpu
from offload.quant import matmul as quant
from offload.models.quantized import PER_CHANNEL
from offload.quant.matmul import quant_linear
from offload.quant.format import QuantError, QuantSpec, dequantize, quantize

PROBE = "trust_probes:behave"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty disk record and no verdicts in this process; restored after."""
    monkeypatch.setenv("OFFLOAD_KERNEL_CACHE", str(tmp_path))
    kernel_trust.forget()
    yield tmp_path
    kernel_trust.forget()


def test_a_crash_hang_or_wrong_answer_in_the_check_leaves_the_caller_running(fresh, monkeypatch):
    monkeypatch.setattr(kernel_trust, "CASE_TIMEOUT_S", 3.0)  # the hang waits this out
    cases = [("ok",), ("segfault",), ("ok", 2), ("wrong",), ("abort",), ("raise",), ("hang",), ("ok", 3)]
    got = kernel_trust.check(PROBE, cases)
    assert got[("ok",)] is None and got[("ok", 2)] is None and got[("ok", 3)] is None
    assert got[("segfault",)] == "the check was killed by SIGSEGV on this case"
    assert got[("abort",)] == "the check was killed by SIGABRT on this case"
    assert got[("wrong",)] == "relative error 9.4e+30"
    assert got[("raise",)] == "raised ArithmeticError: wrong lane"
    assert "hung" in got[("hang",)]
    assert kernel_trust.trusted(PROBE, ("ok",)) and not kernel_trust.trusted(PROBE, ("wrong",))
    assert kernel_trust.verdicts()[PROBE]['["segfault"]'].startswith("the check was killed")


def test_verdicts_are_recorded_per_machine_and_a_damaged_record_is_checked_again(fresh, monkeypatch):
    assert kernel_trust.check(PROBE, [("ok",), ("wrong",)]) == {("ok",): None, ("wrong",): "relative error 9.4e+30"}
    (record,) = fresh.glob("trust-*.json")
    kernel_trust.forget()

    def no_child(*a, **k):
        raise AssertionError("a recorded verdict started a child")
    monkeypatch.setattr(subprocess, "run", no_child)
    assert kernel_trust.check(PROBE, [("wrong",), ("ok",)]) == {("wrong",): "relative error 9.4e+30", ("ok",): None}
    monkeypatch.undo()
    monkeypatch.setenv("OFFLOAD_KERNEL_CACHE", str(fresh))
    record.write_text(json.dumps({"cases": {'["wrong"]': 5}}))  # damaged: never trusted from it
    kernel_trust.forget()
    assert kernel_trust.check(PROBE, [("wrong",)]) == {("wrong",): "relative error 9.4e+30"}
    record.write_text("{not json")
    kernel_trust.forget()
    assert not kernel_trust.trusted(PROBE, ("segfault",))


def test_a_probe_that_cannot_load_fails_every_case_in_one_child(fresh):
    got = kernel_trust.check("trust_probes:no_such_probe", [("a",), ("b",)])
    assert all(why.startswith("the check could not run") and "no_such_probe" in why for why in got.values())


# ---- torch's int8pack kernel at the shapes that break it on AVX-512 ----------------------------
@pytest.mark.parametrize("in_f", [8, 24, 72])
def test_quantized_product_at_the_shapes_that_crash_torchs_int8pack(in_f):
    """Per-channel int8, bf16 x, 1-4 rows: the widths where torch 2.13's int8pack kernel returned
    1e30 or segfaulted on AVX-512 (on AVX2 it is right): the product quant_linear picks must
    equal x @ dequantized W^T. Without the check this test kills the run on such a CPU."""
    spec = QuantSpec(8, 0)
    gen = torch.Generator().manual_seed(in_f)
    for out_f in (1, 17, 48):
        parts = quantize(torch.randn(out_f, in_f, generator=gen), spec)
        deq = dequantize(parts, spec, in_f, torch.float64)
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, in_f, generator=gen).bfloat16()
            with torch.inference_mode():
                y = quant_linear(x, parts, spec, in_f)
            ref = x.double() @ deq.T
            err = ((y.double() - ref).abs() / (x.double().abs() @ deq.abs().T)).max().item()
            assert err <= 2 ** -6, f"in {in_f} out {out_f} rows {rows}: relative error {err:.3g}"


def test_the_fused_kernel_still_runs_where_it_checked_right():
    """in_features 64 was right on every CPU measured: there the fast kernel is used (the check
    must not switch it off everywhere), and it computes the product."""
    spec, in_f, out_f = QuantSpec(8, 0), 64, 48
    parts = quantize(torch.randn(out_f, in_f), spec)
    x = torch.randn(3, in_f).bfloat16()
    before = quant.kernels_run().get("fused", 0)
    with torch.inference_mode():
        y = quant_linear(x, parts, spec, in_f)
    assert quant.kernels_run().get("fused", 0) == before + 1
    deq = dequantize(parts, spec, in_f, torch.float64)
    assert ((y.double() - x.double() @ deq.T).abs() / (x.double().abs() @ deq.abs().T)).max() <= 2 ** -6
    assert kernel_trust.verdicts()[quant.FUSED_PROBE][json.dumps([in_f, out_f])] == "trusted"


def test_an_explicitly_requested_fused_kernel_is_refused_where_its_check_failed(monkeypatch):
    monkeypatch.setattr(kernel_trust, "_known", {**kernel_trust._known,
                                                 (quant.FUSED_PROBE, (64, 5)): "killed by SIGSEGV"})
    spec = QuantSpec(8, 0)
    parts = quantize(torch.randn(5, 64), spec)
    with pytest.raises(QuantError, match="checked on this CPU"):
        quant_linear(torch.randn(2, 64).bfloat16(), parts, spec, 64, kernel="fused")
    with torch.inference_mode():  # chosen automatically: another kernel, the right product
        y = quant_linear(torch.ones(2, 64).bfloat16(), parts, spec, 64)
    assert torch.allclose(y.float(), dequantize(parts, spec, 64, torch.float32).sum(1).expand(2, -1),
                          rtol=2 ** -6, atol=2 ** -6)


# ---- our C kernels: checked in a child before this process loads them --------------------------
@pytest.mark.skipif(cbuild.find_compiler() is None, reason="no C compiler here")
def test_a_c_library_whose_check_crashes_falls_back_to_the_next_flags(fresh):
    """The -march=native build's check dies in its child (as an illegal instruction would): the
    caller survives and the portable build (no arch flags), checked the same way, is used."""
    seen = []

    def verify(path):
        seen.append(path)
        if len(seen) == 1:
            return kernel_trust.verdict(PROBE, ("segfault",))
        return kernel_trust.verdict(quant_cpu.LIBRARY_PROBE, (str(path),))
    lib, why = cbuild.build("quant_gemv", quant_cpu._SOURCE, quant_cpu._FLAGS, quant_cpu._Lib,
                            quant_cpu._self_check, [["-march=native"], []], fresh, verify=verify)
    assert lib is not None and why == f"C kernel {seen[1]}" and len(seen) == 2
    assert kernel_trust.verdicts()[quant_cpu.LIBRARY_PROBE][json.dumps([str(seen[1])])] == "trusted"


# ---- the runner: the same tokens with the fused kernel allowed and not ------------------------
def _odd_width_checkpoint(path) -> str:
    """A random transformers Llama whose widths (hidden 72, MLP 200) are ones torch's int8pack
    kernel breaks on AVX-512 and runs on AVX2."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=10000, hidden_size=72, intermediate_size=200,
                                   num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                   max_position_embeddings=128)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


NEAR_TIE = 0.5  # logits: 4 bf16 steps at 16-32, where SmolLM2's top logits are
PROMPTS = [[1, 504, 3458, 282, 6493, 314], [1, 7, 12, 40, 90], [1, 9690, 314, 3459, 28, 1350]]


def _margin_at(model_dir: str, workdir: str, prefix: list[int], a: int, b: int) -> float:
    """|logit a - logit b| after `prefix`, the int8 bf16 model computed without the fused kernel."""
    from conftest import load_script
    ev = load_script("eval_quant")
    model, streamer, reader, _ = ev.quantized_model(model_dir, None, "int8", PER_CHANNEL, workdir,
                                                    torch.bfloat16)
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([prefix])).float()[0, -1]
    finally:
        streamer.close()
        reader.close()
    return abs(logits[a] - logits[b]).item()


@pytest.mark.parametrize("source", ["smollm2", "odd widths"])
def test_infer_int8_gives_the_same_tokens_with_and_without_the_fused_kernel(source, smollm2_hf,
                                                                            tmp_path, monkeypatch):
    """Greedy int8 (per channel) in bf16 with the fused kernel allowed, and with the C loop that
    runs where it is not: the same tokens, except after a near-tie. In bf16 any two kernels that
    round differently flip a greedy choice where the top two logits are within bf16 rounding (on
    SmolLM2 the C loop, the chunked kernel and the dense reference each disagree with another
    somewhere in 4 x 16 tokens), so a divergence is accepted only where the tokens' logits,
    recomputed without the fused kernel, are within NEAR_TIE."""
    from runners.common import run_main
    from runners.infer import main
    model = smollm2_hf if source == "smollm2" else _odd_width_checkpoint(tmp_path / "odd")
    got = {}
    for kernel in ("auto", "c"):  # auto: fused wherever its check passed on this CPU
        monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", kernel)
        out = tmp_path / f"{kernel}.json"
        argv = ["--model", model, "--quantize", "int8", "--group-size", "channel", "--dtype", "bf16",
                "--max-new-tokens", "12", "--ignore-eos", "--probe-seconds", "0",
                "--offload-dir", str(tmp_path), "--output-json", str(out)]
        for p in PROMPTS:
            argv += ["--prompt-ids", ",".join(map(str, p))]
        assert run_main(main, argv) == 0
        got[kernel] = json.load(open(out))
    monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "c")
    for prompt, fused, plain in zip(PROMPTS, got["auto"]["generated_ids"], got["c"]["generated_ids"]):
        if fused != plain:
            at = next(i for i, (a, b) in enumerate(zip(fused, plain)) if a != b)
            margin = _margin_at(model, str(tmp_path), prompt + plain[:at], fused[at], plain[at])
            assert margin <= NEAR_TIE, f"prompt {prompt}: token {at} differs, logits {margin:.3f} apart"
    calls = got["auto"]["metrics"]["kernels"]["quantized_calls"]
    checked = got["auto"]["metrics"]["kernels"]["checked"][quant.FUSED_PROBE]
    assert set(calls) <= {"fused", "c", "chunked"} and sum(calls.values()) > 0
    # fused ran exactly where the check trusted some (in, out) shape of this model
    hidden, mlp, kv = (576, 1536, 192) if source == "smollm2" else (72, 200, 24)
    shapes = [(hidden, hidden), (hidden, kv), (hidden, mlp), (mlp, hidden)]
    assert all(json.dumps(list(s)) in checked for s in shapes)  # checked at load, all at once
    assert ("fused" in calls) == any(checked[json.dumps(list(s))] == "trusted" for s in shapes)
    assert got["c"]["metrics"]["kernels"]["quantized_calls"].keys() == {"c"}
    if source == "smollm2":  # 576 and 1536 columns: right on every CPU measured
        assert "fused" in calls


# ---- attention: torch's fused CPU kernel only for classes checked here -------------------------
def test_attention_is_checked_per_class_and_runs_the_math_backend_where_the_check_failed(monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from offload.models import attention
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 24, generator=gen)
    k, v = torch.randn(2, 2, 9, 24, generator=gen), torch.randn(2, 2, 9, 24, generator=gen)
    y = attention.attend(q, k, v, None, True, True)
    # every mask kind of this (head_dim, dtype, grouped) class was checked, in one child
    got = kernel_trust.verdicts()[attention.SDPA_PROBE]
    assert all(json.dumps([24, "float32", True, kind]) in got for kind in ("causal", "none", "mask"))
    ref = attention._reference(q, k, v, None, True)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    monkeypatch.setattr(kernel_trust, "_known", {**kernel_trust._known,
                                                 (attention.SDPA_PROBE, (24, "float32", True, "causal")): "wrong"})
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append(torch._C._get_math_sdp_enabled() and not torch._C._get_flash_sdp_enabled())
        return real(*a, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    y_math = attention.attend(q, k, v, None, True, True)
    assert calls == [True]  # the math backend alone was enabled for the call
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(y_math, real(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torchs_attention_passes_its_check_on_this_cpu(dtype):
    """The probe itself against float64 (forward and backward) in this process, for the shapes
    of the real model (SmolLM2: head_dim 64, 3 query heads per key head)."""
    from offload.models import attention
    for kind in ("causal", "none", "mask"):
        assert attention.check_sdpa((64, dtype, True, kind)) is None
