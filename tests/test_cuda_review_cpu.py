"""The CPU-checkable half of the CUDA desk review's tests (../shared/reviews/cuda-desk-review.md;
the GPU half is tests/test_cuda.py): findings whose mechanism shows on the CPU device too, and
the pinned-memory policy every GPU host buffer goes through (offload/memory/tiers.py)."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
from torch import nn

from offload.memory import tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = torch.device("cpu")


def tiny_llama():
    from offload.models import build_model, preset
    return build_model(preset("tiny"), device="cpu", source=0)


def test_H2_offloaded_block_inputs_leave_the_device(tmp_path):
    """With offload_activations the checkpointed inputs are freed on the device once their host
    copy is queued: nothing holds them until backward (CPU: the input's weakref dies; CUDA:
    memory after forward falls by about (L-1) inputs against the run without offload)."""
    import weakref
    from offload.train.activations import enable_activation_checkpointing, ActivationStore

    torch.manual_seed(0)
    model = tiny_llama().to(DEV)
    layers = model.model.layers
    store = ActivationStore(DEV, pin=True)
    enable_activation_checkpointing(layers, store, DEV)
    refs = []
    layers[2].register_forward_pre_hook(lambda m, a: refs.append(weakref.ref(a[0])))
    ids = torch.randint(0, 1024, (2, 32), device=DEV)
    out = model(ids)
    gc.collect()
    assert refs and refs[0]() is None, "block 2's input is still alive after forward"
    out.float().sum().backward()
    store.clear()


def test_H4_planner_counts_rounded_pinned_sizes():
    """(CPU too) A GPU plan counts a pinned buffer at the allocator's power-of-two size."""
    from offload.infer.plan import plan_inference
    from offload.memory.tiers import pinned_bytes
    blocks = [605 << 20] * 3  # a 13B-like block: 605 MiB takes 1 GiB pinned
    plan = plan_inference(block_bytes=blocks, stored_block_bytes=blocks, non_block_bytes=0,
                          batch_size=1, context=16, kv_bytes_per_seq=0, workspace_per_seq=0,
                          device_budget=10**13, host_budget=10**13, device_is_host=False, force="cpu")
    assert plan.host_need == 3 * pinned_bytes(605 << 20) == 3 << 30


def test_M1_callback_read_once():
    """(CPU) A callback that disappears between two reads of the attribute is not called."""
    from offload.memory.blocks import Block, ParamSlot
    from offload.grads.landing import GradLanding
    from offload.memory.tiers import LinkCounter, MemoryAccount

    p = nn.Parameter(torch.zeros(4))
    block = Block(index=0, name="0", module=None)
    block.slots.append(ParamSlot("w", p, 0, 4, p.shape))
    block.numel = 4

    class Vanishing(GradLanding):
        reads = 0

        @property
        def on_block_done(self):
            Vanishing.reads += 1
            return (lambda bi: None) if Vanishing.reads == 1 else None

        @on_block_done.setter
        def on_block_done(self, value):
            pass

    g = Vanishing([block], torch.float32, 1, MemoryAccount(), LinkCounter())
    g.begin_micro(0)
    g.after_land(0, block.slots[0])  # a second read would return None and call it
    assert Vanishing.reads == 1


def test_L2_side_stream_contexts_enter_their_device():
    """(CPU-checkable part) every side-stream context in the library goes through on_stream,
    which enters the stream's device; a bare torch.cuda.stream(...) would restore device 0's
    stream on exit and create a context on GPU 0 in a --gpu 1 run."""
    import pathlib
    bare = []
    for path in pathlib.Path(ROOT, "offload").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "with torch.cuda.stream(" in line and path.name != "gpu.py":
                inside_device = "torch.cuda.device(" in line
                prev = path.read_text().splitlines()[n - 2] if n > 1 else ""
                if not inside_device and "torch.cuda.device(" not in prev:
                    bare.append(f"{path.name}:{n}")
    assert not bare, bare


# ---- the pinned-memory policy (review H3/H4) ------------------------------------------------
def test_pinned_bytes_is_the_allocators_power_of_two():
    assert [tiers.pinned_bytes(n) for n in (0, 1, 4096, 4097, 605 << 20, 1 << 30)] == \
        [0, 1, 4096, 8192, 1 << 30, 1 << 30]


@pytest.fixture
def fake_pinning(monkeypatch):
    """pinned_or_pageable as on a GPU machine: pinning possible, allocations recorded."""
    monkeypatch.setattr(tiers, "pin_possible", lambda pin: pin)
    monkeypatch.setattr(tiers, "_PIN_WARNED", False)
    monkeypatch.setattr(tiers, "_pinned_bytes", 0)
    tiers.reset_pin_cap(10 << 20)
    made = []

    def allocate(nbytes):
        def go(pinned):
            made.append(pinned)
            return torch.empty(nbytes, dtype=torch.uint8)
        return go

    yield made, allocate
    tiers.reset_pin_cap(None)


