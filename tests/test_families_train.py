"""Training every family of tests/families.py (Qwen3, Gemma 2, Gemma 3, Phi-3) against plain
PyTorch, transformers and PEFT, each on transformers' own model of the same checkpoint:

- full fine-tuning: 10 updates by the engine on our decoder loaded from the checkpoint, the
  optimizer state in host RAM or NVMe swap files, the weights resident or streamed, equal
  torch.optim.AdamW on transformers' model (fp32, the same batches and hyper-parameters)
  within 1e-6, parameters and losses;
- LoRA: adapters on whichever projections a family has (Phi-3's fused qkv_proj and
  gate_up_proj), written by save_adapter, load in PEFT over transformers' model with the same
  logits; trained by the engine they follow PEFT with torch's AdamW(fused=True);
- ZeRO stages 2 and 3 on 2 gloo ranks (tests/zero_ranks.py) equal one process within 1e-5;
- runners.finetune on a Gemma 3 checkpoint directory with --offload nvme exports a model that
  transformers loads as Gemma3ForCausalLM.

Every batch is 24 tokens: past Phi-3's LongRoPE switch (16) and the sliding windows (6, 9);
token 0 (every case's pad id, whose embedding row transformers never trains) is among them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from families import FAMILIES, SMALL, VOCAB, random_family_model, save_family_checkpoint
from offload.lora import (PEFT_PREFIX, LoraConfig, LoraError, apply_lora, load_lora_state_dict,
                          lora_modules, lora_state_dict, save_adapter)
from offload.models import load_model
from test_engine import _cfg, engine_train, hf_loss, lm_batches, max_rel_diff, reference_train

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

from test_lora import logits, randomize_b, with_peft  # noqa: E402

UPDATES, SEQ = 10, 24
# lr 1e-4, as tests/test_zero.py: our backward sums a few reductions (the q/k norms' weight
# gradients) in another order than transformers', and Adam turns those last-bit differences
# of near-zero gradients into +-lr steps; at 1e-3 Gemma 3 ends 6e-7 apart after 10 updates,
# at 1e-4 1e-8. The updates still move every tensor ~1e-3 of its largest weight, 1000 times
# the tolerance (checked): a wrong gradient shows.
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.99), 1e-8, 0.01
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> the directory of that family case's random checkpoint (written once)."""
    root = tmp_path_factory.mktemp("families")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            save_family_checkpoint(name, root / name)
            made[name] = str(root / name)
        return made[name]
    return get


def batches_of(n: int) -> list[torch.Tensor]:
    return lm_batches(n, VOCAB, seq=SEQ)


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ---- full fine-tuning ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def full_reference(name: str, clip: float, accum: int) -> tuple[dict, list[float]]:
    """torch.optim.AdamW (for-each, as exact_optimizer follows) on transformers' own model of the
    checkpoint: (parameters after UPDATES updates, the losses)."""
    hf = random_family_model(name)
    return reference_train(hf, batches_of(UPDATES * accum), hf_loss, lr=LR, betas=BETAS, eps=EPS,
                           wd=WD, clip=clip, accum=accum)


# (family, optimizer state, streamed weights, activation checkpointing, clip, accumulation);
# clipping and accumulation as such are tests/test_engine.py's: here once each
FULL = ([(name, "cpu", "none", False, 0.0, 1) for name in FAMILIES if name != "gemma2"] + [
    ("gemma2", "cpu", "none", False, 0.5, 2),
    ("qwen3", "nvme", "none", False, 0.5, 1),
    ("gemma3", "nvme", "none", False, 0.0, 1),
    ("phi3", "nvme", "none", False, 0.0, 1),
    ("gemma3", "cpu", "nvme", True, 0.0, 1),  # weights streamed from swap files, recomputed
    ("phi3-longrope-partial", "cpu", "cpu", False, 0.0, 1),  # streamed from host RAM
])


@pytest.mark.parametrize("name,mode,params,ckpt,clip,accum", FULL,
                         ids=["-".join(map(str, c)) for c in FULL])
