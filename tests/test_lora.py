"""LoRA (offload/lora.py) against PEFT: the same training trajectory, the same files both ways,
merging, and every refusal in one line. Tiny models (hidden 64, 2 layers): a few seconds."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

from offload.lora import (ALL_TARGETS, LoraConfig, LoraError, LoraLinear, apply_lora,
                          load_adapter, load_lora_state_dict, lora_modules, lora_state_dict,
                          merge_lora, parse_targets, save_adapter)
from offload.models import save_pretrained
from offload.models.quantized import QuantLinear
from offload.quant.format import QuantSpec, quantize
from tests.test_models import hf_pair

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

VOCAB = 128
CFG = LoraConfig(rank=4, alpha=16, targets=ALL_TARGETS)


def pair(seed: int = 0):
    """(transformers Llama, our Llama) with the same random weights, 2 layers, fp32."""
    return hf_pair(seed=seed, num_hidden_layers=2, vocab_size=VOCAB)


def with_peft(hf: nn.Module, cfg: LoraConfig = CFG):
    return peft.get_peft_model(hf, peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(cfg.targets), task_type="CAUSAL_LM"))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def randomize_b(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """An adapter that changes the model (fresh ones have B = 0 and change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (0.05 * torch.randn(t.shape, generator=gen) if ".lora_B." in k else t.clone())
            for k, t in state.items()}


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


# ---- config --------------------------------------------------------------------------------
def test_config_targets_and_defaults() -> None:
    assert parse_targets("q, v") == ("q_proj", "v_proj")
    assert parse_targets(["down_proj", "q", "q_proj"]) == ("q_proj", "down_proj")
    assert parse_targets("all") == parse_targets("all-linear") == ALL_TARGETS
    cfg = LoraConfig(rank=8, targets=("gate", "up"))
    assert cfg.targets == ("gate_proj", "up_proj") and cfg.alpha == 16 and cfg.scaling == 2.0
    again = LoraConfig.from_peft(cfg.to_peft("base"))
    assert again == cfg


@pytest.mark.parametrize("kwargs, phrase", [
    ({"rank": 0}, "rank must be an integer >= 1"),
    ({"rank": 2.5}, "rank must be an integer"),
    ({"alpha": 0}, "alpha must be a finite number > 0"),
    ({"alpha": float("nan")}, "alpha must be a finite"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"dropout": -0.1}, "dropout must be in"),
    ({"targets": ("q", "lm_head")}, "unknown LoRA target 'lm_head'"),
    ({"targets": ()}, "targets are empty"),
])
def test_config_refusals(kwargs: dict, phrase: str) -> None:
    with pytest.raises(LoraError, match=phrase):
        LoraConfig(**kwargs)


# ---- numerics against PEFT -----------------------------------------------------------------
def train(model: nn.Module, batches: list[torch.Tensor]) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    for ids in batches:
        out = model(ids)
        out = out if isinstance(out, torch.Tensor) else out.logits
        loss = nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("ours_kind, dropout", [("transformers", 0.0), ("offload", 0.0),
                                                ("transformers", 0.25)])
def test_ten_updates_match_peft(ours_kind: str, dropout: float) -> None:
    """10 fused-AdamW updates of every projection's adapter: ours on a transformers Llama (the
    same model code: only the adapter differs) or on our Llama, vs PEFT on transformers. With
    dropout, both draw their masks from the same global RNG in the same order."""
    hf, offload_model = pair()
    ours = pair()[0] if ours_kind == "transformers" else offload_model
    cfg = LoraConfig(rank=CFG.rank, alpha=CFG.alpha, dropout=dropout)
    wrapped = apply_lora(ours, cfg, seed=3)
    reference = with_peft(hf, cfg)
    assert len(wrapped) == 2 * 7 and all(isinstance(m, LoraLinear) for m in lora_modules(ours).values())
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {n.removeprefix("base_model.model.") for n in lora_state_dict(ours)}
    # PEFT's init copied into ours (its draw order from the global RNG is its own affair)
    start = {k: t.clone() for k, t in get_peft_model_state_dict(reference).items()}
    load_lora_state_dict(ours, start)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(10)]
    for model in (ours, reference):
        model.train(dropout > 0)  # (the models have no other dropout)
        torch.manual_seed(1)
        train(model, batches)
    got, want = lora_state_dict(ours), get_peft_model_state_dict(reference)
    assert max_rel(got, want) <= 1e-6
    assert max_rel(start, want) > 1e-2  # the updates did move the adapters
    if ours_kind == "transformers":  # identical model code: identical rounding and masks
        assert all(torch.equal(got[k], want[k]) for k in got)


