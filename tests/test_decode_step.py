"""The batch-1 decode step of a quantized block in one C call (offload/models/decode_step.py):
equal to the same layer's torch ops and to the block in float64 over the dequantized weights,
taken only where it computes what the layer computes, checked by kernel_trust before use, and
giving the current path's greedy tokens on the real SmolLM2 GGUF."""

from __future__ import annotations

import pytest
import torch

from offload import kernel_trust
from offload.infer.generate import generate
from offload.models import decode_step, preset
from offload.models.llama import DecoderLayer
from offload.models.quantized import QuantLinear
from offload.quant.format import QuantSpec, dequantize, quantize

CFG = preset("tiny")  # hidden 64, MLP 176 (a padded last group of 32 and of 64), 4 heads on 2
SPECS = [QuantSpec(4, 32), QuantSpec(4, 64), QuantSpec(8, 32), QuantSpec(8, 0)]

pytestmark = pytest.mark.skipif(decode_step.library() is None,
                                reason=f"the fused decode block was not built: {decode_step.status()}")


def quantize_projections(layer, spec: QuantSpec) -> None:
    """Replace `layer`'s seven projections by QuantLinear `spec` copies of their weights."""
    for name in decode_step.PROJECTIONS:
        dense = layer.get_submodule(name)
        q = QuantLinear(dense.in_features, dense.out_features, spec, False, torch.float32, "cpu")
        for part, value in quantize(dense.weight.detach(), spec).items():
            getattr(q, part).data = value
        parent, _, leaf = name.rpartition(".")
        setattr(layer.get_submodule(parent), leaf, q)


