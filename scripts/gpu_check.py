"""The GPU proof kit: one command that runs every CUDA path of offload and takes the first numbers.

    python scripts/gpu_check.py                          # every phase, ~10 minutes, gpu_check.json
    python scripts/gpu_check.py --budget-s 1500          # room for every 8B / 13B measurement
    python scripts/gpu_check.py --phases train,infer --train-presets 1B --budget-s 900

Run it from the repository root (it need not be pip-installed) on a machine with one NVIDIA GPU.
Without CUDA it refuses in one line (exit 2); --allow-cpu runs every phase on the CPU with tiny
sizes, for testing this script itself. The phases run in this order, each against a deadline: its
share of --budget-s (seconds at the default 600 in brackets) plus what earlier phases left. Nothing
new starts with under 15 s left (recorded as "skipped: time budget"); every item is a subprocess
with a timeout, so one OOM or hang costs that item only. Ten minutes proves every CUDA path and
takes the 1B numbers; the 8B / 13B items (a 16-26 GB checkpoint each) mostly need --budget-s 1500
and are recorded as "skipped: time budget" otherwise.

  tests  50% [300 s]  `pytest -m cuda tests` three times: plain, every cuda-marked test (1.5 x
        --test-timeout-s); then the quick matrix without the subprocess and peak-memory tests
        (--test-timeout-s each) with TORCH_CUDA_SANITIZER=1 (torch's CUDA stream sanitizer: output
        lines naming CSAN or a data race count as reports) and with delays injected
        (OFFLOAD_CUDA_SIDE_DELAY_CYCLES=2000000: a torch.cuda._sleep on every side stream before
        each copy; OFFLOAD_CUDA_HOST_DELAY_S=0.002: a host sleep in the gradient-landing worker),
        where no result may change (OFFLOAD_CUDA_COMPUTE_DELAY_CYCLES=2000000: a sleep on the compute
        stream before each device optimizer step, too). Counts and failing
        test names from --junitxml; a timeout is a failure; a test module that cannot be imported is
        noted (a failure only when named *cuda*). Goal: all pass, no sanitizer report.
  ranks  10% [60 s]   2 GPUs or more: `pytest -m cuda tests/test_cuda_ranks.py`, ZeRO stages 0-3 across
        2 NCCL ranks (torchrun's environment, one GPU each) against one-process AdamW, and the second
        desk review's rank findings. On one GPU it is refused in one line ("needs 2 GPUs") at once.
  train  15% [90 s]  training step time through the library API (offload.initialize,
        engine.backward, engine.step, engine.last_report), bf16 on cuda:0, seeded random weights,
        per preset and mode (scripts/bench_train.py's MODES; activation checkpointing on for presets
        of 3B+ parameters), each in a fresh process (--mode-timeout-s): one warm-up update, then the
        median of --train-steps. Step s, tokens/s, model TFLOPS = 6 N tokens/s (8 N with activation
        checkpointing) / 1e12, the StepReport time split, peak device memory and RSS. A plan that
        does not fit (BudgetError / ConfigError) is a recorded skip. Against: offload none of the
        same preset. Goal: cpu >= 40% of none's TFLOPS.
  infer  15% [90 s]   `python -m runners.infer`, bf16, device budget a quarter of the model's
        bytes, weights streamed from host RAM (--weights cpu) and from NVMe (--weights nvme): s/token
        at batch 1, tokens/s at batch 32. Against: the link floor the runner reports (bytes per token
        / measured bandwidth; goal >= 85% of it at batch 1) and transformers + accelerate
        device_map="auto" with the same max_memory on the same checkpoint (goal: ours >= 3x faster at
        batch 1). Random-weight checkpoints (runners.infer.random_checkpoint, --checkpoint-timeout-s)
        are written one at a time under --work-dir and deleted after. On a GPU a run whose peak
        device memory exceeds the plan it accepted is a failure.
  big    10% [60 s]   `runners.infer --model 70B --gpu 0 --dry-run` captured; then the largest of
        --big-presets whose bf16 weights fit the disk and whose plan the runner accepts generates 4
        tokens (--weights auto: the planner places the blocks): s/token.

Output: a Markdown table (phase, item, result, reference, ratio, goal met?) and --json with the
machine, every test result and every measurement with its raw timings.

Exit status: 0 only when every selected tests run passed with no sanitizer report, no run exceeded
its plan and no measurement of ours crashed; 1 otherwise, each failure named on stderr, and the work
directory (pytest logs, junit XML, children's logs) kept and named; 2 refused (no GPU, bad flags);
130 interrupted. `--self-test` runs the tests phase on the CPU over a planted suite whose failing
check must make it exit 1: a kit that exits 0 there can pass falsely.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from offload.config import format_bytes  # noqa: E402
from offload.models import PRESETS, num_params, preset  # noqa: E402

PHASES = ("tests", "ranks", "train", "infer", "big")
# ranks needs 2 GPUs: on one it is refused at once and its share goes to the next phases
PHASE_SHARE = {"tests": 0.5, "ranks": 0.1, "train": 0.15, "infer": 0.15, "big": 0.1}
MIN_ITEM_S = 15.0
# The sanitizer and delay runs take the quick matrix (OFFLOAD_CUDA_QUICK: clipping and accumulation
# both off, and both on) and leave out the tests that start runner subprocesses or measure peak
# memory: they add time, not stream orderings the in-process tests do not already cover.
QUICK = {"OFFLOAD_CUDA_QUICK": "1"}
QUICK_K = ["-k", "not cli and not peak_device and not defaults_to_bf16 and not speed"]
TEST_RUNS = (("plain", {}, []),
             ("sanitizer", {"TORCH_CUDA_SANITIZER": "1", **QUICK}, QUICK_K),
             ("delays", {"OFFLOAD_CUDA_SIDE_DELAY_CYCLES": "2000000", "OFFLOAD_CUDA_HOST_DELAY_S": "0.002",
                         "OFFLOAD_CUDA_COMPUTE_DELAY_CYCLES": "2000000", **QUICK}, QUICK_K))
# the 2-GPU phase: NCCL across 2 ranks (ZeRO stages, review 2's P1-P3, P6, P8)
RANKS_TESTS = os.path.join("tests", "test_cuda_ranks.py")
# --self-test: a planted suite whose failing check must make the run exit non-zero
PLANTED_SUITE = {"test_planted_cuda.py": (
    "import pytest\n\npytestmark = pytest.mark.cuda\n\n\n"
    "def test_planted_pass():\n    pass\n\n\n"
    "def test_planted_failure():\n    assert False, 'planted by gpu_check.py --self-test'\n")}
TRAIN_MODES = ("none", "cpu", "nvme", "cpu+delayed", "stream-cpu", "stream-nvme")
# micro-batch x sequence: fills an 80 GB GPU (offload none of 1B: 20 GB of model state, ~10 GB of
# activations, ~17 GB of bf16/fp32 logits and their gradients over a 128k vocabulary) with an
# update well under a minute; other presets (2, 1024); --allow-cpu (2, 32)
TRAIN_SHAPE = {"1B": (4, 2048), "8B": (2, 4096)}
CHECKPOINTING_FROM_PARAMS = 3e9
GOAL_TRAIN_CPU, GOAL_FLOOR, GOAL_VS_ACCELERATE = 0.40, 0.85, 3.0
GPU_DEFAULTS = {"train": ["1B", "8B"], "infer": ["8B", "13B"], "big": ["70B", "13B", "8B", "3B", "1B"]}
CPU_DEFAULTS = {"train": ["tiny"], "infer": ["tiny"], "big": ["small", "tiny"]}


def load_script(name: str):
    """A module of scripts/ (programs, not a package): the benchmarks' helpers are reused."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line(e: BaseException | str, limit: int = 300) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:limit]


