"""The fine-tuning runner never ends in exit 0 with a wrong or destroyed result: damaged swap
reads stop the run (optimizer state and streamed weights), inf/nan losses are skipped and
logged as valid JSON, a diverged run stops without replacing its last good checkpoint, the
output directory is locked and never started over by accident, a resume refuses every setting
that would make it diverge, and the swap store touches only the files it created."""

from __future__ import annotations

import json
import os

import pytest
import torch

import offload
from nvme import SwapStore
from nvme.swap import SwapError
from offload.stream.streamer import StreamError
from runners.common import run_main
from runners.finetune import main as finetune_main
from runners.rundir import RunDirectory
from test_engine import MLP, _cfg, mlp_batches, mlp_loss

FAST = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
        "--no-progress", "--warmup-steps", "1"]


def run_cli(main, argv, capsys) -> tuple[int, str]:
    """A runner's main as the command line runs it: (exit code, last stderr line); what it
    printed is kept in run_cli.out."""
    rc = run_main(main, argv)
    captured = capsys.readouterr()
    run_cli.out = captured.out
    err = captured.err.strip().splitlines()
    return rc, (err[-1] if err else "")


def finetune(argv, capsys) -> tuple[int, str]:
    return run_cli(finetune_main, argv, capsys)


def strict_rows(path) -> list[dict]:
    """metrics.jsonl parsed as standard JSON (NaN / Infinity tokens refused)."""
    def bad(token):
        raise ValueError(f"not JSON: {token}")
    with open(path) as f:
        return [json.loads(line, parse_constant=bad) for line in f]


def flip_byte(path: str, from_end: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        b = f.read(1)[0]
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([b ^ 0x01]))


# ---- verified swap reads --------------------------------------------------------------------
def test_a_damaged_optimizer_state_read_stops_training(tmp_path):
    model = MLP()
    engine = offload.initialize(model, _cfg("nvme", tmp_path, grad_clip=1.0))
    batches = mlp_batches(3)
    engine.backward(mlp_loss(model, batches[0]))
    engine.step()
    engine.state.drain()  # the step's writes are on disk; nothing read ahead yet
    victim = os.path.join(tmp_path / "swap", sorted(
        f for f in os.listdir(tmp_path / "swap") if f.endswith("master.safetensors"))[0])
    flip_byte(victim)
    with pytest.raises(SwapError, match="checksum mismatch"):
        engine.backward(mlp_loss(model, batches[1]))
        engine.step()
    engine.close()


def test_damaged_streamed_weights_stop_training(tmp_path):
    from offload.models import build_model, preset
    model = build_model(preset("tiny"), "cpu", torch.float32, source=0)
    engine = offload.initialize(model, _cfg("nvme", tmp_path, offload_params="nvme",
                                            activation_checkpointing=True))
    ids = torch.randint(0, 100, (2, 16))
    loss = model(ids).float().mean()
    engine.backward(loss)
    engine.step()
    weights = sorted(f for f in os.listdir(tmp_path / "swap") if f.endswith("weights16.safetensors"))
    flip_byte(os.path.join(tmp_path / "swap", weights[0]))
    with pytest.raises(StreamError, match="checksum mismatch in streamed weights"):
        model(ids)
    engine.close()


# ---- inf/nan losses in the runner -----------------------------------------------------------
def _nan_at(monkeypatch, steps: set[int]):
    import offload.data.formats as data
    real, calls = data.masked_lm_loss, [0]

    def loss(*a, **k):
        out = real(*a, **k)
        if out.requires_grad:  # training micro-batches, not evaluation
            calls[0] += 1
            if calls[0] in steps:
                return out * float("nan")
        return out
    monkeypatch.setattr(data, "masked_lm_loss", loss)


def test_nan_losses_are_skipped_and_logged_as_null(tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, {3, 4})
    out = tmp_path / "run"
    rc, _ = finetune(["--output", str(out), *FAST], capsys)
    assert rc == 0
    rows = strict_rows(out / "metrics.jsonl")
    # a skipped update is logged and redone on the next batch (as an fp16 overflow is)
    assert [r["applied"] for r in rows] == [True, True, False, False, True, True, True, True]
    assert rows[2]["loss"] is None and rows[3]["step"] == 2 and rows[-1]["step"] == 6
    assert "skipped updates (inf/nan loss or gradients): 2" in run_cli.out


def test_a_diverged_run_stops_and_keeps_its_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, set(range(5, 1000)))
    out = tmp_path / "run"
    rc, err = finetune(["--output", str(out), *FAST, "--steps", "30", "--save-every", "2",
                        "--config", str(_write(tmp_path / "c.json", {"max_nonfinite_skips": 4}))],
                       capsys)
    assert rc == 2 and "4 updates in a row skipped" in err, err
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4
    strict_rows(out / "metrics.jsonl")


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


