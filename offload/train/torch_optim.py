"""`OffloadAdamW`: the engine behind the torch.optim protocol, for the loops people already
use -- Hugging Face `Trainer`, TRL, Accelerate, a plain `loss.backward(); opt.step();
opt.zero_grad()`.

    opt = offload.OffloadAdamW.from_training_args(model, args, offload="nvme", nvme_dir=...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

(`from_training_args`: what Trainer builds for optim="adamw_torch", its decay groups included;
`OffloadAdamW(model, params, lr=..., ...)` takes torch.optim's arguments.)

What stays the engine's: the gradients leave the device during backward (its post-accumulate
hooks: `loss.backward()` lands them in host buffers and frees the device copies, so no
parameter keeps a `.grad`), the fp32 masters and Adam moments live in RAM or NVMe swap files,
and `step()` is the engine's update after backward (the fused CPU AdamW, block by block).
What is torch.optim's: `param_groups` (per-group lr and weight decay, which LR schedulers
drive), `step(closure)`, `zero_grad()`, `state_dict()` / `load_state_dict()`.

The window of an update is every backward since the last `step()` or `zero_grad()`: the
caller's loop decides the accumulation (gradients of later backward passes are added on the
host in fp32), and scales the loss itself as it does for torch.optim.AdamW (Trainer's
`num_items_in_batch`); an explicit `grad_accum_steps` of the engine's is refused. A step()
with nothing landed changes nothing, as torch's.

Clipping: the trainers call `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`
(Accelerate's `clip_grad_norm_` ends there too) before `step()`. While an OffloadAdamW is
open, that function is wrapped: given this optimizer's parameters it returns the true global
norm of the landed gradients (the per-parameter norms combined as torch combines them) and
the next step scales every gradient by clip_grad_norm_'s coefficient; given anything else it
is torch's own. A call it cannot honour (a part of the parameters, another norm type, twice
in one window, a backward between it and step(), on top of `grad_clip`) raises in one line
-- never a silent no-op; `max_norm=inf` (Trainer's norm for its log) only measures.
`opt.clip_grad_norm_(max_norm)` does the same for code that bound torch's function before the
optimizer existed.

Not served (each refused in one line, docs/RELIABILITY.md T1-T23): fp16 (a GradScaler cannot
unscale gradients that already left the device: use bf16 or fp32; `_step_supports_amp_scaling`
makes torch's GradScaler hand step() its scale, which step() refuses), several ranks (use `offload.initialize` and
`runners.finetune --zero-stage`), the overlapped, speculative and delayed steps (the caller's
loop decides when a window ends and clips after its last backward: the step runs after it),
per-group betas or eps,
parameter groups added after construction.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from offload.config import ConfigError, OffloadConfig, as_config
from offload.optim.state import NvmeState
from offload.train import state as engine_state
from offload.train.engine import Engine
from offload.train.errors import StateError

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP16 = ("dtype='fp16' is not served through the torch.optim protocol: a trainer's fp16 "
         "GradScaler cannot see gradients that already left the device; use dtype='bf16' (or "
         "Trainer(bf16=True)) or 'fp32', or offload.initialize with its own loss scaling")
_SCALER = ("a GradScaler steps this OffloadAdamW (fp16 mixed precision: Trainer(fp16=True), "
           "Accelerator(mixed_precision='fp16')): it cannot unscale gradients that already left "
           "the device, so the update would use the scaled ones; use bf16 or fp32")


_RANKS = ("OffloadAdamW runs in one process (its gradients leave the device before DDP or FSDP "
          "could reduce them); across ranks use offload.initialize or "
          "`torchrun ... -m runners.finetune --zero-stage N`")


def _several_ranks() -> bool:
    """This process is one of several data-parallel ranks (a process group, or torchrun's)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def torch_protocol_config(cfg: OffloadConfig, model: nn.Module, explicit: set[str]) -> OffloadConfig:
    """`cfg` as the optimizer runs it: the step after backward, accumulation decided by the
    caller (grad_accum_steps 2: fp32 landing buffers that later backward passes add into),
    the model's own dtype unless `dtype` is in `explicit`; what it cannot serve refused."""
    if "dtype" not in explicit:
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        name = _DTYPE_NAMES.get(next(iter(dtypes))) if len(dtypes) == 1 else None
        if name is None:
            raise ConfigError(f"the model's trainable parameters are {sorted(map(str, dtypes))}: "
                              f"pass dtype='bf16' or 'fp32' for the weights the engine keeps")
        cfg = cfg.replace(dtype=name)
    if cfg.dtype == "fp16":
        raise ConfigError(_FP16)
    if cfg.delayed_update:
        raise ConfigError("delayed_update is not served through the torch.optim protocol (the "
                          "trainer expects step() to have applied the update); use "
                          "offload.initialize for the delayed update")
    if cfg.speculative_step:
        raise ConfigError("speculative_step is not served through the torch.optim protocol: the "
                          "trainer's loop decides when a window ends (step()) and clips after "
                          "it, so no block can be stepped while backward runs; use "
                          "offload.initialize or runners.finetune --speculative-step")
    if cfg.overlap_step and "overlap_step" in explicit:
        raise ConfigError("overlap_step=True: through the torch.optim protocol the step runs "
                          "after backward (the trainer clips after backward and decides when a "
                          "window ends); leave overlap_step out")
    if "grad_accum_steps" in explicit and cfg.grad_accum_steps != 1:
        raise ConfigError(f"grad_accum_steps={cfg.grad_accum_steps}: through the torch.optim "
                          f"protocol the trainer's loop decides the accumulation (every backward "
                          f"until step() is one update; Trainer's gradient_accumulation_steps); "
                          f"leave grad_accum_steps out")
    return cfg.replace(overlap_step=False, grad_accum_steps=2)


def _group_names(params: Any, model: nn.Module) -> list[tuple[dict[str, Any], list[str]]]:
    """The caller's parameter groups as (options, parameter names), from what torch.optim
    accepts: parameters, (name, parameter) pairs, or dicts with "params"; None: every
    trainable parameter of `model` in one group."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(params, torch.Tensor):
        raise TypeError("params: give an iterable of parameters or of parameter-group dicts, "
                        "not a single tensor")
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    out = []
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError("params: mix of parameters and group dicts; give one or the other")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        names = []
        for p in ps:
            p = p[1] if isinstance(p, tuple) else p
            if id(p) not in name_of:
                raise ConfigError("params: a parameter that is not one of the model's; build the "
                                  "groups from this model's parameters")
            if not p.requires_grad:
                raise ConfigError(f"params: {name_of[id(p)]!r} does not require grad; leave "
                                  f"frozen parameters out of the optimizer's groups")
            names.append(name_of[id(p)])
        out.append(({k: v for k, v in g.items() if k != "params"}, names))
    return out


class OffloadAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's math (decoupled weight decay) run by the offload engine; see the
    module docstring. `model`: the module whose parameters it trains (the engine needs its
    blocks); `params`: its parameters or parameter groups (default: every trainable one);
    the rest are OffloadConfig fields (`offload`, `nvme_dir`, `dtype`, budgets, ...)."""
    # torch.amp.GradScaler then hands step() its scale (`found_inf`, `grad_scale`) instead of
    # unscaling .grad tensors this optimizer never has: step() refuses it in one line
    _step_supports_amp_scaling = True

    def __init__(self, model: nn.Module, params: Iterable[Any] | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, offload: str = "cpu", source: Any = None,
                 **options: Any):
        unknown = sorted(set(options) - set(OffloadConfig.field_names()))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(OffloadConfig.field_names())}")
        cfg = OffloadConfig(offload=offload, lr=lr, betas=tuple(betas), eps=eps,
                            weight_decay=weight_decay, **options)
        self._setup(model, cfg, set(options), params, source)

    @classmethod
    def from_config(cls, model: nn.Module, config: Any, params: Iterable[Any] | None = None,
                    *, source: Any = None) -> "OffloadAdamW":
        """From a whole OffloadConfig (or our flat dict, or a DeepSpeed dict). Its fields that
        differ from the defaults count as asked for (refused where the protocol cannot serve
        them), and an OffloadConfig's dtype always does."""
        cfg, base = as_config(config), OffloadConfig()
        explicit = {f for f in OffloadConfig.field_names() if getattr(cfg, f) != getattr(base, f)}
        self = cls.__new__(cls)
        self._setup(model, cfg, explicit | ({"dtype"} if isinstance(config, OffloadConfig)
                                            else set()), params, source)
        return self

    @classmethod
    def from_training_args(cls, model: nn.Module, args: Any, **options: Any) -> "OffloadAdamW":
        """What Trainer would build from `args` (transformers.TrainingArguments) for
        optim="adamw_torch" -- its learning rate, betas, eps and its two weight-decay groups
        (Trainer.get_decay_parameter_names: norms and biases without decay) -- run by the
        engine; `options`: OffloadConfig fields (offload, nvme_dir, ...)."""
        from transformers import Trainer

        if getattr(args, "fp16", False):
            raise ConfigError(_SCALER)
        decay = set(Trainer.get_decay_parameter_names(None, model))  # reads nothing of self
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay],
                   "weight_decay": args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        return cls(model, [g for g in groups if g["params"]], lr=args.learning_rate,
                   betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                   weight_decay=args.weight_decay, **options)

    def _setup(self, model: nn.Module, cfg: OffloadConfig, explicit: set[str], params: Any,
               source: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"OffloadAdamW needs the model (an nn.Module) first, got "
                            f"{type(model).__name__}: OffloadAdamW(model, lr=...)")
        cfg = torch_protocol_config(cfg, model, explicit)
        if _several_ranks():
            raise ConfigError(_RANKS)
        groups = _group_names(params, model)  # before the engine may replace meta parameters
        self._building = True
        self.engine = Engine(model, cfg, source)
        try:
            if self.engine.zero is not None:  # a group initialised from torchrun's environment
                raise ConfigError(_RANKS)
            live = {s.name: s.param for b in self.engine.blocks for s in b.slots}
            order = [n for _, names in groups for n in names]
            left = sorted(set(live) - set(order))
            if left:
                raise ConfigError(f"params: {len(left)} trainable parameter(s) in no group "
                                  f"({', '.join(left[:3])}...); put every trainable parameter in "
                                  f"a group or freeze it (requires_grad_(False)) first")
            self._order = order  # parameter names in param_groups order (state_dict's indices)
            self._index = {n: i for i, n in enumerate(order)}
            self._names = {id(live[n]): n for n in order}
            defaults = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, amsgrad=False, maximize=False)
            super().__init__([{**opts, "params": [live[n] for n in names]}
                              for opts, names in groups], defaults)
        except BaseException:
            self.engine.close(after_error=True)
            raise
        self._building = False
        self._closed = False
        self._clipped = False
        self._end_queued = False
        self._end_hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                           for p in live.values()]
        self._new_window()
        _LIVE.add(self)
        _install_clip()

    # -- torch.optim.Optimizer --------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise ConfigError("OffloadAdamW cannot take parameter groups after construction "
                              "(the engine's blocks are fixed); pass every group as params=")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients landed since the last step (the next backward starts a window)."""
        super().zero_grad(set_to_none)
        self._new_window()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply the update of every gradient landed since the last step() or zero_grad(),
        clipped as clip_grad_norm_ asked; an update whose gradients hold inf/nan is skipped
        (`engine.last_report.nonfinite`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        if hasattr(self, "found_inf"):
            raise ConfigError(_SCALER)
        if not any(self.engine.grads.touched):  # torch.optim steps no parameter without a .grad
            self._new_window()
            return loss
        lr0, hyper = self._hyper()
        self.engine.set_lr(lr0)
        self.engine.updates.hyper = hyper
        try:
            self.engine.apply_window()
        finally:
            self._new_window()
        return loss

    def _hyper(self) -> tuple[float, dict[str, tuple[float, float]]]:
        """The first group's lr, and (lr, weight decay) of each parameter whose group differs
        from (that lr, the configured weight decay)."""
        cfg = self.engine.cfg
        lr0 = None
        hyper: dict[str, tuple[float, float]] = {}
        for i, g in enumerate(self.param_groups):
            lr, wd = float(g["lr"]), float(g["weight_decay"])
            if not (math.isfinite(lr) and lr >= 0 and math.isfinite(wd) and wd >= 0):
                raise ConfigError(f"param_groups[{i}]: lr {lr!r} and weight_decay {wd!r} must be "
                                  f"finite numbers >= 0")
            if tuple(g["betas"]) != tuple(cfg.betas) or g["eps"] != cfg.eps or \
                    g.get("amsgrad") or g.get("maximize"):
                raise ConfigError(f"param_groups[{i}]: betas, eps, amsgrad and maximize must be the "
                                  f"optimizer's own (betas={cfg.betas}, eps={cfg.eps}, no amsgrad, "
                                  f"no maximize); per-group values of these are not supported")
            lr0 = lr if lr0 is None else lr0
            if (lr, wd) != (lr0, cfg.weight_decay):
                hyper.update({self._names[id(p)]: (lr, wd) for p in g["params"]})
        return lr0, hyper

    # -- clipping ---------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        parameters: list[torch.Tensor] | None = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's landed gradients: returns their
        global L2 norm (fp32, as torch computes it); the next step() multiplies every gradient
        by min(1, max_norm / (norm + 1e-6)). `parameters`: what the caller passed torch's
        function (checked to be this optimizer's, all of them)."""
        self._check_open()
        if parameters is not None:
            self._check_clip_params(parameters)
        if float(norm_type) != 2.0:
            raise ConfigError(f"clip_grad_norm_ with norm_type={norm_type!r}: OffloadAdamW clips "
                              f"by the L2 norm only (norm_type=2)")
        norm_only = math.isinf(float(max_norm)) and float(max_norm) > 0  # Trainer's norm for logs
        if self.engine.cfg.grad_clip > 0 and not norm_only:
            raise ConfigError(f"clip_grad_norm_ on an OffloadAdamW built with grad_clip="
                              f"{self.engine.cfg.grad_clip}: it clips at every step already; "
                              f"drop one of them (e.g. Trainer's max_grad_norm=0)")
        if self._clipped:
            raise RuntimeError("clip_grad_norm_ called twice before step(): clip once per update")
        e = self.engine
        e.grads.wait()
        e.grads.finish_window()
        total = e.grads.global_norm(e.updates.norm_order)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                               f"`parameters` is non-finite, so it cannot be clipped.")
        self._clipped = True
        if not norm_only:
            e.updates.window_clip = float(max_norm)
        return total

    def _check_clip_params(self, parameters: list[torch.Tensor]) -> None:
        ours = set(self._names)
        given = {id(p) for p in parameters}
        if not ours <= given:
            raise ConfigError(f"clip_grad_norm_ over {len(ours & given)} of this OffloadAdamW's "
                              f"{len(ours)} parameters: it clips by the global norm of all of "
                              f"them at once; pass model.parameters()")
        if any(p.grad is not None for p in parameters if id(p) not in ours):
            raise ConfigError("clip_grad_norm_ over this OffloadAdamW's parameters and others "
                              "that hold gradients: clip each optimizer's parameters apart")

    def _owns(self, parameters: list[torch.Tensor]) -> bool:
        return not self._closed and any(id(p) in self._names for p in parameters)

    # -- the window and its backward passes -----------------------------------------------------
    def _new_window(self) -> None:
        self.engine.grads.begin_micro(0)
        self.engine.updates.window_clip = None
        self._clipped = False

    def _on_grad(self, param: torch.Tensor) -> None:
        """A gradient landed (after the engine's own hook): once per backward, what the engine's
        backward() does when it returns is queued for the end of this one."""
        if self._clipped:
            raise RuntimeError("a backward after clip_grad_norm_ and before step(): the norm was "
                               "taken over the gradients landed before it; clip right before "
                               "step(), after the window's last backward")
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end_queued = False
        e = self.engine
        e.grads.end_micro()
        if e.streaming is not None:
            e.streaming.end_backward()
        if e.act_store is not None:
            e.act_store.clear()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout ("state": per parameter index its step, exp_avg,
        exp_avg_sq, plus the fp32 "master"; "param_groups") and the engine's counters under
        "offload". Before the first update "state" is empty (nothing but the weights)."""
        self._check_open()
        e = self.engine
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        state: dict[int, dict[str, torch.Tensor]] = {}
        if e.global_step > 0:
            index = self._index
            for bi, block in enumerate(e.blocks):
                flat = e.optimizer_state(bi)
                engine_state.check_finite(flat, f"block {block.name}")
                views = {k: block.views(v) for k, v in flat.items()}
                for s in block.slots:
                    steps = e.global_step - e.slot_skips.get(s.name, 0)
                    state[index[s.name]] = {"step": torch.tensor(float(steps)),
                                            **{k: views[k][s.name] for k in engine_state.KINDS}}
        return {"state": state, "param_groups": groups,
                "offload": {**e.state_meta(), "names": list(self._order)}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict() gave (validated: another model's, a damaged one or a
        torch.optim.AdamW state is refused in one line); the weights follow the masters."""
        self._check_open()
        e = self.engine
        meta = state_dict.get("offload") if isinstance(state_dict, dict) else None
        if not isinstance(meta, dict):
            raise StateError("not an OffloadAdamW state_dict (no 'offload' entry: a torch.optim "
                             "state holds no fp32 masters); load one that OffloadAdamW saved, or "
                             "start the optimizer fresh")
        where = "the optimizer state"
        if meta.get("names") != self._order:
            raise StateError(f"{where} was saved for other parameters or groups; load it into "
                             f"an OffloadAdamW of the same model built with the same params=")
        skips, _ = engine_state.check_meta(e.parts, meta, where, where)
        saved_groups = state_dict.get("param_groups")
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g.get("params", ())) if isinstance(g, dict) else None
                       for g in (saved_groups if isinstance(saved_groups, list) else [])]
        if saved_sizes != sizes:
            raise StateError(f"{where} has parameter groups of {saved_sizes} parameters, this "
                             f"optimizer {sizes}: build the OffloadAdamW with the params= groups "
                             f"it was saved with")
        state = state_dict.get("state")
        if meta["global_step"] == 0:
            if e.global_step != 0:
                raise StateError(f"{where} is from before the first update; load it into a "
                                 f"fresh OffloadAdamW")
        else:
            state = state if isinstance(state, dict) else {}
            self._check_entries(state)  # all of it, before anything changes
            for bi in range(len(e.blocks)):
                engine_state.restore_block(e.parts, bi, self._block_values(bi, state))
            e.updates.load_state_dict({**meta, "slot_skips": skips})
            if isinstance(e.parts.state, NvmeState):  # the swap files now hold this step
                e.parts.state.end_step(e.parts.unit_order(), e.global_step)
        for g, saved in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self._new_window()

    def _check_entries(self, state: dict) -> None:
        for s in (s for b in self.engine.blocks for s in b.slots):
            entry = state.get(self._index[s.name])
            for k in engine_state.KINDS:
                t = entry.get(k) if isinstance(entry, dict) else None
                if not (isinstance(t, torch.Tensor) and t.shape == s.shape and
                        t.dtype == torch.float32 and bool(torch.isfinite(t).all())):
                    raise StateError(f"the optimizer state's {k} of {s.name!r} is missing or "
                                     f"not a finite float32 tensor of shape {tuple(s.shape)}: "
                                     f"the saved state is damaged; resume from another "
                                     f"checkpoint")

    def _block_values(self, bi: int, state: dict) -> dict[str, torch.Tensor]:
        """Block bi's flat masters and moments from the (checked) per-parameter entries."""
        block = self.engine.blocks[bi]
        flats = {k: torch.empty(block.numel, dtype=torch.float32) for k in engine_state.KINDS}
        for s in block.slots:
            for k in engine_state.KINDS:
                flats[k][s.offset:s.offset + s.numel].copy_(state[self._index[s.name]][k].reshape(-1))
        return flats

    # -- lifetime ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadAdamW used after close()")

    def close(self) -> None:
        """Close the engine (IO, threads, hooks: the model is a plain module again)."""
        if self._closed:
            return
        self._closed = True
        for h in self._end_hooks:
            h.remove()
        _LIVE.discard(self)
        self.engine.close()
        if not _LIVE:
            _uninstall_clip()


# -- torch.nn.utils.clip_grad_norm_, routed to the optimizer that owns the parameters ---------
_LIVE: "weakref.WeakSet[OffloadAdamW]" = weakref.WeakSet()
_TORCH_CLIP: dict[str, Callable] = {}


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, or an open OffloadAdamW's when it owns `parameters`."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for opt in list(_LIVE):
        if opt._owns(params):
            return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, parameters=params)
    return _TORCH_CLIP["fn"](params, max_norm, norm_type, error_if_nonfinite, foreach)


def _install_clip() -> None:
    import torch.nn.utils.clip_grad as clip_grad
    if "fn" not in _TORCH_CLIP:
        _TORCH_CLIP["fn"] = clip_grad.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad.clip_grad_norm_ = clip_grad_norm_


def _uninstall_clip() -> None:
    import torch.nn.utils.clip_grad as clip_grad
    real = _TORCH_CLIP.pop("fn", None)
    if real is None:
        return
    for mod in (torch.nn.utils, clip_grad):
        if getattr(mod, "clip_grad_norm_", None) is clip_grad_norm_:
            mod.clip_grad_norm_ = real


__all__ = ["OffloadAdamW", "clip_grad_norm_", "torch_protocol_config"]