def clean(obj):
    """NaN and inf are not JSON: they become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- time and subprocesses ----------------------------------------------------------------------
class Deadlines:
    """Each selected phase's deadline: its share of the budget on top of what earlier ones left."""

    def __init__(self, budget_s: float, phases: list[str]):
        total, acc, self.end, t0 = sum(PHASE_SHARE[p] for p in phases), 0.0, {}, time.monotonic()
        for p in phases:
            acc += PHASE_SHARE[p]
            self.end[p] = t0 + budget_s * acc / total

    def left_s(self, phase: str) -> float:
        return self.end[phase] - time.monotonic()

    def timeout_s(self, phase: str, item_timeout_s: float) -> float | None:
        """The timeout of an item started now; None when too little is left to start one."""
        left = self.left_s(phase)
        return None if left < MIN_ITEM_S else min(item_timeout_s, left)


def child_env(extra: dict | None = None) -> dict:
    """The repo is not pip-installed on the GPU machine: children find it through PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else ""), **(extra or {})}


_serial = iter(range(1 << 30))


def new_path(work: str, prefix: str) -> str:
    return os.path.join(work, f"{prefix}-{next(_serial)}")


def run_proc(cmd: list[str], timeout_s: float, log_path: str, env: dict | None = None) -> dict:
    """Run `cmd` in its own process group (a timeout kills all it started), output to a log."""
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=timeout_s), False
        except BaseException as e:  # timeout or Ctrl-C: nothing of ours may outlive the check
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the whole group had already exited
                pass
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            rc, timed_out = None, True
    with open(log_path, errors="replace") as f:
        text = f.read()
    return {"rc": rc, "timed_out": timed_out, "wall_s": time.perf_counter() - t0, "output": text}


def failure(r: dict, timeout_s: float) -> str:
    return f"timeout after {timeout_s:.0f} s" if r["timed_out"] else \
        f"exit {r['rc']}: {tail(r['output'], 1) or 'no output'}"


def run_child(spec: dict, timeout_s: float, work: str) -> dict:
    """This script again (--_child) for one measurement in a fresh process (memory returned, an
    OOM or a hang contained); the result comes back as a JSON file."""
    out = new_path(work, spec["kind"]) + ".json"
    r = run_proc([sys.executable, os.path.abspath(__file__), "--_child", json.dumps({**spec, "out": out})],
                 timeout_s, out + ".log")
    result = {"error": failure(r, timeout_s)}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    if "error" in result:
        result["output_tail"] = tail(r["output"])
    return {**result, "wall_s": r["wall_s"]}


# ---- the children: one measurement each, in a fresh process -------------------------------------
def child_env_info(spec: dict) -> dict:
    from offload.infer.plan import measure_links
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None}
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        info.update(device_name=torch.cuda.get_device_name(dev), device_total_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}")
    # the runner's own start-up probe: pinned host -> device copies (memcpy on the CPU)
    info["h2d_gbps"] = measure_links(dev, [], seconds=2.0 if cuda else 0.3).h2d_gbps
    info["h2d_source"] = "pinned host -> device copy" if cuda else "CPU memcpy"
    return info


def child_train(spec: dict) -> dict:
    import offload
    from offload.config import ConfigError, OffloadConfig
    from offload.models import build_model, seeded_init
    from offload.memory.tiers import BudgetError, peak_rss_bytes
    bench = load_script("bench_train")
    dev, mcfg = torch.device(spec["device"]), preset(spec["preset"])
    opts = {**bench.MODES[spec["mode"]], **({"activation_checkpointing": True} if spec["checkpointing"] else {})}
    model = build_model(mcfg, device="meta")
    t0 = time.perf_counter()
    try:  # the plan is checked before anything is allocated: a misfit costs nothing
        cfg = OffloadConfig(nvme_dir=spec["swap_dir"], dtype="bf16", device=str(dev), lr=1e-4,
                            grad_accum_steps=spec["grad_accum"], **opts)
        engine = offload.initialize(model, cfg, source=seeded_init(0, mcfg.initializer_range))
    except (BudgetError, ConfigError) as e:
        return {"skipped": one_line(e)}
    init_s = time.perf_counter() - t0
    mb, seq, accum = spec["micro_batch"], spec["seq_len"], spec["grad_accum"]
    ids = torch.randint(0, mcfg.vocab_size, (accum, mb, seq + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    step_s, reports = bench.timed_updates(model, engine, ids, spec["steps"], sync)
    reports = [r.as_dict() for r in reports]
    engine.close()
    median_s = statistics.median(step_s)
    tokens_per_s = mb * seq * accum / median_s
    flops_per_token = (8 if opts.get("activation_checkpointing") else 6) * num_params(mcfg)
    out = {"init_s": init_s, "step_s": median_s, "steps_s": step_s, "tokens_per_s": tokens_per_s,
           "tflops": flops_per_token * tokens_per_s / 1e12, "flops_per_token": flops_per_token,
           "options": opts, "reports": reports, "peak_rss_bytes": peak_rss_bytes(),
           "split_s": {k: statistics.median(r[k] for r in reports) for k in bench.SPLIT + ("step_s",)}}
    if dev.type == "cuda":  # the GPU's own forward/backward time (timing events): the host's is queueing
        out["split_s"].update({k: statistics.median(r[k] or 0.0 for r in reports)
                               for k in ("forward_gpu_s", "backward_gpu_s")})
    if dev.type == "cuda":
        out.update(peak_device_allocated_bytes=torch.cuda.max_memory_allocated(dev),
                   peak_device_reserved_bytes=torch.cuda.max_memory_reserved(dev))
    return out


def child_checkpoint(spec: dict) -> dict:
    from runners.common import RunnerError
    from runners.infer import random_checkpoint
    t0 = time.perf_counter()
    try:
        random_checkpoint(preset(spec["preset"]), spec["path"], 0, torch.bfloat16)
    except RunnerError as e:  # not enough disk: said in one line by the runner itself
        return {"skipped": one_line(e)}
    return {"path": spec["path"], "write_s": time.perf_counter() - t0, "bytes": dir_bytes(spec["path"])}


def child_accelerate(spec: dict) -> dict:
    """transformers + accelerate device_map="auto" under the same device budget."""
    import transformers
    bench = load_script("bench_infer")
    cuda = spec["device"].startswith("cuda")
    max_memory = {**({0: spec["device_budget_bytes"]} if cuda else {}), "cpu": spec["host_bytes"]}
    # transformers renamed torch_dtype to dtype in 4.56; older versions would ignore `dtype`
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        spec["path"], device_map="auto", max_memory=max_memory,
        **{"dtype" if version >= (4, 56) else "torch_dtype": torch.bfloat16}).eval()
    load_s = time.perf_counter() - t0
    prompts = bench.prompts_for(spec["batch"], spec["prompt_len"], hf.config.vocab_size)
    clock = bench._StepClock()  # notes when generate() hands out each token
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts, device=spec["device"]), max_new_tokens=spec["new_tokens"],
                    streamer=clock, do_sample=False, eos_token_id=None, pad_token_id=0)
    steps = len(clock.times) - 2  # put() got the prompt, then each token (the first from prefill)
    if steps < 1:
        return {"error": f"transformers generated {steps + 1} token(s): no decode step to time"}
    step_s = clock.decode_s() / steps
    out = {"load_s": load_s, "decode_steps": steps, "decode_s_per_step": step_s,
           "s_per_token": step_s / spec["batch"], "tokens_per_s": spec["batch"] / step_s,
           "token_times_s": clock.times, "transformers": transformers.__version__,
           "modules_per_device": dict(collections.Counter(map(str, getattr(hf, "hf_device_map", {}).values())))}
    if cuda:
        out["peak_device_allocated_bytes"] = torch.cuda.max_memory_allocated(0)
    return out


def child_main(spec: dict) -> int:
    kinds = {"env": child_env_info, "train": child_train, "checkpoint": child_checkpoint,
             "accelerate": child_accelerate}
    try:
        result = kinds[spec["kind"]](spec)
    except Exception as e:  # noqa: BLE001 - an OOM or a bug: one line back, the traceback in the log
        import traceback
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {one_line(e)}"}
    with open(spec["out"] + ".tmp", "w") as f:
        json.dump(clean(result), f)
    os.replace(spec["out"] + ".tmp", spec["out"])
    return 0


# ---- phase: tests -------------------------------------------------------------------------------
def parse_junit(path: str) -> dict:
    """Counts and failing test names. A test module that cannot be imported is noted apart:
    pytest runs the rest (--continue-on-collection-errors), and only a module named *cuda* fails
    the check; another one (a test dependency such as hypothesis missing on the GPU machine)
    holds no CUDA test."""
    import xml.etree.ElementTree as ET
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "collection_errors": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        # junit's classname is the dotted path from pytest's rootdir, which differs between
        # checkouts (and for a suite outside it): the name starts at the test module
        parts = case.get("classname", "").split(".")
        first = max((k for k, p in enumerate(parts) if p.startswith("test")), default=0)
        name = f"{'.'.join(parts[first:])}::{case.get('name', '')}".lstrip(":")
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        if problem is not None and problem.get("message") == "collection failure":
            why = [line for line in (problem.text or "").splitlines() if line.startswith("E ")]
            out["collection_errors"].append({"module": name, "why": (why or ["E ?"])[-1][1:].strip()})
        elif problem is not None:
            out["failed" if problem.tag == "failure" else "errors"] += 1
            out["failures"].append(name)
        else:
            out["skipped" if case.find("skipped") is not None else "passed"] += 1
    return out


def phase_tests(args, ctx, runs: list[dict]) -> None:
    for name, extra, select in TEST_RUNS:
        if name not in args.test_runs:
            continue
        timeout = ctx.clock.timeout_s("tests", args.test_timeout_s * (1.5 if name == "plain" else 1))
        if timeout is None:
            runs.append({"run": name, "env": extra, "skipped": "time budget"})
            continue
        runs.append({"run": name, "env": extra, **run_pytest(ctx, name, [args.tests_path, *select],
                                                              timeout, extra)})


def run_pytest(ctx, name: str, select: list[str], timeout: float, extra: dict | None = None) -> dict:
    """`pytest -m cuda SELECT` with a junit file and a log under the work dir: counts, failing
    tests, sanitizer lines and whether all of it is a pass ("ok")."""
    xml = os.path.join(ctx.work, f"junit-{name}.xml")
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", *select, "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={xml}"]
    say(f"[tests] {name}: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)")
    r = run_proc(cmd, timeout, os.path.join(ctx.work, f"pytest-{name}.log"), env=child_env(extra))
    got = parse_junit(xml) if os.path.exists(xml) else {"passed": 0, "failed": 0, "errors": 0}
    reports, record_stream_only = sanitizer_reports(r["output"])
    blocking = [c for c in got.get("collection_errors", []) if "cuda" in c["module"]]
    ok = not r["timed_out"] and got["passed"] > 0 and not (got["failed"] or got["errors"] or
                                                           blocking or reports)
    return {"rc": r["rc"], "timed_out": r["timed_out"], "wall_s": r["wall_s"], **got,
            "sanitizer_reports": len(reports), "sanitizer_record_stream_reports": record_stream_only,
            "sanitizer_lines": reports[:20], "ok": ok, "output_tail": tail(r["output"], 30)}


# ---- phase: ranks (2 GPUs) ------------------------------------------------------------------------
def phase_ranks(args, ctx, out: dict) -> None:
    """ZeRO across 2 NCCL ranks; refused in one line on fewer than 2 GPUs."""
    count = torch.cuda.device_count() if ctx.gpu else 0
    if count < 2:
        out["skipped"] = f"needs 2 GPUs: this machine has {count}"
        say(f"[ranks] refused: {out['skipped']} (the 2-GPU phase runs on a machine with more)")
        return
    timeout = ctx.clock.timeout_s("ranks", args.test_timeout_s)
    if timeout is None:
        out["skipped"] = "time budget"
        return
    out.update(run="ranks", gpus=count, **run_pytest(ctx, "ranks", [os.path.join(ROOT, RANKS_TESTS)],
                                                     timeout))


def sanitizer_reports(output: str) -> tuple[list[str], int]:
    """(the lines that start or name a CSAN report, how many reports involve aten::record_stream).
    Before pytorch/pytorch#172562 (2026-01) the sanitizer flags every correct
    `tensor.record_stream(stream)` as a race: those are counted apart, so a reader can tell that
    known false positive from a real report. Every report still fails the run."""
    lines = [line for line in output.splitlines() if "CSAN" in line or "data race" in line]
    blocks = output.split("CSAN detected")[1:]
    return lines, sum("record_stream" in block.split("CSAN")[0] for block in blocks)


# ---- phase: train -------------------------------------------------------------------------------
def phase_train(args, ctx, rows: list[dict]) -> None:
    for name in args.train_presets:
        mb, seq = (2, 32) if args.allow_cpu else TRAIN_SHAPE.get(name, (2, 1024))
        mb, seq = args.micro_batch or mb, args.seq_len or seq
        for mode in args.train_modes:
            row = {"preset": name, "mode": mode, "params": num_params(preset(name)), "micro_batch": mb,
                   "seq_len": seq, "grad_accum": args.grad_accum}
            rows.append(row)
            timeout = ctx.clock.timeout_s("train", args.mode_timeout_s)
            if timeout is None:
                row["skipped"] = "time budget"
                continue
            say(f"[train] {name} {mode}: batch {mb} x {seq} (timeout {timeout:.0f} s)")
            swap = tempfile.mkdtemp(prefix=f"swap-{name}-", dir=ctx.work)
            spec = {"kind": "train", "device": ctx.device, "preset": name, "mode": mode, "swap_dir": swap,
                    "micro_batch": mb, "seq_len": seq, "grad_accum": args.grad_accum,
                    "steps": args.train_steps,
                    "checkpointing": num_params(preset(name)) >= CHECKPOINTING_FROM_PARAMS}
            try:
                row.update(run_child(spec, timeout, ctx.work))
            finally:  # a killed child leaves its swap files, and the next mode needs the disk
                shutil.rmtree(swap, ignore_errors=True)
            base = next((b for b in rows if b["preset"] == name and b["mode"] == "none" and "tflops" in b), None)
            if "tflops" in row and base:
                row["vs_none"] = row["tflops"] / base["tflops"]


# ---- phases: infer and big ----------------------------------------------------------------------
def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


class Checkpoints:
    """Random-weight checkpoints where runners.infer looks for a preset's (--offload-dir ROOT):
    at most one on disk at a time, since a 64 GiB disk holds one 13B checkpoint (26 GB)."""

    def __init__(self, root: str):
        self.root, self.held = root, None
        os.makedirs(root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, f"{name}-seed0-bf16")  # runners.infer.resolve_model's name

    def free_bytes_for(self, name: str) -> int:
        held = dir_bytes(self.path(self.held)) if self.held not in (None, name) else 0
        return shutil.disk_usage(self.root).free + held

    def ensure(self, name: str, timeout_s: float, work: str) -> dict:
        if self.held == name:
            return {"path": self.path(name), "reused": True}
        self.drop()
        say(f"[checkpoint] {name}: random bf16 weights -> {self.path(name)} (timeout {timeout_s:.0f} s)")
        r = run_child({"kind": "checkpoint", "preset": name, "path": self.path(name)}, timeout_s, work)
        if "path" in r:
            self.held = name
        else:
            shutil.rmtree(self.path(name), ignore_errors=True)
        return r

    def drop(self) -> None:
        if self.held is not None:
            shutil.rmtree(self.path(self.held), ignore_errors=True)
            self.held = None


def run_runner(args, ctx, name: str, extra: list[str], timeout_s: float) -> dict:
    """python -m runners.infer on preset `name` (its checkpoint under ctx.ckpts.root): the
    runner's --output-json and report lines, or why there are none."""
    out = new_path(ctx.work, f"infer-{name}") + ".json"
    ids = load_script("bench_infer").prompts_for(1, args.prompt_len, preset(name).vocab_size)[0]
    cmd = [sys.executable, "-m", "runners.infer", "--model", name, "--dtype", "bf16", "--prompt-ids",
           ",".join(map(str, ids)), "--ignore-eos", "--offload-dir", ctx.ckpts.root, "--output-json",
           out, *extra, *(["--gpu", "0"] if ctx.gpu else ["--probe-seconds", "0.2"])]
    say(f"[runner] {' '.join(cmd[3:])} (timeout {timeout_s:.0f} s)")
    r = run_proc(cmd, timeout_s, out + ".log")
    result = {"cmd": cmd[1:], "rc": r["rc"], "wall_s": r["wall_s"], "report": "\n".join(
        line for line in r["output"].splitlines()
        if line.startswith(("model:", "plan:", "  ", "prefill", "streamed", "peak")))}
    if r["rc"] == 0 and os.path.exists(out):
        with open(out) as f:
            result.update(json.load(f))
        return {**result, **plan_exceeded(result, ctx.gpu)}
    return {**result, "error": failure(r, timeout_s), "output_tail": tail(r["output"])}


