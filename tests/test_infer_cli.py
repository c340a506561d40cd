"""python -m runners.infer: identical greedy output across --weights tiers and a planner mix
(against transformers), text prompts through tokenizer.json, and one clean error line with exit
code 2 for every kind of bad input."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import stderr_until
from offload.models import build_model, preset, save_pretrained
from runners.common import run_main
from runners.infer import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = "3,14,15,92,65,35"
NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    cfg = preset("tiny").replace(initializer_range=0.2, eos_token_id=None)
    save_pretrained(build_model(cfg, "cpu", torch.float32, source=21), path)
    return path


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = run_main(main, [str(a) for a in argv] + ["--probe-seconds", "0.05"])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_tiers_and_planner_mix_match_transformers(ckpt, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    prompt = [int(x) for x in IDS.split(",")]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    base = ["--model", ckpt, "--prompt-ids", IDS, "--max-new-tokens", NEW]
    # size a budget that holds all-NVMe streaming (2 slots) plus one resident block: a planner mix
    one_ahead = ["--nvme-ahead", "1"]
    rc, _, _ = _run(base + one_ahead + ["--weights", "nvme", "--dry-run", "--output-json",
                                        tmp_path / "p.json"], capsys)
    plan = _json(tmp_path / "p.json")["plan"]
    budget = plan["device_need"] + plan["block_bytes"][0] + 1000
    runs = {w: ["--weights", w] for w in ("device", "cpu", "nvme")}
    runs["mix"] = ["--cpu-memory", str(budget)] + one_ahead
    for name, extra in runs.items():
        out = tmp_path / f"{name}.json"
        rc, stdout, err = _run(base + extra + ["--output-json", out], capsys)
        assert rc == 0, err
        res = _json(out)
        assert res["generated_ids"] == [want], name
        assert "prefill" in err and "floor" in err and "peak memory" in err
        assert all(int(p) <= 100 for p in re.findall(r"(\d+)% of floor", err)), err
        if name in ("nvme", "mix"):  # the floor comes from the streamer's own reads
            assert "read by the streamer" in err
        assert stdout.split() == [str(t) for t in want]  # streamed as produced
    mix = _json(tmp_path / "mix.json")
    assert mix["metrics"]["blocks_per_tier"] == {"device": 1, "cpu": 0, "nvme": 3}
    assert mix["metrics"]["bytes_per_token"]["nvme"] > 0


def test_text_prompt_through_tokenizer(ckpt, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>", "hello", "world", "offload"] + [f"w{i}" for i in range(1020)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for f in os.listdir(ckpt):  # copies: links out of a checkpoint dir are refused (hostile input)
        shutil.copy(os.path.join(ckpt, f), model_dir / f)
    tok.save(str(model_dir / "tokenizer.json"))
    out = tmp_path / "o.json"
    rc, stdout, err = _run(["--model", model_dir, "--prompt", "hello world", "--prompt", "offload",
                            "--max-new-tokens", 4, "--output-json", out], capsys)
    assert rc == 0, err
    res = _json(out)
    assert len(res["generated_ids"]) == 2 and len(res["text"]) == 2
    assert res["text"][0] == tok.decode(res["generated_ids"][0])
    rc, _, err = _run(["--model", model_dir, "--prompt", "hello", "--chat"], capsys)
    assert rc == 2 and "chat_template" in err


def _bad(argv, capsys, needle: str) -> None:
    rc, _, err = _run(argv, capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error:") and needle in lines[-1], err
    assert "Traceback" not in err


def test_bad_input_is_one_line_exit_2(ckpt, tmp_path, capsys):
    _bad(["--model", tmp_path / "missing"], capsys, "no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad(["--model", empty], capsys, "config.json")
    gpt = tmp_path / "gpt2"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                "model_type": "gpt2"}))
    _bad(["--model", gpt], capsys, "not supported")
    _bad(["--model", ckpt, "--prompt-ids", "1,2,5000"], capsys, "out of range")
    _bad(["--model", ckpt, "--prompt-ids", "1,x"], capsys, "comma-separated")
    if not torch.cuda.is_available():
        _bad(["--model", ckpt, "--gpu", "1"], capsys, "no CUDA device")
    _bad(["--model", ckpt, "--cpu-memory", "100KiB"], capsys, "below one block")
    _bad(["--model", ckpt, "--cpu-memory", "lots"], capsys, "--cpu-memory")
    _bad(["--model", ckpt, "--prompt", "hello"], capsys, "tokenizer.json")
    _bad(["--model", ckpt, "--weights", "device", "--cpu-memory", "66MB"], capsys, "--weights auto")
    _bad(["--model", "nosuchpreset"], capsys, "not a preset")
    _bad(["--model", ckpt, "--max-new-tokens", "0"], capsys, "--max-new-tokens")
    _bad(["--model", ckpt, "--weights", "gpu"], capsys, "invalid choice")
    fifo = tmp_path / "prompts.fifo"  # no writer: opening it must not wait for one
    os.mkfifo(fifo)
    _bad(["--model", ckpt, "--prompt-file", fifo], capsys, "not a regular text file")


def test_module_entry_point_default_preset(tmp_path):
    """The real command, as a user runs it: a random tiny preset, generated into the cache dir."""
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "runners.infer", "--offload-dir", tmp_path, "--max-new-tokens", 5,
           "--output-json", out]
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr and "speed, not text" in proc.stderr
    res = _json(out)
    assert len(res["generated_ids"]) == 1 and len(res["generated_ids"][0]) <= 5
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "bytes_per_token", "floor_s_per_token",
                "peak_device_bytes", "peak_host_bytes", "link_gbps"):
        assert key in res["metrics"]
    assert os.path.isfile(tmp_path / "tiny-seed0-fp32" / "config.json")


def test_a_run_faster_than_its_floor_prints_no_percentage_above_100(capsys):
    """When a step beats the floor (the links were measured below what the run got), the report
    shows the bandwidth the run's own counters give, never a percentage above 100."""
    from types import SimpleNamespace

    from offload.infer.plan import Links
    from runners.infer_report import print_report, run_metrics
    stream = SimpleNamespace(moved_bytes={"h2d": 0, "disk": 8 * 10**9}, wait_s=0.0)
    res = SimpleNamespace(prompt_tokens=4, prefill_s=1.0, decode_tokens=8, decode_s=4.0,
                          decode_steps=8, decode_stream=stream, kv_h2d_bytes=0)
    links = Links(h2d_gbps=10.0, disk_gbps=1.0, disk_direct=True)
    for floor_s, beat in ((1.0, True), (0.25, False)):  # 0.5 s per step against each floor
        plan = SimpleNamespace(floor_s_per_step=lambda _, f=floor_s: f, count=lambda t: 1, experts=None)
        m = run_metrics([res], plan, links, torch.device("cpu"), 1)
        print_report(m)
        err = capsys.readouterr().err
        assert m["beat_floor"] is beat
        if beat:
            assert m["percent_of_floor"] is None and "% of floor" not in err
            assert "disk-bound at 2.00 GB/s" in err  # 1 GB per step in 0.5 s
        else:
            assert m["percent_of_floor"] == 50.0 and "50% of floor" in err


