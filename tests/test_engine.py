"""The training engine against plain PyTorch: torch.optim.AdamW (+ clip_grad_norm_ and
gradient accumulation done the usual way) is the reference for every offload mode."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload.config import ConfigError, OffloadConfig

STEPS = 20


class MLP(nn.Module):
    """A non-transformer model whose repeated part is a ModuleList."""

    def __init__(self, d_in: int = 12, d: int = 24, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def mlp_batches(n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g, dtype=dtype), torch.randn(8, 1, generator=g, dtype=dtype))
            for _ in range(n)]


def mlp_loss(model, batch):
    x, y = batch
    out = model(x.to(next(model.parameters()).dtype))
    return nn.functional.mse_loss(out.float(), y.float())


def lm_batches(n: int, vocab: int, seq: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(n)]


def hf_loss(model, ids):
    out = model(ids)
    logits = (out.logits if hasattr(out, "logits") else out)[:, :-1].float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def reference_train(model, batches, loss_fn, *, lr, betas, eps, wd, clip, accum, fused=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                            fused=fused)
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        (loss / accum).backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def run_updates(engine, model, batches, loss_fn, on_update=None) -> tuple[list[float], int]:
    """engine.backward / engine.step over `batches`: (the losses, the updates applied);
    on_update(engine) after each applied update."""
    losses, applied = [], 0
    for batch in batches:
        loss = loss_fn(model, batch)
        engine.backward(loss)
        losses.append(loss.item())
        if engine.step():
            applied += 1
            if on_update is not None:
                on_update(engine)
    return losses, applied


def engine_train(model, batches, loss_fn, cfg, source=None):
    engine = offload.initialize(model, cfg, source=source)
    losses, applied = run_updates(engine, model, batches, loss_fn)
    masters = engine.master_params()
    return engine, masters, losses, applied


def max_rel_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
               for k in a)


def _cfg(mode, tmp_path, **kw):
    base = dict(offload=mode, nvme_dir=str(tmp_path / "swap") if mode == "nvme" else None,
                dtype="fp32", device="cpu", lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01,
                # bit-identical to torch.optim.AdamW: on a language model a 1-ulp difference in
                # one step grows chaotically (Adam turns near-zero gradients into +-lr steps)
                exact_optimizer=True)
    base.update(kw)
    return OffloadConfig(**base)


def _check_equivalence(make_model, batches, loss_fn, mode, tmp_path, clip, accum):
    torch.manual_seed(0)
    model = make_model()
    ref_model = copy.deepcopy(model)
    cfg = _cfg(mode, tmp_path, grad_clip=clip, grad_accum_steps=accum)
    ref, ref_losses = reference_train(ref_model, batches, loss_fn, lr=cfg.lr, betas=cfg.betas,
                                      eps=cfg.eps, wd=cfg.weight_decay, clip=clip, accum=accum)
    engine, masters, losses, applied = engine_train(model, batches, loss_fn, cfg)
    engine.close()
    assert applied == STEPS
    assert max_rel_diff(masters, ref) <= 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-5)


MODES = ["none", "cpu", "nvme"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip,accum", [(0.0, 1), (0.05, 1), (0.0, 4), (0.05, 4)])
def test_mlp_matches_torch_adamw(mode, clip, accum, tmp_path):
    _check_equivalence(MLP, mlp_batches(STEPS * accum), mlp_loss, mode, tmp_path, clip, accum)


def _tiny_llama():
    from offload.models import build_model, preset

    return build_model(preset("tiny"), device="cpu", source=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip,accum", [(0.0, 1), (0.5, 4)])
def test_tiny_llama_matches_torch_adamw(mode, clip, accum, tmp_path):
    vocab = _tiny_llama().config.vocab_size
    _check_equivalence(_tiny_llama, lm_batches(STEPS * accum, vocab), hf_loss, mode, tmp_path,
                       clip, accum)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip,accum", [(0.0, 1), (0.5, 4)])
def test_transformers_llama_matches_torch_adamw(mode, clip, accum, tmp_path):
    _check_equivalence(_hf_llama, lm_batches(STEPS * accum, 96), hf_loss, mode, tmp_path,
                       clip, accum)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_bf16_follows_fp32_loss_curve(mode, tmp_path):
    torch.manual_seed(0)
    model = MLP(d=64)
    ref_model = copy.deepcopy(model)
    batches = mlp_batches(30)
    _, ref_losses = reference_train(ref_model, batches, mlp_loss, lr=3e-3, betas=(0.9, 0.999),
                                    eps=1e-8, wd=0.0, clip=1.0, accum=1)
    engine, _, losses, _ = engine_train(model, batches, mlp_loss,
                                        _cfg(mode, tmp_path, dtype="bf16", lr=3e-3,
                                             betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1.0))
    engine.close()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # mixed-precision tolerance: each step's loss within 5% of the fp32 run's, and it falls as much
    assert losses == pytest.approx(ref_losses, rel=5e-2)
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_fp16_overflow_skips_update(mode, tmp_path):
    torch.manual_seed(0)
    model = MLP()
    engine = offload.initialize(model, _cfg(mode, tmp_path, dtype="fp16", initial_scale_power=8))
    batches = mlp_batches(3)
    engine.backward(mlp_loss(model, batches[0]))
    assert engine.step()
    scale = engine.loss_scale
    before = [engine.optimizer_state(i) for i in range(len(engine.blocks))]
    # an inf in one gradient: the hook runs before the gradient is accumulated and offloaded
    victim = model.layers[1][0].weight
    handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    engine.backward(mlp_loss(model, batches[1]))
    assert engine.step() is False
    handle.remove()
    after = [engine.optimizer_state(i) for i in range(len(engine.blocks))]
    for b, a in zip(before, after):
        for k in b:
            assert torch.equal(b[k].view(torch.int32), a[k].view(torch.int32)), k
    assert engine.loss_scale == scale / 2
    assert engine.skipped_steps == 1 and engine.global_step == 1
    engine.backward(mlp_loss(model, batches[2]))
    assert engine.step() is True and engine.global_step == 2
    changed = engine.optimizer_state(0)["master"]
    assert not torch.equal(changed, after[0]["master"])
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_fp32_on_the_cpu_keeps_no_second_copies(mode, tmp_path):
    """fp32 on the CPU device, step after backward: autograd's gradients are stepped from where
    they were made (no landing copy) and, with the masters in RAM, the parameters are views of
    the masters themselves (no second weight copy, no copy after the step) -- and the training
    is still torch.optim.AdamW's, bit for bit, on a Llama."""
    vocab = _tiny_llama().config.vocab_size
    _check_equivalence(_tiny_llama, lm_batches(STEPS, vocab), hf_loss, mode, tmp_path, 0.5, 1)
    model = _tiny_llama()
    engine = offload.initialize(model, _cfg(mode, tmp_path / "shape", grad_clip=0.5))
    try:
        assert engine.grads.adopted
        shared = mode != "nvme"  # nvme: the masters live in swap files
        masters = {engine.state.acquire(bi)[0].data_ptr() for bi in range(len(engine.blocks))} \
            if shared else set()
        assert (engine.flat16[0].data_ptr() in masters) is shared
        assert (("device", "weights") in engine.account.kind_peaks()) is not shared
        engine.backward(hf_loss(model, lm_batches(1, vocab)[0]))
        engine.step()
        moved = engine.last_report.bytes
        assert moved["d2h"] == 0  # adopted: no gradient crossed anything
        assert (moved["h2d"] == 0) is shared  # the step updated the weights themselves
    finally:
        engine.close()
    bf16 = offload.initialize(_tiny_llama(), _cfg(mode, tmp_path / "bf16", grad_clip=0.5,
                                                  dtype="bf16"))
    try:  # 16-bit weights are a copy of their own
        assert bf16.account.kind_peaks()[("device", "weights")] > 0
    finally:
        bf16.close()


