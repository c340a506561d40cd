"""The second CUDA desk review's findings (../shared/reviews/cuda-desk-review-2.md, ids P1-P18)
where the mechanism shows on the CPU: each test failed before its fix. The ones that need
processes of their own are in test_zero_review2.py, the CUDA ones in test_cuda_review2.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload.quant import QuantSpec, dequantize, quant_linear, quantize


def _saved_bytes(fn) -> tuple[torch.Tensor, int, list[tuple]]:
    """fn()'s result, and the bytes and shapes of every tensor autograd saved while it ran."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    seen, total = set(), 0
    for t in saved:  # a tensor saved twice (or two views of one storage) counts once
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return out, total, [(tuple(t.shape), t.dtype) for t in saved]


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_P4_qlora_product_saves_no_dense_weight(bits, group, dtype):
    """QLoRA's product in training: autograd keeps x and the quantized parts, never the dense
    weight (before the fix F.linear on the dequantized weight saved it: +out*in*2 bytes per
    projection from its forward to its backward); x's gradient is the old path's, bit for bit."""
    torch.manual_seed(0)
    out_f, in_f, rows = 96, 128, 5
    spec = QuantSpec(bits, group)
    parts = quantize(torch.randn(out_f, in_f), spec)
    x = torch.randn(rows, in_f, dtype=dtype, requires_grad=True)
    y, saved, shapes = _saved_bytes(lambda: quant_linear(x, parts, spec, in_f))
    parts_bytes = sum(t.nbytes for t in parts.values())
    x_bytes = rows * in_f * 4  # x as the CPU product computes it (float32)
    assert saved <= parts_bytes + x_bytes, (saved, shapes)
    assert not [s for s, dt in shapes if s == (out_f, in_f) and dt.is_floating_point], shapes
    (g_new,) = torch.autograd.grad(y.float().square().sum(), x)
    # the old path: the same dense product through F.linear
    x_old = x.detach().clone().requires_grad_(True)
    y_old = F.linear(x_old.float(), dequantize(parts, spec, in_f, torch.float32)).to(dtype)
    (g_old,) = torch.autograd.grad(y_old.float().square().sum(), x_old)
    assert torch.equal(y, y_old) and torch.equal(g_new, g_old)


def test_P4_the_plan_counts_one_projections_dense_transient():
    """The runner's plan of a QLoRA run adds the largest dense weight one quantized projection
    makes to compute (float32 on the CPU, the compute dtype on a GPU) to the device's
    activations, once: the product keeps only codes, so one projection's copy lives at a time."""
    from offload.config import OffloadConfig
    from offload.models import build_model, preset
    from offload.models.quantized import QuantSettings, projection_specs, quantize_layers
    from offload.train.plan import ActivationEstimate, activation_bytes, no_pinning
    from runners.finetune_lora import LoraRun
    mcfg = preset("tiny")
    model = build_model(mcfg, "meta", torch.bfloat16)
    quantize_layers(model, projection_specs(mcfg, QuantSettings("int4")), torch.bfloat16)
    largest = max(mcfg.intermediate_size * mcfg.hidden_size, mcfg.q_size * mcfg.hidden_size)
    cpu = LoraRun.dense_transient_bytes(model, torch.bfloat16, torch.device("cpu"))
    gpu = LoraRun.dense_transient_bytes(model, torch.bfloat16, torch.device("cuda", 0))
    assert (cpu, gpu) == (4 * largest, 2 * largest)
    cfg = OffloadConfig(device="cpu", offload="cpu")
    est = ActivationEstimate(full=1000, input=10, head=7)
    with_transient = ActivationEstimate(full=1000, input=10, head=7, transient=cpu)
    planned = activation_bytes(with_transient, cfg, mcfg.num_hidden_layers, no_pinning)
    base = activation_bytes(est, cfg, mcfg.num_hidden_layers, no_pinning)
    assert planned["device", "activations"] - base["device", "activations"] == cpu