def test_full_fine_tuning_equals_adamw_on_transformers(name, mode, params, ckpt, clip, accum,
                                                       checkpoint, tmp_path):
    """10 updates by the engine on our decoder equal torch's AdamW on transformers' model."""
    model = load_model(checkpoint(name))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches_of(UPDATES * accum)
    # the pad id is an input: transformers' embedding (padding_idx) never gives its row a gradient
    assert any(bool((ids == SMALL["pad_token_id"]).any()) for ids in data)
    cfg = _cfg(mode, tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=clip,
               grad_accum_steps=accum, offload_params=params, activation_checkpointing=ckpt,
               nvme_dir=str(tmp_path / "swap"))
    engine, masters, losses, applied = engine_train(model, data, hf_loss, cfg)
    try:
        assert applied == UPDATES
        moved = engine.last_report.bytes
        if params != "none":  # the layers really were streamed
            assert moved["stream_h2d"] + moved["stream_disk"] > 0
    finally:
        engine.close()
    ref, ref_losses = full_reference(name, clip, accum)
    assert masters.keys() == ref.keys()
    assert max_rel_diff(masters, ref) <= TOLERANCE
    assert max_rel(losses, ref_losses) <= TOLERANCE
    assert max_rel_diff(start, ref) > 1000 * TOLERANCE  # the updates did move the weights


# ---- LoRA ---------------------------------------------------------------------------------------
# family -> the projections "all" wraps there
PROJECTIONS = {"qwen3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"},
               "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}
PROJECTIONS["gemma2"] = PROJECTIONS["gemma3"] = PROJECTIONS["qwen3"]
ADAPTERS = [("qwen3", "all"), ("gemma2", "all"), ("gemma3", "all"), ("phi3", "all"),
            ("phi3", "qkv,gate_up")]


@pytest.mark.parametrize("name,targets", ADAPTERS)
def test_saved_adapter_loads_in_peft_with_the_same_logits(name, targets, checkpoint, tmp_path):
    """apply_lora (all: whichever projections the family has) and save_adapter; PEFT's
    from_pretrained over transformers' model of the checkpoint gives our logits."""
    model = load_model(checkpoint(name))
    cfg = LoraConfig(rank=4, alpha=8, targets=targets)
    wrapped = apply_lora(model, cfg, seed=2)
    want = PROJECTIONS[name] if targets == "all" else {"qkv_proj", "gate_up_proj"}
    assert {w.rpartition(".")[2] for w in wrapped} == want
    assert len(wrapped) == len(want) * model.config.num_hidden_layers
    load_lora_state_dict(model, randomize_b(lora_state_dict(model)))  # B = 0 would change nothing
    save_adapter(model, cfg, tmp_path / "adapter", base_model_name_or_path=name)
    loaded = peft.PeftModel.from_pretrained(random_family_model(name), str(tmp_path / "adapter"))
    ids = batches_of(1)[0]
    got, reference = logits(model, ids), logits(loaded.eval(), ids)
    assert (got - reference).abs().max().item() <= 1e-6
    plain = logits(random_family_model(name), ids)
    assert (reference - plain).abs().max().item() > 1e-3  # the adapter matters


def test_targets_a_family_lacks_are_refused(checkpoint):
    """An explicit target the family does not have is refused in one line, before the model is
    touched (Phi-3 has qkv_proj and gate_up_proj, the others q/k/v_proj and gate/up_proj)."""
    phi3, qwen3 = load_model(checkpoint("phi3")), load_model(checkpoint("qwen3"))
    cases = [(phi3, "qkv,o,q", r"has no q_proj \(its projections: qkv_proj, o_proj, gate_up_proj, "
                               r"down_proj; Phi-3 fuses"),
             (phi3, "gate_up,up,gate", "has no gate_proj, up_proj"),
             (phi3, "k", "no module named k_proj"),
             (qwen3, "q,qkv", "has no qkv_proj"),
             (qwen3, "down,gate_up", "has no gate_up_proj")]
    for model, targets, phrase in cases:
        with pytest.raises(LoraError, match=phrase) as e:
            apply_lora(model, LoraConfig(rank=4, targets=targets))
        assert "\n" not in str(e.value)
        assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())


