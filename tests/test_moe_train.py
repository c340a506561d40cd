"""Training mixtures of experts (issue 37) against transformers and torch.optim.AdamW:

- full fine-tuning of small random Qwen3-MoE, Mixtral and OLMoE checkpoints (tests/families.py
  MOE_FAMILIES: 8 experts, top-2), fp32, 10 updates by the engine with the optimizer state on
  the device, in RAM and in NVMe swap files and with the weights streamed (RAM, NVMe), equal
  torch's AdamW on transformers' own model (fused 3-D expert tensors) within 1e-6, masters and
  losses, with updates where some experts get no tokens (checked: transformers' gradient of
  those experts is zero, and torch steps them), with clipping and accumulation;
- the same on a model with one module per expert ("skip": torch skips an expert without a
  gradient), against torch's AdamW on that model;
- the routers' load-balancing loss (output_router_logits) equal to transformers' and trained
  with (its gradient reaches the routers); refused in one line where it cannot be right.

lr 1e-4 and eps 1e-5: with renormalised top-k (Qwen3-MoE here, Mixtral always) the gradient
of an unchosen expert's router row is zero but for rounding, and Adam turns rounding noise
into +-lr steps at eps 1e-8: transformers' own two expert kernels ("eager", "grouped_mm") end
3e-6 apart at lr 1e-5 and 3e-4 apart at 1e-4 (measured), so 1e-6 would test rounding, not
training. A larger eps keeps noise-sized gradients' steps small and leaves real ones as they
are (at 1e-6 OLMoE with its aux loss still ended 1.6e-6 apart, at 1e-5 1e-7); the test checks
the updates moved the weights 1000x the tolerance. The reference computes experts with
transformers' "eager" kernel, which our forward equals to the bit (tests/test_moe.py); one
intra-op thread (see one_thread).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import VOCAB, random_family_model, save_family_checkpoint  # noqa: E402
from offload.models import CheckpointError, ConfigError, load_model  # noqa: E402
from offload.models.families import moe_names  # noqa: E402
from offload.models.router_loss import RouterLogits, router_logits_for  # noqa: E402
from offload.train.experts import set_untouched_experts  # noqa: E402
from test_engine import _cfg, hf_loss, lm_batches, max_rel_diff  # noqa: E402

UPDATES, SEQ = 10, 5  # 2 rows x 5 tokens x top-2 over 8 experts: some get none
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.99), 1e-5, 0.01
TOLERANCE = 1e-6
NAMES = ("qwen3_moe", "mixtral", "olmoe")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds waits, and on a machine whose
    cores are busy OpenMP's spinning threads made each step 40x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(name, aux) -> the directory of that family's random checkpoint; `aux`: its config.json
    turns the routers' auxiliary loss on (output_router_logits), as a training config may."""
    root = tmp_path_factory.mktemp("moe_train")
    made: dict[tuple[str, bool], str] = {}

    def get(name: str, aux: bool = False) -> str:
        if (name, aux) not in made:
            path = root / f"{name}{'-aux' if aux else ''}"
            save_family_checkpoint(name, path)
            if aux:
                cfg = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({**cfg, "output_router_logits": True}))
            made[(name, aux)] = str(path)
        return made[(name, aux)]
    return get


def hf_model(name: str, aux: bool = False):
    """transformers' model of the family case, experts on its "eager" kernel, the auxiliary
    loss on when `aux` (as its config would turn it on)."""
    hf = random_family_model(name)
    hf.set_experts_implementation("eager")
    hf.config.output_router_logits = aux
    return hf


def hf_train_loss(hf, ids: torch.Tensor) -> torch.Tensor:
    """The language-model loss (+ router_aux_loss_coef x aux when the config asks for it), as
    transformers' forward with labels adds them."""
    out = hf(ids)
    loss = hf_loss(lambda _: out, ids)
    if hf.config.output_router_logits:
        loss = loss + hf.config.router_aux_loss_coef * out.aux_loss
    return loss


