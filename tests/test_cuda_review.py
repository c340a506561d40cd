"""The GPU proof kit's tests, part 2: one test per finding of the CUDA desk review
(../shared/reviews/cuda-desk-review.md; ids H1-H4, M1-M5, L1-L8 in the test names), on cuda:0.
Their CPU-checkable halves are in test_cuda_review_cpu.py; the set-up (markers, determinism,
helpers) is test_cuda.py's. Without a GPU every test here is skipped with the reason."""

from __future__ import annotations

import copy
import gc
import time

import pytest
import torch
from torch import nn

import offload
from offload.gpu import SIDE_DELAY_ENV

# pytestmark (the cuda marker, skipped without a GPU) and the autouse determinism fixture apply
# here as they do there
from tests.test_cuda import _deterministic, pytestmark  # noqa: F401
from tests.test_cuda import DEV, cfg_for, cuda_only, dev_batches, dev_loss, tiny_llama, updates
from tests.test_engine import MLP

# ---- 6. one test per desk-review finding ------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_H1_accumulation_with_a_slow_landing_worker(dtype, tmp_path, monkeypatch):
    """The next micro-batch's copy must not land in staging before the worker has added the
    previous one: with the worker slowed (20 ms per gradient) the fp32 landing buffers after a
    4-micro-batch window equal the sum of the four gradients plain PyTorch computes."""
    from offload.grads.landing import GradLanding
    torch.manual_seed(0)
    model = MLP(d=64, depth=6).to(DEV)
    ref_model = copy.deepcopy(model).to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
    batches = dev_batches(4, seed=3)
    # plain PyTorch: the window's summed gradient (per micro-batch, each in the model dtype)
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref_model.named_parameters()}
    for b in batches:
        (dev_loss(ref_model, b) / 4).backward()
        for n, p in ref_model.named_parameters():
            total[n] += p.grad.float()
            p.grad = None
    slow = GradLanding.land_host

    def slow_land(self, *a, **k):
        time.sleep(0.02)
        return slow(self, *a, **k)

    monkeypatch.setattr(GradLanding, "land_host", slow_land)
    engine = offload.initialize(model, cfg_for(tmp_path, dtype=dtype, grad_accum_steps=4,
                                               overlap_step=False))
    try:
        for b in batches[:3]:
            engine.backward(dev_loss(model, b))
            engine.step()
        engine.backward(dev_loss(model, batches[3]))
        engine.grads.wait()
        for bi, block in enumerate(engine.blocks):
            landed = engine.grads.landing[bi]
            for s in block.slots:
                got = landed[s.offset:s.offset + s.numel].to(DEV)
                want = total[s.name].reshape(-1)
                tol = 1e-6 if dtype == "fp32" else 2e-2
                assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()), s.name
        engine.step()
    finally:
        engine.close()


@cuda_only
def test_H2_device_memory_after_forward(tmp_path):
    from offload.train.activations import (ActivationStore, disable_activation_checkpointing,
                                     enable_activation_checkpointing)
    torch.manual_seed(0)
    model = tiny_llama().to(DEV)
    layers = model.model.layers
    ids = torch.randint(0, 1024, (8, 512), device=DEV)
    hidden_bytes = 8 * 512 * model.config.hidden_size * 4
    after = {}
    for offloaded in (False, True):
        store = ActivationStore(DEV, pin=True) if offloaded else None
        enable_activation_checkpointing(layers, store, DEV)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(DEV)
        out = model(ids)
        torch.cuda.synchronize()
        after[offloaded] = torch.cuda.memory_allocated(DEV) - before
        out.float().mean().backward()
        del out
        model.zero_grad(set_to_none=True)
        disable_activation_checkpointing(layers)
        if store is not None:
            store.clear()
    L = len(layers)
    assert after[False] - after[True] >= 0.9 * (L - 1) * hidden_bytes, after


