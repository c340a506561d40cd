"""Model, config and preset tests. Numerics are checked against transformers' own models with
the same weights (loaded by name: our names are theirs); counts against published sizes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from offload.models import (ConfigError, KVCache, LlamaForCausalLM, ModelConfig,
                            build_model, kv_cache_bytes, materialize_block, materialize_non_block,
                            num_params, parameter_shapes, preset, release_block)

HF_CLASSES = {
    "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "MistralForCausalLM": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2)


def hf_pair(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides):
    """A transformers model with random weights (norms and biases too), and ours with the same."""
    cfg_cls, model_cls = HF_CLASSES[arch]
    torch.manual_seed(seed)
    overrides = {k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()}
    hf = model_cls(cfg_cls(**{**SMALL, **overrides})).eval()  # (copies: transformers edits dicts)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    cfg = ModelConfig.from_hf(json.loads(hf.config.to_json_string()) | {"architectures": [arch]})
    ours = build_model(cfg, "cpu")
    ours.load_state_dict(hf.state_dict(), strict=True)  # same names, or this raises
    return hf, ours.eval()


# ---- presets and counts ---------------------------------------------------------------------
PUBLISHED_BILLIONS = {"1B": 1.236, "3B": 3.213, "7B": 6.738, "8B": 8.030, "13B": 13.016,
                      "70B": 68.977, "mistral-7B": 7.242, "qwen2-0.5B": 0.494}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_preset_counts_match_published_and_meta_model(name: str) -> None:
    cfg = preset(name)
    assert num_params(cfg) / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], abs=0.005)
    model = build_model(cfg)  # meta: nothing allocated
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    # state_dict names are the checkpoint names (tied lm_head aside)
    names = [n for n, _ in model.named_parameters()]
    assert names == list(parameter_shapes(cfg))


def test_brief_counts_and_small_presets() -> None:
    assert abs(num_params(preset("7B")) / 1e9 - 6.74) <= 0.005
    assert abs(num_params(preset("70B")) / 1e9 - 68.98) <= 0.005
    assert 1e5 < num_params(preset("tiny")) < 1e6
    assert 80e6 < num_params(preset("small")) < 130e6
    shape_70b = preset("70B")
    assert (shape_70b.hidden_size, shape_70b.num_hidden_layers, shape_70b.num_attention_heads,
            shape_70b.num_key_value_heads, shape_70b.intermediate_size) == (8192, 80, 64, 8, 28672)


def test_70b_on_meta_peaks_below_500mb() -> None:
    code = (
        "import resource, torch\n"
        "from offload.models import build_model, num_params, preset\n"
        "cfg = preset('70B')\n"
        "m = build_model(cfg, 'meta', torch.bfloat16)\n"
        "n = sum(p.numel() for p in m.parameters())\n"
        "assert n == num_params(cfg), n\n"
        # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a child spawned from a
        # big test process would report the parent's peak; VmHWM belongs to this address space
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(n, int(hwm.split()[1]))\n"  # KiB
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    count, peak_kib = map(int, out.stdout.split())
    assert count > 68e9
    assert peak_kib * 1024 < 500e6, f"peak RSS {peak_kib / 1024:.0f} MiB"


# ---- config ---------------------------------------------------------------------------------
def test_config_round_trip_and_transformers_reads_ours() -> None:
    cfg = preset("1B")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items()
                                                   if k not in ("architectures",)})
    assert hf_cfg.rope_parameters["rope_type"] == "llama3"
    assert hf_cfg.rope_parameters["rope_theta"] == 500000.0
    assert hf_cfg.rope_parameters["factor"] == 32.0
    assert (hf_cfg.num_key_value_heads, hf_cfg.head_dim, hf_cfg.tie_word_embeddings) == (8, 64, True)


def test_config_reads_old_and_new_rope_spellings() -> None:
    base = {"architectures": ["LlamaForCausalLM"], **SMALL, "max_position_embeddings": 64}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    old_type_key = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old == new == old_type_key
    assert new.rope_theta == 5e5 and new.rope_scaling == {"rope_type": "llama3", **scaling}
    plain = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel is not supported (supported: LlamaForCausalLM"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "missing ['factor']"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
])
def test_config_errors_are_clear(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="config.json") as err:
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **SMALL, **change})
    assert message in str(err.value)


def test_qwen2_sliding_layers_refused() -> None:
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], **SMALL, "use_sliding_window": True,
                             "sliding_window": 8, "max_window_layers": 1})


# ---- numerics against transformers -----------------------------------------------------------
@pytest.mark.parametrize("arch, overrides", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True, "max_position_embeddings": 64, "rope_theta": 5e5,
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("MistralForCausalLM", {"sliding_window": 6}),
])
def test_kv_cache_decode_matches_transformers_full_forward(arch: str, overrides: dict) -> None:
    hf, ours = hf_pair(arch, **overrides)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 20))
    with torch.no_grad():
        ref = hf(ids).logits  # [2, 20, V]
        cache = KVCache(ours.config, 2, 24)
        prefill = ours(ids[:, :12], kv_cache=cache)
        steps = [ours(ids[:, t:t + 1], kv_cache=cache) for t in range(12, 16)]
        chunk = ours(ids[:, 16:], kv_cache=cache)  # several new tokens on top of a cache
    got = torch.cat([prefill, *steps, chunk], dim=1)
    assert cache.length == 20
    assert (got - ref).abs().max().item() <= 1e-5


def test_left_padded_batch_matches_transformers_and_unpadded_rows() -> None:
    hf, ours = hf_pair("LlamaForCausalLM")
    ids = torch.randint(3, SMALL["vocab_size"], (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # row 1 is a 6-token prompt, left-padded
    ids[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask)  # positions derived from the mask
        alone = ours(ids[1:, 4:])  # the short prompt without padding
        # decode 3 tokens on top of a padded prefill
        cache = KVCache(ours.config, 2, 16)
        ours(ids, attention_mask=mask, kv_cache=cache)
        nxt = torch.randint(3, SMALL["vocab_size"], (2, 3))
        full_ids, full_mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
        step_logits = [ours(nxt[:, t:t + 1], attention_mask=full_mask[:, :11 + t], kv_cache=cache)
                       for t in range(3)]
        ref_full = hf(full_ids, attention_mask=full_mask,
                      position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= 1e-5
    assert (got[1, 4:] - alone[0]).abs().max().item() <= 1e-5
    assert (torch.cat(step_logits, 1) - ref_full[:, 10:]).abs().max().item() <= 1e-5


def test_last_only_and_sensitivity() -> None:
    hf, ours = hf_pair("LlamaForCausalLM")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    with torch.no_grad():
        full = ours(ids)
        last = ours(ids, last_only=True)
        ref = hf(ids).logits
        # The comparison can fail: one changed weight moves the logits far beyond 1e-5.
        ours.model.layers[1].mlp.up_proj.weight[0, 0] += 0.5
        perturbed = ours(ids)
    assert last.shape == (2, 1, SMALL["vocab_size"])
    assert (last - full[:, -1:]).abs().max().item() <= 1e-6  # same math, other matmul shape
    assert (full - ref).abs().max().item() <= 1e-5
    assert (perturbed - ref).abs().max().item() > 1e-3


def test_kv_cache_bytes_matches_allocation() -> None:
    cfg = preset("tiny")
    cache = KVCache(cfg, 3, 40, dtype=torch.bfloat16)
    assert kv_cache_bytes(cfg, 3, 40, torch.bfloat16) == cache.nbytes == 2 * 4 * 3 * 2 * 40 * 16 * 2
    assert kv_cache_bytes(preset("70B"), 1, 4096, torch.float16) == 2 * 80 * 8 * 4096 * 128 * 2


# ---- building and materialising -----------------------------------------------------------------
def test_block_materialised_alone_equals_whole_model_build() -> None:
    cfg = preset("tiny")
    whole = build_model(cfg, "cpu", source=7)
    alone = build_model(cfg)  # meta
    materialize_block(alone, 2, "cpu", torch.float32, source=7)
    materialize_non_block(alone, "cpu", torch.float32, source=7)
    for (n1, p1), (n2, p2) in zip(whole.model.layers[2].named_parameters(),
                                  alone.model.layers[2].named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.equal(whole.model.embed_tokens.weight, alone.model.embed_tokens.weight)
    assert alone.model.layers[1].self_attn.q_proj.weight.is_meta
    other = build_model(cfg, "cpu", source=8)
    assert not torch.equal(other.model.layers[2].mlp.up_proj.weight, whole.model.layers[2].mlp.up_proj.weight)
    std = whole.model.layers[0].mlp.down_proj.weight.std().item()
    assert abs(std - cfg.initializer_range) < 0.002
    assert torch.equal(whole.model.norm.weight, torch.ones(cfg.hidden_size))
    release_block(whole, 0)
    assert whole.model.layers[0].mlp.up_proj.weight.is_meta


def test_tied_embedding_stays_tied_after_materialising() -> None:
    cfg = preset("tiny").replace(tie_word_embeddings=True)
    model = build_model(cfg, "cpu", torch.bfloat16, source=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (1, 5)))
    assert logits.shape == (1, 5, cfg.vocab_size) and torch.isfinite(logits).all()


def test_model_is_blocks_in_one_module_list() -> None:
    model = build_model(preset("7B"))
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    assert biggest is model.model.layers and len(biggest) == 32
    assert isinstance(model, LlamaForCausalLM)
    assert math.isclose(sum(p.numel() for p in biggest.parameters()) / 1e9, 6.476, abs_tol=0.001)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["linear", "transposed", "split", "measure"])
def test_small_row_projection_equals_linear(bias: bool, kernel: str, monkeypatch) -> None:
    """`project` (the decode-shaped kernel choice) computes nn.Linear with either kernel, or
    the measured one: the same values for every row count, and outside inference mode (no_grad
    included, as in a checkpointed training forward) it *is* nn.Linear, bit for bit (training's
    equivalence depends on that)."""
    from offload.models import kernels
    from offload.models.llama import project
    SMALL_ROWS_MAX = kernels.SMALL_ROWS_MAX
    monkeypatch.setenv("OFFLOAD_FEW_ROWS_KERNEL", kernel)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # split is offered only then (kernels.py)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # and with 2+ threads
    kernels.reset()
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(1024, 300, bias=bias)  # > MIN_MEASURED_BYTES: measured
    for rows in range(1, SMALL_ROWS_MAX + 3):
        x = torch.randn(rows, 1, 1024, generator=g)  # [B, T=1, in], as in batched decode
        with torch.inference_mode():
            got, want = project(layer, x), layer(x)
        assert got.shape == want.shape == (rows, 1, 300)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # a checkpointed training forward: nn.Linear exactly
            assert torch.equal(project(layer, x), layer(x))


def test_few_rows_kernel_is_chosen_by_measurement(monkeypatch) -> None:
    """Each shape is measured once, among its candidates (one row: F.linear or split across
    threads; 2-32 rows: F.linear or transposed), and the other kernel is used exactly where it
    measured faster by the margin."""
    from offload.models import kernels
    from offload.models.llama import project
    monkeypatch.delenv("OFFLOAD_FEW_ROWS_KERNEL", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # spinning idle threads: no split
    assert kernels.candidates(1) == ("linear",)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    kernels.reset()
    calls = []

    def fake_measure(weight, x2d, names):  # the other kernel faster for 1-4 rows only
        calls.append((x2d.shape[0], names))
        fast = x2d.shape[0] <= 4
        return {"linear": 1.0, names[1]: 0.5 if fast else 0.97}

    monkeypatch.setattr(kernels, "measure", fake_measure)
    ran = []
    real_run = kernels.run
    monkeypatch.setattr(kernels, "run", lambda k, w, x: ran.append(k) or real_run(k, w, x))
    layer = torch.nn.Linear(16, 24, bias=False)  # under MIN_MEASURED_BYTES: never measured
    with torch.inference_mode():
        assert project(layer, torch.randn(2, 1, 16)).shape == (2, 1, 24) and not calls
    layer = torch.nn.Linear(1024, 512, bias=False)  # 2 MiB
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 2, 8, 1):
            y = project(layer, torch.randn(rows, 1, 1024))
            assert y.shape == (rows, 1, 512)
    assert calls == [(1, ("linear", "split")), (2, ("linear", "transposed")),
                     (4, ("linear", "transposed")), (8, ("linear", "transposed"))]
    assert ran == ["split", "transposed", "transposed", "transposed", "split"]
    assert {k[2]: v["kernel"] for k, v in kernels.choices().items()} == \
        {1: "split", 2: "transposed", 4: "transposed", 8: "linear"}
    kernels.reset()


def test_few_rows_measurement_times_every_candidate() -> None:
    from offload.models import kernels
    w = torch.randn(512, 256)
    for rows, names in ((1, ("linear", "split")), (3, ("linear", "transposed"))):
        times = kernels.measure(w, torch.randn(rows, 256), names)
        assert set(times) == set(names) and all(0 < t < 1 for t in times.values())


def test_kernel_measurement_buffer_is_in_the_inference_plan(monkeypatch) -> None:
    """The measurement's eviction buffer is transient device memory of the first forward: the
    planner counts it, so a budget that only fits without it places fewer blocks in memory."""
    from offload.models import kernels
    from offload.infer.plan import plan_inference
    monkeypatch.delenv("OFFLOAD_FEW_ROWS_KERNEL", raising=False)
    cpu = torch.device("cpu")
    assert kernels.scratch_bytes(cpu, torch.float32) == kernels.EVICT_BYTES
    assert kernels.scratch_bytes(cpu, torch.bfloat16) == 0  # never measured: F.linear
    assert kernels.scratch_bytes(torch.device("meta"), torch.float32) == 0
    monkeypatch.setenv("OFFLOAD_FEW_ROWS_KERNEL", "linear")
    assert kernels.scratch_bytes(cpu, torch.float32) == 0
    blocks = [32 << 20] * 8
    kw = dict(block_bytes=blocks, stored_block_bytes=blocks, non_block_bytes=0, batch_size=1,
              context=64, kv_bytes_per_seq=1 << 20, workspace_per_seq=1 << 20,
              device_is_host=True)
    budget = plan_inference(device_budget=1 << 40, host_budget=1 << 40, **kw).device_need
    fits = plan_inference(device_budget=budget, host_budget=budget, **kw)
    assert "nvme" not in fits.residency  # the whole model in memory (a CPU device: "device")
    counted = plan_inference(device_budget=budget, host_budget=budget,
                             scratch_bytes=kernels.EVICT_BYTES, **kw)
    assert "nvme" in counted.residency and counted.device_need <= budget
    assert counted.workspace_bytes == fits.workspace_bytes + kernels.EVICT_BYTES


def test_head_projection_gradients_and_tied_peak() -> None:
    """Training's vocabulary head gives nn.Linear's gradients (to fp32 rounding), and with a
    tied embedding autograd sums the two vocab x hidden gradients in place: the backward's
    peak is two such tensors, not three (measured in a fresh process, in fp32: a bf16 matmul
    on a CPU without bf16 instructions makes fp32 temporaries of its own, which would measure
    the CPU rather than the autograd graph)."""
    from offload.models.llama import _HeadProjection
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 40, generator=g, requires_grad=True)
    x = torch.randn(2, 5, 40, generator=g, requires_grad=True)
    up = torch.randn(2, 5, 300, generator=g)
    (_HeadProjection.apply(x, w) * up).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (torch.nn.functional.linear(x, w) * up).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-6, atol=1e-6)
    code = """
