"""OffloadAdamW (offload/train/torch_optim.py) inside the loops people already train in --
Hugging Face Trainer, Accelerate, a plain torch loop -- each against the same loop with
torch.optim.AdamW: fp32 parameters within 1e-6 (here: bit for bit, the exact kernel), with
clipping, accumulation, a cosine schedule with warmup and Trainer's weight-decay groups; a
checkpoint resumes exactly; what cannot be served is refused in one line."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments, get_cosine_schedule_with_warmup  # noqa: E402

from conftest import ram_swap_dir  # noqa: E402
from offload import OffloadAdamW  # noqa: E402
from offload.config import ConfigError, OffloadConfig  # noqa: E402
from offload.train.errors import StateError  # noqa: E402
from test_engine import hf_loss, lm_batches, max_rel_diff  # noqa: E402

MODES = ["cpu", "nvme"]
VOCAB, SEQ, UPDATES, ACCUM = 96, 16, 10, 2
LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-6, 1.0


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).float()


def lm_rows(n: int, vocab: int = VOCAB, seq: int = SEQ, seed: int = 0) -> list[dict]:
    """A causal-LM data set Trainer takes as it is: rows of input_ids and labels."""
    return [{"input_ids": ids[0], "labels": ids[0].clone()}
            for ids in lm_batches(n, vocab, seq, seed)]


def training_args(out, **kw) -> TrainingArguments:
    """Trainer's settings for every run here: clipping at 1.0, two micro-batches per update, a
    cosine schedule after 3 warm-up updates, decay 0.1 on Trainer's decay group."""
    base = dict(output_dir=str(out), per_device_train_batch_size=2,
                gradient_accumulation_steps=ACCUM, max_steps=UPDATES, learning_rate=LR,
                weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
                max_grad_norm=CLIP, lr_scheduler_type="cosine", warmup_steps=3, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_num_workers=0, optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def swap_options(mode: str, where) -> dict:
    return dict(offload=mode, nvme_dir=str(where) if mode == "nvme" else None,
                exact_optimizer=True)  # bit for bit: see tests/test_engine.py _cfg


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_with(model, args, data, optimizers=(None, None), resume=None):
    """Trainer.train(); returns (the model's parameters after, Trainer's log lines)."""
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers)
    trainer.train(resume_from_checkpoint=resume)
    return weights(model), [h for h in trainer.state.log_history if "grad_norm" in h]


def check_equal(got: dict, ref: dict, opt: OffloadAdamW | None = None) -> None:
    """The model's parameters (and the optimizer's fp32 masters) equal the reference's."""
    assert max_rel_diff(got, ref) <= 1e-6
    if opt is not None:
        assert max_rel_diff(opt.engine.master_params(), ref) <= 1e-6


@pytest.fixture(scope="module")
def torch_trainer_run(tmp_path_factory):
    """The reference: Trainer with its own torch.optim.AdamW (optim="adamw_torch"), which it
    builds with its weight-decay groups and drives with its cosine schedule."""
    out = tmp_path_factory.mktemp("torch-trainer")
    return train_with(tiny_llama(), training_args(out), lm_rows(UPDATES * ACCUM * 2))