def plan_exceeded(run: dict, gpu: bool) -> dict:
    """{"plan_exceeded": ...} when a runner's peak device memory passed the device bytes its
    accepted plan promised (on a GPU: on the CPU the peak is the process's RSS); else {}."""
    peak = run.get("metrics", {}).get("peak_device_bytes")
    need = run.get("plan", {}).get("device_need")
    if gpu and peak is not None and need is not None and peak > need:
        return {"plan_exceeded": {"peak_device_bytes": peak, "device_need": need}}
    return {}


def decode_numbers(m: dict, weights: str, batch: int, h2d_gbps: float | None) -> dict:
    """s/token, tokens/s and the floor of one runner run (its metrics). The floor is the
    runner's own (bytes per step over the bandwidth it measured); where it has none, the bytes
    it moved from host RAM over the pinned H2D bandwidth measured at the start."""
    step_s, floor_s = m["decode_s_per_step"], m.get("floor_s_per_step")
    out = {"s_per_token": step_s / batch, "tokens_per_s": m["decode_tokens_per_s"],
           "decode_s_per_step": step_s, "floor_source": "runner"}
    if not (floor_s and math.isfinite(floor_s)) and weights == "cpu" and h2d_gbps:
        floor_s = m["bytes_per_token"]["cpu"] * batch / (h2d_gbps * 1e9)
        out["floor_source"] = "bytes moved / pinned H2D measured at start"
    if floor_s and math.isfinite(floor_s):
        out.update(floor_s_per_step=floor_s, vs_floor=floor_s / step_s)
    else:
        out["floor_source"] = "no floor: nothing streamed"
    return out