def _layers(spec: QuantSpec, seed: int = 0) -> tuple[DecoderLayer, DecoderLayer]:
    """(a DecoderLayer with `spec` projections, the same block in float64 with the dequantized
    weights): norms away from 1 so that their weights count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = DecoderLayer(CFG)
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(1 + 0.2 * torch.randn(CFG.hidden_size, generator=gen))
    dense = DecoderLayer(CFG)
    dense.load_state_dict(layer.state_dict())
    quantize_projections(layer, spec)
    with torch.no_grad():
        for name in decode_step.PROJECTIONS:
            q = layer.get_submodule(name)
            parts = {n: getattr(q, n) for n in q.part_names}
            dense.get_submodule(name).weight.copy_(dequantize(parts, spec, q.in_features, torch.float32))
    return layer, dense.double()


def _rotation(pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    from offload.models.rope import Rotary
    return Rotary(CFG, "full")(torch.tensor([[pos]]), torch.float32)  # [1, 1, D] each


def _step(layer, h, pos, cache, fused: bool, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DECODE_STEP", "on" if fused else "off")
    before = decode_step.counts["blocks"]
    with torch.inference_mode():
        out = layer(h, *_rotation(pos), None, cache, pos)
    assert decode_step.counts["blocks"] - before == (1 if fused else 0)
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"int{s.bits}g{s.group_size}")
def test_fused_block_equals_the_torch_ops_and_float64(spec, monkeypatch):
    """Decode steps at positions 6..9 after a 6-token prefill: the fused call against the same
    layer's torch ops (same caches, filled by the prefill) and against the float64 block over
    the dequantized weights -- the output and the keys/values it writes."""
    layer, dense = _layers(spec)
    gen = torch.Generator().manual_seed(1)
    max_len, prefill = 12, 6
    caches = {k: [torch.zeros(1, CFG.num_key_value_heads, max_len, CFG.head_dim) for _ in range(2)]
              for k in ("fused", "torch")}
    ref_cache = [torch.zeros(1, CFG.num_key_value_heads, max_len, CFG.head_dim, dtype=torch.float64)
                 for _ in range(2)]
    x = torch.randn(1, prefill, CFG.hidden_size, generator=gen)
    from offload.models.rope import Rotary
    cos, sin = Rotary(CFG, "full")(torch.arange(prefill)[None], torch.float32)
    with torch.inference_mode():
        for k in caches:
            layer(x, cos, sin, None, caches[k], 0)
        dense(x.double(), cos.double(), sin.double(), None, ref_cache, 0)
    for pos in range(prefill, prefill + 4):
        h = torch.randn(1, 1, CFG.hidden_size, generator=gen)
        got = _step(layer, h, pos, caches["fused"], True, monkeypatch)
        plain = _step(layer, h, pos, caches["torch"], False, monkeypatch)
        with torch.inference_mode():
            want = dense(h.double(), *(t.double() for t in _rotation(pos)), None, ref_cache, pos)
        scale = want.abs().max().item()
        assert got.shape == plain.shape == (1, 1, CFG.hidden_size) and got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() <= 1e-5 * scale
        assert (got - plain).abs().max().item() <= 1e-5 * scale
        for mine, theirs, ref in zip(caches["fused"], caches["torch"], ref_cache):
            assert torch.allclose(mine[:, :, pos].double(), ref[:, :, pos], rtol=0, atol=1e-5 * ref.abs().max().item())
            assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


def test_taken_only_where_it_computes_what_the_layer_computes(monkeypatch):
    """Not taken (the torch ops run): a mask, bf16, more than one token or row, gradients on, a
    forced kernel, a projection replaced after the plan was made (a LoRA wrap), a block with
    q/k norms or dense projections, no cache."""
    monkeypatch.delenv("OFFLOAD_DECODE_STEP", raising=False)
    layer, _ = _layers(QuantSpec(4, 32))
    h = torch.randn(1, 1, CFG.hidden_size)
    cos, sin = _rotation(3)
    cache = [torch.zeros(1, CFG.num_key_value_heads, 8, CFG.head_dim) for _ in range(2)]
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with torch.inference_mode():
        assert decode_step.fused_forward(layer, h, cos, sin, None, cache, 3) is not None
        assert decode_step.fused_forward(layer, h, cos, sin, mask, cache, 3) is None
        assert decode_step.fused_forward(layer, h, cos, sin, None, None, 3) is None
        assert decode_step.fused_forward(layer, h.bfloat16(), cos, sin, None, cache, 3) is None
        assert decode_step.fused_forward(layer, h.expand(2, 1, -1), cos, sin, None, cache, 3) is None
        bf16_cache = [c.bfloat16() for c in cache]
        assert decode_step.fused_forward(layer, h, cos, sin, None, bf16_cache, 3) is None
        monkeypatch.setenv("OFFLOAD_QUANT_KERNEL", "chunked")
        assert decode_step.fused_forward(layer, h, cos, sin, None, cache, 3) is None
        monkeypatch.delenv("OFFLOAD_QUANT_KERNEL")
        layer.self_attn.q_proj = torch.nn.Sequential(layer.self_attn.q_proj)  # wrapped after the plan
        assert decode_step.fused_forward(layer, h, cos, sin, None, cache, 3) is None
    assert decode_step.fused_forward(_layers(QuantSpec(8, 32))[0], h, cos, sin, None, cache, 3) is None  # grad on
    with torch.inference_mode():
        qk = DecoderLayer(CFG.replace(architecture="Qwen3ForCausalLM", qk_norm=True))
        quantize_projections(qk, QuantSpec(4, 32))
        assert decode_step.plan_for(qk) is None
        assert decode_step.plan_for(DecoderLayer(CFG)) is None  # dense nn.Linear projections


def test_a_library_that_failed_its_check_is_never_used(monkeypatch):
    """The library is trusted by a child's check on this CPU (recorded in kernel_trust's
    verdicts); where that check fails, no build is loaded and the layer runs its torch ops.
    Loaded afresh here: another test in this process may have made kernel_trust forget()
    its verdicts after the library was loaded."""
    monkeypatch.setattr(decode_step, "_state", {})
    assert decode_step.library() is not None
    assert "trusted" in kernel_trust.verdicts().get(decode_step.LIBRARY_PROBE, {}).values()
    monkeypatch.setattr(decode_step, "_state", {})
    real = kernel_trust.verdict
    monkeypatch.setattr(kernel_trust, "verdict", lambda probe, case: "planted failure"
                        if probe == decode_step.LIBRARY_PROBE else real(probe, case))
    assert decode_step.library() is None and "planted failure" in decode_step.status()
    layer, _ = _layers(QuantSpec(4, 32))
    cache = [torch.zeros(1, CFG.num_key_value_heads, 8, CFG.head_dim) for _ in range(2)]
    with torch.inference_mode():
        assert decode_step.fused_forward(layer, torch.randn(1, 1, CFG.hidden_size), *_rotation(2),
                                         None, cache, 2) is None


@pytest.mark.parametrize("mode,prompts", [("int4", (0, 2)), ("int8", (0,))])
def test_real_model_greedy_tokens_unchanged(smollm2_gguf, smollm2_hf, tmp_path, monkeypatch, mode, prompts):
    """SmolLM2-135M-Instruct from its Q4_1 GGUF (int4: its blocks taken as they are; int8:
    quantized from their values), batch 1, greedy, real prompts: the fused decode step gives
    the tokens of the layer's torch ops, and ran for every block of every decode step."""
    from conftest import load_script
    ev = load_script("eval_quant")
    model, streamer, reader, _ = ev.quantized_model(smollm2_hf, smollm2_gguf, mode, 32, str(tmp_path))
    try:
        layers = model.config.num_hidden_layers
        for prompt in (ev.GREEDY_PROMPTS[i] for i in prompts):
            tokens = {}
            for fused in (True, False):
                monkeypatch.setenv("OFFLOAD_DECODE_STEP", "on" if fused else "off")
                before = decode_step.counts["blocks"]
                res = generate(model, [prompt], max_new_tokens=24)
                tokens[fused] = res.tokens[0]
                assert decode_step.counts["blocks"] - before == (layers * res.decode_steps if fused else 0)
            assert tokens[True] == tokens[False], (prompt, tokens)
    finally:
        streamer.close()
        reader.close()


