"""The engine never goes silently wrong: updates where only some blocks got gradients match
torch.optim.AdamW (which skips a parameter whose .grad is None), inf/nan losses and gradients
skip the update in every dtype and stop the run after too many in a row, state holding inf/nan
is never saved or exported, and library misuse raises instead of training something else."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("hypothesis", reason="property tests need hypothesis: pip install -e '.[test]' "
                    "(the GPU machine has none; its kit is `pytest -m cuda`)")

from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import offload
from offload.train.errors import NonFiniteError, StateError
from test_engine import MLP, _cfg, max_rel_diff, mlp_batches, mlp_loss


class DropLayer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin, self.act = nn.Linear(d, d), nn.GELU()
        self.use_bias = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.lin(h) if self.use_bias else F.linear(h, self.lin.weight))


class DropMLP(MLP):
    """An MLP whose forward runs only the layers in `self.active` (LayerDrop), and in the
    layers of `self.no_bias` leaves the bias out (a parameter of a running block that gets no
    gradient, as an unused expert of a mixture-of-experts layer)."""

    def __init__(self, d_in: int = 12, d: int = 24, depth: int = 4):
        super().__init__(d_in, d, depth)
        self.layers = nn.ModuleList(DropLayer(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            layer.use_bias = i not in self.no_bias
            if i in self.active:
                h = layer(h)
        return self.out(h)


def _train_pattern(model, batches, pattern, step_fn):
    for batch, (active, no_bias) in zip(batches, pattern):
        model.active, model.no_bias = active, no_bias
        step_fn(mlp_loss(model, batch))


def _reference(model, batches, pattern, cfg):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    accum, calls = cfg.grad_accum_steps, [0]

    def step(loss):
        (loss / accum).backward()
        calls[0] += 1
        if calls[0] % accum == 0:
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad()  # set_to_none: a parameter with no gradient next time is skipped

    _train_pattern(model, batches, pattern, step)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


PATHS = {  # name -> config overrides (each a different step path)
    "none": dict(offload="none"),
    "cpu-overlapped": dict(offload="cpu"),
    "cpu-clip": dict(offload="cpu", grad_clip=0.05),
    "nvme-overlapped": dict(offload="nvme"),
    "nvme-clip-subgroups": dict(offload="nvme", grad_clip=0.05, sub_group_size=1 << 10),
    "cpu-streamed-weights": dict(offload="cpu", offload_params="cpu"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
@settings(max_examples=8, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(accum=st.sampled_from([1, 3]),
       pattern=st.lists(st.tuples(st.frozensets(st.integers(0, 3)), st.frozensets(st.integers(0, 3))),
                        min_size=12, max_size=12))
def test_blocks_without_gradients_match_torch(path, accum, pattern, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drop")
    torch.manual_seed(0)
    model = DropMLP()
    ref_model = copy.deepcopy(model)
    over = dict(PATHS[path])
    cfg = _cfg(over.pop("offload"), tmp, grad_accum_steps=accum, **over)
    batches = mlp_batches(len(pattern))
    ref = _reference(ref_model, batches, pattern, cfg)
    engine = offload.initialize(model, cfg)
    try:
        _train_pattern(model, batches, pattern, lambda loss: (engine.backward(loss), engine.step()))
        assert max_rel_diff(engine.master_params(), ref) <= 1e-6
        # the per-slot step counts survive a save and a load
        engine.save_state(str(tmp / "state"))
        skips = dict(engine.slot_skips)
    finally:
        engine.close()
    other = offload.initialize(copy.deepcopy(ref_model), cfg.replace(nvme_dir=str(tmp / "swap2")))
    try:
        other.load_state(str(tmp / "state"))
        assert other.slot_skips == skips
    finally:
        other.close()


def _nan_loss(model, batch):
    return mlp_loss(model, batch) * float("nan")


@pytest.mark.parametrize("dtype,mode", [("fp32", "cpu"), ("fp32", "nvme"), ("bf16", "cpu"),
                                        ("fp32", "none")])
def test_nonfinite_loss_skips_the_update_in_every_dtype(dtype, mode, tmp_path):
    torch.manual_seed(0)
    model = MLP()
    ref_model = copy.deepcopy(model)
    cfg = _cfg(mode, tmp_path, dtype=dtype)
    batches = mlp_batches(6)
    engine = offload.initialize(model, cfg)
    applied = []
    for i, b in enumerate(batches):
        engine.backward((_nan_loss if i == 2 else mlp_loss)(model, b))
        applied.append(engine.step())
        assert engine.last_report.nonfinite == (i == 2)
    assert applied == [True, True, False, True, True, True]
    assert engine.skipped_steps == 1 and engine.global_step == 5
    masters = engine.master_params()
    engine.close()
    if dtype == "fp32":  # the same as torch never seeing batch 2
        opt = torch.optim.AdamW(ref_model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
        for i, b in enumerate(batches):
            if i != 2:
                mlp_loss(ref_model, b).backward()
                opt.step()
                opt.zero_grad()
        assert max_rel_diff(masters, dict(ref_model.named_parameters())) <= 1e-6
    else:
        assert all(bool(torch.isfinite(t).all()) for t in masters.values())


def test_nonfinite_updates_in_a_row_stop_the_run(tmp_path):
    model = MLP()
    engine = offload.initialize(model, _cfg("cpu", tmp_path, max_nonfinite_skips=3))
    batch = mlp_batches(1)[0]
    for _ in range(2):
        engine.backward(_nan_loss(model, batch))
        assert engine.step() is False
    engine.backward(_nan_loss(model, batch))
    with pytest.raises(NonFiniteError, match="3 updates in a row skipped"):
        engine.step()
    engine.close()


def _poison(param):
    return param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))


def test_nonfinite_gradient_with_finite_loss(tmp_path):
    batches = mlp_batches(2)
    # clipping: every gradient is checked before any block is stepped -> skipped, state intact
    model = MLP()
    engine = offload.initialize(model, _cfg("cpu", tmp_path, grad_clip=1.0))
    before = engine.master_params()
    handle = _poison(model.layers[1][0].weight)
    engine.backward(mlp_loss(model, batches[0]))
    assert engine.step() is False and engine.last_report.nonfinite
    handle.remove()
    assert max_rel_diff(engine.master_params(), before) == 0
    engine.close()
    # the overlapped step has stepped later blocks already: the run stops, it does not go on
    model = MLP()
    engine = offload.initialize(model, _cfg("cpu", tmp_path))
    assert engine.overlap
    _poison(model.layers[0][0].weight)
    engine.backward(mlp_loss(model, batches[0]))
    with pytest.raises(NonFiniteError, match="overlapped step"):
        engine.step()
    engine.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_nonfinite_state_is_never_saved_or_exported(mode, tmp_path):
    model = MLP()
    engine = offload.initialize(model, _cfg(mode, tmp_path))
    engine.backward(mlp_loss(model, mlp_batches(1)[0]))
    engine.step()
    engine.save_state(str(tmp_path / "good"))
    bad = engine.optimizer_state(1)["exp_avg_sq"]
    bad[3] = float("inf")
    engine.state.load(1, "exp_avg_sq", bad)
    with pytest.raises(NonFiniteError, match="exp_avg_sq holds inf/nan"):
        engine.save_state(str(tmp_path / "bad"))
    master = engine.optimizer_state(2)["master"]
    master[0] = float("nan")
    engine.state.load(2, "master", master)
    with pytest.raises(NonFiniteError, match="master weights holds inf/nan"):
        list(engine.iter_master_params())
    engine.close()


def test_library_misuse_raises(tmp_path):
    model = MLP()
    batch = mlp_batches(1)[0]
    engine = offload.initialize(model, _cfg("cpu", tmp_path))
    with pytest.raises(RuntimeError, match="step without engine.backward"):
        engine.step()
    engine.backward(mlp_loss(model, batch))
    with pytest.raises(RuntimeError, match="backward called twice"):
        engine.backward(mlp_loss(model, batch))
    assert engine.step() and engine.global_step == 1
    with pytest.raises(RuntimeError, match="already wrapped by an open offload engine"):
        offload.initialize(model, _cfg("cpu", tmp_path))
    engine.close()
    with pytest.raises(RuntimeError, match="after close"):
        engine.step()
    again = offload.initialize(model, _cfg("cpu", tmp_path))  # closed: wrapping anew is fine
    again.close()


def test_frozen_parameters_are_not_counted_as_missing(tmp_path):
    """A frozen parameter is outside the engine's blocks: it is never a 'missing' slot."""
    model = MLP()
    model.layers[0][0].bias.requires_grad_(False)
    engine = offload.initialize(model, _cfg("cpu", tmp_path))
    engine.backward(mlp_loss(model, mlp_batches(1)[0]))
    engine.step()
    assert engine.slot_skips == {}
    engine.close()