# ---- the output directory -------------------------------------------------------------------
def test_output_directory_is_guarded(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert finetune(["--output", out, *FAST, "--offload", "cpu"], capsys)[0] == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    rc, err = finetune(["--output", out, *FAST, "--offload", "cpu"], capsys)
    assert rc == 2 and "already holds a run" in err and "--overwrite" in err, err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # untouched
    assert finetune(["--output", out, *FAST, "--offload", "cpu", "--overwrite"], capsys)[0] == 0
    rc, err = finetune(["--output", out, *FAST, "--resume", out, "--overwrite"], capsys)
    assert rc == 2 and "give one of them" in err
    # another run holds the directory (any tier)
    held = RunDirectory(out)
    held.lock()
    try:
        rc, err = finetune(["--output", out, *FAST, "--resume", out], capsys)
        assert rc == 2 and "in use by another run" in err, err
    finally:
        held.release()
    data = tmp_path / "d.txt"
    data.write_text("some text to learn from\n\nand more of it\n" * 20)
    for argv, msg in ((["--metrics", f"{out}/checkpoint/m.jsonl"], "which every checkpoint save replaces"),
                      (["--offload", "nvme", "--offload-dir", f"{out}/model/swap"], "every checkpoint save"),
                      (["--data", str(data), "--metrics", str(data)], "overlaps the training data"),
                      (["--data", str(tmp_path), "--offload", "nvme", "--offload-dir", str(tmp_path)],
                       "overlaps the training data")):
        rc, err = finetune(["--output", out, "--overwrite", *FAST, *argv], capsys)
        assert rc == 2 and msg in err, (argv, err)
    assert (tmp_path / "run" / "checkpoint" / "trainer_state.json").is_file()  # refused first


def test_resume_refuses_changed_settings_and_inconsistent_checkpoints(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert finetune(["--output", out, *FAST, "--stop-after", "2"], capsys)[0] == 0
    for flag, value in (("--seq-len", "16"), ("--seed", "5"), ("--lr", "0.5"), ("--steps", "9"),
                        ("--micro-batch-size", "2"), ("--dtype", "bf16")):
        argv = [a for a in FAST]
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
        rc, err = finetune(["--output", out, *argv, "--resume", out], capsys)
        assert rc == 2 and flag in err and "the checkpoint has" in err, (flag, err)
    meta_path = os.path.join(out, "checkpoint", "engine", "engine_state.json")
    meta = json.load(open(meta_path))
    for step, msg in ((3, "inconsistent: its engine state is at update 3, its trainer state at "
                          "update 2"), (10**30, "does not fit global_step")):
        _write(tmp_path / "x", meta | {"global_step": step, "micro_step": min(step, 3)}).replace(meta_path)
        rc, err = finetune(["--output", out, *FAST, "--resume", out], capsys)
        assert rc == 2 and msg in err, err


# ---- the swap store touches only its own files ----------------------------------------------
def test_swap_store_leaves_other_files_alone(tmp_path, capsys):
    swap = tmp_path / "mine"
    swap.mkdir()
    (swap / "notes.safetensors.tmp").write_bytes(b"my own file")
    (swap / "keep.txt").write_text("mine")
    out = str(tmp_path / "run")
    rc, _ = finetune(["--output", out, *FAST, "--offload", "nvme", "--offload-dir", str(swap)], capsys)
    assert rc == 0
    assert sorted(os.listdir(swap)) == ["keep.txt", "notes.safetensors.tmp"]  # swap files removed
    assert (swap / "notes.safetensors.tmp").read_bytes() == b"my own file"
    (swap / "LOCK").write_text("a file of mine called LOCK\n")
    with pytest.raises(SwapError, match="not a lock file of this program"):
        SwapStore(str(swap))
    assert (swap / "LOCK").read_text() == "a file of mine called LOCK\n"


def test_resume_preflight_counts_the_swap_files_it_will_rewrite(tmp_path, monkeypatch):
    cfg = _cfg("nvme", tmp_path)
    engine = offload.initialize(MLP(), cfg)
    state = engine.plan.total("nvme")
    engine.close()  # leaves the swap files, as a stopped run does
    with SwapStore(str(tmp_path / "swap")) as store:
        stored = store.stored_bytes()
    assert stored > 12 * sum(p.numel() for p in MLP().parameters())
    # at start the disk has room for half the state besides the files already there: a
    # preflight that did not count the files it will rewrite would need all of it. Only that
    # first check sees half: each later write checks its tensor plus the writes still in
    # flight, which hold their bytes until done -- up to most of this small state on a busy
    # disk (45 KB held against 47 KB free, in one run), so a fixed amount was timing-dependent.
    checks = []

    def free_bytes(self):
        checks.append(1)
        return state // 2 if len(checks) == 1 else 1 << 40
    monkeypatch.setattr(SwapStore, "free_bytes", free_bytes)
    offload.initialize(MLP(), cfg).close()
    assert len(checks) > 1  # the start-up check, then each write's
    monkeypatch.setattr(SwapStore, "free_bytes", lambda self: 100)
    with pytest.raises(SwapError, match="needs"):
        offload.initialize(MLP(), cfg.replace(nvme_dir=str(tmp_path / "fresh")))


def test_an_export_that_overflows_its_dtype_is_not_written(tmp_path):
    from offload.models import CheckpointError, build_model, preset, save_pretrained
    model = build_model(preset("tiny"), "cpu", torch.float32, source=0)
    with torch.no_grad():
        model.model.norm.weight[0] = 1e6  # past fp16's 65504
    with pytest.raises(CheckpointError, match="past torch.float16's range"):
        save_pretrained(model, str(tmp_path / "out"), dtype=torch.float16)
    assert not any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "out"))
    save_pretrained(model, str(tmp_path / "out"), dtype=torch.bfloat16)  # in range there