# 1e-3: with clipping at 1e-2 Phi-3's adapters end 5.5e-7 from PEFT's, too near the tolerance
# (the engine takes the gradient norm block by block, clip_grad_norm_ tensor by tensor: the clip
# factors differ in their last bits and Adam carries that into every update); 1.8e-7 at 1e-3,
# and without clipping the two are equal to the bit
LORA_LR = 1e-3
LORA_ENGINE = [  # (family, targets, adapters' optimizer state, frozen base, checkpointing, clip)
    ("qwen3", "all", "cpu", "none", False, 0.0),
    ("phi3", "qkv,o,gate_up", "nvme", "nvme", True, 0.5),
]


@pytest.mark.parametrize("name,targets,mode,params,ckpt,clip", LORA_ENGINE)
def test_lora_engine_updates_equal_peft_with_fused_adamw(name, targets, mode, params, ckpt, clip,
                                                        checkpoint, tmp_path):
    """10 updates of the adapters by the engine (its default AdamW kernel computes what torch's
    fused one does), the base resident or streamed, equal PEFT on transformers' model with
    torch.optim.AdamW(fused=True) from the same adapter weights."""
    lora = LoraConfig(rank=4, alpha=8, targets=targets)
    model = load_model(checkpoint(name))
    apply_lora(model, lora, seed=1)
    reference = with_peft(random_family_model(name), lora)
    start = randomize_b(get_peft_model_state_dict(reference))
    peft.set_peft_model_state_dict(reference, start)
    load_lora_state_dict(model, start)
    data = batches_of(UPDATES)
    _, ref_losses = reference_train(reference, data, hf_loss, lr=LORA_LR, betas=BETAS, eps=EPS,
                                    wd=WD, clip=clip, accum=1, fused=True)
    want = get_peft_model_state_dict(reference)
    cfg = _cfg(mode, tmp_path, lr=LORA_LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=clip,
               exact_optimizer=False, offload_params=params, activation_checkpointing=ckpt,
               nvme_dir=str(tmp_path / "swap"))
    engine, masters, losses, applied = engine_train(model, data, hf_loss, cfg)
    try:
        assert applied == UPDATES
        if params != "none":
            assert type(engine.streaming).__name__ == "FrozenBaseStreamer"
    finally:
        engine.close()
    got = {PEFT_PREFIX + n: t for n, t in masters.items()}
    assert max_rel_diff(got, want) <= TOLERANCE
    assert max_rel(losses, ref_losses) <= TOLERANCE
    assert max_rel_diff(start, want) > 1e-2  # the adapters did train


# ---- ZeRO across 2 ranks ------------------------------------------------------------------------
ZERO_FAMILIES = ("qwen3", "gemma3")
# stage 2 (optimizer state and gradients sharded) and stage 3 (the weights too, each rank's
# shard of the layers streamed from host RAM)
ZERO = [(2, "cpu", "none"), (3, "cpu", "cpu")]


@pytest.fixture(scope="module")
def zero_runs(checkpoint, tmp_path_factory) -> dict[tuple[str, int], dict]:
    """One launch of 2 gloo ranks for every (family, stage): each rank imports torch once and
    loads our decoder from the family's checkpoint directory."""
    from test_zero import ROWS, SEQ as ZERO_SEQ, UPDATES as ZERO_UPDATES, fp32_configs, launch_ranks
    tmp = tmp_path_factory.mktemp("zero_families")
    configs = [dict(c, model=f"checkpoint:{checkpoint(name)}") for name in ZERO_FAMILIES
               for c in fp32_configs(ZERO, str(tmp / "swap"))]
    results = iter(launch_ranks(dict(model="tiny", updates=ZERO_UPDATES, rows=ROWS, seq=ZERO_SEQ,
                                     configs=configs), 2, tmp))
    return {(name, stage): next(results) for name in ZERO_FAMILIES for stage, _, _ in ZERO}