def test_dtype_change_on_resume_is_refused(tmp_path):
    model = MLP()
    engine = offload.initialize(model, _cfg("cpu", tmp_path, dtype="fp16"))
    engine.backward(mlp_loss(model, mlp_batches(1)[0]))
    engine.step()
    engine.save_state(str(tmp_path / "s"))
    engine.close()
    other = offload.initialize(MLP(), _cfg("cpu", tmp_path, dtype="fp32"))
    with pytest.raises(StateError, match="saved with dtype 'fp16'"):
        other.load_state(str(tmp_path / "s"))
    other.close()



@pytest.mark.parametrize("mode,clip", [("cpu", 0.05), ("nvme", 0.0)])
def test_blocks_without_gradients_under_the_delayed_update(mode, clip, tmp_path):
    """The one-step delayed update with LayerDrop / unused biases against its torch reference
    (whose master optimizer skips parameters whose .grad is None)."""
    from test_delayed import reference_delayed

    import random
    rng = random.Random(1)
    pattern = [(frozenset(rng.sample(range(4), rng.randrange(5))),
                frozenset(rng.sample(range(4), rng.randrange(3)))) for _ in range(12)]
    batches = list(zip(mlp_batches(12), pattern))

    def loss_fn(model, item):
        batch, (active, no_bias) = item
        model.active, model.no_bias = active, no_bias
        return mlp_loss(model, batch)

    torch.manual_seed(0)
    model = DropMLP()
    ref_model = copy.deepcopy(model)
    cfg = _cfg(mode, tmp_path, grad_clip=clip, delayed_update=True, delayed_update_warmup=1)
    ref_masters, _, _ = reference_delayed(ref_model, batches, loss_fn, cfg=cfg, warmup=1)
    engine = offload.initialize(model, cfg)
    try:
        for item in batches:
            engine.backward(loss_fn(model, item))
            engine.step()
        assert max_rel_diff(engine.master_params(), ref_masters) <= 1e-6
    finally:
        engine.close()