def run_accelerate(args, ctx, name: str, budget: int, timeout_s: float) -> dict:
    import psutil
    say(f"[accelerate] {name}: device_map=auto, device budget {format_bytes(budget)}")
    return run_child({"kind": "accelerate", "device": ctx.device, "path": ctx.ckpts.path(name),
                      "device_budget_bytes": budget, "batch": 1, "prompt_len": args.prompt_len,
                      "host_bytes": int(psutil.virtual_memory().available * 0.8),
                      "new_tokens": args.new_tokens}, timeout_s, ctx.work)


def phase_infer(args, ctx, results: list[dict]) -> None:
    for name in args.infer_presets:
        model_bytes = num_params(preset(name)) * 2
        budget = model_bytes // 4  # forced below the model: most of it must stream
        entry = {"preset": name, "model_bytes": model_bytes, "device_budget_bytes": budget, "runs": [],
                 "accelerate": {"skipped": "not reached"}}
        results.append(entry)
        timeout = ctx.clock.timeout_s("infer", args.checkpoint_timeout_s)
        ck = entry["checkpoint"] = ctx.ckpts.ensure(name, timeout, ctx.work) if timeout else \
            {"skipped": "time budget"}
        if "path" not in ck:
            entry["skipped"] = ck.get("skipped") or ck.get("error")
            continue
        # batch by batch, the reference right after the first run: the goals are at batch 1
        order = [(weights, batch) for batch in args.infer_batches for weights in args.infer_weights]
        for k, (weights, batch) in enumerate(order):
            item = {"weights": weights, "batch": batch}
            entry["runs"].append(item)
            timeout = ctx.clock.timeout_s("infer", args.infer_timeout_s)
            if timeout is None:
                item["skipped"] = "time budget"
            else:
                item.update(run_runner(args, ctx, name, [
                    "--weights", weights, "--batch-size", str(batch), "--max-new-tokens",
                    str(args.new_tokens), *(["--gpu-memory", str(budget)] if ctx.gpu else [])], timeout))
                if "metrics" in item:
                    item.update(decode_numbers(item["metrics"], weights, batch, ctx.h2d_gbps))
            if k == 0:
                timeout = ctx.clock.timeout_s("infer", args.infer_timeout_s)
                entry["accelerate"] = run_accelerate(args, ctx, name, budget, timeout) if timeout \
                    else {"skipped": "time budget"}
        ours = next((r for r in entry["runs"] if r["weights"] == "cpu" and r["batch"] == 1
                     and "s_per_token" in r), None)
        if ours and entry["accelerate"].get("s_per_token"):
            entry["vs_accelerate"] = entry["accelerate"]["s_per_token"] / ours["s_per_token"]
        if "big" not in args.phases or name != args.infer_presets[-1]:
            ctx.ckpts.drop()  # the last one may be the big phase's largest: kept for it