def test_memory_report_and_time_split(tmp_path):
    model = MLP()
    engine = offload.initialize(model, _cfg("nvme", tmp_path, overlap_step=False))
    engine.backward(mlp_loss(model, mlp_batches(1)[0]))
    engine.step()
    rep = engine.memory_report()
    n = sum(p.numel() for p in model.parameters())
    assert rep["nvme"]["masters"] == 4 * n and rep["nvme"]["moments"] == 8 * n
    assert rep["device"]["weights"] == 4 * n
    # on the CPU device the step after backward keeps autograd's own gradients (no landing
    # copy, nothing crosses a link) until each block is stepped
    assert engine.grads.adopted and "grads" not in rep["host"]
    assert engine.account.kind_peaks()[("host", "grads")] == 4 * n
    step = engine.last_report
    assert step.bytes["d2h"] == 0 and step.bytes["h2d"] == 4 * n
    assert step.bytes["nvme_read"] == 12 * n and step.bytes["nvme_write"] == 12 * n
    assert step.forward_s > 0 and step.backward_s > 0 and step.cpu_step_s > 0
    engine.close()


def test_config_errors_are_clear():
    with pytest.raises(ConfigError, match="valid keys"):
        OffloadConfig.from_dict({"offlaod": "cpu"})
    with pytest.raises(ConfigError, match="nvme_dir"):
        OffloadConfig(offload="nvme")
    with pytest.raises(ConfigError, match="dtype"):
        OffloadConfig(dtype="int8")
    with pytest.raises(ConfigError, match="betas"):
        OffloadConfig(betas=(0.9, 1.5))