def test_two_runs_generating_one_preset_into_one_offload_dir_take_turns(tmp_path):
    """Two runs writing the same preset's random weights into one --offload-dir: the first died
    on the other's temporary file. The second now waits for the first (saying so) and reuses
    what it wrote."""
    from nvme.format import held_lock
    target = tmp_path / "tiny-seed0-fp32"
    cmd = [sys.executable, "-m", "runners.infer", "--model", "tiny", "--offload-dir", str(tmp_path),
           "--prompt-ids", "1,2", "--max-new-tokens", "2", "--probe-seconds", "0"]
    with held_lock(str(target) + ".lock", "test", 5):  # as a run writing them holds it
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = stderr_until(child, "is writing")  # the child says it waits
        time.sleep(0.5)
        assert child.poll() is None and not (target / "config.json").exists(), seen
    out, err = child.communicate(timeout=120)
    err = "".join(seen) + err
    assert child.returncode == 0 and "is writing" in err and (target / "config.json").exists(), err


def test_report_gives_the_bytes_a_step_reads_and_the_memory_floor(ckpt, tmp_path, capsys):
    """On the CPU the report names what a decode step reads from RAM -- every weight but the
    embedding table (tiny is untied: one row of it per token), plus the KV cache up to the mean
    position -- and the floor those bytes set at the measured read bandwidth (issue 36)."""
    from transformers import AutoConfig
    from safetensors import safe_open

    out = tmp_path / "run.json"
    prompt = len(IDS.split(","))
    rc, _, err = _run(["--model", ckpt, "--prompt-ids", IDS, "--max-new-tokens", NEW,
                       "--output-json", out], capsys)
    assert rc == 0, err
    mem = _json(out)["metrics"]["memory"]
    cfg = AutoConfig.from_pretrained(str(ckpt))
    assert not cfg.tie_word_embeddings
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:  # fp32 as run
        every = {k: f.get_slice(k).get_shape() for k in f.keys()}
    weights = sum(4 * math.prod(shape) for name, shape in every.items() if "embed_tokens" not in name)
    assert mem["weights_per_step_bytes"] == weights
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    steps = NEW - 1  # the prefill makes the first token
    assert mem["kv_per_step_bytes"] == pytest.approx(per_position * (prompt + (steps + 1) / 2))
    assert mem["read_gbps"] > 0 and mem["floor_s_per_step"] == pytest.approx(
        mem["read_per_step_bytes"] / mem["read_gbps"] / 1e9)
    assert "read per step from RAM" in err and "memory floor" in err


def test_int8_activations_are_opt_in_and_reported(ckpt, tmp_path, capsys):
    """--activations int8 without --quantize is refused in one line; with --quantize int4 the
    report's kernels line names the int8-activation kernel (c-a8) where this CPU takes it, and
    without the flag the run never takes it."""
    from offload.quant import cpu as quant_cpu
    from offload.quant.format import QuantSpec
    base = ["--model", ckpt, "--prompt-ids", IDS, "--max-new-tokens", 3, "--offload-dir", tmp_path]
    rc, _, err = _run(base + ["--activations", "int8"], capsys)
    assert rc == 2 and "--activations int8" in err and "add --quantize int8|int4" in err
    assert len([line for line in err.splitlines() if "--activations" in line]) == 1
    quant = ["--quantize", "int4", "--group-size", "32"]
    rc, _, err = _run(base + quant, capsys)
    assert rc == 0 and "c-a8" not in err, err
    if not quant_cpu.takes_a8(QuantSpec(4, 32), 64):
        pytest.skip(f"no int8-activation kernel on this CPU: {quant_cpu.status()}")
    rc, _, err = _run(base + quant + ["--activations", "int8"], capsys)
    assert rc == 0, err
    assert re.search(r"kernels: quantized products .*c-a8 \d+", err), err