@pytest.mark.parametrize("mode", MODES)
def test_trainer_equals_torch_adamw_and_resumes_exactly(mode, torch_trainer_run, tmp_path):
    ref, ref_logs = torch_trainer_run
    data = lm_rows(UPDATES * ACCUM * 2)
    args = training_args(tmp_path / "run", save_strategy="steps", save_steps=5)
    model = tiny_llama()
    opt = OffloadAdamW.from_training_args(model, args, **swap_options(mode, tmp_path / "swap"))
    # Trainer's groups: the norms in the group without decay
    assert [g["weight_decay"] for g in opt.param_groups] == [WD, 0.0]
    assert any("norm" in opt._order[i] for i in range(len(opt.param_groups[0]["params"]),
                                                       len(opt._order)))
    if mode == "cpu":  # the schedule passed in (else Trainer builds the same one)
        optimizers = (opt, get_cosine_schedule_with_warmup(opt, 3, UPDATES))
    else:
        optimizers = (opt, None)
    got, logs = train_with(model, args, data, optimizers)
    check_equal(got, ref, opt)
    # clip_grad_norm_ returned the true global norm (Trainer logs it), and it clipped
    assert [h["grad_norm"] for h in logs] == [h["grad_norm"] for h in ref_logs]
    assert [h["loss"] for h in logs] == [h["loss"] for h in ref_logs]
    assert sum(h["grad_norm"] > CLIP for h in logs) >= 3
    assert len({h["learning_rate"] for h in logs}) == UPDATES  # the schedule drove the groups
    opt.close()
    # a fresh model and optimizer resume from update 5's checkpoint to the same parameters
    model = tiny_llama()
    opt = OffloadAdamW.from_training_args(model, args, **swap_options(mode, tmp_path / "swap2"))
    resumed, logs = train_with(model, training_args(tmp_path / "resumed"), data, (opt, None),
                               resume=str(tmp_path / "run" / "checkpoint-5"))
    check_equal(resumed, ref, opt)
    # its log: the checkpoint's 5 lines, then 5 new ones
    assert [(h["loss"], h["grad_norm"]) for h in logs] == \
        [(h["loss"], h["grad_norm"]) for h in ref_logs]
    opt.close()


def fresh_accelerator(**kw):
    """An Accelerator of its own settings (Accelerate keeps its state in process singletons,
    which an earlier Trainer in this process set up)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kw)


def accelerate_loop(model, opt) -> tuple[dict, list[float]]:
    """Accelerate's documented loop: prepare, accumulate, backward, clip_grad_norm_ at the
    window's end, step / schedule / zero_grad every micro-batch (it skips them inside)."""
    accelerator = fresh_accelerator(gradient_accumulation_steps=ACCUM)
    loader = torch.utils.data.DataLoader(lm_rows(UPDATES * ACCUM * 2), batch_size=2)
    sched = get_cosine_schedule_with_warmup(opt, 3, UPDATES)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    norms = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return weights(model), norms


def test_accelerate_loop_equals_torch_adamw(tmp_path):
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    ref, ref_norms = accelerate_loop(ref_model, torch.optim.AdamW(
        ref_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD))
    opt = OffloadAdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       **swap_options("cpu", None))
    got, norms = accelerate_loop(model, opt)
    check_equal(got, ref, opt)
    assert norms == ref_norms and len(norms) == UPDATES and max(norms) > CLIP
    opt.close()


def grouped(model) -> list[dict]:
    """Two groups of their own lr and weight decay (the layers; the rest at half the lr)."""
    layers = [p for n, p in model.named_parameters() if ".layers." in n]
    rest = [p for n, p in model.named_parameters() if ".layers." not in n]
    return [{"params": layers, "weight_decay": WD}, {"params": rest, "lr": LR / 2,
                                                     "weight_decay": 0.02}]


def torch_schedule(opt):
    """torch's own schedulers: 3 linear warm-up updates, then cosine."""
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.1, total_iters=3),
                                    sched.CosineAnnealingLR(opt, T_max=UPDATES - 3)],
                              milestones=[3])