def test_deepspeed_dict(tmp_path):
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {
              "device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "buffer_count": 5}},
          "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 4},
          "bf16": {"enabled": True}, "gradient_clipping": 1.0, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95],
                                                    "eps": 1e-8, "weight_decay": 0.1}}}
    cfg = OffloadConfig.from_dict(ds)
    assert (cfg.offload, cfg.nvme_dir, cfg.buffer_count, cfg.dtype) == ("nvme", str(tmp_path), 5, "bf16")
    assert (cfg.io_block_bytes, cfg.io_queue_depth, cfg.io_threads) == (1 << 20, 8, 4)
    assert (cfg.grad_clip, cfg.grad_accum_steps, cfg.lr, cfg.betas, cfg.weight_decay) == \
        (1.0, 4, 2e-5, (0.9, 0.95), 0.1)
    with pytest.raises(ConfigError, match="offload_optimizer"):
        OffloadConfig.from_dict({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})


def test_budget_refused_up_front():
    model = MLP()
    with pytest.raises(offload.BudgetError, match="host budget"):
        offload.initialize(model, OffloadConfig(offload="cpu", device="cpu", host_budget="1KiB"))


@pytest.mark.parametrize("mode", MODES)
def test_save_and_resume_state_is_exact(mode, tmp_path):
    batches = mlp_batches(10)
    torch.manual_seed(0)
    model_a = MLP()
    model_b = copy.deepcopy(model_a)
    model_c = copy.deepcopy(model_a)
    eng_a, masters_a, losses_a, _ = engine_train(model_a, batches, mlp_loss, _cfg(mode, tmp_path / "a"))
    eng_a.close()
    eng_b, _, losses_b1, _ = engine_train(model_b, batches[:5], mlp_loss, _cfg(mode, tmp_path / "b"))
    eng_b.save_state(str(tmp_path / "ckpt"))
    eng_b.close()
    eng_c = offload.initialize(model_c, _cfg(mode, tmp_path / "c"))
    eng_c.load_state(str(tmp_path / "ckpt"))
    losses_c = []
    for batch in batches[5:]:
        loss = mlp_loss(model_c, batch)
        eng_c.backward(loss)
        losses_c.append(loss.item())
        eng_c.step()
    assert losses_b1 + losses_c == losses_a
    masters_c = eng_c.master_params()
    assert all(torch.equal(masters_c[k], masters_a[k]) for k in masters_a)
    other = offload.initialize(MLP(d=16), _cfg(mode, tmp_path / "d"))
    with pytest.raises(offload.train.engine.StateError, match="different model"):
        other.load_state(str(tmp_path / "ckpt"))
    eng_c.close()
    other.close()