@cuda_only
def test_H3_buffers_that_cross_the_link_are_pinned_and_state_is_not(tmp_path, recwarn):
    """The landing buffers, the upload ring and streamed weights are pinned; masters and moments
    (read only by the CPU kernel) are not, so they never spend the pinned-memory cap."""
    from offload.memory import tiers
    torch.manual_seed(0)
    model = tiny_llama()
    engine = offload.initialize(model, cfg_for(tmp_path, dtype="bf16", offload_params="cpu",
                                               grad_clip=1.0))
    try:
        assert all(t.is_pinned() for t in engine.grads.landing if t is not None)
        assert all(t.is_pinned() for t in engine.stepper.upload_ring)
        streamer = engine.streaming.streamer
        assert all(streamer.host_buffer(i).is_pinned() for i in streamer._host)
        master, m, v = engine.state.acquire(0)
        assert not (master.is_pinned() or m.is_pinned() or v.is_pinned())
        assert tiers.pinned_live_bytes() > 0
    finally:
        engine.close()
    assert not [w for w in recwarn if "pageable" in str(w.message)]


@cuda_only
def test_H3_gradient_hook_does_not_block(tmp_path):
    """A pinned landing buffer makes the gradient copy asynchronous: the hook returns in well
    under a millisecond even for a 100 MB gradient (a pageable one would wait for the copy)."""
    from offload.grads.transport import Cuda
    model = nn.Sequential(nn.Linear(5000, 5000, bias=False)).to(DEV, torch.bfloat16)
    durations = []
    inner = Cuda.land

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        inner(self, *a, **k)
        durations.append(time.perf_counter() - t0)

    engine = offload.initialize(model, cfg_for(tmp_path, dtype="bf16", grad_clip=1.0))
    try:
        engine.grads.transport.land = timed.__get__(engine.grads.transport)
        x = torch.randn(64, 5000, device=DEV, dtype=torch.bfloat16)
        for _ in range(3):
            engine.backward(model(x).float().pow(2).mean())
            engine.step()
    finally:
        engine.close()
    assert durations and min(durations) < 1e-3, durations


@cuda_only
def test_H4_pinned_bytes_within_the_inference_plan(tmp_path):
    """Every cpu-tier block pinned, block bytes far from powers of two: the pinned memory held
    (counted at the allocator's rounded sizes) stays within the plan's host bytes, which count
    the same rounding."""
    from offload.memory import tiers
    from offload.models import CheckpointReader
    from offload.infer.plan import plan_inference
    from offload.models import load_streamed
    from tests.test_generate import _checkpoint

    _checkpoint(tmp_path, "llama")

    def allocator_bytes() -> int | None:  # what torch's pinned allocator hands out, if it says
        stats = getattr(torch.cuda, "host_memory_stats", None)
        value = stats().get("allocated_bytes.current") if stats is not None else None
        return value if isinstance(value, int) else None

    before, before_alloc = tiers.pinned_live_bytes(), allocator_bytes()
    with CheckpointReader(tmp_path) as reader:
        model, streamer = load_streamed(reader, ["cpu"] * 4, device=DEV, dtype=torch.bfloat16)
        try:
            held = tiers.pinned_live_bytes() - before
            assert all(streamer.host_buffer(i).is_pinned() for i in range(4))
            blocks = [streamer.block_bytes(i) for i in range(4)]
            plan = plan_inference(block_bytes=blocks, stored_block_bytes=blocks, non_block_bytes=0,
                                  batch_size=1, context=16, kv_bytes_per_seq=0, workspace_per_seq=0,
                                  device_budget=10**12, host_budget=10**12, device_is_host=False,
                                  force="cpu")
            assert held <= plan.host_need, (held, plan.host_need)
            after_alloc = allocator_bytes()
            if before_alloc is not None and after_alloc is not None:
                assert after_alloc - before_alloc <= 1.1 * plan.host_need, \
                    (after_alloc - before_alloc, plan.host_need)
        finally:
            streamer.close()