import torch
from offload.models.llama import _HeadProjection
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
V, H = 65536, 1024
w = torch.zeros(V, H, dtype=torch.float32, requires_grad=True)
ids = torch.randint(0, V, (1, 16))
base = hwm()
h = torch.nn.functional.embedding(ids, w)
_HeadProjection.apply(h, w).sum().backward()
print((hwm() - base) / (V * H * 4))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 2.5  # nn.Linear's transposed-view gradient: 3.0


def test_chunked_init_draws_the_same_values(monkeypatch):
    """init_parameter_ draws large tensors in chunks (bounded temporaries); the values are the
    ones a single draw from the same generator gives, so seeded checkpoints do not change."""
    from offload.models import llama
    from offload.models.llama import init_parameter_, param_seed
    monkeypatch.setattr(llama, "INIT_CHUNK", 1 << 10)
    out = torch.empty(37, 301)  # 11137 values: ten full chunks and a partial one
    init_parameter_("model.layers.0.mlp.up_proj.weight", out, 3, 0.02)
    gen = torch.Generator().manual_seed(param_seed(3, "model.layers.0.mlp.up_proj.weight"))
    assert torch.equal(out, torch.empty(37, 301).normal_(0.0, 0.02, generator=gen))


def test_frozen_16bit_projection_backward_on_the_cpu(monkeypatch):
    """A frozen bf16 projection in training (a LoRA base) takes its input gradient through fp32
    (torch's CPU bf16 product of that layout is pathologically slow): same forward bits as
    nn.Linear, the gradient within one bf16 rounding of the exact one, no weight gradient."""
    from offload.models.llama import project
    from offload.models import projections
    lin = torch.nn.Linear(64, 48, dtype=torch.bfloat16).requires_grad_(False)
    monkeypatch.setattr(projections, "FROZEN_GRAD_CHUNK_BYTES", 4 * 64 * 7)  # 7 rows a chunk: 48 in 7
    x = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    x3 = x.view(1, 5, 64)
    y = project(lin, x3)
    assert torch.equal(y, lin(x3.detach()))
    g = torch.randn(1, 5, 48, dtype=torch.bfloat16)
    y.backward(g)
    exact = g[0].double() @ lin.weight.double()
    assert torch.allclose(x.grad.double(), exact, rtol=2 ** -8, atol=1e-6)
    assert lin.weight.grad is None and y.grad_fn is not None