def test_pooled_gradient_landing_bounds_host_grads(tmp_path):
    """With the overlapped step and no accumulation, gradient landing buffers come from a pool
    of block-sized buffers: host memory for gradients stops growing with depth. Exact results
    with torch.optim.AdamW through the pool and the lazily made non-layer buffer."""
    model = MLP(depth=12)
    ref_model = copy.deepcopy(model)
    batches = mlp_batches(5)
    cfg = _cfg("cpu", tmp_path, buffer_count=3)
    engine, masters, _, _ = engine_train(model, batches, mlp_loss, cfg)
    largest = max(b.numel for b in engine.blocks if b.module is not None)
    rest = [i for i, b in enumerate(engine.blocks) if b.module is None]
    # between steps only the pool is held: the non-layer block's buffer (gradients from the
    # CPU) is made when its first gradient lands and freed after its step
    assert engine.grads.pooled and engine.memory_report()["host"]["grads"] == 3 * largest * 4
    assert rest and all(engine.grads.landing[i] is None for i in rest)
    engine.close()
    ref, _ = reference_train(ref_model, batches, mlp_loss, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             wd=cfg.weight_decay, clip=0.0, accum=1)
    assert max_rel_diff(masters, ref) <= 1e-6


@pytest.mark.parametrize("overlap", [True, False])
def test_nvme_sub_groups_match_torch_adamw(overlap, tmp_path):
    """Blocks larger than sub_group_size are swapped and stepped in sub-groups (staging memory
    bounded by the sub-group): the result is still torch.optim.AdamW's."""
    model = MLP(d=64)
    ref_model = copy.deepcopy(model)
    batches = mlp_batches(6)
    cfg = _cfg("nvme", tmp_path, sub_group_size=1500, overlap_step=overlap, buffer_count=2)
    engine, masters, _, _ = engine_train(model, batches, mlp_loss, cfg)
    assert max(len(engine.state.units_of(i)) for i in range(len(engine.blocks))) >= 3
    assert engine.memory_report()["host"]["buffers"] == 2 * 12 * max(engine.state.unit_numel)
    engine.close()
    ref, _ = reference_train(ref_model, batches, mlp_loss, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             wd=cfg.weight_decay, clip=0.0, accum=1)
    assert max_rel_diff(masters, ref) <= 1e-6


def test_fp32_norm_of_16bit_gradients_is_chunked_and_exact_for_fp32():
    """A 16-bit gradient's fp32 norm is taken a chunk at a time (no whole fp32 copy of a tied
    embedding's gradient mid-backward), at least as accurate as the one-call fp32 norm (against
    fp64); fp32 input goes through the single call clip_grad_norm_ uses, bit for bit."""
    from offload.grads.landing import NORM_CHUNK, fp32_norm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * NORM_CHUNK + 5, generator=g)
    assert torch.equal(fp32_norm(x), torch.linalg.vector_norm(x))
    for dtype in (torch.bfloat16, torch.float16):
        h = x.to(dtype)
        got, one_call = fp32_norm(h), torch.linalg.vector_norm(h, dtype=torch.float32)
        exact = h.double().norm().item()
        assert got.dtype == torch.float32
        assert abs(got.item() - exact) <= max(abs(one_call.item() - exact), 1e-6 * exact)