def test_pinned_allocations_count_rounded_sizes_against_a_fixed_cap(fake_pinning):
    made, allocate = fake_pinning
    a = tiers.pinned_or_pageable(3 << 20, True, allocate(3 << 20))  # counts 4 MiB
    b = tiers.pinned_or_pageable(3 << 20, True, allocate(3 << 20))  # 8 MiB of the 10 MiB cap
    assert made == [True, True] and tiers.pinned_live_bytes() == 8 << 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tiers.pinned_or_pageable(3 << 20, True, allocate(3 << 20))  # 12 MiB > cap
        d = tiers.pinned_or_pageable(1 << 20, True, allocate(1 << 20))  # fits: pinned again
    assert made[2:] == [False, True] and c.numel() == 3 << 20
    assert len(caught) == 1 and "synchronous" in str(caught[0].message)
    del a, b, c, d
    gc.collect()
    assert tiers.pinned_live_bytes() == 0  # freed buffers give their rounded bytes back


def test_failed_pinning_falls_back_and_gives_its_reservation_back(fake_pinning):
    made, _ = fake_pinning

    def flaky(pinned):
        made.append(pinned)
        if pinned:
            raise RuntimeError("cudaHostAlloc failed")
        return torch.empty(16)

    with pytest.warns(UserWarning, match="failed"):
        t = tiers.pinned_or_pageable(64, True, flaky)
    assert made == [True, False] and t.numel() == 16 and tiers.pinned_live_bytes() == 0


def test_freeze_pin_cap_measures_once(monkeypatch):
    tiers.reset_pin_cap(None)
    free = iter([8 << 30, 1 << 30])
    monkeypatch.setattr(tiers, "host_free_bytes", lambda: next(free))
    try:
        assert tiers.freeze_pin_cap() == int((8 << 30) * tiers.PIN_RAM_FRACTION)
        assert tiers.freeze_pin_cap() == int((8 << 30) * tiers.PIN_RAM_FRACTION)  # not re-measured
        assert tiers.pin_limit_bytes() == int((8 << 30) * tiers.PIN_RAM_FRACTION)
    finally:
        tiers.reset_pin_cap(None)


def test_training_plan_on_a_gpu_counts_pinned_rounding_and_the_d2h_backlog():
    """Host buffers that cross the link at their pinned size; device gradients waiting for their
    copy bounded by D2H_BACKLOG_BLOCKS largest blocks (review M5); no upload ring and no
    backlog without offload (review L4)."""
    from offload.config import OffloadConfig
    from offload.grads.transport import D2H_BACKLOG_BLOCKS
    from offload.train.plan import plan_training
    gpu = torch.device("cuda", 0)
    blocks = [(3_000_000, True)] * 4 + [(5_000_000, False)]
    cfg = OffloadConfig(offload="cpu", dtype="bf16", grad_clip=1.0, device="cpu")
    plan = plan_training(blocks, cfg, gpu)
    grads = 4 * tiers.pinned_bytes(6_000_000) + tiers.pinned_bytes(10_000_000)
    assert plan.bytes["host"]["grads"] == grads
    ring = max(2, min(cfg.buffer_count, len(blocks)))
    assert plan.bytes["host"]["buffers"] == ring * tiers.pinned_bytes(10_000_000)  # upload ring
    assert plan.bytes["host"]["masters"] == 4 * 17_000_000  # pageable: exact
    assert plan.bytes["device"]["grads"] == D2H_BACKLOG_BLOCKS * 10_000_000
    on_cpu = plan_training(blocks, cfg, torch.device("cpu"))
    assert on_cpu.bytes["host"]["grads"] == 2 * 17_000_000 and "grads" not in on_cpu.bytes["device"]
    none = plan_training(blocks, cfg.replace(offload="none"), gpu)
    assert "buffers" not in none.bytes["host"] and none.bytes["device"]["grads"] == 2 * 17_000_000


def test_finetune_dtype_auto_is_fp32_on_the_cpu(tmp_path):
    """Review M4's CPU side: the default --dtype is auto, fp32 on the CPU (bf16 on a GPU:
    tests/test_cuda.py)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "runners.finetune", "--dry-run", "--output",
                        str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fp32" in r.stdout and "bf16" not in r.stdout


def test_pinned_count_lasts_as_long_as_any_view(fake_pinning):
    """The pinned bytes are given back when the memory is, not when the returned tensor object
    dies: callers keep only views of it (the streamer's `.view(dtype)`, the pool's slices)."""
    _, allocate = fake_pinning
    view = tiers.pinned_or_pageable(1 << 20, True, allocate(1 << 20)).view(torch.float32)[:16]
    gc.collect()
    assert tiers.pinned_live_bytes() == 1 << 20
    del view
    gc.collect()
    assert tiers.pinned_live_bytes() == 0
