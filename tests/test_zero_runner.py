"""runners.finetune as several data-parallel ranks under torchrun (gloo on this CPU): a run
that is stopped and resumed ends bit-identical to one that was not, equals the one-process run
over the same global batch, two "nodes" rendezvousing on 127.0.0.1 train the same model, and a
killed rank ends the job with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import free_port
from nvme.format import SafetensorsFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-4",
         "--eval-every", "0", "--no-progress", "--warmup-steps", "0"]


def torchrun(args: list[str], *, nproc: int = 2, extra: list[str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *(extra or []), "-m", "runners.finetune", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def one_process(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runners.finetune", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def model_tensors(output: str) -> dict[str, torch.Tensor]:
    out = {}
    model = os.path.join(output, "model")
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(model, name)) as f:
                out.update({k: f.read(k) for k in f.tensors})
    return out


def check_ok(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


ZERO = ["--zero-stage", "2", "--offload", "nvme"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    """An uninterrupted 2-rank run (the reference of the tests below)."""
    out = str(tmp_path_factory.mktemp("whole") / "run")
    run = torchrun([*FLAGS, *ZERO, "--output", out])
    check_ok(run)
    assert "ranks     2 data-parallel ranks, ZeRO stage 2" in run.stdout
    assert "reduce-scatter (grads, sent)" in run.stdout
    return out


def test_two_ranks_stop_resume_exact_and_match_one_process(whole, tmp_path):
    parts, single = (str(tmp_path / n) for n in ("parts", "single"))
    zero = ZERO
    check_ok(torchrun([*FLAGS, *zero, "--output", parts, "--stop-after", "3"]))
    ckpt = os.path.join(parts, "checkpoint", "engine")
    assert any(".rank-00001." in n for n in os.listdir(ckpt))  # each rank saved its shards
    check_ok(torchrun([*FLAGS, *zero, "--output", parts, "--resume", parts]))
    a, b = model_tensors(whole), model_tensors(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # each rank's loss is the mean over its own rows' tokens, as each micro-batch's is in one
    # process: 2 ranks of 2 rows each are one process's 2 micro-batches of 2 rows
    check_ok(one_process([*FLAGS, "--offload", "cpu", "--micro-batch-size", "2", "--output", single]))
    c = model_tensors(single)
    worst = max(((a[k].double() - c[k].double()).abs().max()
                 / c[k].double().abs().max().clamp_min(1e-12)).item() for k in a)
    assert worst <= 1e-5, worst


def test_two_nodes_rendezvous_on_localhost(whole, tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1`, two launches on this machine, trains the same
    model as one launch of two ranks."""
    port = free_port()
    nodes = str(tmp_path / "nodes")
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
             "1", "--node_rank", str(r), "--master_addr", "127.0.0.1", "--master_port", str(port),
             "-m", "runners.finetune", *FLAGS, *ZERO, "--output", nodes]
            for r in (0, 1)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-2000:] + logs[1][-2000:]
    a, b = model_tensors(nodes), model_tensors(whole)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_killed_rank_ends_the_job_with_one_line(tmp_path):
    """SIGKILL one rank mid-run: the other stops within 60 s with one line that says what
    happened and how to resume (no hang until a 10-30 minute collective timeout)."""
    port, out = free_port(), str(tmp_path / "run")
    procs = []
    for r in (0, 1):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "runners.finetune", "--steps", "100000", "--batch-size", "4",
             "--seq-len", "32", "--eval-every", "0", "--no-progress", "--zero-stage", "1",
             "--output", out], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True))
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 120
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].stderr.read()
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        err = procs[0].communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving rank did not stop within 60 s of its peer's death")
    assert time.monotonic() - t0 < 60
    assert procs[0].returncode not in (0, None)
    lines = [ln for ln in err.splitlines() if ln.startswith("rank 0: error:")]
    assert len(lines) == 1 and "peer rank stopped answering" in lines[0], err[-2000:]
    assert f"--resume {out}" in lines[0]
    procs[1].wait()


def test_zero_stage_in_one_process_says_it_does_nothing(tmp_path, capsys):
    from runners.finetune import main
    assert main(["--zero-stage", "2", "--dry-run", "--output", str(tmp_path / "run")]) == 0
    assert "--zero-stage 2 has no effect in one process" in capsys.readouterr().err


