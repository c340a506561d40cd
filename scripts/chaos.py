"""Crash campaign: SIGKILL a fine-tuning run at random moments, resume it each time, and check
that the end result is bit-identical to an uninterrupted run of the same seed and flags.

    python scripts/chaos.py                       # 24 kills over a 72-update NVMe run (~6 min)
    python scripts/chaos.py --kills 40 --steps 120 --seed 3 --workdir /tmp/chaos --table out.md
    python scripts/chaos.py --damage 24               # damage swap files under running runs
    python scripts/chaos.py --ranks 2 --kills 10      # a 2-rank torchrun job, killed whole

What it does:
1. runs `python -m runners.finetune --offload nvme --save-every S ...` to the end: the reference;
2. runs the same command again, and kills it with SIGKILL — either from outside after a random
   delay, or from inside at the N-th call of one phase (a decoder layer's forward, the backward
   through it, the CPU AdamW kernel, a swap-file write before/after its rename, a checkpoint file
   write, between the two renames that swap checkpoint directories, the final model export).
   After each kill it relaunches with `--resume OUTPUT` (from scratch while no checkpoint exists
   yet), until `--kills` kills have happened; then lets the last launch finish;
3. compares: every engine-state file (fp32 masters + Adam moments per block), every exported
   safetensors shard and the trainer state (loss history, data position, RNG states) byte for
   byte with the reference, and every metrics.jsonl row (a step logged by a launch that was
   later killed and then redone must carry the same loss as its redo and as the reference).

With --ranks N the runs are torchrun jobs of N ranks (ZeRO stage --zero-stage, default 2; each
rank saves its shards) and every kill is a SIGKILL of the whole job -- the launcher and every
rank at once -- at a random moment; the reference is an uninterrupted N-rank run.

With --damage N it runs a different campaign (scripts/chaos_damage.py): N fresh runs, each with
one swap file damaged mid-run, each of which must stop with a one-line swap error or finish
bit-identical to the reference.

In-process kills are installed by this script's own child mode (`chaos.py child ARGS...`),
which wraps a few library functions before calling `runners.finetune.main`; the library carries
no test hooks. The child also records its current phase in a small memory-mapped file so an
outside kill can be attributed to a phase. Each launch's output goes to WORKDIR/logs/.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from chaos_common import REPO, compare_runs, finetune_args, run_env

KILL_ENV = "OFFLOAD_CHAOS_KILL"    # "phase:n:when" — armed in the child
PHASE_ENV = "OFFLOAD_CHAOS_PHASE"  # path of the phase file the child keeps current
PHASE_BYTES = 64

# In-process kill points and how many times each is reached per update (tiny model, one micro-
# batch): 4 layers' forward/backward, 5 blocks stepped, 3 swap files per block.
PHASES = ("forward", "backward", "cpu-step", "swap-write", "checkpoint", "checkpoint-rename",
          "export", "time")


# ---- the child: a finetune run with kill points --------------------------------------------------
class _PhaseFile:
    """The child's current phase, in a memory-mapped file (no syscall per update)."""

    def __init__(self, path: str | None):
        self.map = None
        if path:
            with open(path, "wb") as f:
                f.write(b"\0" * PHASE_BYTES)
            with open(path, "r+b") as f:
                self.map = mmap.mmap(f.fileno(), PHASE_BYTES)
        self.stack = ["startup"]
        self.set("startup")

    def set(self, name: str) -> None:
        if self.map is not None:
            self.map[:] = name.encode()[:PHASE_BYTES].ljust(PHASE_BYTES, b"\0")

    def push(self, name: str) -> None:
        self.stack.append(name)
        self.set(name)

    def pop(self) -> None:
        self.stack.pop()
        self.set(self.stack[-1] if self.stack else "")


