"""LoRA adapters (Hu et al. 2021) on the decoder's projections, interchangeable with PEFT's.

A targeted projection `W` [out, in] is frozen and wrapped: y = W x + B A dropout(x) * alpha / r,
with A [r, in] and B [out, r] the only trainable weights. Everything here mirrors PEFT's
`peft.tuners.lora.layer.Linear` so that an adapter trained here is a PEFT adapter and back:

- the same operation order and dtype casts in forward (fp32 results equal PEFT's bit for bit);
- the same init (A kaiming-uniform with a = sqrt(5), B zeros), drawn from a generator seeded by
  (seed, module name) rather than from the global RNG, so that wrapping a model neither
  depends on nor disturbs the caller's random stream;
- the same files: `adapter_config.json` and `adapter_model.safetensors` with PEFT's tensor
  names, `base_model.model.<module path>.lora_{A,B}.weight` (the adapter name "default" is
  dropped, as `get_peft_model_state_dict` does). Our module paths are transformers' paths, so
  the same name serves our Llama and a transformers one;
- adapter weights in fp32 by default whatever the base dtype, as PEFT's get_peft_model does
  (`autocast_adapter_dtype=True`): r x (in + out) weights cost little, and 16-bit adapters
  lose small updates.

The wrapper keeps PEFT's layout (`<proj>.base_layer`, `<proj>.lora_A`, `<proj>.lora_B`), so
the base weights are named `...q_proj.base_layer.weight` while adapters are on; merge_lora
folds the adapters in and restores plain `nn.Linear`s under their checkpoint names.

Only plain LoRA is supported: no DoRA, rsLoRA, per-module rank/alpha patterns, LoRA biases,
or modules_to_save; an adapter_config.json asking for one is refused in one line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from nvme.format import FormatError, SafetensorsFile, fsync_dir, write_file, write_json_atomic
from offload.models.llama import param_seed, project

# Short names accepted on the command line -> the attribute names of the families' projections
# (PEFT's names: Phi-3 fuses q, k, v into qkv_proj and gate, up into gate_up_proj).
SHORT_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "qkv": "qkv_proj", "o": "o_proj",
                 "gate": "gate_proj", "up": "up_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
ALL_TARGETS = tuple(SHORT_TARGETS.values())
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the wrapped transformers model
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is ~2 KB
# adapter_config.json keys that ask for more than plain LoRA; each must be unset/false/empty
UNSUPPORTED_KEYS = ("use_dora", "use_rslora", "lora_bias", "fan_in_fan_out", "bias",
                    "modules_to_save", "layers_to_transform", "exclude_modules", "rank_pattern",
                    "alpha_pattern", "target_parameters", "trainable_token_indices", "use_qalora")


class LoraError(ValueError):
    """A LoRA setting, model or adapter directory cannot be used; the message says what is wrong
    and how to fix it, in one line."""


def parse_targets(spec: str | Iterable[str]) -> tuple[str, ...]:
    """"q,v" / ["q_proj", "v"] / "all" (or PEFT's "all-linear") -> full projection names, in
    the canonical order q, k, v, o, gate, up, down, without repeats."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: set[str] = set()
    for raw in items:
        item = str(raw).strip()
        if item in ("all", "all-linear"):
            names.update(ALL_TARGETS)
        elif item in SHORT_TARGETS or item in ALL_TARGETS:
            names.add(SHORT_TARGETS.get(item, item))
        else:
            raise LoraError(f"unknown LoRA target {item!r}: use any of "
                            f"{','.join(SHORT_TARGETS)} (or their _proj names, or all)")
    return tuple(t for t in ALL_TARGETS if t in names)


@dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the update is scaled by alpha / r), dropout on the adapter's input, and
    which projections get an adapter (short or full names, stored as full names).

    alpha defaults to 16, twice the default rank: the usual choice (scaling 2). PEFT's own
    default lora_alpha is 8 (scaling 1 at r = 8); PEFT users nearly always set it, so any
    default is a convention, and the saved adapter_config.json records the value either way."""
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_TARGETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", parse_targets(self.targets))
        self.validate()

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise LoraError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise LoraError("LoRA targets are empty: name at least one of " + ",".join(SHORT_TARGETS))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_peft(self, base_model_name_or_path: str | None = None) -> dict:
        """adapter_config.json as PEFT writes it (the fields its loader reads; others default)."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else float(self.alpha)
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": alpha,
                "lora_dropout": float(self.dropout), "target_modules": list(self.targets),
                "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
                "init_lora_weights": True, "use_dora": False, "use_rslora": False,
                "lora_bias": False, "modules_to_save": None, "layers_to_transform": None,
                "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                "base_model_name_or_path": base_model_name_or_path, "revision": None}

    @classmethod
    def from_peft(cls, d: object) -> "LoraConfig":
        """An adapter_config.json's contents -> LoraConfig; anything beyond plain LoRA refused."""
        if not isinstance(d, dict):
            raise LoraError(f"{CONFIG_FILE} must hold a JSON object, got {type(d).__name__}")
        if d.get("peft_type") != "LORA":
            raise LoraError(f"{CONFIG_FILE}: peft_type {d.get('peft_type')!r} is not a LoRA adapter")
        for key in UNSUPPORTED_KEYS:
            value = d.get(key)  # 0 is a real value here (layers_to_transform=0: layer 0 only)
            if not (value is None or value is False or value == "none" or value == {} or value == []):
                raise LoraError(f"{CONFIG_FILE}: {key}={d[key]!r} is not supported (plain LoRA "
                                f"only: leave {key} unset)")
        targets = d.get("target_modules")
        if isinstance(targets, str) and targets not in ("all", "all-linear"):
            raise LoraError(f"{CONFIG_FILE}: target_modules {targets!r} is a regex; list the "
                            f"projections instead (any of {', '.join(ALL_TARGETS)})")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise LoraError(f"{CONFIG_FILE}: target_modules must be a list of projection names")
        # PEFT matches a target as a suffix of the module path: keep the last component
        names = [t.rpartition(".")[2] for t in targets]
        return cls(rank=d.get("r", 8), alpha=d.get("lora_alpha", 8), dropout=d.get("lora_dropout", 0.0),
                   targets=tuple(names))


def _features(base: nn.Module, name: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection LoRA can wrap, or one line saying why not."""
    in_f, out_f = getattr(base, "in_features", None), getattr(base, "out_features", None)
    if not isinstance(in_f, int) or not isinstance(out_f, int) or not callable(base):
        raise LoraError(f"LoRA cannot wrap {name} ({type(base).__name__}): it needs a projection "
                        f"with in_features/out_features (nn.Linear or QuantLinear)")
    if getattr(base, "input_major", False):  # gpt-oss's experts (offload/models/moe.py)
        raise LoraError(f"LoRA on {name} is not built (gpt-oss's experts hold their weights [in, out], "
                        f"and PEFT cannot target them): target the attention, --lora-targets q,k,v,o")
    return in_f, out_f


class LoraLinear(nn.Module):
    """A frozen projection plus a trainable low-rank update, computed as PEFT's lora.Linear does.

    `base` is an nn.Linear or anything with in_features / out_features mapping x [..., in] to
    [..., out] (QuantLinear). Not an nn.Linear subclass on purpose: the model's `project()`
    calls `layer(x)` for anything that is not an nn.Linear, which lands in forward() here."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        in_f, out_f = _features(base, type(base).__name__)
        if device is None:  # beside the base weight; a meta (streamed) base gets CPU adapters,
            # since they never come from the checkpoint and must hold their init from the start
            first = next(base.parameters(), None)
            device = first.device if first is not None and not first.is_meta else torch.device("cpu")
        self.base_layer = base.requires_grad_(False)
        self.in_features, self.out_features = in_f, out_f
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        # nn.Identity at 0, as PEFT: no mask drawn, so no random numbers used
        self.lora_dropout: nn.Module = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
        # built on meta (no init, no global RNG use), then given storage; reset_lora() fills it
        self.lora_A = nn.Linear(in_f, rank, bias=False, device="meta")
        self.lora_B = nn.Linear(rank, out_f, bias=False, device="meta")
        self.lora_A.weight = nn.Parameter(torch.empty(rank, in_f, dtype=dtype, device=device))  # [r, in]
        self.lora_B.weight = nn.Parameter(torch.empty(out_f, rank, dtype=dtype, device=device))  # [out, r]

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """PEFT's init_lora_weights=True: A as nn.Linear's default (kaiming-uniform, a=sqrt(5)),
        B zeros, so the wrapped model starts exactly equal to the base. Drawn on the CPU in fp32
        so the values depend on the generator only, not on device or dtype."""
        if self.lora_A.weight.device.type == "meta":  # shapes only (a plan): nothing to fill
            return
        a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        result = project(self.base_layer, x)  # the base's own (possibly few-row) kernel
        result_dtype = result.dtype
        if x.dtype != self.lora_A.weight.dtype:  # PEFT's _cast_input_dtype
            x = x.to(self.lora_A.weight.dtype)
        # the same expression as PEFT, so fp32 results round identically; a 16-bit base with
        # fp32 adapters sums in fp32 and casts back
        result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(result_dtype)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling [out, in] as PEFT's get_delta_weight computes it (16-bit adapters on
        the CPU multiplied in fp32, where 16-bit matmuls are slow)."""
        a, b = self.lora_A.weight, self.lora_B.weight
        widen = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
        delta = ((b.float() @ a.float()) if widen else (b @ a)) * self.scaling
        return delta.to(b.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def base_checkpoint_name(name: str) -> str:
    """A parameter name of a LoRA-wrapped model -> the base checkpoint's name for it
    ("...q_proj.base_layer.weight" -> "...q_proj.weight"): how a frozen base is filled from the
    checkpoint it came from."""
    return name.replace(".base_layer.", ".")


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Module path -> LoraLinear, in the model's module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0, *,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> list[str]:
    """Wrap every targeted projection in a LoraLinear and freeze everything else (embeddings,
    norms, head, base weights). Targets match by attribute name anywhere in the model, as
    PEFT's target_modules list does (`...layers.3.self_attn.q_proj` for "q_proj"); works on
    our LlamaForCausalLM and on a transformers one. Each adapter's init is seeded by
    (seed, module path), so it does not depend on which other modules are wrapped.
    Returns the wrapped modules' paths."""
    cfg.validate()
    if lora_modules(model):
        raise LoraError("apply_lora: the model already has LoRA adapters; merge_lora(model) "
                        "first, or load_adapter into it as it is")
    found = [(name, m) for name, m in model.named_modules() if name.rpartition(".")[2] in cfg.targets]
    if not found:
        raise LoraError(f"apply_lora: no module named {'/'.join(cfg.targets)} in this "
                        f"{type(model).__name__}; LoRA targets the decoder layers' projections")
    present = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    absent = [t for t in cfg.targets if t not in present]
    if absent and set(cfg.targets) != set(ALL_TARGETS):  # "all" takes whichever the family has
        have = [t for t in ALL_TARGETS if t in present]
        raise LoraError(f"apply_lora: this model has no {', '.join(absent)} (its projections: "
                        f"{', '.join(have)}; Phi-3 fuses q, k, v as qkv and gate, up as gate_up)")
    for name, base in found:  # all checked before the model is touched
        _features(base, name)
    model.requires_grad_(False)
    for name, base in found:
        # device "meta": the adapters' shapes only (offload/train/lora_plan.py plans without allocating)
        wrapped = LoraLinear(base, cfg.rank, cfg.alpha, cfg.dropout, dtype=dtype, device=device)
        wrapped.reset_lora(torch.Generator().manual_seed(param_seed(seed, f"{name}.lora_A.weight")))
        _set_module(model, name, wrapped)
    return [name for name, _ in found]