def phase_big(args, ctx, out: dict) -> None:
    def per_tier(run: dict) -> dict:
        placed = run.get("plan", {}).get("residency", [])
        return {t: placed.count(t) for t in ("device", "cpu", "nvme")}

    timeout = ctx.clock.timeout_s("big", 60)
    if timeout is None:
        out["skipped"] = "time budget"
        return
    dry = run_runner(args, ctx, "70B", ["--dry-run"], timeout)
    out.update(largest=None, tried=[], dry_run_70B={
        "rc": dry["rc"], "error": dry.get("error"), "report": dry["report"], "blocks_per_tier": per_tier(dry)})
    for name in args.big_presets:  # largest first: the first that runs is the answer
        need, free = num_params(preset(name)) * 2, ctx.ckpts.free_bytes_for(name)
        item = {"preset": name, "weights_bytes": need, "disk_free_bytes": free}
        out["tried"].append(item)
        if need > 0.95 * free:  # random_checkpoint would refuse too; saying so here costs nothing
            item["skipped"] = f"bf16 weights {format_bytes(need)} > {format_bytes(free)} free on disk"
            continue
        # the runner's plan (a refusal is a skip), the weights on disk, then 4 tokens
        steps = (("plan", "plan", ["--dry-run"], 60), ("checkpoint", "path", None, args.checkpoint_timeout_s),
                 ("run", "metrics", ["--weights", "auto", "--max-new-tokens", "4"], args.infer_timeout_s))
        for what, proof, extra, limit_s in steps:
            timeout = ctx.clock.timeout_s("big", limit_s)
            got = {"skipped": "time budget"} if timeout is None else \
                ctx.ckpts.ensure(name, timeout, ctx.work) if extra is None else \
                run_runner(args, ctx, name, extra, timeout)
            item[what] = got
            if proof not in got:
                why = got.get("skipped") or got.get("error")
                if what == "plan" and not got.get("skipped"):  # the runner refused it: it does not fit
                    item["skipped"] = f"the runner's plan: {why}"
                else:
                    item["skipped" if got.get("skipped") else "error"] = why
                break
        else:
            item.update(s_per_token=item["run"]["metrics"]["decode_s_per_step"],
                        blocks_per_tier=per_tier(item["run"]))
            out["largest"] = name
            break
    ctx.ckpts.drop()


