"""Every key the DeepSpeed import accepts is honoured: the test finds the accepted keys by asking
the importer itself (each section's "supported: ..." list), so a key added later without a test
here fails. A mapped key must change the resulting OffloadConfig; a validated key must change
what is accepted; an inert key must say so (a note). "auto" values resolve from the runner's
flags or the defaults; offload_param really streams the weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

import offload
from offload.config import ConfigError, OffloadConfig
from offload.config import DEEPSPEED_INERT, AutoValues, from_deepspeed
from offload.models import build_model, preset

ZERO3 = {"stage": 3}
# section -> how to place a dict of keys into a full config
SECTIONS = {
    "": lambda d: d,
    "zero_optimization": lambda d: {"zero_optimization": {**ZERO3, **d}},
    "offload_optimizer": lambda d: {"zero_optimization": {**ZERO3, "offload_optimizer": {"device": "cpu", **d}}},
    "offload_param": lambda d: {"zero_optimization": {**ZERO3, "offload_param": {"device": "cpu", **d}}},
    "aio": lambda d: {"aio": d},
    "fp16": lambda d: {"fp16": {"enabled": True, **d}},
    "bf16": lambda d: {"bf16": d},
    "optimizer": lambda d: {"optimizer": d},
    "optimizer.params": lambda d: {"optimizer": {"type": "AdamW", "params": d}},
}
# keys that are sections themselves (their keys are walked in their own section)
CONTAINERS = {("", "zero_optimization"), ("", "aio"), ("", "fp16"), ("", "bf16"), ("", "optimizer"),
              ("zero_optimization", "offload_optimizer"), ("zero_optimization", "offload_param"),
              ("optimizer", "params")}
# mapped keys: a non-default value and the OffloadConfig field it must set to what
MAPPED = {
    ("", "gradient_clipping"): (0.5, "grad_clip", 0.5),
    ("", "gradient_accumulation_steps"): (4, "grad_accum_steps", 4),
    ("", "train_micro_batch_size_per_gpu"): (4, "micro_batch_size", 4),
    ("", "train_batch_size"): (8, "micro_batch_size", 8),
    ("zero_optimization", "sub_group_size"): (1 << 20, "sub_group_size", 1 << 20),
    ("offload_optimizer", "device"): ("none", "offload", "none"),  # the probe section says cpu
    ("offload_optimizer", "nvme_path"): ("/tmp/swap", "nvme_dir", "/tmp/swap"),
    ("offload_optimizer", "pin_memory"): (False, "pin_memory", False),
    ("offload_optimizer", "buffer_count"): (8, "buffer_count", 8),
    ("offload_optimizer", "super_offload"): (True, "speculative_step", True),  # SuperOffload
    ("offload_param", "device"): ("none", "offload_params", "none"),  # the probe section says cpu
    ("offload_param", "nvme_path"): ("/tmp/swap", "nvme_dir", "/tmp/swap"),
    ("offload_param", "pin_memory"): (False, "pin_memory", False),
    ("offload_param", "buffer_count"): (5, "prefetch_blocks", 4),
    ("aio", "block_size"): (1 << 20, "io_block_bytes", 1 << 20),
    ("aio", "queue_depth"): (8, "io_queue_depth", 8),
    ("aio", "thread_count"): (2, "io_threads", 2),
    ("fp16", "enabled"): (False, "dtype", "fp32"),  # the probe section enables it
    ("fp16", "loss_scale"): (128.0, "loss_scale", 128.0),
    ("fp16", "initial_scale_power"): (8, "initial_scale_power", 8),
    ("fp16", "loss_scale_window"): (50, "loss_scale_window", 50),
    ("fp16", "hysteresis"): (2, "hysteresis", 2),
    ("fp16", "min_loss_scale"): (2.0, "min_loss_scale", 2.0),
    ("bf16", "enabled"): (True, "dtype", "bf16"),
    ("optimizer.params", "lr"): (3e-5, "lr", 3e-5),
    ("optimizer.params", "betas"): ([0.8, 0.95], "betas", (0.8, 0.95)),
    ("optimizer.params", "eps"): (1e-6, "eps", 1e-6),
    ("optimizer.params", "weight_decay"): (0.1, "weight_decay", 0.1),
}
# validated keys: (a value that is accepted, a value that is refused)
VALIDATED = {
    ("", "scheduler"): (None, {"type": "WarmupLR"}),
    ("zero_optimization", "stage"): (3, 2),  # offload_param needs stage 3 (given in the probe below)
    ("offload_optimizer", "ratio"): (1, 0.5),
    ("aio", "use_gds"): (False, True),
    ("optimizer", "type"): ("AdamW", "SGD"),
    ("optimizer.params", "adam_w_mode"): (True, False),
    ("optimizer.params", "bias_correction"): (True, False),
}


def accepted_keys(section: str) -> set[str]:
    """The keys the importer accepts in `section`, read off its own refusal of a bogus key."""
    with pytest.raises(ConfigError) as e:
        from_deepspeed(SECTIONS[section]({"no_such_key": 1}))
    supported = re.search(r"supported: (.*)$", str(e.value)).group(1)
    return set(supported.split(", "))


def test_every_accepted_key_is_honoured():
    walked = 0
    for section in SECTIONS:
        for key in sorted(accepted_keys(section)):
            where = (section, key)
            if where in CONTAINERS:
                continue
            walked += 1
            if where in MAPPED:
                value, field, want = MAPPED[where]
                base = from_deepspeed(SECTIONS[section]({}), notes=[])
                got = from_deepspeed(SECTIONS[section]({key: value}), notes=[])
                assert getattr(got, field) == want != getattr(base, field), where
            elif where in VALIDATED:
                ok, bad = VALIDATED[where]
                probe = (lambda d: {"zero_optimization": {**d, "offload_param": {"device": "cpu"}}}) \
                    if where == ("zero_optimization", "stage") else SECTIONS[section]
                if ok is not None:
                    from_deepspeed(probe({key: ok}), notes=[])
                with pytest.raises(ConfigError):
                    from_deepspeed(probe({key: bad}), notes=[])
            elif key in DEEPSPEED_INERT.get(section, {}):
                notes: list[str] = []
                cfg = from_deepspeed(SECTIONS[section]({key: True}), notes=notes)
                assert any(f"{key} has no effect here: " in n for n in notes), where
                assert cfg == from_deepspeed(SECTIONS[section]({}), notes=[]), where
            else:
                pytest.fail(f"DeepSpeed key {section}.{key} is accepted but this test does not know "
                            f"how it is honoured: add it to MAPPED, VALIDATED or DEEPSPEED_INERT")
    assert walked >= 50


def test_inert_keys_are_never_silent_for_library_callers():
    with pytest.warns(UserWarning, match="overlap_comm has no effect here"):
        offload.OffloadConfig.from_dict({"zero_optimization": {"stage": 2, "overlap_comm": True}})


def test_auto_values_resolve_from_the_flags_and_the_defaults():
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                "stage3_prefetch_bucket_size": "auto", "sub_group_size": "auto"}}
    flags = AutoValues(lr=2e-5, weight_decay=0.01, grad_clip=0.7, dtype="bf16", micro_batch_size=2,
                       grad_accum_steps=8)
    cfg = from_deepspeed(ds, auto=flags, notes=[])
    assert (cfg.lr, cfg.weight_decay, cfg.grad_clip, cfg.dtype) == (2e-5, 0.01, 0.7, "bf16")
    assert (cfg.micro_batch_size, cfg.grad_accum_steps) == (2, 8)
    default = OffloadConfig()
    assert (cfg.betas, cfg.eps, cfg.sub_group_size) == (default.betas, default.eps, default.sub_group_size)
    bare = from_deepspeed(ds, notes=[])  # nothing supplied: our defaults
    assert (bare.lr, bare.grad_clip, bare.dtype, bare.micro_batch_size) == \
        (default.lr, default.grad_clip, "fp32", None)
    assert from_deepspeed({"fp16": {"enabled": "auto"}}, auto=AutoValues(dtype="fp16"), notes=[]).dtype == "fp16"


def test_published_zero3_nvme_config(tmp_path):
    """The shape of the Hugging Face Trainer's ds_config_zero3.json, with NVMe for both."""
    ds = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                   "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
          "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "zero_optimization": {
              "stage": 3,
              "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True},
              "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True},
              "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
              "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
              "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
          "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "wall_clock_breakdown": False}
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(ds))
    notes: list[str] = []
    cfg = offload.load_config_file(str(path), auto=AutoValues(lr=1e-4, dtype="bf16", grad_clip=1.0,
                                                               micro_batch_size=1, grad_accum_steps=4),
                                   notes=notes)
    assert (cfg.offload, cfg.offload_params, cfg.nvme_dir) == ("nvme", "nvme", str(tmp_path))
    assert (cfg.dtype, cfg.lr, cfg.grad_clip, cfg.grad_accum_steps, cfg.sub_group_size) == \
        ("bf16", 1e-4, 1.0, 4, 10**9)
    assert len(notes) == 10 and all("has no effect here" in n for n in notes)