@functools.lru_cache(maxsize=None)
def zero_reference(name: str) -> tuple[dict, list[float]]:
    """tests/test_zero.py's one-process reference on transformers' model of the checkpoint:
    torch.optim.AdamW over the global micro-batches, with its clipping and accumulation."""
    from test_zero import ACCUM, CLIP, OPT, ROWS, SEQ as ZERO_SEQ, UPDATES as ZERO_UPDATES
    from zero_ranks import batches, lm_loss
    data = batches(VOCAB, ZERO_UPDATES * ACCUM, ROWS, ZERO_SEQ)
    return reference_train(random_family_model(name), data, lm_loss, lr=OPT["lr"],
                           betas=OPT["betas"], eps=OPT["eps"], wd=OPT["weight_decay"], clip=CLIP,
                           accum=ACCUM)


@pytest.mark.parametrize("stage", [s for s, _, _ in ZERO])
@pytest.mark.parametrize("name", ZERO_FAMILIES)
def test_zero_ranks_equal_one_process_on_transformers(name, stage, zero_runs):
    """2 ranks, each training on its half of every global micro-batch, end (masters and losses)
    within 1e-5 of torch's AdamW over the global batch in one process on transformers' model."""
    from test_zero import TOLERANCE as ZERO_TOLERANCE, UPDATES as ZERO_UPDATES
    res = zero_runs[(name, stage)]
    ref, ref_losses = zero_reference(name)
    assert len(res["sent"]) == ZERO_UPDATES and res["masters"].keys() == ref.keys()
    assert max_rel_diff(res["masters"], ref) <= ZERO_TOLERANCE
    assert max_rel(res["losses"], ref_losses) <= ZERO_TOLERANCE
    if stage == 3:  # the layers' weights were gathered from the shards in every forward
        assert res["sent"][-1]["all_gather_fetch"] > 0


# ---- runners.finetune ---------------------------------------------------------------------------
TEXT = ("the quick brown fox jumps over the lazy dog. offload trains models larger than the "
        "device: weights, gradients and adam moments move between tiers as they are needed.\n")


def write_tokenizer(path) -> None:
    """A character-level BPE tokenizer small enough for the family checkpoints' 211-token
    vocabulary (a byte-level one needs 256 tokens before any merge): <pad> 0, <bos> 1 (added in
    front), <eos> 2 -- the checkpoints' own ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120,
                                  special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"])
    tok.train_from_iterator([TEXT] * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                   "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def test_finetune_runner_on_gemma3_exports_what_transformers_loads(checkpoint, tmp_path, capsys):
    """python -m runners.finetune --model <a Gemma 3 checkpoint directory> --offload nvme on a
    plain text file: the exported model/ loads in transformers as Gemma3ForCausalLM (config,
    weights, tokenizer), with our logits, and the updates changed it."""
    from runners.finetune import main
    model_dir = tmp_path / "gemma3"
    shutil.copytree(checkpoint("gemma3"), model_dir)
    write_tokenizer(model_dir)
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT * 40)
    out = tmp_path / "run"
    assert main(["--model", str(model_dir), "--data", str(data), "--output", str(out),
                 "--offload", "nvme", "--steps", "3", "--batch-size", "2", "--seq-len", str(SEQ),
                 "--lr", "1e-3", "--warmup-steps", "0", "--eval-every", "0", "--no-progress"]) == 0
    assert "model (Hugging Face layout)" in capsys.readouterr().out
    exported = out / "model"
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(hf) is transformers.Gemma3ForCausalLM
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = torch.tensor([tokenizer("the lazy fox moves weights between tiers")["input_ids"]])
    assert ids[0, 0].item() == 1 and ids.shape[1] > 8
    got = logits(hf, ids)
    assert (got - logits(load_model(exported), ids)).abs().max().item() <= 1e-6
    before = logits(random_family_model("gemma3"), ids)
    assert (got - before).abs().max().item() > 1e-3  # trained
