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


def device_memory_mark() -> tuple[int, int, int]:
    """(allocated, reserved, allocator retries so far) on DEV, after a sync, an emptied cache and
    a reset peak: what a peak-memory test measures from."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(DEV)
    return (torch.cuda.memory_allocated(DEV), torch.cuda.memory_reserved(DEV),
            torch.cuda.memory_stats(DEV).get("num_alloc_retries", 0))


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
    from offload.infer.generate import generate
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
    from offload.train.plan import llama_activation_estimate, plan_training

    torch.manual_seed(0)
    model = tiny_llama()
    micro, seq = 4, 64
    batches = [torch.randint(0, 1024, (micro, seq), device=DEV) for _ in range(4)]
    cfg = cfg_for(tmp_path, dtype="bf16", **kw)
    base_alloc, base_reserved, retries0 = device_memory_mark()
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
