"""Config and CLI fuzzing: every invalid value or combination is a typed error from the library
(ConfigError) or one line `error: ...` with a non-zero exit from the runners — never a
traceback from deep inside, a hang, or an allocation the plan did not allow."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

pytest.importorskip("hypothesis", reason="property tests need hypothesis: pip install -e '.[test]' "
                    "(the GPU machine has none; its kit is `pytest -m cuda`)")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.config import ConfigError, OffloadConfig, parse_bytes
from offload.config import from_deepspeed, load_config_file
from offload.memory.tiers import BudgetError
from offload.train.plan import plan_training

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# values of every JSON type, plus the edge cases of numbers and sizes
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.integers(),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["", "cpu", "nvme", "none", "cuda:0", "cuda:x", "meta",
                                     "bf16", "fp16", "fp32", "float64", "12GiB", "1e3", "-1",
                                     "9" * 400, "auto", "/tmp/x", 4096, 2**40, 2**70, 127, 128]))
_value = st.one_of(_scalar, st.lists(_scalar, max_size=3),
                   st.dictionaries(st.text(max_size=3), _scalar, max_size=2))


def _check_accepted(cfg: OffloadConfig) -> None:
    """A config the library accepted must be usable: derived values and the plan compute."""
    assert cfg.offload in ("none", "cpu", "nvme") and cfg.dtype in ("fp32", "bf16", "fp16")
    bools = [f.name for f in dataclasses.fields(cfg) if f.default in (True, False)
             and type(f.default) is bool]
    assert len(bools) >= 8 and all(isinstance(getattr(cfg, k), bool) for k in bools), bools
    assert math.isfinite(cfg.lr) and math.isfinite(cfg.loss_scale)
    float(2.0 ** cfg.initial_scale_power)
    for tier in ("device", "host", "nvme"):
        cfg.budget_bytes(tier)
    try:
        device = cfg.resolve_device()
    except ConfigError:
        return  # cuda asked for on a machine without one: refused when used, in one line
    plan = plan_training([(1000, True), (3000, False)], cfg, device)
    try:
        plan.check()
    except BudgetError:
        pass


@FUZZ
@given(d=st.dictionaries(st.sampled_from(OffloadConfig.field_names() + ["bogus"]), _value,
                         max_size=6))
def test_fuzzed_flat_configs(d):
    try:
        cfg = OffloadConfig.from_dict(d)
    except ConfigError:
        return
    _check_accepted(cfg)


_ds_section = st.dictionaries(st.sampled_from(
    ["stage", "offload_optimizer", "device", "nvme_path", "pin_memory", "buffer_count", "enabled",
     "loss_scale", "initial_scale_power", "hysteresis", "min_loss_scale", "type", "params", "lr",
     "betas", "eps", "weight_decay", "adam_w_mode", "block_size", "queue_depth", "thread_count",
     "bogus"]), st.one_of(_value, st.dictionaries(st.sampled_from(
         ["device", "nvme_path", "lr", "betas", "buffer_count", "pin_memory"]), _value, max_size=3)),
    max_size=4)


@FUZZ
@given(ds=st.dictionaries(st.sampled_from(
    ["zero_optimization", "aio", "fp16", "bf16", "gradient_clipping", "gradient_accumulation_steps",
     "optimizer", "train_batch_size", "scheduler", "bogus"]), st.one_of(_ds_section, _value),
    max_size=4))
def test_fuzzed_deepspeed_configs(ds):
    try:
        cfg = from_deepspeed(ds)
    except ConfigError:
        return
    _check_accepted(cfg)


@FUZZ
@given(value=st.one_of(st.text(max_size=30), _scalar))
def test_fuzzed_sizes(value):
    try:
        n = parse_bytes(value, "budget")
    except ConfigError as e:
        assert str(e).startswith("budget: ")
        return
    assert n is None or (type(n) is int and n >= 0)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=40), st.just(b"[" * 50_000),
                     st.just(b'{"lr": ' + b"1" * 5000 + b"}"), st.just(b'{"lr": NaN}'),
                     st.just(json.dumps({"betas": 5}).encode()),
                     st.just(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
                         "device": "nvme"}}}).encode())))
def test_fuzzed_config_files(tmp_path, raw):
    path = tmp_path / "ds.json"
    path.write_bytes(raw)
    try:
        cfg = load_config_file(str(path))
    except ConfigError as e:
        assert str(e).startswith(f"config file {path}: ")
        return
    _check_accepted(cfg)


CONFIG_CASES = {  # invalid values, each with the message that names it
    "offload 'gpu'": ({"offload": "gpu"}, "offload: 'gpu' is not one of"),
    "nvme without a dir": ({"offload": "nvme"}, "needs nvme_dir"),
    "nvme_dir a number": ({"offload": "nvme", "nvme_dir": 5}, "nvme_dir: must be a string"),
    "dtype fp64": ({"dtype": "fp64"}, "dtype: 'fp64' is not supported"),
    "device a list": ({"device": ["cpu"]}, "is not a device"),
    "device tpu": ({"device": "xla:0"}, "only 'cpu' and 'cuda:N'"),
    "lr NaN": ({"lr": float("nan")}, "lr: must be a finite number"),
    "lr a string": ({"lr": "1e-3"}, "lr: must be a finite number"),
    "eps 0": ({"eps": 0}, "eps: must be > 0"),
    "betas an int": ({"betas": 5}, "betas: must be two numbers"),
    "beta 1.0": ({"betas": (0.9, 1.0)}, "betas: must be two numbers in [0, 1)"),
    "grad_accum_steps 0": ({"grad_accum_steps": 0}, "grad_accum_steps: must be an integer >= 1"),
    "buffer_count a float": ({"buffer_count": 4.0}, "buffer_count: must be an integer"),
    "io_threads 10**6": ({"io_threads": 10**6}, "io_threads: must be an integer in [1, 1024]"),
    "io_block_bytes not 4 KiB-aligned": ({"io_block_bytes": 5000}, "multiple of 4096"),
    "initial_scale_power 2000": ({"initial_scale_power": 2000}, "must be <= 127"),
    "loss_scale inf": ({"loss_scale": float("inf")}, "loss_scale: must be a finite number"),
    "min_loss_scale NaN": ({"min_loss_scale": float("nan")}, "min_loss_scale: must be a finite"),
    "pin_memory 'yes'": ({"pin_memory": "yes"}, "pin_memory: must be true or false"),
    "overlap_step 1": ({"overlap_step": 1}, "overlap_step: must be true or false"),
    "budget '12 parsecs'": ({"host_budget": "12 parsecs"}, "host_budget: cannot read"),
    "budget of 400 digits": ({"host_budget": "9" * 400}, "not a finite size"),
    "budget negative": ({"host_budget": -5}, "host_budget: must be a non-negative size"),
    "replay_hold_bytes 'lots'": ({"replay_hold_bytes": "lots"}, "replay_hold_bytes: cannot read"),
    "unknown key": ({"learning_rate": 1}, "unknown config key(s) 'learning_rate'"),
    "non-string key": ({1: 2}, "config keys must be strings"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_value(case):
    d, match = CONFIG_CASES[case]
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_dict(d)
    assert match in str(e.value)


DEEPSPEED_CASES = {
    "fp16 and bf16 both on": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "pick one"),
    "enabled a string": ({"fp16": {"enabled": "false"}}, "fp16.enabled: must be true or false"),
    "scheduler": ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' is not supported"),
    "optimizer SGD": ({"optimizer": {"type": "SGD"}}, "'SGD' is not supported"),
    "adam_w_mode false": ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
                          "only AdamW"),
    "offload device gpu": ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
                           "offload_optimizer.device: 'gpu'"),
    "unknown zero key": ({"zero_optimization": {"stage3_magic": 1}}, "unknown key(s) 'stage3_magic'"),
    "section a list": ({"aio": [1]}, "aio: must be a dict"),
    "'auto' path": ({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "auto"}}}, '"auto" cannot be resolved here'),
    "'auto' device": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}}},
                      '"auto" cannot be resolved here'),
    "offload_param device disk": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
                                  "offload_param.device: 'disk'"),
    "offload_param without stage 3": ({"zero_optimization": {"stage": 2, "offload_param": {
        "device": "cpu"}}}, "offload_param needs stage 3"),
    "offload_optimizer at stage 0": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                                     "needs stage 1, 2 or 3"),
    "two nvme paths": ({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/a"}, "offload_param": {"device": "nvme", "nvme_path": "/b"}}},
        "nvme_path differ"),
    "partial offload": ({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 0.3}}}, "partial optimizer offload"),
    "gds": ({"aio": {"use_gds": True}}, "GPUDirect Storage is not supported"),
    "batch sizes disagree": ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 4}, "fix one of them"),
    "batch not a multiple": ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
                             "not a multiple"),
    "stage 4": ({"zero_optimization": {"stage": 4}}, "stage: 4 is not one of"),
}


@pytest.mark.parametrize("case", sorted(DEEPSPEED_CASES))
def test_bad_deepspeed_value(case):
    d, match = DEEPSPEED_CASES[case]
    with pytest.raises(ConfigError, match=None) as e:
        from_deepspeed(d)
    assert match in str(e.value)


@pytest.mark.parametrize("raw, match", [
    (b"\xff\xfe{}", "not valid JSON"), (b"[" * 50_000, "nested too deeply"),
    (b'{"lr": ' + b"1" * 5000 + b"}", "not valid JSON"), (b"[1, 2]", "must be a dict"),
])
def test_bad_config_file(tmp_path, raw, match):
    path = tmp_path / "c.json"
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=match):
        load_config_file(str(path))


def test_config_file_that_is_not_a_file(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(ConfigError, match="not a regular JSON file"):
        load_config_file(str(tmp_path / "fifo.json"))
    with pytest.raises(ConfigError, match="not a regular JSON file"):
        load_config_file("/dev/zero")


# ---- the command lines ------------------------------------------------------------------------
def _one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0, err
    assert err and err[-1].startswith("error: "), err
    assert not any("Traceback" in line for line in err), err
    return err[-1]


FINETUNE_CASES = {  # argv -> part of the one-line message
    "--steps 0": (["--steps", "0"], "--steps must be at least 1"),
    "--seq-len -4": (["--seq-len", "-4"], "--seq-len must be at least 1"),
    "--micro-batch-size 0": (["--micro-batch-size", "0"], "must divide --batch-size"),
    "--micro-batch-size 3 of 16": (["--micro-batch-size", "3"], "must divide --batch-size"),
    "--seed 2**64": (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
    "--seed -1": (["--seed", "-1"], "--seed must be in"),
    "--lr nan": (["--lr", "nan"], "lr: must be a finite number"),
    "--grad-clip -1": (["--grad-clip", "-1"], "grad_clip: must be a finite number"),
    "--weight-decay 1e400": (["--weight-decay", "1e400"], "weight_decay: must be a finite"),
    "--min-lr-ratio 2": (["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
    "--eval-every -1": (["--eval-every", "-1"], "must be >= 0"),
    "--stop-after 0": (["--stop-after", "0"], "--stop-after must be at least 1"),
    "--dtype fp64": (["--dtype", "fp64"], "invalid choice: 'fp64'"),
    "--offload gpu": (["--offload", "gpu"], "invalid choice: 'gpu'"),
    "--steps ten": (["--steps", "ten"], "invalid int value: 'ten'"),
    "--offload-dir with --offload cpu": (["--offload", "cpu", "--offload-dir", "/tmp"],
                                         "only used with --offload nvme"),
    "--offload-activations alone": (["--offload-activations"], "add --activation-checkpointing"),
    "--cpu-memory lots": (["--cpu-memory", "lots"], "cannot read 'lots' as a size"),
    "--cpu-memory 1KiB": (["--cpu-memory", "1KiB"], "host budget of 1.00 KiB"),
    "--gpu 0 without CUDA": (["--gpu", "0"], "--gpu 0"),
    "--model unknown": (["--model", "gpt5"], "unknown preset 'gpt5'"),
    "--model missing dir": (["--model", "./nope"], "no such file or directory"),
    "--config missing": (["--config", "/nonexistent.json"], "cannot read"),
    "--config /dev/zero": (["--config", "/dev/zero"], "not a regular JSON file"),
    "--metrics in a missing dir": (["--metrics", "/nonexistent/m.jsonl"], "does not exist"),
    "--data a FIFO": (["--data", "FIFO"], "not a regular file"),
    "--data missing": (["--data", "/nonexistent.txt"], "does not exist"),
    "--resume without a checkpoint": (["--resume", "EMPTY"], "no complete checkpoint"),
    "--output not writable": (["--output", "/proc/offload-out"], "not writable"),
}


@pytest.mark.parametrize("case", sorted(FINETUNE_CASES))
def test_bad_finetune_command_line(case, tmp_path, capsys):
    from runners.finetune import main

    argv, match = FINETUNE_CASES[case]
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "empty").mkdir()
    argv = [{"FIFO": str(tmp_path / "fifo.txt"), "EMPTY": str(tmp_path / "empty")}.get(a, a)
            for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "out")]
    argv += ["--no-progress"] + ([] if "--steps" in argv else ["--steps", "1"])
    line = _one_line_error(capsys, main(argv))
    assert match in line, line


_FLAG_VALUES = {
    "--offload": ["none", "cpu", "nvme", "auto", "gpu"], "--dtype": ["fp32", "bf16", "fp16", "x"],
    "--steps": ["1", "0", "-1", "2.5", "99999999999999999999"], "--batch-size": ["1", "16", "0", "3"],
    "--micro-batch-size": ["1", "2", "0", "5", "-1"], "--seq-len": ["8", "0", "100000000"],
    "--lr": ["0", "1e-3", "nan", "inf", "-1", "x"], "--grad-clip": ["0", "1", "nan"],
    "--weight-decay": ["0", "-0.1", "1e400"], "--warmup-steps": ["0", "5", "-3"],
    "--min-lr-ratio": ["0", "1", "1.5", "nan"], "--eval-every": ["0", "-1"],
    "--save-every": ["0", "3", "-2"], "--seed": ["0", "-1", str(2**63), str(2**70)],
    "--stop-after": ["1", "0"], "--cpu-memory": ["1KiB", "12GiB", "-1", "x", "9" * 50],
    "--gpu-memory": ["1GiB", "0"], "--gpu": ["0", "-1", "7"],
    "--offload-params": ["none", "cpu", "nvme", "disk"], "--model": ["tiny", "70B", "nope", "./x"],
    "--offload-dir": ["SWAP", "/proc/x"],
}
_SWITCHES = ["--activation-checkpointing", "--offload-activations"]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(sorted(_FLAG_VALUES)), st.integers(0, 10), max_size=5),
       switches=st.lists(st.sampled_from(_SWITCHES), max_size=2, unique=True))
def test_fuzzed_finetune_flag_combinations(tmp_path, capsys, flags, switches):
    """Random combinations through everything up to the memory plan (--dry-run): a plan, or
    one line — never a traceback."""
    from runners.finetune import main

    argv = ["--dry-run", "--output", str(tmp_path / "o")] + switches
    for flag, i in flags.items():
        values = _FLAG_VALUES[flag]
        value = values[i % len(values)]
        argv += [flag, str(tmp_path / "swap") if value == "SWAP" else value]
    rc = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    if rc != 0:
        assert rc == 2 and captured.err.strip().splitlines()[-1].startswith("error: "), captured.err
    else:
        assert "dry run: the plan fits" in captured.out


INFER_CASES = {
    "--probe-seconds nan (measured forever)": (["--probe-seconds", "nan"], "--probe-seconds must"),
    "--probe-seconds 1e9": (["--probe-seconds", "1e9"], "--probe-seconds must be in [0, 60]"),
    "--nvme-ahead 0": (["--nvme-ahead", "0"], "--nvme-ahead must be >= 1"),
    "--batch-size 10**8": (["--batch-size", str(10**8)], "--batch-size must be in [1, 65536]"),
    "--seed 2**64": (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
    "--init-seed -1": (["--init-seed", "-1"], "--init-seed must be in"),
    "--temperature inf": (["--temperature", "inf"], "--temperature must be a finite"),
    "--temperature -1": (["--temperature", "-1"], "temperature must be >= 0"),
    "--top-p 0": (["--top-p", "0"], "top-p must be in (0, 1]"),
    "--top-k -1": (["--top-k", "-1"], "top-k must be >= 0"),
    "--max-new-tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    "--prompt-ids with a letter": (["--prompt-ids", "1,x"], "comma-separated integers"),
    "--prompt-ids out of vocabulary": (["--prompt-ids", "5000"], "out of range"),
    "--prompt-file /dev/zero": (["--prompt-file", "/dev/zero"], "not a regular text file"),
    "--prompt without a tokenizer": (["--prompt", "hi"], "need a tokenizer.json"),
    "--gpu-memory on the CPU": (["--gpu-memory", "1GiB"], "--gpu-memory applies to a GPU"),
    "--cpu-memory 1KiB": (["--cpu-memory", "1KiB"], "below one block"),
    "--max-new-tokens 10**12": (["--max-new-tokens", str(10**12)], "more than the"),
    "--model /dev/null": (["--model", "/dev/null"], "not a directory"),
}


@pytest.mark.parametrize("case", sorted(INFER_CASES))
def test_bad_infer_command_line(case, tmp_path, capsys):
    from runners.common import run_main
    from runners.infer import main

    argv, match = INFER_CASES[case]
    extra = ["--probe-seconds", "0"] if "--probe-seconds" not in argv else []
    line = _one_line_error(capsys, run_main(main, argv + extra + [
        "--dry-run", "--offload-dir", str(tmp_path / "cache")]))
    assert match in line, line
    assert not os.path.exists(tmp_path / "cache") or not os.listdir(tmp_path / "cache")