def _unwrap(model: nn.Module, fold: bool) -> list[str]:
    """Put each LoraLinear's base back in its place, with B @ A * scaling added to its weight
    when `fold`. Checks every module before touching any, so a refusal changes nothing."""
    modules = lora_modules(model)
    if not modules:
        raise LoraError("the model has no LoRA adapters (apply_lora or load_adapter first)")
    if fold:
        for name, m in modules.items():
            if not isinstance(m.base_layer, nn.Linear):
                raise LoraError(f"merge_lora: {name} wraps a {type(m.base_layer).__name__}, which "
                                f"cannot absorb the update; merge into the dense model and quantize after")
    for name, m in modules.items():
        if fold:
            with torch.no_grad():  # in place, promoted as PEFT's `weight.data += delta`
                m.base_layer.weight += m.delta_weight()
        _set_module(model, name, m.base_layer)
    return list(modules)


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight (W += B @ A * scaling) and put the plain
    nn.Linear back under its checkpoint name, so `offload.models.save_pretrained` exports a
    merged Hugging Face model. Parameters stay frozen (requires_grad False) as apply_lora left
    them. Returns the merged modules' paths."""
    return _unwrap(model, fold=True)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights under PEFT's saved names, base_model.model.<path>.lora_{A,B}.weight:
    the live (detached) parameters, not copies, as PEFT's get_peft_model_state_dict gives."""
    modules = lora_modules(model)
    if not modules:
        raise LoraError("lora_state_dict: the model has no LoRA adapters (apply_lora first)")
    out: dict[str, torch.Tensor] = {}
    for name, m in modules.items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach()  # [r, in]
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach()  # [out, r]
    return out