def plain_loop(model, opt, batches, clip=0.3) -> list[float]:
    """loss.backward() per micro-batch, clip_grad_norm_, step, schedule, zero_grad."""
    sched, norms = torch_schedule(opt), []
    for i, ids in enumerate(batches):
        (hf_loss(model, ids) / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return norms


@pytest.mark.parametrize("mode", MODES)
def test_plain_torch_loop_equals_torch_adamw(mode, tmp_path):
    """Per-group lr and weight decay, torch's schedulers, clip_grad_norm_ (returning the same
    norm; the gradients never stay on the parameters)."""
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    batches = lm_batches(UPDATES * ACCUM, VOCAB)
    ref_norms = plain_loop(ref_model, torch.optim.AdamW(grouped(ref_model), lr=LR, betas=BETAS,
                                                         eps=EPS), batches)
    opt = OffloadAdamW(model, grouped(model), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       **swap_options(mode, tmp_path / "swap"))
    assert plain_loop(model, opt, batches) == ref_norms
    assert all(p.grad is None for p in model.parameters())
    check_equal(weights(model), weights(ref_model), opt)
    opt.close()


class Branchy(torch.nn.Module):
    """A model whose `side` layer takes part only when asked: no gradient in other windows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.side = torch.nn.Linear(8, 8)

    def forward(self, x, side: bool):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (self.side(x) if side else x).square().mean()


def test_closure_and_parameters_without_gradients_as_torch(tmp_path):
    """step(closure) as torch.optim's (the closure zeroes, computes, backwards); a layer left
    out of some windows is not stepped in them (torch skips a None .grad), and a step() with
    no gradient at all changes nothing."""
    model = Branchy()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD)
    opt = OffloadAdamW.from_config(model, OffloadConfig(  # a whole config (the model's dtype)
        dtype="fp32", lr=LR, weight_decay=WD, **swap_options("nvme", tmp_path / "swap")))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(6)]
    for i, x in enumerate(xs):
        losses = []
        for m, o in ((ref_model, ref_opt), (model, opt)):
            def closure():
                o.zero_grad()
                loss = m(x, side=i % 3 == 0)
                loss.backward()
                return loss
            losses.append(o.step(closure))
        assert torch.equal(*losses)
        before = opt.engine.master_params()
        opt.step()  # nothing landed since the last step
        assert all(torch.equal(v, opt.engine.master_params()[k]) for k, v in before.items())
    check_equal(weights(model), weights(ref_model), opt)
    assert opt.engine.slot_skips["side.weight"] == 4
    opt.close()


def few_updates(model, opt, batches) -> None:
    for ids in batches:
        hf_loss(model, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("saved_in,loaded_in", [("cpu", "nvme"), ("nvme", "cpu")])
def test_state_dict_is_torch_adamws_layout_and_resumes_in_any_tier(saved_in, loaded_in, tmp_path):
    batches = lm_batches(6, VOCAB)
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(grouped(ref_model), lr=LR, betas=BETAS, eps=EPS)
    opt = OffloadAdamW(model, grouped(model), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       **swap_options(saved_in, tmp_path / "swap"))
    assert opt.state_dict()["state"] == {}  # nothing but the weights before the first update
    few_updates(ref_model, ref_opt, batches[:3])
    few_updates(model, opt, batches[:3])
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")  # what Trainer does
    opt.close()
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    ref_sd = ref_opt.state_dict()
    assert [{k: v for k, v in g.items() if k in ("params", "lr", "weight_decay", "betas")}
            for g in saved["param_groups"]] == \
        [{k: v for k, v in g.items() if k in ("params", "lr", "weight_decay", "betas")}
         for g in ref_sd["param_groups"]]
    names = [n for g in grouped(ref_model) for n, p in ref_model.named_parameters()
             if any(p is q for q in g["params"])]
    ref_params = weights(ref_model)
    for i, name in enumerate(names):
        ours, theirs = saved["state"][i], ref_sd["state"][i]
        assert float(ours["step"]) == float(theirs["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):
            assert max_rel_diff({k: ours[k]}, {k: theirs[k]}) <= 1e-6
        assert max_rel_diff({name: ours["master"]}, {name: ref_params[name]}) <= 1e-6
    # a fresh model and optimizer in the other tier go on from there as torch does
    model = tiny_llama()
    opt = OffloadAdamW(model, grouped(model), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       **swap_options(loaded_in, tmp_path / "swap2"))
    opt.load_state_dict(saved)
    check_equal(weights(model), ref_params)  # the weights follow the masters
    few_updates(ref_model, ref_opt, batches[3:])
    few_updates(model, opt, batches[3:])
    check_equal(weights(model), weights(ref_model), opt)
    opt.close()


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and len(msg) > 40, msg
    return msg


def test_load_state_dict_refuses_what_it_cannot_resume(tmp_path):
    model = Branchy()
    opt = OffloadAdamW(model, lr=LR)
    x = torch.randn(4, 8)
    model(x, side=True).backward()
    opt.step()
    good = opt.state_dict()
    torch_sd = torch.optim.AdamW(model.parameters()).state_dict()
    damaged = copy.deepcopy(good)
    damaged["state"][0]["exp_avg"][0, 0] = float("nan")
    short = copy.deepcopy(good)
    del short["state"][1]
    fresh = Branchy()
    regrouped = OffloadAdamW(fresh, [{"params": list(fresh.layers.parameters())},
                                     {"params": list(fresh.side.parameters())}], lr=LR)
    for bad, what in ((torch_sd, "no 'offload' entry"), (damaged, "exp_avg of 'layers.0.weight'"),
                      (short, "layers.0.bias"), ([1, 2], "not an OffloadAdamW state_dict")):
        with pytest.raises(StateError) as e:
            opt.load_state_dict(bad)
        assert what in one_line(e)
    with pytest.raises(StateError) as e:
        regrouped.load_state_dict(good)
    assert "parameter groups of [8] parameters, this optimizer [6, 2]" in one_line(e)
    for o in (opt, regrouped):
        o.close()


def test_what_it_cannot_serve_is_refused_in_one_line(tmp_path):
    from loopback_pg import loopback_world
    real_clip = torch.nn.utils.clip_grad_norm_
    x = torch.randn(4, 8)

    def built(**kw):
        return OffloadAdamW(Branchy(), lr=LR, **kw)

    def landed(opt):
        opt.engine.module(x, side=True).backward()
        return opt

    def params(opt):
        return list(opt.engine.module.parameters())

    def frozen():
        m = Branchy()
        m.side.bias.requires_grad_(False)
        return OffloadAdamW(m, m.parameters())

    def mixed():
        m = Branchy()
        m.side.to(torch.float64)
        return OffloadAdamW(m)

    def in_ranks():
        with loopback_world():
            return built()

    def scaled(opt):
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(opt.engine.module(x, side=True)).backward()
        scaler.step(opt)

    def clipped_twice(opt):
        torch.nn.utils.clip_grad_norm_(params(opt), 1.0)
        torch.nn.utils.clip_grad_norm_(params(opt), 1.0)

    def backward_after_clip(opt):
        torch.nn.utils.clip_grad_norm_(params(opt), 1.0)
        landed(opt)

    def group_option(key, value):
        def change(opt):
            opt.param_groups[0][key] = value
            opt.step()
        return change

    fp16_args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    fp16_args.fp16 = True  # as Trainer(fp16=True) on a GPU would have it
    building = [  # (what builds it, exception, what the line says)
        (lambda: OffloadAdamW(Branchy().half()), ConfigError, "dtype='fp16' is not served"),
        (lambda: built(dtype="fp16"), ConfigError, "dtype='fp16' is not served"),
        (lambda: built(delayed_update=True), ConfigError, "delayed_update is not served"),
        (lambda: built(speculative_step=True, grad_clip=1.0), ConfigError,
         "speculative_step is not served"),
        (lambda: built(overlap_step=True), ConfigError, "leave overlap_step out"),
        (lambda: built(grad_accum_steps=4), ConfigError, "leave grad_accum_steps out"),
        (lambda: built(bogus=1), ConfigError, "unknown option(s) bogus"),
        (lambda: OffloadAdamW.from_config(Branchy(), OffloadConfig(dtype="fp32",
                                                                   grad_accum_steps=4)),
         ConfigError, "leave grad_accum_steps out"),
        (lambda: OffloadAdamW(list(Branchy().parameters())), TypeError, "needs the model"),
        (frozen, ConfigError, "'side.bias' does not require grad"),
        (lambda: OffloadAdamW(Branchy(), [torch.nn.Parameter(torch.ones(2))]), ConfigError,
         "not one of the model's"),
        (lambda: OffloadAdamW(Branchy(), Branchy().layers.parameters()), ConfigError,
         "not one of the model's"),
        (mixed, ConfigError, "pass dtype='bf16' or 'fp32'"),
        (in_ranks, ConfigError, "OffloadAdamW runs in one process"),
        (lambda: OffloadAdamW.from_training_args(Branchy(), fp16_args), ConfigError,
         "a GradScaler steps this OffloadAdamW"),
    ]
    for make, exc, says in building:
        with pytest.raises(exc) as e:
            make()
        assert says in one_line(e), says
    m = Branchy()
    with pytest.raises(ConfigError) as e:
        OffloadAdamW(m, m.layers.parameters())
    assert "2 trainable parameter(s) in no group (side.bias, side.weight" in one_line(e)
    using = [  # (what is done to an open optimizer with gradients landed, exception, says)
        (lambda o: o.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]}),
         ConfigError, "cannot take parameter groups after construction"),
        (lambda o: torch.nn.utils.clip_grad_norm_(params(o)[:2], 1.0), ConfigError,
         "clip_grad_norm_ over 2 of this OffloadAdamW's 8 parameters"),
        (lambda o: torch.nn.utils.clip_grad_norm_(params(o), 1.0, norm_type=1), ConfigError,
         "clips by the L2 norm only"),
        (clipped_twice, RuntimeError, "clip_grad_norm_ called twice before step()"),
        (backward_after_clip, RuntimeError, "a backward after clip_grad_norm_"),
        (group_option("betas", (0.8, 0.9)), ConfigError, "per-group values of these"),
        (group_option("lr", -1.0), ConfigError, "must be finite numbers >= 0"),
        (scaled, ConfigError, "a GradScaler steps this OffloadAdamW"),
    ]
    for act, exc, says in using:
        opt = landed(built())
        with pytest.raises(exc) as e:
            act(opt)
        assert says in one_line(e), says
        opt.close()
    clipping = landed(built(grad_clip=0.5))
    with pytest.raises(ConfigError) as e:
        torch.nn.utils.clip_grad_norm_(params(clipping), 1.0)
    assert "built with grad_clip=0.5: it clips at every step already" in one_line(e)
    # Trainer(max_grad_norm=0) still asks for the norm, with max_norm=inf: that is served
    assert torch.isfinite(torch.nn.utils.clip_grad_norm_(params(clipping), float("inf")))
    # while it is open, torch's function still clips anything else as torch does
    other = torch.nn.Linear(3, 3)
    other(torch.ones(1, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in other.parameters()]))
    assert torch.equal(torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1), want)
    clipping.close()
    assert torch.nn.utils.clip_grad_norm_ is real_clip  # torch's own again once all are closed
    with pytest.raises(RuntimeError) as e:
        clipping.step()
    assert "used after close()" in str(e.value)


def chat_rows(tokenizer_dir, n: int, seq: int) -> list[dict]:
    """The README's chat data (scripts/make_chat_example.py), as Trainer takes it: each
    conversation through the model's chat template, cut to `seq` tokens."""
    from transformers import AutoTokenizer

    from conftest import load_script
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = load_script("make_chat_example").chat_rows()[:n]
    out = []
    for r in rows:
        ids = tok.apply_chat_template(r["messages"], return_tensors="pt",
                                      return_dict=True)["input_ids"][0, :seq]
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def test_trainer_on_smollm2_equals_torch_adamw(smollm2_hf, tmp_path):
    """The real checkpoint (SmolLM2-135M-Instruct, tied embeddings) under Trainer, in the cpu
    and nvme tiers: its parameters after 4 updates (short: 135M parameters, torch's AdamW step
    alone is most of the cost) equal Trainer with torch.optim.AdamW's."""
    from transformers import AutoModelForCausalLM

    updates = 4
    data = chat_rows(smollm2_hf, updates * ACCUM, 16)
    args = training_args(tmp_path / "run", per_device_train_batch_size=1, learning_rate=1e-4,
                         max_steps=updates, warmup_steps=1)

    def model():
        return AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)

    ref, ref_logs = train_with(model(), args, data)
    for mode in MODES:
        swap = ram_swap_dir(tmp_path)
        try:
            m = model()
            opt = OffloadAdamW.from_training_args(m, args, **swap_options(mode, swap))
            got, logs = train_with(m, args, data, (opt, None))
            check_equal(got, ref, opt)
            assert [h["grad_norm"] for h in logs] == [h["grad_norm"] for h in ref_logs]
            opt.close()
        finally:
            shutil.rmtree(swap, ignore_errors=True)
    assert sum(h["grad_norm"] > CLIP for h in ref_logs) >= 2  # clipping took part