def test_offload_param_streams_the_weights(tmp_path):
    """A DeepSpeed config asking for the weights in host RAM gives an engine that streams them."""
    model = build_model(preset("tiny"), "cpu", torch.float32, source=0)
    cfg = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                "offload_param": {"device": "cpu"}}}, notes=[],
                         device="cpu")
    engine = offload.initialize(model, cfg)
    try:
        assert engine.streaming is not None and engine.memory_report()["host"]["weights"] > 0
    finally:
        engine.close()


def test_runner_takes_batch_sizes_from_the_config(tmp_path, capsys):
    from runners import finetune
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                      "offload_optimizer": {"device": "cpu"}}}))
    assert finetune.main(["--config", str(path), "--steps", "1", "--seq-len", "16", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "6 x 16 tokens = 3 micro-batches of 2" in out
    assert "note: DeepSpeed config: zero_optimization.overlap_comm has no effect here" in err
    assert finetune.main(["--config", str(path), "--batch-size", "8", "--dry-run"]) == 2
    assert "disagree with --config" in capsys.readouterr().err


def test_the_runner_resolves_a_config_file_once_and_says_where_each_value_came_from(tmp_path, capsys):
    """`--config {}` kept the library's defaults (bf16, lr 0.001, no clipping) over the runner's;
    "auto" clipping resolved to 0, not the runner's 1.0; a key given twice was accepted (last
    wins). Now: what the file leaves out is the runner's default, "auto" is what the runner
    would choose, a flag wins over the file, duplicates are refused, and the banner names each
    value's source."""
    from runners import finetune

    def banner(config: dict | str, *flags: str) -> tuple[int, str, str]:
        path = tmp_path / "c.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        rc = finetune.main(["--config", str(path), "--dry-run", *flags])
        out, err = capsys.readouterr()
        line = next((ln for ln in out.splitlines() if ln.startswith("  config ")), "")
        return rc, line, err

    rc, line, _ = banner({})
    assert rc == 0
    for value in ("dtype fp32 (default)", "lr 0.003 (default)", "grad_clip 1.0 (default)",
                  "offload cpu (default)"):
        assert value in line, line
    rc, line, _ = banner({"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                          "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    assert rc == 0 and "grad_clip 1.0 (file)" in line and "lr 0.003 (file)" in line, line
    rc, line, _ = banner({"lr": 1e-4, "grad_clip": 0.5}, "--lr", "2e-4")
    assert rc == 0 and "lr 0.0002 (flag)" in line and "grad_clip 0.5 (file)" in line, line
    rc, _, err = banner('{"lr": 1e-4, "dtype": "fp32", "lr": 2e-4}')
    assert rc == 2 and "the key 'lr' is given twice" in err, err
