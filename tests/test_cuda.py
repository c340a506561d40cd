"""The GPU proof kit's tests: every CUDA-specific path on cuda:0 against plain PyTorch on the same
GPU, the planner's promise measured in device memory, and one test per finding of the CUDA desk
review (../shared/reviews/cuda-desk-review.md; ids H1-H4, M1-M5, L1-L8 in the test names).

    python -m pytest -m cuda                 # on a machine with a GPU (scripts/gpu_check.py runs it
                                             # plain, under TORCH_CUDA_SANITIZER=1 and with delays)

Without a GPU every test is skipped with the reason. OFFLOAD_TEST_CUDA_ON_CPU=1 runs the tests that
make sense on the CPU device (matrix, generation, CLIs) against the same references, so the kit's
own logic is exercised before its first GPU run; the CUDA-only checks skip themselves there.

On the GPU: TF32 off and deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG is set before CUDA
starts), so "identical" comparisons (delays injected, streamed vs resident) are bit for bit.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: determinism

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError, OffloadConfig
from offload.gpu import HOST_DELAY_ENV, SIDE_DELAY_ENV

from tests.test_delayed import reference_delayed
from tests.test_engine import MLP, hf_loss, lm_batches, max_rel_diff, mlp_batches, reference_train
from tests.test_streamed_training import _train as train_and_close

ON_CPU = os.environ.get("OFFLOAD_TEST_CUDA_ON_CPU") == "1"
# the sanitizer and delay runs of scripts/gpu_check.py (the sanitizer slows every op): the matrix
# with clipping and accumulation both off (the overlapped step) and both on (staged gradients,
# the norm before the step), and the optimizer on the device or in host RAM (NVMe differs from
# host RAM in host-side IO only, not in any stream ordering)
QUICK = os.environ.get("OFFLOAD_CUDA_QUICK") == "1"
HAVE_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda:0") if HAVE_CUDA else torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAVE_CUDA or ON_CPU),
                       reason="needs a CUDA GPU (run `python scripts/gpu_check.py` on one; "
                              "OFFLOAD_TEST_CUDA_ON_CPU=1 runs the CPU-meaningful part here)"),
]
cuda_only = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU: a CUDA-only mechanism "
                               "(events, pinned memory, device memory statistics); run "
                               "`python scripts/gpu_check.py` on one")


@pytest.fixture(autouse=True)
def _deterministic():
    """Bit-exact GPU comparisons: no TF32, deterministic kernels (cuBLAS, SDPA math)."""
    if not HAVE_CUDA:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    det = torch.are_deterministic_algorithms_enabled()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # the flash / memory-efficient attention backwards are not deterministic run to run;
        # the math kernel is (and transformers' reference takes the same one in-process)
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.use_deterministic_algorithms(det)
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()


# ---- helpers ------------------------------------------------------------------------------------
def dev_batches(n: int, seed: int = 0):
    return [(x.to(DEV), y.to(DEV)) for x, y in mlp_batches(n, seed)]


def dev_loss(model, batch):
    x, y = batch
    out = model(x.to(next(model.parameters()).dtype))
    return nn.functional.mse_loss(out.float(), y.float())


def tiny_llama():
    from offload.models import build_model, preset
    return build_model(preset("tiny"), device="cpu", source=0)


def cfg_for(tmp_path, **kw) -> OffloadConfig:
    base = dict(offload="cpu", dtype="fp32", device=str(DEV), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                weight_decay=0.01, nvme_dir=str(tmp_path / "swap"))
    base.update(kw)
    return OffloadConfig(**base)


def run_engine(model, batches, loss_fn, cfg, setup=None):
    """(masters on DEV, losses, last report) after training `batches`."""
    masters, losses, report = train_and_close(model, batches, loss_fn, cfg, setup)
    return {k: v.to(DEV) for k, v in masters.items()}, losses, report


def torch_reference(model, batches, loss_fn, cfg):
    """Plain PyTorch on the same device: backward, clip_grad_norm_, AdamW(fused=True) on GPU."""
    return reference_train(model, batches, loss_fn, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                           wd=cfg.weight_decay, clip=cfg.grad_clip, accum=cfg.grad_accum_steps,
                           fused=HAVE_CUDA or None)


def delayed_reference(model, batches, loss_fn, cfg):
    """The delayed update's schedule in plain PyTorch (tests/test_delayed.py), fused AdamW."""
    masters, _live, losses = reference_delayed(model, batches, loss_fn, cfg=cfg,
                                               warmup=cfg.delayed_update_warmup,
                                               fused=HAVE_CUDA or None)
    return masters, losses