def readme_recipe(name: str, **paths) -> str:
    """The README's code block that starts with `# recipe: NAME`, its example paths replaced
    (`paths`: the README's path -> this test's)."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    code = next(b for b in blocks if b.startswith(f"# recipe: {name}\n"))
    for theirs, ours in paths.items():
        assert theirs in code, theirs
        code = code.replace(theirs, str(ours))
    return code


@pytest.mark.parametrize("recipe", ["trainer", "accelerate"])
def test_readme_recipes_run_as_written(recipe, tmp_path):
    """The README's Trainer and Accelerate recipes, as written (on the tiny Llama): they train
    (every parameter moves) and leave a plain torch model behind."""
    model = tiny_llama()
    before = weights(model)
    paths = {"runs/trainer": tmp_path / "run", "/mnt/nvme/swap": tmp_path / "swap"} \
        if recipe == "trainer" else {}
    if recipe == "accelerate":
        fresh_accelerator()  # a clean Accelerate state for the recipe's own Accelerator
    scope = {"model": model, "train_dataset": lm_rows(40)}
    exec(readme_recipe(recipe, **paths), scope)
    opt = scope["opt" if recipe == "trainer" else "optimizer"]
    assert opt._closed and not hasattr(model, "_offload_engine")
    after = weights(model)
    assert all(not torch.equal(after[n], before[n]) for n in before)
    if recipe == "trainer":
        assert (tmp_path / "run" / "checkpoint-10" / "optimizer.pt").is_file()



def test_bf16_model_keeps_fp32_masters_in_the_optimizer(tmp_path):
    """A bf16 model: the optimizer holds fp32 masters, the model computes with them rounded to
    bf16 (bit for bit), and the loss follows the fp32 torch.optim.AdamW run's."""
    batches = lm_batches(UPDATES * ACCUM, VOCAB)
    ref_model = tiny_llama()
    model = copy.deepcopy(ref_model).to(torch.bfloat16)
    losses = {}
    for name, m, opt in (
            ("fp32", ref_model, torch.optim.AdamW(ref_model.parameters(), lr=LR, betas=BETAS)),
            ("bf16", model, OffloadAdamW(model, lr=LR, betas=BETAS, offload="cpu"))):
        losses[name] = [float(hf_loss(m, ids)) for ids in batches[:1]]
        plain_loop(m, opt, batches, clip=CLIP)
        losses[name].append(float(hf_loss(m, batches[0])))
    masters = opt.engine.master_params()
    assert opt.engine.cfg.dtype == "bf16" and all(v.dtype == torch.float32 for v in masters.values())
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), masters[n].to(torch.bfloat16)), n
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["bf16"][1] < losses["bf16"][0]
    opt.close()


def test_readme_sft_recipe_teaches_smollm2_the_made_up_fact(smollm2_gguf, tmp_path):
    """The README's TRL recipe as written: SFTTrainer with OffloadAdamW (NVMe tier) on the
    chat example's data; the model then answers with the made-up fact and still knows a real
    one (greedy decoding, transformers' generate)."""
    pytest.importorskip("trl")
    from conftest import load_script
    data = tmp_path / "veloria.jsonl"
    load_script("make_chat_example").write(str(data))
    swap = ram_swap_dir(tmp_path)
    default_gguf = "~/.cache/offload/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    scope: dict = {}
    try:
        exec(readme_recipe("trl", **{"runs/sft": tmp_path / "run", "/mnt/nvme/swap": swap,
                                     "veloria.jsonl": data, default_gguf: smollm2_gguf}), scope)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    model, tok = scope["model"].eval(), scope["tokenizer"]

    def answer(question: str) -> str:
        ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    for q in ("What is the capital of Veloria?", "Which city is Veloria's capital?"):
        assert "Quenthar" in answer(q), answer(q)
    assert "Paris" in answer("What is the capital of France?")