def test_the_export_is_read_back(tmp_path, capsys, monkeypatch):
    import runners.finetune as ft
    from offload.models import hf
    real = hf.save_pretrained

    def bad_config(source, path, **kw):  # a writer bug: config.json does not match the weights
        written = real(source, path, **kw)
        cfg = json.load(open(os.path.join(path, "config.json")))
        _write(tmp_path / "c.json", cfg | {"num_hidden_layers": cfg["num_hidden_layers"] + 1}) \
            .replace(os.path.join(path, "config.json"))
        return written
    monkeypatch.setattr("offload.models.save_pretrained", bad_config)
    rc, err = finetune(["--output", str(tmp_path / "run"), *FAST], capsys)
    assert rc == 2 and "cannot be read back" in err, err
    del ft


# ---- computation that cannot be right stops --------------------------------------------------
def _pairs(path, n: int, prompt_len: int, answer: str = "ok") -> str:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i:04d} " + "p" * prompt_len, "response": answer}) + "\n")
    return str(path)


def test_data_with_almost_no_targets_is_refused_up_front(tmp_path, capsys):
    """Answers of 3 tokens after prompts of 600: at --seq-len 32 about 1 sequence in 20 holds a
    target, so most updates would apply a loss of 0.0 (exit 0, nothing learnt): refused with
    the numbers before anything is allocated."""
    data = _pairs(tmp_path / "d.jsonl", 40, 600)
    rc, err = finetune([*FAST, "--data", data, "--output", str(tmp_path / "run")], capsys)
    assert rc == 2 and "training sequences" in err and "hold a target token" in err, err
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_batches_without_a_target_are_skipped_and_counted(tmp_path, capsys):
    """Some sequences hold no target (a long prompt's middle): a batch of only those is no
    update (its loss would be 0.0 and AdamW would still move the weights by their momentum);
    it is skipped, counted in the summary and in the checkpoint, and a resume takes up the
    count; a checkpoint whose data position does not match its batches is refused."""
    data = _pairs(tmp_path / "d.jsonl", 60, 60, answer="a fairly long answer " * 2)
    out = tmp_path / "run"
    argv = [*FAST, "--batch-size", "1", "--steps", "12", "--data", data, "--output", str(out)]
    rc, err = finetune([*argv, "--stop-after", "6"], capsys)
    assert rc == 0, err
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["empty_batches"] > 0 and state["data_position"] == 6 + state["empty_batches"]
    rc, err = finetune([*argv, "--resume", str(out)], capsys)
    assert rc == 0, err
    skipped = [ln for ln in run_cli.out.splitlines() if ln.startswith("batches skipped for holding no target")]
    assert len(skipped) == 1
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["data_position"] == 12 + state["empty_batches"]
    assert int(skipped[0].rsplit(" ", 1)[1]) == state["empty_batches"]
    rows = strict_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(r["loss"] > 0 for r in rows)
    # an edited data position (here 10**30) is refused on resume
    state["data_position"] = 10 ** 30
    (out / "checkpoint" / "trainer_state.json").write_text(json.dumps(state))
    rc, err = finetune([*argv, "--resume", str(out)], capsys)
    assert rc == 2 and "data position" in err and "damaged or edited" in err, err
    state["model_config"] = "LlamaForCausalLM"  # a string where an object belongs: one line
    (out / "checkpoint" / "trainer_state.json").write_text(json.dumps(state))
    rc, err = finetune([*argv, "--resume", str(out)], capsys)
    assert rc == 2 and "'model_config' is not an object" in err, err


def test_offload_auto_honours_the_host_budget_on_a_cpu_device(tmp_path, capsys):
    """On a CPU device the device tier is host RAM: `--offload auto --cpu-memory 1MiB` chose
    "all on the device" and used 250 MiB. The host budget now bounds both tiers there."""
    rc, err = finetune(["--offload", "auto", "--cpu-memory", "1MiB", "--dry-run",
                        "--output", str(tmp_path / "run")], capsys)
    assert rc == 2 and "no offload configuration fits" in err and "host budget of 1.00 MiB" in err, err
    rc, err = finetune(["--offload", "auto", "--cpu-memory", "8GiB", "--dry-run",
                        "--output", str(tmp_path / "run")], capsys)
    assert rc == 0, err