def load_lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *,
                         what: str = "adapter state") -> None:
    """Copy PEFT-named adapter weights (lora_state_dict's names; also what PEFT's
    get_peft_model_state_dict returns) into the model's adapters. Every name, shape and value is
    checked before anything is copied."""
    own = lora_state_dict(model)
    missing = [k for k in own if k not in state]
    if missing:
        raise LoraError(f"{what} lacks {len(missing)} of the model's adapter tensors, first "
                        f"{missing[0]!r}: it was made for other targets or another model")
    extra = [k for k in state if k not in own]
    if extra:
        raise LoraError(f"{what} holds {len(extra)} tensors this model has no adapter for, first "
                        f"{extra[0]!r}: it was made for other targets or another model")
    for k, t in state.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise LoraError(f"{what}: {k!r} has shape {list(t.shape)}, this model needs "
                            f"{list(own[k].shape)} (rank and layer sizes must match)")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise LoraError(f"{what}: {k!r} is not a finite float tensor; the adapter is damaged")
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t)


def _check_matches(model: nn.Module, cfg: LoraConfig, action: str) -> None:
    """The model's adapters agree with cfg (rank, scaling, targets), or one line saying why not."""
    modules = lora_modules(model)
    targets = set(cfg.targets)
    if targets == set(ALL_TARGETS):  # "all" takes whichever projections the family has
        targets &= {name.rpartition(".")[2] for name, _ in model.named_modules()}
    unused = targets - {name.rpartition(".")[2] for name in modules}
    if unused:  # PEFT would wrap those too, with adapters that were never trained
        raise LoraError(f"{action}: the config targets {','.join(sorted(unused))} but the model has "
                        f"no adapter there; use the targets the adapters were made with")
    for name, m in modules.items():
        if m.rank != cfg.rank:
            raise LoraError(f"{action}: {name} has rank {m.rank}, the config rank {cfg.rank}; "
                            f"use the same rank (or load into a model without adapters)")
        if m.scaling != cfg.scaling:
            raise LoraError(f"{action}: {name} scales by {m.scaling:g}, the config alpha/rank "
                            f"= {cfg.scaling:g}; use the same alpha")
        if name.rpartition(".")[2] not in cfg.targets:
            raise LoraError(f"{action}: {name} has an adapter but the config targets only "
                            f"{','.join(cfg.targets)}")