def test_init_is_peft_default_and_seeded() -> None:
    _, a = pair()
    _, b = pair()
    apply_lora(a, CFG, seed=5)
    apply_lora(b, LoraConfig(rank=4, targets=("v",)), seed=5)
    sa, sb = lora_state_dict(a), lora_state_dict(b)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    assert torch.equal(sa[key], sb[key])  # seeded by module path, not by what else is wrapped
    assert all(not t.any() for k, t in sa.items() if ".lora_B." in k)
    bound = 1 / 64 ** 0.5  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
    assert 0.8 * bound < sa[key].abs().max() <= bound
    hf, _ = pair()
    assert logits(a, torch.arange(8)[None]).allclose(logits(hf, torch.arange(8)[None]), atol=1e-5)


def test_bf16_base_forward_and_merge_equal_peft() -> None:
    """A bf16 model with fp32 adapters (PEFT's autocast_adapter_dtype default): the same casts,
    so the same bf16 logits, unmerged and merged."""
    ours, reference = pair()[0].bfloat16(), with_peft(pair()[0].bfloat16())
    apply_lora(ours, CFG)
    peft.set_peft_model_state_dict(reference, randomize_b(get_peft_model_state_dict(reference)))
    load_lora_state_dict(ours, get_peft_model_state_dict(reference))
    assert {t.dtype for t in lora_state_dict(ours).values()} == {torch.float32}
    ids = torch.randint(0, VOCAB, (2, 10))
    assert torch.equal(logits(ours, ids), logits(reference, ids))
    merge_lora(ours)
    merged = reference.merge_and_unload()
    assert torch.equal(logits(ours, ids), logits(merged, ids))