@cuda_only
def test_M1_overlapped_steps_with_jittered_landing(tmp_path, monkeypatch):
    """The landing worker reads on_block_done once: with a random 0-2 ms delay before each
    landing, 100 overlapped updates run without a TypeError from a callback cleared between
    the check and the call."""
    import random
    from offload.grads.landing import GradLanding
    rng = random.Random(0)
    inner = GradLanding.after_land

    def jittered(self, *a, **k):
        time.sleep(rng.random() * 0.002)
        return inner(self, *a, **k)

    monkeypatch.setattr(GradLanding, "after_land", jittered)
    torch.manual_seed(0)
    cfg = cfg_for(tmp_path, overlap_step=True)
    assert cfg.step_path()[0] == "overlapped"
    updates(MLP(d=32).to(DEV), cfg, 100, applied=True)


@cuda_only
def test_M2_landing_worker_sleeps_while_waiting(tmp_path):
    """The landing worker waits on blocking events: while backward's kernels run for ~1 s
    (a GPU sleep), the worker thread uses a small fraction of a core."""
    import psutil
    torch.manual_seed(0)
    model = MLP(d=64).to(DEV)
    engine = offload.initialize(model, cfg_for(tmp_path, grad_clip=1.0))
    try:
        worker = engine.grads.transport.worker
        native = worker.native_id

        def cpu_s() -> float:
            for t in psutil.Process().threads():
                if t.id == native:
                    return t.user_time + t.system_time
            return 0.0

        batch = dev_batches(1)[0]
        loss = dev_loss(model, batch)
        before, t0 = cpu_s(), time.perf_counter()
        # the first gradient is produced after ~1 s of GPU sleep queued ahead of backward
        torch.cuda._sleep(int(2e9))
        engine.backward(loss)
        engine.step()
        wall = time.perf_counter() - t0
        assert cpu_s() - before < 0.1 * wall, (cpu_s() - before, wall)
    finally:
        engine.close()


@cuda_only
def test_M3_slots_are_not_reused_while_a_copy_writes_them(tmp_path):
    """Close a streamer with prefetches still in flight (slow copies), drop it, and allocate the
    same amount at once on the compute stream: the new tensors keep their values."""
    from offload.infer.generate import generate
    from offload.models import CheckpointReader
    from offload.models import load_streamed
    from tests.test_generate import _checkpoint

    _checkpoint(tmp_path, "llama")
    with CheckpointReader(tmp_path) as reader:
        model, streamer = load_streamed(reader, ["cpu"] * 4, device=DEV, dtype=torch.float32,
                                        fetch_delay_s=0.3)
        generate(model, [[5, 6, 7]], max_new_tokens=2, device=DEV, streamer=streamer)
        slot_bytes, n_slots = streamer.slots[0].raw.numel(), len(streamer.slots)
        streamer.close()
        del model, streamer
    gc.collect()
    fresh = [torch.full((slot_bytes,), 7, dtype=torch.uint8, device=DEV) for _ in range(n_slots + 1)]
    torch.cuda.synchronize()
    assert all(bool((t == 7).all()) for t in fresh)


@cuda_only
def test_L1_offload_none_clip_with_an_unused_parameter(tmp_path):
    class WithUnused(MLP):
        def __init__(self):
            super().__init__(d=32)
            self.unused = nn.Linear(4, 4)

    torch.manual_seed(0)
    updates(WithUnused().to(DEV), cfg_for(tmp_path, offload="none", grad_clip=1.0), 3, applied=True)


@cuda_only
def test_L4_no_upload_ring_without_offload(tmp_path):
    model = MLP(d=32).to(DEV)
    engine = offload.initialize(model, cfg_for(tmp_path, offload="none"))
    try:
        assert engine.account.held("host", "buffers") == 0
        assert engine.stepper.upload_ring == []
    finally:
        engine.close()


