"""Small C kernels built once per machine with the system compiler and loaded with ctypes.

Used by the fused CPU AdamW step (offload/csrc/cpu_adamw.c, offload/optim/adamw.py) and the few-row
quantized products (offload/csrc/quant_gemv.c, offload/quant/cpu.py). Plain C + ctypes instead
of a torch C++ extension: no torch headers, no ninja, a build of about a second, and a cached
.so keyed on what it depends on -- the source, the compiler's version, the flags, and (for
-march=native binaries) the CPU's model and feature flags -- so a different machine sharing the
cache rebuilds instead of loading code its CPU cannot run. ctypes drops the GIL for a call.

`build` tries each set of architecture flags in order; the first that compiles, passes the
caller's `verify` (its self-check run in a child process, offload/kernel_trust.py: a -march=native
binary that dies of an illegal instruction or a segfault there costs the caller nothing) and then
its self-check in this process (against a torch reference) wins. A library that fails either is
never used; the next set of flags (down to none: portable code) is tried.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
# Tried in order; "native" binaries are only reused on the CPU they were built for.
ARCH_FLAG_SETS: list[list[str]] = [["-march=native"], ["-mcpu=native"], []]


def cache_dir() -> Path:
    env = os.environ.get("OFFLOAD_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "offload" / "kernels"


def cpu_identity() -> str:
    """What a -march=native binary depends on: the CPU's model and feature flags."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
                    parts.append(line.strip())
                if line.strip() == "":      # the first processor's block is enough
                    break
    except OSError:
        pass
    return "\n".join(parts)


def find_compiler() -> str | None:
    """The C compiler kernels are built with: $CC, else cc, gcc or clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_c(compiler: str, source: Path, flags: list[str], out_path: Path) -> None:
    # Build under a unique temporary name and rename into place: concurrent processes (several
    # ranks, pytest-xdist) may build the same key at once, and rename is atomic.
    fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, str(source), "-o", tmp, "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(name: str, source: Path, base_flags: list[str], bind: Callable[[Path], T],
          self_check: Callable[[T], str | None], arch_flag_sets: list[list[str]] | None = None,
          cache: Path | None = None,
          verify: Callable[[Path], str | None] | None = None) -> tuple[T | None, str]:
    """Compile `source` (or reuse the cached .so), `verify` the file (None: passed; else why
    not) before this process loads it, bind it, self-check it: (bound, why)."""
    compiler = find_compiler()
    if compiler is None:
        return None, "no C compiler (cc/gcc/clang or $CC) on PATH"
    if not source.is_file():
        return None, f"kernel source {source} is missing"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        version = repr(exc)
    text = source.read_bytes()
    cache = cache or cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: a per-user temp dir still saves the rebuild per process
        cache = Path(tempfile.gettempdir()) / f"offload-kernels-{getattr(os, 'getuid', lambda: 0)()}"
        cache.mkdir(parents=True, exist_ok=True)
    why = ""
    for arch in ARCH_FLAG_SETS if arch_flag_sets is None else arch_flag_sets:
        key = hashlib.sha256(b"\0".join(
            [text, version.encode(), " ".join(base_flags + arch).encode(),
             cpu_identity().encode(), sys.platform.encode()])).hexdigest()[:20]
        path = cache / f"{name}-{key}.so"
        try:
            if not path.exists():
                compile_c(compiler, source, base_flags + arch, path)
            problem = verify(path) if verify is not None else None
            if problem is not None:
                why = f"{path}: {problem}"
                continue
            try:
                candidate = bind(path)
            except OSError:      # unreadable leftover: rebuild it once
                path.unlink()
                compile_c(compiler, source, base_flags + arch, path)
                candidate = bind(path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            why = f"build with {arch or 'no arch flags'}: {exc}"
            continue
        problem = self_check(candidate)
        if problem is None:
            return candidate, f"C kernel {path}"
        why = f"{path}: {problem}"
    return None, why