def adapter_tensors(output: str) -> dict[str, torch.Tensor]:
    with SafetensorsFile(os.path.join(output, "adapter", "adapter_model.safetensors")) as f:
        return {k: f.read(k) for k in f.tensors}


def test_qlora_across_two_ranks_matches_one_process(tmp_path):
    """runners.finetune --lora-rank --quantize int4 at stage 2 on 2 ranks, each keeping the int4
    base on its device (converted once by local rank 0 while the other waits): the adapters
    equal a one-process run over the same global batch in one micro-batch within 1e-5
    relative. On chat data, whose rows hold different numbers of answer tokens: the ranks agree
    on the update's target tokens, so two ranks' halves weigh each token as the one-process
    mean over the whole batch does. (LoRA over a 16-bit base, resident or streamed by each
    rank, across ranks: tests/test_zero.py.)"""
    from conftest import load_script
    data = tmp_path / "chat.jsonl"
    load_script("make_chat_example").write(str(data))
    lora = ["--lora-rank", "4", "--lora-targets", "q,v,down", "--lr", "1e-3", "--steps", "3",
            "--quantize", "int4", "--group-size", "32", "--cache-dir", str(tmp_path / "cache"),
            "--data", str(data)]
    ranks, single = str(tmp_path / "ranks"), str(tmp_path / "single")
    check_ok(torchrun([*FLAGS, *lora, "--zero-stage", "2", "--offload", "cpu", "--output", ranks]))
    check_ok(one_process([*FLAGS, *lora, "--offload", "cpu", "--micro-batch-size", "4", "--output", single]))
    assert len(os.listdir(tmp_path / "cache" / "quant")) == 1  # made by the ranks, then reused
    a, c = adapter_tensors(ranks), adapter_tensors(single)
    assert a.keys() == c.keys() and a
    worst = max(((a[k].double() - c[k].double()).abs().max()
                 / c[k].double().abs().max().clamp_min(1e-12)).item() for k in a)
    assert worst <= 1e-5, worst


def _two_ranks(flags: list[list[str]], cwds: list[str] | None = None,
               timeout: float = 90) -> list[tuple[int, str, float]]:
    """Ranks 0 and 1 started by hand with flags (and working directories) of their own: (exit
    code, stderr, seconds from the start) per rank."""
    port, procs, t0 = free_port(), [], time.monotonic()
    for r in (0, 1):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "runners.finetune", *flags[r]],
                                      cwd=cwds[r] if cwds else ROOT,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        try:
            err = p.communicate(timeout=timeout)[1]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("ranks started with different settings hung")
        out.append((p.returncode, err, time.monotonic() - t0))
    return out


def test_ranks_started_differently_refuse_at_once(tmp_path):
    """Ranks given a different --lr, --zero-stage, --steps or --output (each would train on its
    own settings, hang, or write half a checkpoint), or different data files: every rank exits
    with one line naming what differs and each rank's value, within seconds of starting."""
    base = [*FLAGS, "--zero-stage", "1"]
    flags = [[*base, "--output", str(tmp_path / "a")],
             [*FLAGS, "--zero-stage", "2", "--lr", "3e-4", "--steps", "7", "--output", str(tmp_path / "b")]]
    for r, (rc, err, _) in enumerate(_two_ranks(flags)):
        line = [ln for ln in err.splitlines() if ln.startswith(f"rank {r}: error:")]
        assert rc == 2 and len(line) == 1, err[-2000:]
        for flag, a, b in (("--lr", "0.0001", "0.0003"), ("--zero-stage", "1", "2"), ("--steps", "6", "7")):
            assert f"{flag} (rank 0: {a}, rank 1: {b})" in line[0], line[0]
        assert "--output" in line[0] and "the ranks disagree on their flags" in line[0]
    # the same flags, different files behind one --data path: the data's fingerprint differs
    for r, text in ((0, "first corpus " * 400), (1, "other corpus " * 400)):
        (tmp_path / f"r{r}").mkdir()
        (tmp_path / f"r{r}" / "d.txt").write_text(text)
    flags = [[*base, "--data", "d.txt", "--output", str(tmp_path / "out")]] * 2
    for r, (rc, err, _) in enumerate(_two_ranks(flags, [str(tmp_path / "r0"), str(tmp_path / "r1")])):
        line = [ln for ln in err.splitlines() if ln.startswith(f"rank {r}: error:")]
        assert rc == 2 and len(line) == 1 and "data fingerprint" in line[0], err[-2000:]
        assert "resolved configuration, data and model" in line[0]