def our_loss(recorder: RouterLogits | None):
    """Our model's training loss: the same, the aux loss taken from `recorder`."""
    def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
        loss = hf_loss(model, ids)
        return loss if recorder is None else loss + recorder.coef * recorder.aux_loss()
    return loss_fn


def train(model, data, loss_fn, *, clip: float, accum: int, count_zero: bool = False):
    """torch.optim.AdamW on `model`: (parameters after, losses, how many (update, expert)
    pairs got an all-zero gradient: fused experts without tokens)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, zero = [], 0
    for i, ids in enumerate(data):
        loss = loss_fn(model, ids)
        (loss / accum).backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            if count_zero:
                zero += sum(int(not g.any()) for n, p in model.named_parameters()
                            if n.endswith("experts.down_proj") for g in p.grad)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, zero


@functools.lru_cache(maxsize=None)
def reference(name: str, clip: float, accum: int, aux: bool):
    return train(hf_model(name, aux), lm_batches(UPDATES * accum, VOCAB, seq=SEQ), hf_train_loss,
                 clip=clip, accum=accum, count_zero=True)


def fused(masters: dict[str, torch.Tensor], model, hf) -> dict[str, torch.Tensor]:
    """Our masters under transformers' in-memory names and shapes: each layer's experts as
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and `down_proj` [E, H, I], the
    router as `mlp.gate.weight` (Mixtral's module is `block_sparse_moe` here)."""
    module, (gate, up, down) = moe_names(model.config.architecture)
    E, out = model.config.num_experts, {}
    for n, _ in hf.named_parameters():
        layer, _, rest = n.partition(".mlp.")
        ours = f"{layer}.{module}.{rest}"
        if rest == "experts.gate_up_proj":
            out[n] = torch.stack([torch.cat([masters[f"{layer}.{module}.experts.{e}.{gate}.weight"],
                                             masters[f"{layer}.{module}.experts.{e}.{up}.weight"]])
                                  for e in range(E)])
        elif rest == "experts.down_proj":
            out[n] = torch.stack([masters[f"{layer}.{module}.experts.{e}.{down}.weight"] for e in range(E)])
        else:
            out[n] = masters[ours if rest else n]
    return out


def engine_run(model, data, loss_fn, cfg):
    """offload.initialize and the usual loop: (masters, losses, the engine's last report,
    slot_skips), the engine closed."""
    import offload
    engine = offload.initialize(model, cfg)
    losses, applied = [], 0
    try:
        for ids in data:
            loss = loss_fn(model, ids)
            engine.backward(loss)
            losses.append(loss.item())
            applied += engine.step()
        assert applied == len(data) // cfg.grad_accum_steps
        return engine.master_params(), losses, engine.last_report, dict(engine.slot_skips)
    finally:
        engine.close()


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# ---- fused experts: an expert without tokens has a zero gradient, and torch steps it ------------
# (family, optimizer state, streamed weights, clip, accumulation, router aux loss)
FULL = [(name, mode, params, clip, accum, aux)
        for i, name in enumerate(NAMES)
        for j, (mode, params) in enumerate([("none", "none"), ("cpu", "none"), ("nvme", "none"),
                                            ("cpu", "cpu"), ("nvme", "nvme")])
        for clip, accum, aux in [[(0.0, 1, False), (0.5, 2, False), (0.5, 1, True)][(i + j) % 3]]]


@pytest.mark.parametrize("name,mode,params,clip,accum,aux", FULL,
                         ids=["-".join(map(str, c)) for c in FULL])
def test_full_fine_tuning_equals_adamw_on_transformers_fused_experts(name, mode, params, clip, accum,
                                                                     aux, checkpoint, tmp_path):
    model = load_model(checkpoint(name, aux))
    recorder = router_logits_for(model)
    assert (recorder is not None) == aux
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _cfg(mode, tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=clip,
               grad_accum_steps=accum, offload_params=params, nvme_dir=str(tmp_path / "swap"))
    data = lm_batches(UPDATES * accum, VOCAB, seq=SEQ)
    masters, losses, report, skips = engine_run(model, data, our_loss(recorder), cfg)
    if params != "none":  # the layers really were streamed
        assert report.bytes["stream_h2d"] + report.bytes["stream_disk"] > 0
    assert not skips  # nothing skipped: fused experts without tokens are stepped
    ref, ref_losses, zero = reference(name, clip, accum, aux)
    assert zero > 0  # some updates had experts without tokens
    hf = hf_model(name)
    assert max_rel_diff(fused(masters, model, hf), ref) <= TOLERANCE
    assert max_rel(losses, ref_losses) <= TOLERANCE
    assert max_rel_diff(fused(start, model, hf), ref) > 1000 * TOLERANCE  # the updates moved them


# ---- one module per expert: an expert without tokens has no gradient, and torch skips it -------
@pytest.mark.parametrize("name,mode,params", [("qwen3_moe", "cpu", "none"), ("mixtral", "nvme", "nvme"),
                                              ("olmoe", "none", "cpu")])
def test_one_module_per_expert_equals_adamw_skipping_experts_without_tokens(name, mode, params,
                                                                            checkpoint, tmp_path):
    model = load_model(checkpoint(name))
    assert set_untouched_experts(model, "skip") == model.config.num_hidden_layers
    reference_model = copy.deepcopy(model)  # plain torch on the same ModuleList model
    data = lm_batches(UPDATES, VOCAB, seq=SEQ)
    ref, ref_losses, _ = train(reference_model, data, hf_loss, clip=0.5, accum=1)
    cfg = _cfg(mode, tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.5,
               offload_params=params, nvme_dir=str(tmp_path / "swap"))
    masters, losses, _, skips = engine_run(model, data, hf_loss, cfg)
    assert skips and all(".experts." in n for n in skips)  # experts without tokens were skipped
    assert max_rel_diff(masters, ref) <= TOLERANCE
    assert max_rel(losses, ref_losses) <= TOLERANCE
    with pytest.raises(ValueError, match="must be one of step, skip"):
        set_untouched_experts(model, "zero")


# ---- the routers' auxiliary loss ----------------------------------------------------------------
@pytest.mark.parametrize("name", [*NAMES, "gpt_oss"])
def test_router_aux_loss_equals_transformers(name, checkpoint):
    """Value equal to transformers' aux_loss (output_router_logits from the config), its
    coefficient the config's; the router weights get its gradient; an evaluation forward
    records nothing."""
    model = load_model(checkpoint(name, aux=True))
    recorder = router_logits_for(model)
    hf = hf_model(name, aux=True)
    ids = lm_batches(1, VOCAB, seq=9)[0]
    want = hf(ids).aux_loss
    model(ids)
    got = recorder.aux_loss()
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    assert recorder.coef == hf.config.router_aux_loss_coef
    got.backward()
    routers = [p.grad for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight"))
               and ".experts." not in n]
    assert routers and all(g is not None and g.abs().sum() > 0 for g in routers)
    with torch.no_grad():
        model(ids)
    with pytest.raises(RuntimeError, match="call aux_loss once after each forward"):
        recorder.aux_loss()
    recorder.close()
    assert all(m.record_logits is None for m in recorder.moes)
    assert router_logits_for(load_model(checkpoint(name))) is None  # off in the plain config


def test_router_aux_loss_refusals(checkpoint, tmp_path):
    """Activation checkpointing drops the logits' gradient (one line, not silently untrained);
    DeepSeek-V3's config refuses output_router_logits (transformers has no aux loss there)."""
    import offload
    model = load_model(checkpoint("olmoe", aux=True))
    recorder = router_logits_for(model)
    engine = offload.initialize(model, _cfg("cpu", tmp_path, activation_checkpointing=True))
    try:
        model(lm_batches(1, VOCAB, seq=SEQ)[0])
        with pytest.raises(ConfigError, match="activation checkpointing drops") as e:
            recorder.aux_loss()
        assert "\n" not in str(e.value)
    finally:
        engine.close()
    path = Path(tmp_path / "ds")
    save_family_checkpoint("deepseek_v3", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "output_router_logits": True}))
    with pytest.raises(CheckpointError, match="DeepSeek-V3 has no auxiliary loss"):
        load_model(path)
