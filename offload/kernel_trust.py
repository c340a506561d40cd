"""A fast kernel runs only where it was checked on this machine, in a child process.

The failure class this guards against: *a kernel trusted on a CPU where it is wrong*. torch
2.13's `_weight_int8pack_mm` is correct on AVX2 for every in_features % 8 == 0, but on AVX-512
(AMD EPYC, avx512f/bw/vl/bf16) every in_features % 16 == 8 either returns garbage (relative
error 1e30 at 1 row) or kills the process (SIGSEGV at 2-4 rows): a rule measured on one CPU
crashed CI on the next (docs/RELIABILITY.md). Our own C kernels are built with -march=native,
so the code that runs differs between machines too.

So every kernel chosen by a rule rather than computed by torch's reference path is checked
against a float64 reference, on the running CPU, for each shape class it will run -- and the
check runs in a *child process*: a segfault, an illegal instruction or a hang there marks the
class untrusted and the caller's process carries on with the reference kernel. A *probe* is a
function `probe(case) -> None | why` named "module:function" (the child imports it); a *case*
is a tuple of ints and strings, the probe's shape class.

The verdicts are kept for the process and recorded on disk (cbuild.cache_dir(), one JSON file
per probe, keyed by the torch version, the CPU's model and flags, the Python version and the
probe module's source), so each machine pays for a shape class once: a child costs ~1-2 s,
mostly importing torch. `verdicts()` says what was checked and decided (the runs' reports).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from offload import cbuild
from offload.cbuild import cache_dir, cpu_identity

# A hang is a failed check: a child gets CHILD_START_S to load torch and the probe (a loaded
# machine can take long), then CASE_TIMEOUT_S for each case, counted from its previous answer.
CHILD_START_S = 300.0
CASE_TIMEOUT_S = 120.0
Case = tuple

_lock = threading.Lock()  # one check at a time: a class is never checked twice at once
_known: dict[tuple[str, Case], str | None] = {}  # (probe, case) -> None (trusted) or why not
_UNKNOWN = object()


def check(probe: str, cases: Sequence[Case]) -> dict[Case, str | None]:
    """{case: None where `probe` passed on this machine, else why it did not}: from this
    process's verdicts, else the disk record, else one child process for all unknown cases."""
    cases = [tuple(c) for c in cases]
    with _lock:
        missing = [c for c in dict.fromkeys(cases) if (probe, c) not in _known]
        if missing:
            record = _record_path(probe)
            stored = _read_record(record)
            unknown = [c for c in missing if _case_key(c) not in stored]
            for c in missing:
                if c not in unknown:
                    _known[(probe, c)] = stored[_case_key(c)]
            if unknown:
                fresh = _check_in_children(probe, unknown)
                _known.update({(probe, c): why for c, why in fresh.items()})
                _write_record(record, {**_read_record(record),
                                       **{_case_key(c): why for c, why in fresh.items()}})
        return {c: _known[(probe, c)] for c in cases}


def build_library(name: str, source: Path, flags: list[str], bind, self_check, probe: str):
    """cbuild.build of a C kernel library whose every build is first checked in a child by
    `probe` (called with the case (path,)), then self-checked in this process: (bound, why)."""
    try:
        return cbuild.build(name, source, flags, bind, self_check,
                            verify=lambda path: verdict(probe, (str(path),)))
    except OSError as exc:
        return None, f"cannot build: {exc}"


def verdict(probe: str, case: Case) -> str | None:
    """None where `probe` passed for `case` on this machine, else why not (checked now if never)."""
    return check(probe, [case])[tuple(case)]


def trusted(probe: str, case: Case) -> bool:
    """`probe` passed for `case` on this machine (checked now if it never was)."""
    why = _known.get((probe, case), _UNKNOWN)  # the hot path (every projection, every layer)
    if why is _UNKNOWN:
        why = verdict(probe, case)
    return why is None


def known(probe: str, case: Case) -> bool:
    """This process already has a verdict for `case` (a caller may then check related cases
    together, in one child)."""
    return (probe, tuple(case)) in _known


def verdicts() -> dict[str, dict[str, str]]:
    """What this process checked or read: {probe: {case: "trusted" | why not}} (reports, tests)."""
    out: dict[str, dict[str, str]] = {}
    for (probe, case), why in sorted(_known.items(), key=lambda kv: (kv[0][0], _case_key(kv[0][1]))):
        out.setdefault(probe, {})[_case_key(case)] = why or "trusted"
    return out


def forget() -> None:
    """Forget this process's verdicts (tests; the disk record stays)."""
    with _lock:
        _known.clear()