@cuda_only
def test_L5_gpu_time_split_from_timing_events(tmp_path):
    """The report's forward_gpu_s is the GPU's time: a GPU sleep queued in every forward shows
    there (the host's forward_s, which only queues it, stays far below)."""
    cycles = int(2e8)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(cycles)
    t1.record()
    t1.synchronize()
    sleep_s = t0.elapsed_time(t1) / 1e3

    class Sleepy(MLP):
        def forward(self, x):
            torch.cuda._sleep(cycles)
            return super().forward(x)

    torch.manual_seed(0)
    model = Sleepy(d=32).to(DEV)
    engine = offload.initialize(model, cfg_for(tmp_path, grad_clip=1.0))
    reports = []
    try:
        for b in dev_batches(5):
            engine.backward(dev_loss(model, b))
            engine.step()
            reports.append(engine.last_report)
    finally:
        engine.close()
    gpu = sum(r.forward_gpu_s for r in reports)
    host = sum(r.forward_s for r in reports)
    # pairs still running at an update count toward the next: at most the last one is missing
    assert 0.7 * 4 * sleep_s <= gpu <= 1.3 * 5 * sleep_s + 0.5, (gpu, sleep_s)
    assert host < 0.5 * gpu, (host, gpu)


@cuda_only
def test_L6_no_sync_inside_the_micro_batch_loop(tmp_path):
    """Between update boundaries nothing waits for the GPU: backward and a non-boundary step
    run under the sync debug mode set to "error"."""
    torch.manual_seed(0)
    model = MLP(d=32).to(DEV)
    engine = offload.initialize(model, cfg_for(tmp_path, grad_accum_steps=4, grad_clip=1.0))
    batches = dev_batches(8)
    try:
        for i, b in enumerate(batches):
            loss = dev_loss(model, b)
            boundary = (i + 1) % 4 == 0
            if not boundary and i % 4:  # the window's first backward reads nothing either
                torch.cuda.set_sync_debug_mode("error")
            try:
                engine.backward(loss)
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.close()


@cuda_only
def test_L7_resume_with_extra_cuda_rng_entries(tmp_path):
    from offload.train.checkpoint import rng_state, set_rng_state
    state = rng_state(DEV)
    assert len(state["cuda"]) == 1
    state["cuda"] = state["cuda"] + state["cuda"] * 7  # saved where 8 GPUs were visible
    want = torch.cuda.get_rng_state(DEV).clone()
    torch.cuda.manual_seed(123)
    set_rng_state(state, DEV)
    assert torch.equal(torch.cuda.get_rng_state(DEV), want)


@cuda_only
def test_L8_load_state_during_delayed_updates_with_slow_uploads(tmp_path, monkeypatch):
    """load_state with a delayed job's uploads still queued (slowed on the H2D stream): after
    it, live and shadow weights equal what a fresh engine loads from the same state."""
    torch.manual_seed(0)
    model = MLP(d=64).to(DEV)
    twin = copy.deepcopy(model)
    fresh_model = copy.deepcopy(model)
    batches = dev_batches(6)
    cfg = cfg_for(tmp_path / "a", delayed_update=True)
    saver = offload.initialize(twin, cfg_for(tmp_path / "t", delayed_update=True))
    try:
        for b in batches[:3]:
            saver.backward(dev_loss(twin, b))
            saver.step()
        saver.save_state(str(tmp_path / "state"))
    finally:
        saver.close()
    engine = offload.initialize(model, cfg)
    try:
        monkeypatch.setenv(SIDE_DELAY_ENV, "50000000")
        for b in batches:
            engine.backward(dev_loss(model, b))
            engine.step()
        engine.load_state(str(tmp_path / "state"))  # a job's slow uploads are still queued
        monkeypatch.delenv(SIDE_DELAY_ENV)
        fresh = offload.initialize(fresh_model, cfg_for(tmp_path / "f", delayed_update=True))
        try:
            fresh.load_state(str(tmp_path / "state"))
            torch.cuda.synchronize()
            for a, b in zip(engine.flat16, fresh.flat16):
                assert torch.equal(a, b)
            for a, b in zip(engine.delayed.shadow, fresh.delayed.shadow):
                assert torch.equal(a, b)
        finally:
            fresh.close()
    finally:
        engine.close()