@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(4, 64), QuantSpec(8, 32)],
                         ids=lambda s: f"int{s.bits}g{s.group_size}")
def test_int8_activations_fused_equals_unfused(spec, monkeypatch):
    """--activations int8 (set_activations): each projection as the fused block runs it
    (offload_block_project, from its proj_t with act_bits 8) gives the unfused path's bits for
    the same x; whole decode steps agree with the torch ops to the rounding of x to 8 bits
    (the two compute x in float32 in different orders: a code of x may land one step apart),
    and the fused block ran."""
    import array
    from offload.models.quantized import set_activations
    from offload.quant import cpu as quant_cpu
    lib = decode_step.library()
    if not lib.a8_taken(spec.bits, 64, spec.group_size):
        pytest.skip("no int8-activation kernel on this CPU (AVX2)")
    layer, _ = _layers(spec, seed=4)
    set_activations(layer, "int8")
    gen = torch.Generator().manual_seed(2)
    for name in decode_step.PROJECTIONS:
        p = layer.get_submodule(name)
        pin = p.spec.padded_in(p.in_features)
        parts = {n: getattr(p, n) for n in p.part_names}
        fields = array.array("q", [p.qweight.data_ptr(), p.scales.data_ptr(), parts.get("mins", p.scales).data_ptr(),
                                   spec.bits, p.out_features, p.in_features, pin,
                                   pin // spec.groups(p.in_features), 8])
        x, xpad, y = torch.randn(p.in_features, generator=gen), torch.empty(pin), torch.empty(p.out_features)
        assert lib.project(fields.buffer_info()[0], x.data_ptr(), xpad.data_ptr(), y.data_ptr()) == 0
        with torch.inference_mode():
            unfused = p(x[None])[0]
        assert torch.equal(y, unfused), name
        assert not torch.equal(y, quant_cpu.rows_product(x[None], parts, spec, p.in_features)[0])
    max_len = 8
    caches = {k: [torch.zeros(1, CFG.num_key_value_heads, max_len, CFG.head_dim) for _ in range(2)]
              for k in ("fused", "torch")}
    for pos in range(4):
        h = torch.randn(1, 1, CFG.hidden_size, generator=gen)
        got = _step(layer, h, pos, caches["fused"], True, monkeypatch)
        plain = _step(layer, h, pos, caches["torch"], False, monkeypatch)
        scale = plain.abs().max().item()
        assert (got - plain).abs().max().item() <= decode_step.CHECK_TOLERANCE_A8 * scale