# ---- the disk record ---------------------------------------------------------------------------
def _case_key(case: Case) -> str:
    return json.dumps(list(case))


def _record_path(probe: str) -> Path:
    module = probe.split(":", 1)[0]
    spec = importlib.util.find_spec(module)
    source = Path(spec.origin).read_bytes() if spec and spec.origin else b""
    import torch  # the probes check torch's kernels: its build is part of what was checked
    key = hashlib.sha256(b"\0".join([probe.encode(), source, torch.__version__.encode(),
                                     cpu_identity().encode(), sys.version.encode(),
                                     platform.platform().encode()])).hexdigest()[:20]
    name = probe.replace(":", "-").replace(".", "_")
    return cache_dir() / f"trust-{name}-{key}.json"


def _read_record(path: Path) -> dict[str, str | None]:
    try:
        data = json.loads(path.read_text())
        return {k: v for k, v in data["cases"].items() if v is None or isinstance(v, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none yet, or unreadable: checked again, never trusted from a damaged file


def _write_record(path: Path, cases: dict[str, str | None]) -> None:
    """Atomically (a temporary file renamed over it): readers see the old or the new record."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            model = [ln for ln in cpu_identity().splitlines() if ln.startswith("model name")]
            json.dump({"cpu": model[:1], "cases": cases}, f, indent=0)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the verdicts still hold for this process


# ---- the child processes ------------------------------------------------------------------------
def _check_in_children(probe: str, cases: list[Case]) -> dict[Case, str | None]:
    """Run the probe on each case in a child, in order; a child that dies takes the case it was
    on with it (marked with how it died) and a new child goes on from the next one."""
    import torch
    out: dict[Case, str | None] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    pending = list(cases)
    while pending:
        request = json.dumps({"probe": probe, "cases": [list(c) for c in pending],
                              "threads": torch.get_num_threads()})
        stdout, died, tail = _run_child(request, env)
        started, done = False, 0
        for line in stdout.splitlines():
            if line == "READY":
                started = True
            elif line.startswith("CASE ") and done < len(pending):
                out[pending[done]] = json.loads(line[5:])
                done += 1
        if done == len(pending):
            break
        if not started:  # the child could not even load the probe: no case can be checked
            why = f"the check could not run ({died}): {tail[0][-300:]}"
            out.update({c: why for c in pending[done:]})
            break
        out[pending[done]] = f"the check {died} on this case"
        pending = pending[done + 1:]
    return out


def _run_child(request: str, env: dict) -> tuple[str, str, list[str]]:
    """(its stdout, how it ended, its last stderr line). Killed when no line comes within
    CHILD_START_S of the start, then within CASE_TIMEOUT_S of the previous line."""
    import selectors
    # stderr to a file: a pipe nobody reads until the end could fill and stall the child
    with tempfile.TemporaryFile("w+") as errors, selectors.DefaultSelector() as sel:
        proc = subprocess.Popen([sys.executable, "-m", "offload.kernel_trust"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errors, env=env)
        proc.stdin.write(request.encode())
        proc.stdin.close()
        # raw reads of the pipe (a buffered reader could hold answers the select cannot see)
        out, hung, fd = b"", None, proc.stdout.fileno()
        sel.register(fd, selectors.EVENT_READ)
        limit = CHILD_START_S
        while True:
            if not sel.select(timeout=limit):
                hung = f"hung (no answer in {limit:.0f} s)"
                proc.kill()
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child closed its output: it has ended
                break
            out += chunk
            if chunk.endswith(b"\n"):  # an answer came: the next case starts its clock
                limit = CASE_TIMEOUT_S
        rc = proc.wait()
        proc.stdout.close()
        errors.seek(0)
        tail = errors.read().strip().splitlines()[-1:] or [""]
    return out.decode(errors="replace"), hung or _how_it_ended(rc), tail


def _how_it_ended(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _child() -> int:
    """The child: read {"probe", "cases", "threads"} from stdin, print READY, then one
    `CASE <json why or null>` line per case, flushed, so a crash loses only the case it hit."""
    request = json.loads(sys.stdin.read())
    import torch
    torch.set_num_threads(int(request["threads"]))  # the caller's threads: its work split
    module, name = request["probe"].split(":", 1)
    fn = getattr(importlib.import_module(module), name)
    print("READY", flush=True)
    for case in request["cases"]:
        try:
            why = fn(tuple(case))
        except Exception as exc:  # a probe that raises: that kernel is not trusted
            why = f"raised {type(exc).__name__}: {exc}"
        print("CASE " + json.dumps(why), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