def save_adapter(model: nn.Module, cfg: LoraConfig, out_dir: str | os.PathLike,
                 base_model_name_or_path: str | None = None) -> list[str]:
    """Write adapter_model.safetensors and adapter_config.json into `out_dir`, as PEFT's
    save_pretrained does (`PeftModel.from_pretrained(base, out_dir)` loads them). Each file
    goes to a temporary name in the directory, is fsynced and renamed over the old one; the
    weights first, so a config never describes weights that are not there yet. Returns the
    files written."""
    out_dir = os.fspath(out_dir)
    _check_matches(model, cfg, "save_adapter")
    state = lora_state_dict(model)
    for k, t in state.items():
        if not bool(torch.isfinite(t).all()):
            raise LoraError(f"save_adapter: {k!r} holds inf/nan; nothing was written to {out_dir}")
    os.makedirs(out_dir, exist_ok=True)
    weights, config = os.path.join(out_dir, WEIGHTS_FILE), os.path.join(out_dir, CONFIG_FILE)
    write_file(weights, state, {"format": "pt"}, atomic=True)
    write_json_atomic(config, cfg.to_peft(base_model_name_or_path), indent=2, sort_keys=True)
    fsync_dir(out_dir)
    return [weights, config]


def _read_config(adapter_dir: str) -> LoraConfig:
    path = os.path.join(adapter_dir, CONFIG_FILE)
    if not os.path.isdir(adapter_dir):
        raise LoraError(f"load_adapter: {adapter_dir} is not a directory (expected one holding "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not os.path.isfile(path):
        raise LoraError(f"load_adapter: {adapter_dir} has no {CONFIG_FILE}; point at the directory "
                        f"save_adapter or PEFT's save_pretrained wrote")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise LoraError(f"load_adapter: {path} is {os.path.getsize(path)} bytes, far too large "
                        f"for an adapter config")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (ValueError, RecursionError) as e:  # also bad UTF-8, absurd nesting
        raise LoraError(f"load_adapter: {path} is not valid JSON ({str(e)[:200]})") from None
    return LoraConfig.from_peft(data)


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike, *,
                 dtype: torch.dtype = torch.float32) -> LoraConfig:
    """Load an adapter directory (ours or PEFT's) into the model: a model without adapters gets
    them from the directory's config first (apply_lora); one with adapters must match its rank,
    alpha and targets. Names and shapes are checked against the model before anything is
    copied; if that fails, adapters added here are removed again. Returns the adapter's config."""
    adapter_dir = os.fspath(adapter_dir)
    cfg = _read_config(adapter_dir)
    weights = os.path.join(adapter_dir, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        pickled = os.path.isfile(os.path.join(adapter_dir, "adapter_model.bin"))
        raise LoraError(f"load_adapter: {adapter_dir} has no {WEIGHTS_FILE}" + (
            " (only adapter_model.bin, a pickle, which is not read: re-save it with PEFT's "
            "save_pretrained(safe_serialization=True))" if pickled else ""))
    added = not lora_modules(model)
    if added:
        trainable = [(p, p.requires_grad) for p in model.parameters()]  # apply_lora freezes them
        apply_lora(model, cfg, dtype=dtype)
    try:
        _check_matches(model, cfg, "load_adapter")
        with SafetensorsFile(weights) as f:
            state = {name: f.read(name) for name in f.tensors}
        load_lora_state_dict(model, state, what=weights)
    except (LoraError, FormatError) as e:
        if added:  # leave the model as it came
            _unwrap(model, fold=False)
            for p, flag in trainable:
                p.requires_grad_(flag)
        if isinstance(e, LoraError):
            raise
        raise LoraError(f"load_adapter: {e}") from None
    return cfg
