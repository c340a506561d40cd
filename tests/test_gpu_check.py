"""scripts/gpu_check.py, the GPU proof kit, tested on the CPU: its help, its refusal without
CUDA, and its orchestration (--allow-cpu runs every phase with tiny sizes). Every run is a
subprocess of the script, the way it is used -- except the three that end before any work
(help, the refusal, a usage error), which call its main() here: a process each cost a torch
import for nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_check.py")


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The script's main() in this process, for runs that end before any work: the same
    (returncode, stdout, stderr) as run() gives."""
    from conftest import load_script
    try:
        rc = load_script("gpu_check").main(list(args))
    except SystemExit as e:  # argparse: --help, usage errors
        rc = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["gpu_check.py", *args], rc, out.out, out.err)


def test_help_names_every_phase_and_option(capsys):
    r = run_main(capsys, "--help")
    assert r.returncode == 0, r.stderr
    for word in ("tests", "train", "infer", "big", "TORCH_CUDA_SANITIZER", "OFFLOAD_CUDA_SIDE_DELAY_CYCLES",
                 "accelerate", "floor", "--budget-s", "--phases", "--json", "--allow-cpu", "--train-presets",
                 "--infer-presets", "--seq-len", "--micro-batch", "--test-timeout-s"):
        assert word in r.stdout, word
    assert "--_child" not in r.stdout  # the internal entry point stays out of the help


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_refuses_without_cuda_in_one_line(tmp_path, capsys):
    r = run_main(capsys, "--json", str(tmp_path / "out.json"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device here"), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "out.json").exists()


def test_bad_phase_is_a_usage_error(capsys):
    r = run_main(capsys, "--allow-cpu", "--phases", "train,warp")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--phases" in r.stderr


def test_smoke_train_and_infer_on_cpu(tmp_path):
    out = tmp_path / "out.json"
    r = run("--allow-cpu", "--phases", "train,infer", "--train-presets", "tiny", "--train-modes",
            "none", "nvme", "--train-steps", "1", "--infer-presets", "tiny", "--infer-batches",
            "1", "--new-tokens", "3", "--budget-s", "400", "--json", str(out),
            "--work-dir", str(tmp_path / "work"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "| phase | item | result | reference | ratio | goal met? |" in r.stdout
    res = json.loads(out.read_text())
    assert {"date", "argv", "machine", "phases", "table", "elapsed_s"} <= set(res)
    assert {"torch", "cuda", "cpu_model", "nvidia_smi_L", "h2d_gbps"} <= set(res["machine"])
    assert res["phases"]["tests"] == {"skipped": "not selected (--phases)"}
    assert res["phases"]["big"] == {"skipped": "not selected (--phases)"}

    train = {row["mode"]: row for row in res["phases"]["train"]}
    assert set(train) == {"none", "nvme"}  # (cpu: the same orchestration, a process less)
    for row in train.values():
        assert row["step_s"] > 0 and row["tflops"] > 0 and len(row["steps_s"]) == 1, row
        assert {"forward_s", "backward_s", "cpu_step_s", "io_wait_s", "upload_s"} <= set(row["split_s"])
        assert row["peak_rss_bytes"] > 0
    assert train["nvme"]["vs_none"] == pytest.approx(train["nvme"]["tflops"] / train["none"]["tflops"])
    assert train["nvme"]["reports"][0]["bytes"]["nvme_write"] > 0  # the state really went to disk

    (infer,) = res["phases"]["infer"]
    assert "path" in infer["checkpoint"]
    runs = {(x["weights"], x["batch"]): x for x in infer["runs"]}
    assert set(runs) == {("cpu", 1), ("nvme", 1)}
    for x in runs.values():
        assert x["rc"] == 0 and x["s_per_token"] > 0 and x["metrics"]["decode_steps"] == 2, x
    # streamed from NVMe there is a floor (disk bytes / bandwidth); on a CPU device nothing
    # crosses a host->device link, and the check says so rather than inventing one
    assert runs[("nvme", 1)]["vs_floor"] > 0
    assert runs[("cpu", 1)]["floor_source"].startswith("no floor")
    assert infer["accelerate"]["s_per_token"] > 0
    assert infer["vs_accelerate"] == pytest.approx(infer["accelerate"]["s_per_token"]
                                                   / runs[("cpu", 1)]["s_per_token"])
    assert not os.path.exists(infer["checkpoint"]["path"])  # deleted after its preset
    assert not any(name.startswith("swap-") for name in os.listdir(tmp_path / "work"))


def test_tests_phase_counts_failures_and_sanitizer_lines(tmp_path):
    """A stand-in for tests/: one test always passes, one fails only with the sanitizer on (its
    message names CSAN), one only with the delay knobs set, an unmarked one is deselected and a
    module that cannot be imported is noted."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_fake_cuda.py").write_text(
        "import os\nimport pytest\n\npytestmark = pytest.mark.cuda\n\n\n"
        "def test_passes():\n    pass\n\n\n"
        "def test_sanitizer_clean():\n"
        "    assert 'TORCH_CUDA_SANITIZER' not in os.environ, 'CSAN detected a possible data race'\n\n\n"
        "def test_delays_change_nothing():\n"
        "    assert 'OFFLOAD_CUDA_SIDE_DELAY_CYCLES' not in os.environ\n")
    (suite / "test_not_cuda.py").write_text("def test_unmarked():\n    assert False\n")
    # a module needing a package the GPU machine lacks (hypothesis, say): noted, not a failure
    (suite / "test_needs_missing.py").write_text("import package_that_is_not_installed\n")
    out = tmp_path / "out.json"
    work = tmp_path / "work"
    r = run("--allow-cpu", "--phases", "tests", "--tests-path", str(suite), "--json", str(out),
            "--work-dir", str(work))
    # a failed test or a sanitizer report fails the kit: exit 1, each named, the logs kept
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu_check: FAILED (2): tests sanitizer: 1 failed") and str(work) in last
    assert "sanitizer report lines" in last and "test_delays_change_nothing" in last
    assert (work / "junit-plain.xml").exists() and (work / "pytest-sanitizer.log").exists()
    res = json.loads(out.read_text())
    assert len(res["failures"]) == 2 and res["work_dir"] == str(work)
    runs = {x["run"]: x for x in res["phases"]["tests"]}
    assert runs["plain"]["ok"] and runs["plain"]["passed"] == 3 and runs["plain"]["failed"] == 0
    assert runs["plain"]["sanitizer_reports"] == 0
    (missing,) = runs["plain"]["collection_errors"]
    assert "test_needs_missing" in missing["module"] and "package_that_is_not_installed" in missing["why"]
    assert not runs["sanitizer"]["ok"] and runs["sanitizer"]["sanitizer_reports"] >= 1
    assert runs["sanitizer"]["failures"] == ["test_fake_cuda::test_sanitizer_clean"]
    assert runs["delays"]["env"]["OFFLOAD_CUDA_HOST_DELAY_S"] == "0.002"
    assert runs["delays"]["failures"] == ["test_fake_cuda::test_delays_change_nothing"]


def test_time_budget_skips_instead_of_measuring(tmp_path):
    out = tmp_path / "out.json"
    r = run("--allow-cpu", "--phases", "train,infer,big", "--budget-s", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert all(row["skipped"] == "time budget" and "tflops" not in row for row in res["phases"]["train"])
    assert res["phases"]["infer"][0]["skipped"] == "time budget"
    assert res["phases"]["big"] == {"skipped": "time budget"}
    assert "skipped: time budget" in r.stdout


def test_sanitizer_reports_name_the_record_stream_false_positive():
    """Reports on aten::record_stream (flagged by torch's sanitizer before pytorch#172562) are
    counted apart from the others; every report's header line is kept."""
    from conftest import load_script
    gpu_check = load_script("gpu_check")
    out = ("CSAN detected a possible data race on tensor with data pointer 1\n"
           "Access by stream 2 during kernel:\naten::record_stream(Tensor(a!) self, Stream s)\n"
           "CSAN detected a possible data race on tensor with data pointer 3\n"
           "Access by stream 4 during kernel:\naten::mul.out(Tensor self, Tensor other)\n")
    lines, record_stream_only = gpu_check.sanitizer_reports(out)
    assert len(lines) == 2 and record_stream_only == 1
    assert gpu_check.sanitizer_reports("12 passed\n") == ([], 0)


def test_self_test_exits_non_zero_on_its_planted_failure(tmp_path, capsys):
    """--self-test runs the tests phase on the CPU over a planted suite with a failing check:
    the kit must exit 1 and say where its logs are (an exit 0 would be a false pass)."""
    work = tmp_path / "work"
    r = run_main(capsys, "--self-test", "--json", str(tmp_path / "out.json"), "--work-dir", str(work))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "test_planted_failure" in r.stderr and f"kept in {work}" in r.stderr
    assert "--self-test: the planted failure was caught" in r.stderr.strip().splitlines()[-1]
    res = json.loads((tmp_path / "out.json").read_text())
    assert [t["run"] for t in res["phases"]["tests"]] == ["plain"]
    assert res["phases"]["tests"][0]["passed"] == 1 and (work / "junit-plain.xml").exists()


def test_failures_name_every_way_a_run_fails():
    """Exit 1 for: a tests run not ok (failed, timed out, a sanitizer report, not run for
    time), the 2-GPU phase failing, a measurement of ours crashing, a runner past its plan on a
    GPU. A refused 2-GPU phase (one GPU), a skipped measurement and the accelerate reference's
    error are not failures."""
    from conftest import load_script
    g = load_script("gpu_check")
    ok_run = {"run": "plain", "ok": True, "failed": 0, "errors": 0, "sanitizer_reports": 0}
    res = {"selected": ["tests", "ranks", "train", "infer"], "phases": {
        "tests": [ok_run, {"run": "sanitizer", "ok": False, "failed": 0, "errors": 0,
                           "sanitizer_reports": 3}, {"run": "delays", "skipped": "time budget"}],
        "ranks": {"skipped": "needs 2 GPUs: this machine has 1"},
        "train": [{"preset": "1B", "mode": "cpu", "error": "exit -9: killed"},
                  {"preset": "1B", "mode": "nvme", "skipped": "time budget"}],
        "infer": [{"preset": "8B", "accelerate": {"error": "no transformers"}, "runs": [
            {"weights": "cpu", "batch": 1, "plan_exceeded": {"peak_device_bytes": 3 << 30,
                                                             "device_need": 2 << 30}},
            {"weights": "nvme", "batch": 1, "s_per_token": 0.1}]}]}}
    got = g.failures(res)
    assert len(got) == 4, got
    assert got[0].startswith("tests sanitizer: 0 failed") and "3 sanitizer report lines" in got[0]
    assert got[1] == "tests delays: not run (time budget)"
    assert got[2] == "train 1B cpu: exit -9: killed"
    assert got[3].startswith("infer 8B --weights cpu batch 1: peak device 3.00 GiB > the plan's")
    assert g.failures({"selected": ["tests"], "phases": {"tests": [ok_run]}}) == []
    run = {"metrics": {"peak_device_bytes": 5}, "plan": {"device_need": 4}}
    assert g.plan_exceeded(run, gpu=True) and not g.plan_exceeded(run, gpu=False)


def test_two_gpu_phase_is_refused_in_one_line_without_two_gpus(tmp_path, capsys):
    """The ranks phase (ZeRO across 2 NCCL ranks) needs 2 GPUs: with fewer it is refused at once,
    in one line, recorded as skipped and not a failure."""
    r = run_main(capsys, "--allow-cpu", "--phases", "ranks", "--json", str(tmp_path / "out.json"),
                 "--work-dir", str(tmp_path / "work"))
    assert r.returncode == 0, r.stderr[-3000:]
    refused = [line for line in r.stderr.splitlines() if line.startswith("[ranks]")]
    assert refused == ["[ranks] refused: needs 2 GPUs: this machine has 0 (the 2-GPU phase runs "
                       "on a machine with more)"]
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["phases"]["ranks"] == {"skipped": "needs 2 GPUs: this machine has 0"}
    assert "skipped: needs 2 GPUs" in r.stdout