def updates(model, cfg, n: int, *, applied: bool = False) -> None:
    """n plain updates of an MLP on dev_batches (applied: each must apply)."""
    engine = offload.initialize(model, cfg)
    try:
        for b in dev_batches(n):
            engine.backward(dev_loss(model, b))
            ok = engine.step()
            assert ok or not applied
    finally:
        engine.close()


# ---- 1. the engine's fidelity matrix ------------------------------------------------------------
PATHS = {"after": dict(overlap_step=False), "overlapped": dict(overlap_step=True),
         "delayed": dict(delayed_update=True)}
UPDATES = 6


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("clip,accum", [(0.0, 1), (0.05, 3)] if QUICK else
                         [(0.0, 1), (0.05, 1), (0.0, 3), (0.05, 3)])
@pytest.mark.parametrize("params", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("opt", ["none", "cpu"] if QUICK else ["none", "cpu", "nvme"])
def test_fidelity_matrix_fp32(opt, params, clip, accum, path, tmp_path):
    """fp32 masters after UPDATES updates equal torch.optim.AdamW(fused=True) on the same GPU
    within 1e-6 (relative), for every tier combination the engine accepts, on every step path."""
    try:
        cfg = cfg_for(tmp_path, offload=opt, offload_params=params, grad_clip=clip,
                      grad_accum_steps=accum, **PATHS[path])
    except ConfigError as e:
        pytest.skip(f"combination refused by the config, as documented: {e}")
    if path == "overlapped" and cfg.step_path()[0] != "overlapped":
        pytest.skip(f"the overlapped step does not apply here: {cfg.step_path()[1]}")
    torch.manual_seed(0)
    model = MLP(d=48).to(DEV)
    ref_model = copy.deepcopy(model)
    batches = dev_batches(UPDATES * accum)
    reference = delayed_reference if path == "delayed" else torch_reference
    ref, ref_losses = reference(ref_model, batches, dev_loss, cfg)
    try:
        got, losses, rep = run_engine(model, batches, dev_loss, cfg)
    except ConfigError as e:
        pytest.skip(f"combination refused by the engine, as documented: {e}")
    assert max_rel_diff(got, ref) <= 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if params != "none":
        assert rep.bytes["stream_h2d"] + rep.bytes["stream_disk"] > 0


@pytest.mark.parametrize("params", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("ckpt,act", [(True, True)] if QUICK else [(False, False), (True, False),
                                                                   (True, True)])
def test_llama_streamed_equals_resident_on_the_gpu(params, ckpt, act, tmp_path):
    """A Llama (attention, RoPE, tied paths) streamed, checkpointed and with activations in host
    RAM gives the resident engine's masters bit for bit on the GPU."""
    torch.manual_seed(0)
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    batches = [b.to(DEV) for b in lm_batches(8, 1024)]
    ref, ref_losses, _ = run_engine(ref_model, batches, hf_loss, cfg_for(tmp_path / "a"))
    got, losses, rep = run_engine(model, batches, hf_loss, cfg_for(
        tmp_path / "b", offload_params=params, activation_checkpointing=ckpt, offload_activations=act))
    assert losses == ref_losses
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert (rep.bytes["act_offload"] > 0) == act


@pytest.mark.parametrize("dtype", ["bf16"] if QUICK else ["bf16", "fp16"])
@pytest.mark.parametrize("opt,params", [("cpu", "none"), ("nvme", "nvme")] if QUICK else
                         [("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_16bit_tracks_the_fp32_loss(dtype, opt, params, tmp_path):
    """bf16/fp16 weights and gradients on the device, fp32 masters on the host: the loss curve
    follows the fp32 run's within mixed-precision tolerance and falls as much."""
    torch.manual_seed(0)
    model = MLP(d=64).to(DEV)
    ref_model = copy.deepcopy(model)
    batches = dev_batches(30)
    kw = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1.0, offload=opt,
              offload_params=params)
    _, ref_losses, _ = run_engine(ref_model, batches, dev_loss, cfg_for(tmp_path / "a", **kw))
    # fp16: a loss scale the gradients cannot overflow, so no update is skipped and the curves
    # line up step for step (skipping is tested on the CPU: test_fp16_overflow_skips_update)
    scale = dict(initial_scale_power=8) if dtype == "fp16" else {}
    _, losses, _ = run_engine(model, batches, dev_loss,
                                 cfg_for(tmp_path / "b", dtype=dtype, **scale, **kw))
    assert losses == pytest.approx(ref_losses, rel=5e-2)
    assert losses[-1] < 0.7 * losses[0]


# ---- 2. delays on every side stream: identical numbers --------------------------------------
DELAY_CASES = [  # (opt, params, clip, accum, extra)
    ("cpu", "none", 0.0, 1, {}),  # overlapped step: uploads on the step thread during backward
    ("cpu", "none", 0.5, 3, {}),  # accumulation: staged gradients, host adds (H1)
    ("nvme", "none", 0.0, 2, dict(delayed_update=True)),  # the delayed job's uploads
    ("cpu", "cpu", 0.0, 1, dict(activation_checkpointing=True, offload_activations=True)),
    ("nvme", "nvme", 0.5, 2, dict(activation_checkpointing=True)),
    ("none", "none", 0.5, 2, {}),
]


@cuda_only
@pytest.mark.parametrize("opt,params,clip,accum,extra", DELAY_CASES)
def test_injected_side_stream_delays_change_nothing(opt, params, clip, accum, extra, tmp_path,
                                                    monkeypatch):
    """A GPU sleep before every side-stream copy (gradients out, weights up, activations both
    ways, streamed blocks) and a slow landing worker: a missing wait would now read or write at
    the wrong time on every run. The numbers must be the undelayed run's, bit for bit."""
    torch.manual_seed(0)
    model = tiny_llama()
    delayed_model = copy.deepcopy(model)
    batches = [b.to(DEV) for b in lm_batches(6 * accum, 1024)]
    kw = dict(offload=opt, offload_params=params, grad_clip=clip, grad_accum_steps=accum, **extra)
    ref, ref_losses, _ = run_engine(model, batches, hf_loss, cfg_for(tmp_path / "a", **kw))
    monkeypatch.setenv(SIDE_DELAY_ENV, "20000000")  # ~10 ms per copy on a ~2 GHz clock
    monkeypatch.setenv(HOST_DELAY_ENV, "0.002")
    got, losses, _ = run_engine(delayed_model, batches, hf_loss, cfg_for(tmp_path / "b", **kw))
    assert losses == ref_losses
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


# ---- 3. streamed generation against transformers on the same GPU ------------------------------
@pytest.mark.parametrize("residency", [["device"] * 4, ["cpu"] * 4, ["nvme"] * 4,
                                       ["nvme", "device", "cpu", "nvme"]])
def test_streamed_generation_matches_transformers(residency, tmp_path):
    transformers = pytest.importorskip("transformers")
    from offload.generate import generate
    from offload.models import CheckpointReader
    from offload.models import load_streamed
    from tests.test_generate import NEW, PROMPTS, _checkpoint

    _checkpoint(tmp_path, "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).to(DEV)
    want = [hf.generate(torch.tensor([p], device=DEV), max_new_tokens=NEW, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    del hf
    with CheckpointReader(tmp_path) as reader:
        model, streamer = load_streamed(reader, residency, device=DEV, dtype=torch.float32,
                                        fetch_delay_s=0.002,
                                        zero_copy_host=None if HAVE_CUDA else False)
        try:
            got = [generate(model, [p], max_new_tokens=NEW, device=DEV, streamer=streamer).tokens[0]
                   for p in PROMPTS]
        finally:
            streamer.close()
    assert got == want


# ---- 4. both runners' CLIs with --gpu 0 ---------------------------------------------------------
def run_cli(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


GPU_FLAG = ["--gpu", "0"] if HAVE_CUDA else []


@pytest.mark.parametrize("flags", [["--offload", "cpu"], ["--offload", "nvme"],
                                   ["--offload", "cpu", "--offload-params", "cpu",
                                    "--activation-checkpointing"],
                                   ["--offload", "nvme", "--offload-params", "nvme",
                                    "--batch-size", "8", "--micro-batch-size", "4"]])
def test_finetune_cli_on_the_gpu(flags, tmp_path):
    out = tmp_path / "run"
    r = run_cli("runners.finetune", *GPU_FLAG, "--steps", "4", "--eval-every", "2",
                "--output", str(out), "--no-progress", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 4 and all(row["loss"] == row["loss"] for row in rows)  # finite
    assert (out / "model" / "config.json").exists()


def test_finetune_defaults_to_bf16_on_a_gpu(tmp_path):
    """Review M4: no --dtype on a GPU means bf16 (fp32 there runs full-fp32 GEMMs)."""
    r = run_cli("runners.finetune", *GPU_FLAG, "--dry-run", "--output", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("bf16" if HAVE_CUDA and torch.cuda.is_bf16_supported() else
            "fp16" if HAVE_CUDA else "fp32") in r.stdout


@pytest.mark.parametrize("weights", ["cpu", "nvme"])
def test_infer_cli_on_the_gpu(weights, tmp_path):
    """Streamed from host RAM and from NVMe, the runner prints the resident run's tokens."""
    def run(tier: str) -> list:
        out = tmp_path / f"{tier}.json"
        r = run_cli("runners.infer", *GPU_FLAG, "--weights", tier, "--prompt-ids", "5,6,7,8",
                    "--max-new-tokens", "6", "--dtype", "fp32", "--ignore-eos",
                    "--output-json", str(out), "--offload-dir", str(tmp_path / "cache"))
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(out.read_text())["generated_ids"]

    got = run(weights)
    assert len(got[0]) == 6
    assert got == run("device")


# ---- 5. the planner's promise -----------------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("kw", [dict(offload="cpu"), dict(offload="nvme", offload_params="cpu"),
                                dict(offload="cpu", grad_accum_steps=2),
                                dict(offload="cpu", activation_checkpointing=True,
                                     offload_activations=True)])
def test_training_peak_device_memory_within_the_plan(kw, tmp_path):
    """Review M5 / H2: what the GPU really held (allocated *and* reserved by the caching
    allocator, above what existed before) stays within the plan's device total, and the
    allocator never had to free its cache and retry (num_alloc_retries)."""
    from offload.train_plan import llama_activation_estimate, plan_training

    torch.manual_seed(0)
    model = tiny_llama()
    micro, seq = 4, 64
    batches = [torch.randint(0, 1024, (micro, seq), device=DEV) for _ in range(4)]
    cfg = cfg_for(tmp_path, dtype="bf16", **kw)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(DEV)
    base_alloc = torch.cuda.memory_allocated(DEV)
    base_reserved = torch.cuda.memory_reserved(DEV)
    retries0 = torch.cuda.memory_stats(DEV).get("num_alloc_retries", 0)
    engine = offload.initialize(model, cfg)
    blocks = [(b.numel, b.module is not None) for b in engine.blocks]
    acts = llama_activation_estimate(model.config, micro, seq, torch.bfloat16)  # hf_loss: all seq
    plan = plan_training(blocks, cfg, DEV, acts)
    try:
        for ids in batches:
            engine.backward(hf_loss(model, ids))
            engine.step()
        torch.cuda.synchronize()
    finally:
        engine.close()
    used = torch.cuda.max_memory_allocated(DEV) - base_alloc
    reserved = torch.cuda.max_memory_reserved(DEV) - base_reserved
    assert used <= plan.total("device"), (used, plan.bytes["device"])
    # the allocator rounds blocks up (2 MiB segments for large ones): a small model's plan gets
    # that granularity on top
    assert reserved <= plan.total("device") + 64 * 2**20, (reserved, plan.bytes["device"])
    assert torch.cuda.memory_stats(DEV).get("num_alloc_retries", 0) == retries0


@cuda_only
def test_inference_peak_device_memory_within_an_accepted_plan(tmp_path):
    """An accepted streaming plan under a small --gpu-memory budget runs without OOM and the
    measured peak device memory stays within what the plan said it needs."""
    out = tmp_path / "out.json"
    r = run_cli("runners.infer", "--gpu", "0", "--model", "small", "--gpu-memory", "200MiB",
                "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--dtype", "bf16",
                "--ignore-eos", "--output-json", str(out), "--offload-dir", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "device" not in set(got["plan"]["residency"]) or "cpu" in got["plan"]["residency"] \
        or "nvme" in got["plan"]["residency"], "the budget did not force streaming"
    peak = got["metrics"]["peak_device_bytes"]
    assert peak <= got["plan"]["device_need"] <= 200 * 2**20, (peak, got["plan"])


# ---- 6. one test per desk-review finding ------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_H1_accumulation_with_a_slow_landing_worker(dtype, tmp_path, monkeypatch):
    """The next micro-batch's copy must not land in staging before the worker has added the
    previous one: with the worker slowed (20 ms per gradient) the fp32 landing buffers after a
    4-micro-batch window equal the sum of the four gradients plain PyTorch computes."""
    from offload.grads import GradLanding
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
    from offload.activations import (ActivationStore, disable_activation_checkpointing,
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
    from offload import tiers
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
    from offload.grad_transport import Cuda
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
    from offload import tiers
    from offload.models import CheckpointReader
    from offload.planner import plan_inference
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
    from offload.grads import GradLanding
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
    from offload.generate import generate
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
    from offload.checkpoint import rng_state, set_rng_state
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