# ---- the report ---------------------------------------------------------------------------------
def goal(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "no")


def not_measured(r: dict) -> str:
    if r.get("skipped") or r.get("error"):
        return f"skipped: {r['skipped']}" if r.get("skipped") else f"failed: {r['error']}"
    return "not finished (interrupted)"


def test_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for t in runs:
        if "ok" not in t:
            rows.append(["tests", t["run"], not_measured(t), "-", "-", "n/a"])
            continue
        got = (f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t.get('skipped', 0)} "
               f"skipped, {t['sanitizer_reports']} sanitizer lines"
               + (f" ({t['sanitizer_record_stream_reports']} on aten::record_stream: the known false "
                  f"positive of torch before pytorch#172562)" if t.get("sanitizer_record_stream_reports")
                  else "")
               + f" ({'timeout' if t['timed_out'] else 'rc ' + str(t['rc'])}, {t['wall_s']:.0f} s)")
        if t.get("failures"):
            got += "; failing: " + ", ".join(t["failures"][:5])
        if t.get("collection_errors"):
            got += "; not importable: " + ", ".join(f"{c['module']} ({c['why']})" for c in t["collection_errors"])
        rows.append(["tests", t["run"], got, "all pass, no report", "-", goal(t["ok"])])
    return rows


def ranks_rows(r: dict) -> list[list[str]]:
    return test_rows([{**r, "run": f"2 NCCL ranks ({r.get('gpus', '?')} GPUs)"}])


def train_rows(modes: list[dict]) -> list[list[str]]:
    rows = []
    for r in modes:
        item = f"{r['preset']} {r['mode']} ({r['micro_batch']}x{r['seq_len']})"
        if "tflops" not in r:
            rows.append(["train", item, not_measured(r), "-", "-", "n/a"])
            continue
        sp = r["split_s"]
        peak = format_bytes(r["peak_device_allocated_bytes"]) if "peak_device_allocated_bytes" in r else "-"
        got = (f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s, {r['tflops']:.3g} TFLOPS "
               f"(fwd {sp['forward_s']:.2f} bwd {sp['backward_s']:.2f} cpu {sp['cpu_step_s']:.2f} "
               f"io {sp['io_wait_s']:.2f} up {sp['upload_s']:.2f}"
               + (f"; on the GPU fwd {sp['forward_gpu_s']:.2f} bwd {sp['backward_gpu_s']:.2f}"
                  if "forward_gpu_s" in sp else "") + f"; peak device {peak}, "
               f"RSS {format_bytes(r['peak_rss_bytes'])})")
        ok = r["vs_none"] >= GOAL_TRAIN_CPU if r["mode"] == "cpu" and "vs_none" in r else None
        rows.append(["train", item, got, "offload none" if r["mode"] != "none" else "-",
                     f"{r['vs_none']:.2f}" if "vs_none" in r else "-", goal(ok)])
    return rows


def infer_rows(entries: list[dict]) -> list[list[str]]:
    rows = []
    for e in entries:
        if "skipped" in e:
            rows.append(["infer", e["preset"], not_measured(e), "-", "-", "n/a"])
            continue
        for r in e["runs"]:
            item = f"{e['preset']} --weights {r['weights']} batch {r['batch']}"
            if "s_per_token" not in r:
                rows.append(["infer", item, not_measured(r), "-", "-", "n/a"])
                continue
            floor = (f"floor {r['floor_s_per_step'] / r['batch']:.4f} s/token ({r['floor_source']})"
                     if "vs_floor" in r else r["floor_source"])
            ok = r["vs_floor"] >= GOAL_FLOOR if r["batch"] == 1 and "vs_floor" in r else None
            over = (f"; peak device {format_bytes(r['plan_exceeded']['peak_device_bytes'])} OVER the "
                    f"plan's {format_bytes(r['plan_exceeded']['device_need'])}" if r.get("plan_exceeded") else "")
            rows.append(["infer", item, f"{r['s_per_token']:.4f} s/token, {r['tokens_per_s']:.1f} tok/s{over}",
                         floor, f"{100 * r['vs_floor']:.0f}% of floor" if "vs_floor" in r else "-", goal(ok)])
        acc = e["accelerate"]
        ours = next((r for r in e["runs"] if r["weights"] == "cpu" and r["batch"] == 1
                     and "s_per_token" in r), None)
        rows.append(["infer", f"{e['preset']} vs accelerate, batch 1",
                     f"{ours['s_per_token']:.4f} s/token (--weights cpu)" if ours else "ours not measured",
                     f"accelerate {acc['s_per_token']:.4f} s/token" if "s_per_token" in acc
                     else f"accelerate {not_measured(acc)}",
                     f"{e['vs_accelerate']:.2f}x" if "vs_accelerate" in e else "-",
                     goal(e["vs_accelerate"] >= GOAL_VS_ACCELERATE) if "vs_accelerate" in e else "n/a"])
    return rows