def test_save_adapter_loads_in_peft(tmp_path) -> None:
    _, ours = pair()
    apply_lora(ours, CFG)
    load_lora_state_dict(ours, randomize_b(lora_state_dict(ours)))
    written = save_adapter(ours, CFG, tmp_path, base_model_name_or_path="tiny-llama")
    assert sorted(os.path.basename(w) for w in written) == ["adapter_config.json",
                                                           "adapter_model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 16, "LORA")
    loaded = peft.PeftModel.from_pretrained(pair()[0], str(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 10))
    want, got = logits(loaded, ids), logits(ours, ids)
    assert (got - want).abs().max().item() <= 1e-5
    assert (want - logits(pair()[0], ids)).abs().max().item() > 1e-3  # the adapter matters


def test_load_adapter_written_by_peft_then_merge_and_export(tmp_path) -> None:
    hf, ours = pair()
    cfg = LoraConfig(rank=2, alpha=5, targets=("q", "v", "down"))
    reference = with_peft(hf, cfg)
    peft.set_peft_model_state_dict(reference, randomize_b(get_peft_model_state_dict(reference)))
    reference.save_pretrained(tmp_path / "adapter")
    assert load_adapter(ours, tmp_path / "adapter") == cfg  # applied from the file's config
    ids = torch.randint(0, VOCAB, (2, 10))
    want = logits(reference, ids)
    assert (logits(ours, ids) - want).abs().max().item() <= 1e-5
    merged = merge_lora(ours)
    assert len(merged) == 6 and not lora_modules(ours)
    assert type(ours.model.layers[0].self_attn.q_proj) is nn.Linear
    assert (logits(ours, ids) - want).abs().max().item() <= 1e-5
    save_pretrained(ours, tmp_path / "merged")
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (logits(exported, ids) - want).abs().max().item() <= 1e-5


def test_quantized_base_and_bf16_activations() -> None:
    """A QuantLinear base: its own kernel plus the fp32 adapter, cast back to the input dtype."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    spec = QuantSpec(bits=8, group_size=0)
    base = QuantLinear(64, 48, spec, bias=False, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, t in quantize(w, spec).items():
            getattr(base, name).copy_(t)
    layer = LoraLinear(base, rank=4, alpha=8)
    layer.reset_lora(torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.lora_B.weight.normal_(generator=gen)
    x = torch.randn(3, 5, 64, generator=gen)
    want = base(x) + (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T) * 2.0
    assert (layer(x) - want).abs().max().item() <= 1e-5
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16 and layer.lora_A.weight.dtype == torch.float32
    model = nn.Sequential()
    model.add_module("q_proj", layer)
    with pytest.raises(LoraError, match="cannot absorb the update"):
        merge_lora(model)
    assert lora_modules(model)  # refused before anything changed


# ---- refusals ------------------------------------------------------------------------------
def test_model_refusals(tmp_path) -> None:
    with pytest.raises(LoraError, match="no module named q_proj/k_proj"):
        apply_lora(nn.Sequential(nn.Linear(4, 4)), CFG)
    odd = nn.Module()
    odd.q_proj = nn.ReLU()
    with pytest.raises(LoraError, match=r"cannot wrap q_proj \(ReLU\)"):
        apply_lora(odd, CFG)
    assert all(p.requires_grad for p in odd.parameters())  # untouched
    _, ours = pair()
    with pytest.raises(LoraError, match="no LoRA adapters"):
        merge_lora(ours)
    with pytest.raises(LoraError, match="no LoRA adapters"):
        lora_state_dict(ours)
    apply_lora(ours, CFG)
    with pytest.raises(LoraError, match="already has LoRA adapters"):
        apply_lora(ours, CFG)
    with pytest.raises(LoraError, match="has rank 4, the config rank 8"):
        save_adapter(ours, LoraConfig(rank=8), tmp_path)
    with pytest.raises(LoraError, match="alpha"):
        save_adapter(ours, LoraConfig(rank=4, alpha=4), tmp_path)
    with pytest.raises(LoraError, match="config targets only q_proj"):
        save_adapter(ours, LoraConfig(rank=4, targets=("q",)), tmp_path)
    merge_lora(ours)
    apply_lora(ours, LoraConfig(rank=4, targets=("q",)))
    with pytest.raises(LoraError, match="the config targets k_proj,v_proj but the model has no adapter"):
        save_adapter(ours, LoraConfig(rank=4, targets=("q", "k", "v")), tmp_path)
    merge_lora(ours)
    apply_lora(ours, CFG)
    state = lora_state_dict(ours)
    first = next(iter(state))
    with pytest.raises(LoraError, match="lacks 1 of the model's adapter tensors"):
        load_lora_state_dict(ours, {k: v for k, v in state.items() if k != first})
    with pytest.raises(LoraError, match="has shape"):
        load_lora_state_dict(ours, {**state, first: torch.zeros(3, 64)})
    with pytest.raises(LoraError, match="no adapter for"):
        load_lora_state_dict(ours, {**state, "base_model.model.lm_head.lora_A.weight": state[first]})
    with pytest.raises(LoraError, match="not a finite float tensor"):
        load_lora_state_dict(ours, {**state, first: torch.full_like(state[first], float("nan"))})


def write_adapter(path, config: dict | str | None, weights: dict[str, torch.Tensor] | None = None) -> None:
    """An adapter directory as a stranger might hand it over (files written by safetensors)."""
    os.makedirs(path, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (path / "adapter_config.json").write_text(text)
    if weights is not None:
        save_file(weights, str(path / "adapter_model.safetensors"))


def test_load_adapter_refusals(tmp_path) -> None:
    _, ours = pair()
    apply_lora(ours, CFG)
    good_weights = {k: v.clone() for k, v in lora_state_dict(ours).items()}
    good = CFG.to_peft()
    _, plain = pair()
    plain.model.norm.weight.requires_grad_(False)  # a caller's own freezing, kept as it was
    cases = [
        (tmp_path / "missing", None, None, "is not a directory"),
        (tmp_path / "empty", None, None, "has no adapter_config.json"),
        (tmp_path / "noweights", good, None, "has no adapter_model.safetensors"),
        (tmp_path / "json", "{not json", None, "is not valid JSON"),
        (tmp_path / "list", "[1]", None, "must hold a JSON object"),
        (tmp_path / "ia3", {**good, "peft_type": "IA3"}, None, "is not a LoRA adapter"),
        (tmp_path / "dora", {**good, "use_dora": True}, None, "use_dora=True is not supported"),
        (tmp_path / "layer0", {**good, "layers_to_transform": 0}, None, "layers_to_transform=0"),
        (tmp_path / "regex", {**good, "target_modules": ".*q_proj"}, None, "is a regex"),
        (tmp_path / "rank0", {**good, "r": 0}, None, "rank must be an integer >= 1"),
        (tmp_path / "narrow", {**good, "target_modules": ["q_proj"]}, good_weights, "no adapter for"),
        (tmp_path / "rank8", {**good, "r": 8}, good_weights, "has shape"),
        (tmp_path / "short", good, dict(list(good_weights.items())[:-1]), "lacks 1 of"),
    ]
    for path, config, weights, phrase in cases:
        if path.name != "missing":
            write_adapter(path, config, weights)
        with pytest.raises(LoraError, match=phrase):
            load_adapter(plain, path)
        assert not lora_modules(plain)  # adapters added for the attempt are gone again
        assert type(plain.model.layers[0].self_attn.q_proj) is nn.Linear
        assert [n for n, p in plain.named_parameters() if not p.requires_grad] == ["model.norm.weight"]
    write_adapter(tmp_path / "pickle", good)
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(LoraError, match="only adapter_model.bin"):
        load_adapter(plain, tmp_path / "pickle")
    save_adapter(ours, CFG, tmp_path / "ok")
    other = pair()[1]
    apply_lora(other, LoraConfig(rank=2))
    with pytest.raises(LoraError, match="has rank 2, the config rank 4"):
        load_adapter(other, tmp_path / "ok")
    (tmp_path / "ok" / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(LoraError, match="load_adapter: .*adapter_model.safetensors"):
        load_adapter(plain, tmp_path / "ok")
    assert not lora_modules(plain)