def test_a_saved_state_with_a_file_of_another_save_damage_or_nan_is_refused(tmp_path):
    """Each block file of a saved state carries its tensors' CRCs and engine_state.json records
    them: a block file copied in from an older save of the same run, a flipped byte, or a NaN
    written with a fresh checksum are each refused on resume in one line (the NaN's message no
    longer sends the user back to this same checkpoint)."""
    import json
    import shutil

    from nvme.format import SafetensorsFile, read_header, write_file
    model = MLP()
    engine = offload.initialize(model, _cfg("cpu", tmp_path))
    for k, batch in enumerate(mlp_batches(3)):
        engine.backward(mlp_loss(model, batch))
        engine.step()
        engine.save_state(str(tmp_path / f"s{k}"))
    engine.close()
    block = "block-00001.safetensors"
    assert json.load(open(tmp_path / "s2" / "engine_state.json"))["files"][block]

    def resume(directory) -> None:
        other = offload.initialize(MLP(), _cfg("cpu", tmp_path))
        try:
            other.load_state(str(directory))
        finally:
            other.close()

    resume(tmp_path / "s2")  # as written: fine
    cases = {}
    for name in ("older", "flipped", "nan"):
        cases[name] = tmp_path / name
        shutil.copytree(tmp_path / "s2", cases[name])
    shutil.copy(tmp_path / "s1" / block, cases["older"] / block)
    infos, _ = read_header(cases["flipped"] / block)
    with open(cases["flipped"] / block, "r+b") as f:
        f.seek(infos["exp_avg"].offset + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with SafetensorsFile(cases["nan"] / block) as f:
        tensors = {k: f.read(k) for k in f.tensors}
    tensors["master"][3] = float("nan")
    write_file(cases["nan"] / block, tensors, {"block": "x"}, checksums=True)
    for name, msg in (("older", "not the file engine_state.json records"),
                      ("flipped", "fails its checksum"), ("nan", "not the file engine_state.json records")):
        with pytest.raises(StateError, match=msg):
            resume(cases[name])
    # a state saved before files were recorded: the NaN itself is named as damage
    meta = json.load(open(cases["nan"] / "engine_state.json"))
    del meta["files"]
    (cases["nan"] / "engine_state.json").write_text(json.dumps(meta))
    with pytest.raises(StateError, match="holds inf/nan values, which no save writes"):
        resume(cases["nan"])