def _plan_needing_host(nbytes: int):
    """A CPU-device plan of one block whose host tier needs about `nbytes` (fp32 masters and
    moments in host RAM: 12 bytes per parameter)."""
    from offload.config import OffloadConfig
    from offload.train.plan import plan_training
    return plan_training([(nbytes // 12, True)], OffloadConfig(device="cuda", offload="cpu",
                                                                pin_memory=False),
                         torch.device("cuda", 0))


def test_P5_ranks_on_one_machine_plan_against_their_share(monkeypatch):
    """torchrun with 2 ranks on a machine: each plans against half its free RAM and disk, and
    pins at most half of the cap one process would. A plan that fits one process (60% of the
    free RAM) is refused on each of 2 ranks, in one line; before the fix every rank checked
    the whole machine and both started, taking 120% of it."""
    import offload.memory.tiers as tiers
    import offload.train.plan as tp
    from offload.memory.tiers import BudgetError
    free = 10 << 30
    monkeypatch.setattr(tp, "host_free_bytes", lambda: free)
    monkeypatch.setattr(tiers, "host_free_bytes", lambda: free)
    monkeypatch.setattr(tp, "device_free_bytes", lambda device: 80 << 30)
    plan = _plan_needing_host(int(0.6 * free))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    plan.check()  # one process: 60% fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(BudgetError) as e:
        plan.check()
    msg = str(e.value)
    assert "\n" not in msg and "2 ranks of this machine" in msg and "host tier" in msg, msg
    tiers.reset_pin_cap()
    try:
        assert tiers.freeze_pin_cap() == int(free // 2 * tiers.PIN_RAM_FRACTION)
    finally:
        tiers.reset_pin_cap()


def _fake_gpus(monkeypatch, count: int) -> list:
    """CUDA "available" with `count` devices; returns the devices torch.cuda.set_device got."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    return calls


def test_P15_torchrun_on_a_gpu_node_trains_on_cuda_local_rank(monkeypatch):
    """Under torchrun on a GPU node each rank takes cuda:LOCAL_RANK without --gpu (before the
    fix: the CPU, silently); with no GPU visible, the CPU; in one process --gpu as given. P8:
    the chosen device becomes the current one."""
    from runners.common import select_device
    from runners.ranks import Ranks
    calls = _fake_gpus(monkeypatch, 2)
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    ranks = Ranks.from_env()
    assert ranks.gpu(None) == 1 and ranks.gpu(0) == 1
    assert select_device(ranks.gpu(None)) == torch.device("cuda", 1)
    assert calls == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ranks.gpu(None) is None
    assert Ranks(0, 1, 0).gpu(None) is None and Ranks(0, 1, 0).gpu(1) == 1


def test_P8_worker_threads_start_on_the_run_device(monkeypatch):
    """The step and fetch threads set the run's device before their first job (a new thread
    starts on device 0: before the fix every worker's current device was GPU 0)."""
    import threading
    from offload.memory.tiers import started_worker
    calls = _fake_gpus(monkeypatch, 2)
    names = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: (calls.append(torch.device(d)),
                                   names.append(threading.current_thread().name)))
    pool = started_worker("offload-test", torch.device("cuda", 1))
    pool.shutdown()
    assert calls == [torch.device("cuda", 1)] and names[0].startswith("offload-test")
    started_worker("offload-test-cpu", torch.device("cpu")).shutdown()
    assert len(calls) == 1


def test_P10_host_kv_cache_goes_through_the_pinned_cap_as_planned(monkeypatch):
    """The host KV cache's tensors are allocated through pinned_or_pageable: counted against
    the process's pinned cap at the allocator's rounded size, pageable (with a warning) past
    it -- before the fix torch.zeros(pin_memory=True) bypassed the cap and its accounting, and
    raised where cudaHostAlloc failed. The plan counts what the cap counts: one rounded buffer
    per layer. (Pinning is faked on this CPU: the accounting is what is checked.)"""
    import offload.memory.tiers as tiers
    from offload.infer.kv_cache import OffloadedKVCache
    from offload.infer.plan import _Sizes
    from offload.models import preset
    from offload.models.llama import kv_cache_bytes
    real_empty = torch.empty
    monkeypatch.setattr(tiers, "pin_possible", lambda pin: pin)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(tiers, "_PIN_WARNED", False)
    cfg, batch, max_len = preset("tiny"), 3, 37
    layers = cfg.num_hidden_layers
    per_layer = kv_cache_bytes(cfg, batch, max_len, torch.float32) // layers
    rounded = tiers.pinned_bytes(per_layer)
    assert rounded > per_layer  # the allocator's rounding matters at this size
    before = tiers.pinned_live_bytes()
    tiers.reset_pin_cap(before + (layers - 1) * rounded)  # room for all layers but one
    try:
        with pytest.warns(UserWarning, match="pinned-memory cap"):
            cache = OffloadedKVCache(cfg, batch, max_len, device="cpu", dtype=torch.float32,
                                     pin=True)
        assert tiers.pinned_live_bytes() - before == (layers - 1) * rounded
        assert cache.nbytes == layers * per_layer  # exact sizes: views of one buffer per layer
        del cache
        assert tiers.pinned_live_bytes() == before
    finally:
        tiers.reset_pin_cap(None)
    sizes = _Sizes([1], [1], 0, kv_cache_bytes(cfg, 1, max_len, torch.float32), 0, False,
                   {"cpu": 1, "nvme": 1}, False, kv_tier="host", num_layers=layers)
    assert sizes.kv_host(batch) == layers * rounded


def test_P12_global_norm_casts_a_chunk_at_a_time(monkeypatch):
    """ZeRO's global norm sums fp64 squares a chunk at a time: before the fix each owned shard
    was cast to fp64 whole (8.4 GB for an 8B model's rest block on the device, unplanned). The
    value is the whole-tensor one. (Rank 0 of a stand-in group of 2, tests/loopback_pg.py: its
    mirror adds the same sum.)"""
    import offload.zero.group as group
    from tests.loopback_pg import loopback_world
    monkeypatch.setattr(group, "NORM_CHUNK_ELEMS", 1000)
    seen = []
    norm = torch.linalg.vector_norm

    def recording(x, *a, **k):
        if k.get("dtype") == torch.float64:
            seen.append(x.numel())
        return norm(x, *a, **k)
    monkeypatch.setattr(torch.linalg, "vector_norm", recording)
    grads = [torch.randn(4321, dtype=torch.bfloat16), torch.randn(10)]
    want = (2 * sum(norm(g, dtype=torch.float64) ** 2 for g in grads)).sqrt().float()
    with loopback_world():
        got = group.ZeroGroup(0, torch.device("cpu")).global_norm(grads, True)
    assert max(seen) <= 1000 and sum(seen) == 4331
    assert torch.allclose(got, want, rtol=1e-6)