def big_rows(big: dict) -> list[list[str]]:
    d = big.get("dry_run_70B") or {"rc": None, "error": "interrupted"}
    rows = [["big", "70B --dry-run", f"plan: blocks per tier {d['blocks_per_tier']}" if d["rc"] == 0
             else not_measured(d), "-", "-", goal(d["rc"] == 0)]]
    for t in big.get("tried", []):
        rows.append(["big", f"{t['preset']} (largest that runs?)",
                     f"{t['s_per_token']:.4f} s/token, blocks per tier {t['blocks_per_tier']}"
                     if "s_per_token" in t else not_measured(t), "-", "-",
                     "yes" if "s_per_token" in t else "n/a"])
    return rows


def markdown(res: dict) -> str:
    ph, rows = res["phases"], []
    for name, make in (("tests", test_rows), ("ranks", ranks_rows), ("train", train_rows),
                       ("infer", infer_rows), ("big", big_rows)):
        if name in res["selected"]:
            not_run = isinstance(ph[name], dict) and "skipped" in ph[name]
            rows += [[name, "-", not_measured(ph[name]), "-", "-", "n/a"]] if not_run else make(ph[name])
    res["table"] = rows
    out = ["| phase | item | result | reference | ratio | goal met? |", "|---|---|---|---|---:|---|"]
    return "\n".join(out + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows])


# ---- main ---------------------------------------------------------------------------------------
def machine_info() -> dict:
    import psutil
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "host_total_bytes": psutil.virtual_memory().total,
            "nvidia_smi_L": None, "cpu_model": None}
    try:
        info["nvidia_smi_L"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                              timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi_error"] = one_line(e)
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--phases", default=",".join(PHASES), help=f"comma-separated, of {','.join(PHASES)} (default all)")
    add("--budget-s", type=float, default=600.0, help="total wall time in seconds (default 600)")
    add("--json", help="everything measured (default gpu_check.json; --self-test: in its work dir)")
    add("--work-dir", help="swap files, checkpoints, logs and junit files (default: a temp dir under "
        "the current directory, on its disk, removed at the end unless the run failed)")
    add("--tests-path", default="tests", help="what `pytest -m cuda` collects (default tests)")
    add("--test-timeout-s", type=float, default=150.0, help="per pytest run (default 150)")
    add("--test-runs", default=",".join(n for n, _, _ in TEST_RUNS),
        help="which of the tests phase's runs, comma-separated (default all: plain,sanitizer,delays)")
    add("--train-presets", nargs="+", help=f"default {' '.join(GPU_DEFAULTS['train'])}")
    add("--train-modes", nargs="+", default=list(TRAIN_MODES), choices=list(load_script("bench_train").MODES),
        metavar="MODE", help=f"bench_train.py modes (default {' '.join(TRAIN_MODES)})")
    add("--train-steps", type=int, default=3, help="timed updates per mode, after one warm-up (default 3)")
    add("--micro-batch", type=int, help=f"sequences per micro-batch (default per preset: {TRAIN_SHAPE})")
    add("--seq-len", type=int, help="tokens per sequence (default per preset, above)")
    add("--grad-accum", type=int, default=1, help="micro-batches per update (default 1)")
    add("--mode-timeout-s", type=float, default=120.0, help="per training mode (default 120)")
    add("--infer-presets", nargs="+", help=f"default {' '.join(GPU_DEFAULTS['infer'])}")
    add("--infer-weights", nargs="+", default=["cpu", "nvme"], choices=["cpu", "nvme"])
    add("--infer-batches", nargs="+", type=int, default=[1, 32])
    add("--new-tokens", type=int, default=5, help="generated per run, the first by prefill (default 5)")
    add("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    add("--infer-timeout-s", type=float, default=120.0, help="per runner or accelerate run (default 120)")
    add("--checkpoint-timeout-s", type=float, default=240.0, help="per random checkpoint (default 240)")
    add("--big-presets", nargs="+", help=f"largest first (default {' '.join(GPU_DEFAULTS['big'])})")
    add("--allow-cpu", action="store_true", help="run every phase on the CPU with tiny sizes: for "
        "testing the script itself, not a measurement of anything")
    add("--self-test", action="store_true", help="check this kit on the CPU: the tests phase over a "
        "planted suite with a failing check, which must make it exit 1 (an exit 0 means the kit can "
        "pass falsely)")
    add("--_child", help=argparse.SUPPRESS)
    return p


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def failures(res: dict) -> list[str]:
    """What makes the run a failure (exit 1), one line each: a selected tests run that is not
    ok (a failed or erroring test, a timeout, a sanitizer report, or not run for time), the
    2-GPU phase's, a run past its plan, a measurement of ours that crashed."""
    out, ph = [], res["phases"]
    if "tests" in res["selected"]:
        runs = ph["tests"] if isinstance(ph["tests"], list) else [{"run": "all", **ph["tests"]}]
        for t in runs:
            if "ok" not in t:
                out.append(f"tests {t['run']}: not run ({t.get('skipped', 'interrupted')})")
            elif not t["ok"]:
                names = ", ".join(t.get("failures", [])[:5])
                out.append(f"tests {t['run']}: {t['failed']} failed, {t['errors']} errors"
                           + (f" ({names})" if names else "")
                           + (f", {t['sanitizer_reports']} sanitizer report lines"
                              if t.get("sanitizer_reports") else "")
                           + (", timed out" if t.get("timed_out") else ""))
    ranks = ph.get("ranks", {})
    if "ok" in ranks and not ranks["ok"]:
        out.append(f"ranks: {ranks['failed']} failed, {ranks['errors']} errors "
                   f"({', '.join(ranks.get('failures', [])[:5])})")
    for row in ph.get("train") if isinstance(ph.get("train"), list) else []:
        if row.get("error"):
            out.append(f"train {row['preset']} {row['mode']}: {row['error']}")
    for entry in ph.get("infer") if isinstance(ph.get("infer"), list) else []:
        for r in entry.get("runs", []):
            item = f"infer {entry['preset']} --weights {r['weights']} batch {r['batch']}"
            if r.get("error"):
                out.append(f"{item}: {r['error']}")
            if r.get("plan_exceeded"):
                p = r["plan_exceeded"]
                out.append(f"{item}: peak device {format_bytes(p['peak_device_bytes'])} > the plan's "
                           f"{format_bytes(p['device_need'])}")
    return out


def plant_suite(work: str) -> str:
    """--self-test's suite (PLANTED_SUITE) under `work`; its directory."""
    suite = os.path.join(work, "planted_suite")
    os.makedirs(suite, exist_ok=True)
    for name, text in PLANTED_SUITE.items():
        with open(os.path.join(suite, name), "w") as f:
            f.write(text)
    return suite


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args._child:
        return child_main(json.loads(args._child))
    if args.self_test:  # the tests phase on the CPU over the planted suite, the plain run only
        args.allow_cpu, args.phases, args.test_runs = True, "tests", "plain"
    gpu = torch.cuda.is_available() and not args.self_test
    if not gpu and not args.allow_cpu:
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, cuda {torch.version.cuda}); "
              f"run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not args.phases or set(args.phases) - set(PHASES):
        p.error(f"--phases: a comma-separated list of {','.join(PHASES)}")
    args.test_runs = [x.strip() for x in args.test_runs.split(",") if x.strip()]
    if not args.test_runs or set(args.test_runs) - {n for n, _, _ in TEST_RUNS}:
        p.error(f"--test-runs: a comma-separated list of {','.join(n for n, _, _ in TEST_RUNS)}")
    if min(args.train_steps, args.grad_accum, *args.infer_batches) < 1 or args.new_tokens < 2:
        p.error("--train-steps, --grad-accum and --infer-batches must be >= 1, --new-tokens >= 2")
    for kind in ("train", "infer", "big"):
        names = getattr(args, f"{kind}_presets") or (GPU_DEFAULTS if gpu else CPU_DEFAULTS)[kind]
        if set(names) - set(PRESETS):
            p.error(f"--{kind}-presets: unknown {', '.join(sorted(set(names) - set(PRESETS)))}")
        setattr(args, f"{kind}_presets", names)
    # children run in sessions of their own (a timeout kills each whole tree), so a SIGTERM to
    # this process must end them too: it stops the run like Ctrl-C
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    work = args.work_dir or tempfile.mkdtemp(prefix="gpu_check-",
                                             dir=None if args.self_test else os.getcwd())
    os.makedirs(work, exist_ok=True)
    args.json = args.json or os.path.join(work if args.self_test else ".", "gpu_check.json")
    if args.self_test:
        args.tests_path = plant_suite(work)
    ctx = types.SimpleNamespace(clock=Deadlines(args.budget_s, args.phases), work=work, gpu=gpu,
                                device="cuda:0" if gpu else "cpu", h2d_gbps=None,
                                ckpts=Checkpoints(os.path.join(work, "checkpoints")))
    res = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "argv": sys.argv, "budget_s": args.budget_s, "selected": args.phases,
           "machine": machine_info(), "phases": {
               name: {"skipped": "not reached" if name in args.phases else "not selected (--phases)"}
               for name in PHASES}}
    try:
        if args.self_test:  # the planted suite needs no machine numbers
            res["machine"].update(torch=torch.__version__, cuda=torch.version.cuda)
        else:
            res["machine"].update(run_child({"kind": "env", "device": ctx.device}, 120, work))
        ctx.h2d_gbps = res["machine"].get("h2d_gbps")
        for name in args.phases:
            say(f"== {name}: {ctx.clock.left_s(name):.0f} s to its deadline")
            out = res["phases"][name] = {} if name in ("big", "ranks") else []
            {"tests": phase_tests, "ranks": phase_ranks, "train": phase_train, "infer": phase_infer,
             "big": phase_big}[name](args, ctx, out)
    except KeyboardInterrupt:  # what was measured so far is still reported and written
        res["interrupted"] = True
    finally:
        ctx.ckpts.drop()
    return report(args, res, work, t0)