def test_a_noisy_first_measurement_does_not_pin_a_slower_kernel(monkeypatch) -> None:
    """Issue 36: the few-row kernel is measured again at its RECHECK_AT_USE-th use; a choice the
    second measurement does not confirm falls back to F.linear, one it confirms stays."""
    from offload.models import kernels
    from offload.models.llama import project
    monkeypatch.delenv("OFFLOAD_FEW_ROWS_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "RECHECK_AT_USE", 5)
    kernels.reset()
    verdicts = {2: iter([0.5, 1.2]), 3: iter([0.5, 0.6])}  # transposed's time vs linear's 1.0
    monkeypatch.setattr(kernels, "measure", lambda w, x, names: {
        "linear": 1.0, "transposed": next(verdicts[x.shape[0]])})
    layer = torch.nn.Linear(1024, 512, bias=False)  # 2 MiB: measured
    seen = {2: [], 3: []}
    with torch.inference_mode():
        for _ in range(7):
            for rows in (2, 3):
                project(layer, torch.randn(rows, 1, 1024))
                seen[rows].append(kernels.choices()[(512, 1024, rows)]["kernel"])
    assert seen[2] == ["transposed"] * 4 + ["linear"] * 3  # the recheck disagreed: F.linear
    assert seen[3] == ["transposed"] * 7  # confirmed
    kernels.reset()