def _child(argv: list[str]) -> int:
    import threading

    import torch

    import nvme.format
    import nvme.swap
    import offload.train.checkpoint
    import offload.train.engine
    import offload.models
    import offload.models.hf
    import offload.models.llama
    import offload.optim.adamw
    import offload.train.stepper
    from runners.finetune import main

    spec = os.environ.get(KILL_ENV, "")
    phase, n, when = (spec.split(":") + ["", "", ""])[:3] if spec else ("", "0", "")
    target = int(n or 0)
    counter = [0]
    lock = threading.Lock()
    phases = _PhaseFile(os.environ.get(PHASE_ENV))

    def die(where: str) -> None:
        sys.stderr.write(f"\nchaos: SIGKILL in {where} (call {target} of {phase})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def hit(name: str) -> bool:
        """Count a call of kill point `name`; True when it is the armed one's n-th."""
        if name != phase:
            return False
        with lock:
            counter[0] += 1
            return counter[0] == target

    def tracked(fn, name):
        def wrapper(*a, **k):
            phases.push(name(a, k) if callable(name) else name)
            try:
                return fn(*a, **k)
            finally:
                phases.pop()
        return wrapper

    # phase tracking (main thread)
    E = offload.train.engine.Engine
    E.__init__ = tracked(E.__init__, "engine-init")
    E.load_state = tracked(E.load_state, "resume-load")
    E.backward = tracked(E.backward, "backward")
    E.step = tracked(E.step, "optimizer-step")
    M = offload.models.llama.LlamaForCausalLM
    M.forward = tracked(M.forward, lambda a, k: "forward" if torch.is_grad_enabled() else "eval")
    offload.train.checkpoint.save_checkpoint = tracked(offload.train.checkpoint.save_checkpoint, "checkpoint")
    save_pretrained = offload.models.save_pretrained
    offload.models.save_pretrained = tracked(
        save_pretrained, lambda a, k: "checkpoint" if "checkpoint" in phases.stack else "export")

    # kill points
    layer_forward = offload.models.llama.DecoderLayer.forward

    def decoder_forward(self, *a, **k):
        grad = torch.is_grad_enabled()
        if grad and hit("forward"):
            die("a decoder layer's forward")
        out = layer_forward(self, *a, **k)
        if grad and out.requires_grad and hit("backward"):
            out.register_hook(lambda g: die("backward through a decoder layer"))
        return out
    offload.models.llama.DecoderLayer.forward = decoder_forward

    def kill_around(fn, point: str, before: str, after: str):
        """`fn` with a kill at kill point `point`'s armed call: before it or after it (`when`)."""
        def wrapper(*a, **k):
            if when != "after" and hit(point):
                die(before)
            out = fn(*a, **k)
            if when == "after" and hit(point):
                die(after)
            return out
        return wrapper

    adamw = kill_around(offload.train.stepper.cpu_adamw_step, "cpu-step",
                        "the CPU AdamW step (before a block's kernel)",
                        "the CPU AdamW step (after a block's kernel, before its write-behind)")
    offload.train.stepper.cpu_adamw_step = adamw  # read when the engine builds its stepper
    offload.optim.adamw.cpu_adamw_step = adamw

    # a speculative step's rollback (runners.finetune --speculative-step): each touched
    # block's weights rebuilt from its restored state (tests/test_speculative_step.py aims
    # here; not among the random PHASES: only a run with --speculative-step reaches it)
    offload.train.stepper.BlockStepper.rewrite_weights = kill_around(
        offload.train.stepper.BlockStepper.rewrite_weights, "rollback",
        "a speculative step's rollback (before rebuilding a block's weights)",
        "a speculative step's rollback (after rebuilding a block's weights)")

    nvme.swap.SwapStore._finish_write = kill_around(
        nvme.swap.SwapStore._finish_write, "swap-write",
        "a swap write (data in the .tmp file, before header and rename)",
        "a swap write (just after its rename)")

    write_file = nvme.format.write_file

    def chaos_write_file(path, *a, **k):
        kind = "checkpoint" if "checkpoint" in phases.stack else "export"
        if when != "after" and hit(kind):
            die(f"a {kind} file write (before {os.path.basename(os.fspath(path))})")
        out = write_file(path, *a, **k)
        if when == "after" and hit(kind):
            die(f"a {kind} file write (after {os.path.basename(os.fspath(path))})")
        return out
    nvme.format.write_file = chaos_write_file
    offload.models.hf.write_file = chaos_write_file

    replace = os.replace

    def chaos_replace(src, dst, *a, **k):
        out = replace(src, dst, *a, **k)
        s = os.fspath(src)
        if s.endswith(os.sep + "checkpoint") or s.endswith(os.sep + "checkpoint.tmp"):
            if hit("checkpoint-rename"):
                die(f"the checkpoint directory swap (after renaming {os.path.basename(s)})")
        return out
    os.replace = chaos_replace

    phases.set("startup")
    return main(argv)


# ---- the driver ---------------------------------------------------------------------------------
@dataclass
class Launch:
    index: int
    resumed: bool          # launched with --resume
    from_step: int         # the checkpoint's update (0: fresh start)
    plan: str              # the kill that was armed ("phase:n:when" or "time:SECONDS")
    outcome: str = ""      # "killed", "completed", "failed (rc N)"
    killed_in: str = ""    # where the kill landed (the child's message or its phase file)
    resume_ok: bool | None = None  # a --resume launch got past loading the checkpoint
    seconds: float = 0.0


@dataclass
class Campaign:
    launches: list[Launch] = field(default_factory=list)
    reference_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return sum(1 for x in self.launches if x.outcome == "killed")

    @property
    def resumes(self) -> list[Launch]:
        return [x for x in self.launches if x.resumed]


def checkpoint_step(output: str) -> int | None:
    """The update of the complete checkpoint a resume would load, or None."""
    sys.path.insert(0, REPO)
    from offload.train.checkpoint import CheckpointNotFound, find_checkpoint, load_trainer_state

    try:
        return int(load_trainer_state(find_checkpoint(output))["step"])
    except (CheckpointNotFound, KeyError, ValueError):
        return None


# calls per update of each in-process kill point with the tiny preset (4 layers, 5 blocks, 3
# swap files per block), per micro-batch for forward/backward
RATES = {"forward": 4, "backward": 4, "cpu-step": 5, "swap-write": 15,
         "rollback": 5}  # blocks stepped during backward (all 5), where every update rolls back


def choose_kill(rng: random.Random, remaining: int, save_every: int, max_delay: float,
                phases: list[str] | None = None, launch_s: float = 0.0, kills_left: int = 1,
                resumed: bool = True, micro_batches: int = 1) -> str:
    """A kill plan that fires before the run ends (so every launch but the last is killed),
    aimed so that the kills left spread over the updates left: the target update lies in the
    second half of this launch's share (`remaining / kills_left` updates), so most launches
    get a checkpoint further. `launch_s`: a low estimate of this launch's duration if not
    killed; `resumed`: the launch rewrites the swap files from a checkpoint at start."""
    if phases:
        phase = phases[0]
    elif remaining <= 1:
        phase = rng.choice(["checkpoint", "checkpoint-rename", "export"])
    else:  # an outside kill needs enough run left that it surely lands before the end
        phase = rng.choice([p for p in PHASES if p != "export" and (p != "time" or launch_s >= 2.0)])
    share = max(1, remaining // max(1, kills_left))
    if phase == "time":  # counted from the first training forward (see run_launch); within
        # half the estimate: the machine may be faster than when the reference ran
        return f"time:{min(max_delay, rng.uniform(0.05, 0.5) * launch_s * share / remaining):.2f}"
    if phase == "export":
        return f"export:1:{rng.choice(['before', 'after'])}"
    when = rng.choice(["before", "after"])
    if phase in ("checkpoint", "checkpoint-rename"):
        saves = max(1, min(share, remaining) // save_every)  # saves this launch reaches
        k = rng.randint(max(1, (saves + 1) // 2), saves)
        if phase == "checkpoint":  # each save writes one file per block (5) and one model shard
            return f"{phase}:{6 * (k - 1) + rng.randint(1, 6)}:{when}"
        # two renames per save (the first save of a fresh run has only the second)
        first = 1 if resumed else 0
        return f"{phase}:{max(1, 2 * (k - 1) + rng.randint(1, 2) - (1 - first))}:after"
    update = rng.randint(max(1, (share + 1) // 2), max(1, min(share, remaining - 1)))
    if phase == "swap-write":
        start = 30 if resumed else 15  # init, then (resumed) the checkpoint rewritten into swap
        if rng.random() < 0.2:  # sometimes while the swap files are being (re)written at start
            return f"{phase}:{rng.randint(1, start)}:{when}"
        return f"{phase}:{start + 15 * (update - 1) + rng.randint(1, 15)}:{when}"
    rate = RATES[phase] * (micro_batches if phase in ("forward", "backward") else 1)
    return f"{phase}:{rate * (update - 1) + rng.randint(1, rate)}:{when}"


def kill_job(p: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it at once (torchrun may start its ranks in
    process groups of their own), and wait until all are gone: the next launch must not find
    the run directory still locked by a dying rank."""
    import psutil
    try:
        procs = [psutil.Process(p.pid)] + psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def run_launch(cmd: list[str], plan: str, log: str, phase_file: str, timeout: float,
               job: bool = False) -> tuple[int, str]:
    """`job`: cmd is a launcher with children (torchrun): a kill is a SIGKILL of the launcher and
    every rank at once (kill_job)."""
    env = run_env()
    env[PHASE_ENV] = phase_file
    if os.path.exists(phase_file):
        os.unlink(phase_file)  # the previous launch's last phase must not be read as this one's
    if not plan.startswith("time:"):
        env[KILL_ENV] = plan
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            if plan.startswith("time:"):
                # the delay runs from the first training forward: start-up time varies a lot
                # with the machine's load, the pace of updates much less
                # (a job's: past the first evaluation too, which takes its ranks a while)
                waits = STARTING + (("eval",) if job else ())
                while p.poll() is None and _read_phase(phase_file) in waits:
                    time.sleep(0.005)
                try:
                    rc = p.wait(timeout=float(plan.split(":")[1]))
                except subprocess.TimeoutExpired:
                    where = _read_phase(phase_file)
                    if job:
                        kill_job(p)
                    else:
                        p.send_signal(signal.SIGKILL)
                    p.wait()
                    return -signal.SIGKILL, f"{where} (SIGKILL from outside)"
                return rc, ""
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if job:
                kill_job(p)
            else:
                p.kill()
            p.wait()
            return 124, "timeout"
    where = ""
    if rc == -signal.SIGKILL:
        with open(log) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("chaos: SIGKILL in ")]
        where = lines[-1][len("chaos: SIGKILL in "):] if lines else _read_phase(phase_file)
    return rc, where


STARTING = ("", "?", "startup", "engine-init", "resume-load")


def _read_phase(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(PHASE_BYTES).rstrip(b"\0").decode() or "?"
    except OSError:
        return "?"


def launcher(ranks: int) -> list[str]:
    """The command prefix that runs a Python program: the interpreter, or torchrun with `ranks`
    ranks on a free port (each launch its own: a killed job's port may still be held)."""
    if ranks <= 1:
        return [sys.executable]
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(port)]


def run_campaign(workdir: str, kills: int, steps: int, save_every: int, seed: int,
                 extra: list[str], rng_seed: int, max_delay: float = 8.0,
                 phases: list[str] | None = None, launch_timeout: float = 600.0,
                 echo=print, ranks: int = 1) -> Campaign:
    """Reference run, then the killed-and-resumed run; returns the record (problems empty on
    success). `phases` forces the kill phases in order (tests); default: random. `ranks` > 1:
    torchrun jobs, each kill a SIGKILL of the whole job at a random time."""
    rng = random.Random(rng_seed)
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    ref, out = os.path.join(workdir, "reference"), os.path.join(workdir, "chaos")
    for d in (ref, out):
        shutil.rmtree(d, ignore_errors=True)
    camp = Campaign()
    t0 = time.perf_counter()
    r = subprocess.run(launcher(ranks) + ["-m", "runners.finetune"]
                       + finetune_args(ref, steps, save_every, seed, extra), env=run_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=launch_timeout)
    camp.reference_s = time.perf_counter() - t0
    if r.returncode != 0:
        camp.problems.append(f"reference run failed (rc {r.returncode}): {r.stderr[-2000:]}")
        return camp
    echo(f"reference: {steps} updates in {camp.reference_s:.1f} s")
    child = [os.path.abspath(__file__), "child"]
    flags = dict(zip(extra[::2], extra[1::2]))  # --batch-size 4 --micro-batch-size 2 ...
    batch = int(flags.get("--batch-size", 16))
    micro_batches = batch // int(flags.get("--micro-batch-size", batch))
    forced = list(phases or (["time"] * kills if ranks > 1 else []))
    while True:
        step = checkpoint_step(out)
        resumed = step is not None
        args = finetune_args(out, steps, save_every, seed, extra) + (["--resume", out] if resumed
                                                                     else ["--overwrite"])
        i = len(camp.launches)
        if camp.kills < kills:
            # the reference's time for the updates left: an underestimate of this launch (its
            # start-up and evaluation are counted once, spread over all updates)
            launch_s = camp.reference_s * (steps - (step or 0)) / steps
            plan = choose_kill(rng, steps - (step or 0), save_every, max_delay, forced[:1] or None,
                               launch_s, kills - camp.kills, resumed, micro_batches)
            forced = forced[1:]
        else:
            plan = "none"
        launch = Launch(i, resumed, step or 0, plan)
        log = os.path.join(workdir, "logs", f"launch-{i:03d}.log")
        t = time.perf_counter()
        env_plan = "" if plan == "none" else plan
        rc, where = run_launch(launcher(ranks) + child + args, env_plan, log,
                               os.path.join(workdir, "phase"), launch_timeout, job=ranks > 1)
        launch.seconds = time.perf_counter() - t
        with open(log) as f:
            text = f.read()
        if resumed:
            launch.resume_ok = "resumed from " in text
        if rc == -signal.SIGKILL:
            launch.outcome, launch.killed_in = "killed", where
        elif rc == 0:
            launch.outcome = "completed"
        else:
            launch.outcome = f"failed (rc {rc})"
            camp.problems.append(f"launch {i} ({plan}) failed with rc {rc}; log {log}:\n"
                                 + "\n".join(text.splitlines()[-15:]))
        camp.launches.append(launch)
        echo(f"launch {i:3d}: {'resume from ' + str(step) if resumed else 'fresh start':>16}  "
             f"plan {plan:<28} -> {launch.outcome}{': ' + where if where else ''} "
             f"({launch.seconds:.1f} s)")
        if rc != -signal.SIGKILL:
            break
        if len(camp.launches) > 4 * kills + 10:
            camp.problems.append("the run did not finish within the launch limit")
            return camp
    if camp.launches[-1].outcome == "completed":
        camp.problems += compare_runs(ref, out)
    for x in camp.resumes:
        if x.resume_ok is False and x.outcome != "killed":
            camp.problems.append(f"launch {x.index}: --resume did not load the checkpoint")
    if camp.kills < kills:
        camp.problems.append(f"only {camp.kills} kills happened (wanted {kills}): the run ended first")
    return camp


def table(camp: Campaign) -> str:
    lines = ["| # | start | kill plan | outcome | where the kill landed | s |",
             "|---|---|---|---|---|---|"]
    for x in camp.launches:
        start = f"resume @ {x.from_step}" + ("" if x.resume_ok is not False else " (killed before load)") \
            if x.resumed else "fresh"
        lines.append(f"| {x.index} | {start} | `{x.plan}` | {x.outcome} | {x.killed_in} | "
                     f"{x.seconds:.1f} |")
    return "\n".join(lines)


def summary(camp: Campaign) -> str:
    resumes = camp.resumes
    loaded = sum(1 for x in resumes if x.resume_ok)
    landed: dict[str, int] = {}
    for x in camp.launches:
        if x.outcome == "killed":
            key = x.killed_in.split(" (")[0]
            landed[key] = landed.get(key, 0) + 1
    return (f"{camp.kills} SIGKILLs, {len(resumes)} resumes ({loaded} loaded the checkpoint, "
            f"{len(resumes) - loaded} were killed before loading finished and resumed again), "
            f"{'no differences' if not camp.problems else f'{len(camp.problems)} problems'}; "
            f"kills by phase: " + ", ".join(f"{k} {v}" for k, v in sorted(landed.items())))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        return _child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--steps", type=int, default=72)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="training seed (both runs)")
    ap.add_argument("--chaos-seed", type=int, default=0, help="seed of the kill schedule")
    ap.add_argument("--max-delay", type=float, default=8.0, help="longest outside-kill delay (s)")
    ap.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--table", default=None, help="write the result table (markdown) here")
    ap.add_argument("--ranks", type=int, default=1, help="torchrun ranks per job (kills: the "
                    "whole job at random times)")
    ap.add_argument("--zero-stage", type=int, default=2, help="with --ranks: the ZeRO stage")
    ap.add_argument("--damage", type=int, default=0, metavar="N",
                    help="instead of kills: N runs, each with one swap file damaged mid-run")
    ap.add_argument("finetune_args", nargs="*", help="extra runners.finetune flags (after --)")
    a = ap.parse_args(argv)
    import tempfile
    workdir = a.workdir or tempfile.mkdtemp(prefix="offload-chaos-")
    extra = ["--batch-size", "4", "--seq-len", "32", "--eval-every", "10", "--warmup-steps", "4"] \
        + (["--zero-stage", str(a.zero_stage)] if a.ranks > 1 else []) + a.finetune_args
    if a.damage:
        from chaos_damage import damage_table, run_damage_campaign
        rows, problems = run_damage_campaign(workdir, a.damage, a.steps, a.save_every, a.seed,
                                             extra, a.chaos_seed)
        text = f"command: python scripts/chaos.py {' '.join(argv)}\n\n" + damage_table(rows) + "\n"
        print("\n" + text)
        for p in problems:
            print("PROBLEM:", p)
        if a.table:
            with open(a.table, "w") as f:
                f.write(text)
        if not a.keep and not a.workdir and not problems:
            shutil.rmtree(workdir, ignore_errors=True)
        return 1 if problems else 0
    camp = run_campaign(workdir, a.kills, a.steps, a.save_every, a.seed, extra, a.chaos_seed,
                        a.max_delay, ranks=a.ranks)
    text = (f"command: python scripts/chaos.py {' '.join(argv)}\n\n" + table(camp) + "\n\n"
            + summary(camp) + "\n")
    print("\n" + text)
    for p in camp.problems:
        print("PROBLEM:", p)
    if a.table:
        with open(a.table, "w") as f:
            f.write(text)
    if not a.keep and not a.workdir and not camp.problems:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if camp.problems else 0


if __name__ == "__main__":
    sys.exit(main())