def report(args, res: dict, work: str, t0: float) -> int:
    """Print the table, write the json, keep the work dir where anything failed; the exit status
    (module docstring)."""
    res["failures"] = failures(res)
    keep = bool(res["failures"] or res.get("interrupted"))
    if not args.work_dir and not keep:
        shutil.rmtree(work, ignore_errors=True)
    res["work_dir"] = work if (args.work_dir or keep) else None
    res["elapsed_s"] = time.monotonic() - t0
    m = res["machine"]
    h2d = f"{m['h2d_gbps']:.1f} GB/s" if m.get("h2d_gbps") else f"not measured ({m.get('error')})"
    print(f"\n{m.get('device_name', 'CPU (--allow-cpu: not a measurement)')}; torch {m.get('torch')}, "
          f"cuda {m.get('cuda')}; {m.get('cpu_model')} x{m.get('cpu_count')}; {m.get('h2d_source')} "
          f"{h2d}; {res['elapsed_s']:.0f} s" + ("; INTERRUPTED" if res.get("interrupted") else ""))
    print(markdown(res))
    with open(args.json, "w") as f:
        json.dump(clean(res), f, indent=1)
    print(f"wrote {args.json}")
    if res.get("interrupted"):
        say(f"gpu_check: interrupted; logs kept in {work}")
        return 130
    if res["failures"]:
        say(f"gpu_check: FAILED ({len(res['failures'])}): " + "; ".join(res["failures"])
            + f"; logs and junit files kept in {work}")
        if args.self_test:
            say("gpu_check --self-test: the planted failure was caught (exit 1, as it must be); "
                "an exit 0 here would mean the kit can pass falsely")
        return 1
    if args.self_test:  # the planted failure went unseen: the kit itself is broken
        say("gpu_check --self-test: the planted failing check was NOT caught: the kit can pass "
            "falsely")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
