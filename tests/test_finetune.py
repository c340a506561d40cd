"""runners.finetune end to end: learning, exact resume per offload mode, transformers loads the
output, and every bad input is one line with a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from runners.finetune import main

FAST = ["--steps", "20", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
        "--no-progress", "--warmup-steps", "2"]


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _engine_state(out):
    from nvme.format import SafetensorsFile

    d = os.path.join(out, "checkpoint", "engine")
    state = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(d, name)) as f:
                state.update({f"{name}/{k}": f.read(k) for k in f.tensors})
    return state


def test_loss_falls_on_the_builtin_corpus(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["--output", out, "--steps", "40", "--eval-every", "20", "--no-progress"]) == 0
    text = capsys.readouterr().out
    first = float(text.split("step 0: eval loss ")[1].split()[0])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    last = rows[-1]["eval_loss"]
    assert last < 0.7 * first, (first, last)
    assert "time split" in text and "peak memory per tier" in text
    assert {"step", "loss", "lr", "tokens_per_s", "time"} <= set(rows[0])


@pytest.mark.parametrize("mode", ["none", "cpu", "nvme", "nvme --delayed-update --grad-clip 1"])
def test_resume_is_exact(mode, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = FAST + ["--offload"] + mode.split()
    assert main(common + ["--output", full]) == 0
    assert main(common + ["--output", part, "--stop-after", "10"]) == 0  # interrupted at 10
    assert main(common + ["--output", part, "--resume", part]) == 0
    assert _losses(part) == _losses(full)
    a, b = _engine_state(full), _engine_state(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


FIXTURE_BEFORE_LAYOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                                     "run_before_layout")


def test_a_run_saved_before_the_layout_move_resumes_exactly(tmp_path):
    """A run stopped after 3 of 6 updates and saved by the code before issue 32's package move
    (tests/fixtures/run_before_layout/README.md): resumed by today's code, it ends with the
    losses and the engine state, bit for bit, of a fresh run of the same command."""
    import shutil
    args = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
            "--no-progress", "--warmup-steps", "2", "--offload", "nvme"]
    part, full = str(tmp_path / "part"), str(tmp_path / "full")
    shutil.copytree(FIXTURE_BEFORE_LAYOUT, part)
    assert main(args + ["--output", part, "--resume", part]) == 0
    assert main(args + ["--output", full]) == 0
    a, b = _engine_state(full), _engine_state(part)
    assert a.keys() == b.keys() and len(_losses(full)) == 6
    if _losses(full)[:3] == _losses(part)[:3]:  # this CPU computes what the fixture's did
        assert _losses(part) == _losses(full)
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:
        # The fixture's first 3 updates ran on another CPU (AVX-512), whose kernels round
        # differently from this one's (AVX2: ~1e-7 in the losses): bit-equality cannot hold
        # here, but a state read wrongly would be off by the order of its values.
        assert _losses(part) == pytest.approx(_losses(full), rel=1e-5)
        for k in a:  # ~1e-5 of each tensor's scale seen; a misread state is of its order
            scale = float(a[k].abs().max())
            assert float((b[k] - a[k]).abs().max()) <= 1e-3 * scale, k


def test_an_update_weighs_every_target_token_alike(tmp_path):
    """Chat data, whose packed rows hold different numbers of answer tokens: an update is the
    gradient of the mean over all its target tokens, so how the batch is cut into micro-batches
    changes nothing but float rounding (a mean of per-micro-batch means would weigh the tokens
    of a row with a short answer more; transformers' num_items_in_batch fix). Masters and
    logged losses after 3 updates at 1, 2 and 4 micro-batches per update."""
    from conftest import load_script
    data = tmp_path / "chat.jsonl"
    load_script("make_chat_example").write(str(data))
    common = ["--data", str(data), "--steps", "3", "--batch-size", "4", "--seq-len", "64",
              "--eval-every", "0", "--no-progress", "--warmup-steps", "0", "--offload", "cpu",
              "--lr", "1e-3"]
    runs = {}
    for mb in (4, 2, 1):
        out = str(tmp_path / f"mb{mb}")
        assert main(common + ["--micro-batch-size", str(mb), "--output", out]) == 0
        runs[mb] = (_engine_state(out), _losses(out))
    whole, whole_losses = runs[4]
    for mb in (2, 1):
        state, losses = runs[mb]
        worst = max(((state[k].double() - whole[k].double()).abs().max()
                     / whole[k].double().abs().max().clamp_min(1e-12)).item() for k in whole)
        assert worst <= 1e-5, (mb, worst)
        assert losses == pytest.approx(whole_losses, rel=1e-5)


def test_output_loads_in_transformers_with_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    import offload
    from offload.config import OffloadConfig
    from offload.models import build_model, preset, save_pretrained

    model = build_model(preset("tiny"), device="cpu", source=0)
    engine = offload.initialize(model, OffloadConfig(offload="cpu", dtype="fp32", device="cpu", lr=1e-2))
    ids = torch.randint(0, 1000, (2, 16))
    for _ in range(3):
        logits = model(ids)
        engine.backward(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                          ids[:, 1:].reshape(-1)))
        engine.step()
    save_pretrained(engine.iter_master_params(), tmp_path / "m", config=model.config, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-5
    engine.close()


def _bad(args, capsys, match):
    rc = main(args + ["--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err and err[-1].startswith("error: ") and match in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_bad_inputs_are_one_line(tmp_path, capsys, monkeypatch):
    out = ["--output", str(tmp_path / "o")]
    _bad(out + ["--data", str(tmp_path / "nope.txt")], capsys, "does not exist")
    (tmp_path / "empty.txt").write_text("")
    _bad(out + ["--data", str(tmp_path / "empty.txt")], capsys, "empty")
    (tmp_path / "noconfig").mkdir()
    _bad(out + ["--model", str(tmp_path / "noconfig")], capsys, "config.json")
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _bad(out + ["--model", str(tmp_path / "gpt")], capsys, "GPT2LMHeadModel")
    _bad(out + ["--offload", "nvme", "--offload-dir", "/sys/offload-swap"], capsys, "not writable")
    _bad(out + ["--cpu-memory", "1KiB"], capsys, "host budget")
    _bad(out + ["--gpu", "1"], capsys, "--gpu 1")
    _bad(out + ["--batch-size", "16", "--micro-batch-size", "3"], capsys, "must divide")
    _bad(out + ["--offload", "cpu", "--offload-dir", str(tmp_path)], capsys, "only used with --offload nvme")
    _bad(out + ["--model", "nonexistent-preset"], capsys, "unknown preset")
    _bad(out + ["--delayed-update", "--offload", "none"], capsys, "needs offload='cpu' or 'nvme'")
    _bad(out + ["--delayed-update", "--offload", "cpu", "--offload-params", "cpu"], capsys,
         "offload_params='none'")
    _bad(out + ["--delayed-update-warmup", "-1"], capsys, "must be >= 0")
    import offload.train.plan as tp
    monkeypatch.setattr(tp, "disk_free_bytes", lambda path: 1024)
    _bad(out + ["--offload", "nvme"], capsys, "free disk space")


def test_resume_from_a_different_model_is_refused(tmp_path, capsys):
    out = str(tmp_path / "r")
    assert main(["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
                 "--no-progress", "--output", out]) == 0
    capsys.readouterr()
    _bad(["--output", str(tmp_path / "r2"), "--resume", out, "--model", "small"], capsys,
         "different model")


def test_no_final_checkpoint_writes_the_export_only_unless_stopped_early(tmp_path, capsys):
    base = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--no-progress",
            "--offload", "nvme", "--no-final-checkpoint"]
    done = tmp_path / "done"
    assert main(base + ["--output", str(done)]) == 0
    assert (done / "model" / "config.json").is_file() and not (done / "checkpoint").exists()
    assert "not written at the end (--no-final-checkpoint)" in capsys.readouterr().out
    early = tmp_path / "early"  # stopped before the last update: resumable as always
    assert main(base + ["--output", str(early), "--stop-after", "1"]) == 0
    assert (early / "checkpoint").is_dir() and not (early / "model").exists()


def test_cli_subprocess_clean_error_and_dry_run_70b():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "runners.finetune", "--gpu", "3"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: ") and "Traceback" not in r.stderr
    # the 70B plan is printed without allocating anything; it fits or is refused in one line
    r = subprocess.run([sys.executable, "-m", "runners.finetune", "--dry-run", "--model", "70B",
                        "--offload", "nvme", "--offload-dir", "/tmp/offload-dry"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert "memory plan: 68976." in r.stdout, r.stdout
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr
