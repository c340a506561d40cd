"""The three memory tiers (device, host, nvme): budgets, host buffer allocation, and an exact
account of what lives where.

Budgets are checked *before* anything is allocated: a plan that does not fit is refused with
a message saying what would fit, instead of being discovered as an OOM in the middle of a run.
On a machine without a GPU the device tier is the CPU; the same budgets and the same account
apply, so every tier transition runs (and is tested) on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
import shutil
import threading
import warnings
import weakref
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, get_args

import psutil
import torch

from offload.config import format_bytes

Tier = Literal["device", "host", "nvme"]
Kind = Literal["weights", "frozen", "masters", "moments", "grads", "buffers", "activations", "kv_cache",
               "rollback"]
TIERS: tuple[str, ...] = get_args(Tier)
KINDS: tuple[str, ...] = get_args(Kind)


class BudgetError(RuntimeError):
    """A plan does not fit its memory budgets; the message says what would."""


def started_worker(name: str, device: torch.device | None = None) -> ThreadPoolExecutor:
    """A one-thread executor whose thread is running already: an address-space or thread limit
    that leaves no room for its stack is found while setting up, in one line, not at the first
    job in the middle of training. `device` (CUDA): the thread's current device, set first --
    a new thread starts on device 0, where anything that uses the current device (object
    collectives, a bare allocation) would make a context of its own (review 2 P8)."""
    init = (functools.partial(torch.cuda.set_device, device)
            if device is not None and device.type == "cuda" else None)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)
    try:
        pool.submit(lambda: None).result()
    except RuntimeError as e:  # "can't start new thread"
        pool.shutdown(wait=False)
        raise BudgetError(f"cannot start the {name} thread ({e}): an address-space or thread "
                          f"limit (ulimit -v / -u) leaves no room for its stack; raise the "
                          f"limit") from None
    return pool


def device_free_bytes(device: torch.device) -> int:
    """Free memory on the device tier right now (for cpu: psutil's available RAM)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def host_free_bytes() -> int:
    return int(psutil.virtual_memory().available)


def local_ranks() -> int:
    """Processes of this job on this machine ($LOCAL_WORLD_SIZE, which torchrun sets; 1
    without it). They share its RAM, pinned memory and disks: each plans against its share
    (node_share) and pins at most its share of the cap, or N ranks would each take what the
    whole machine has (review 2 P5)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        return max(1, int(raw)) if raw else 1
    except ValueError:
        return 1


def node_share(free_bytes: int) -> int:
    """This process's share of `free_bytes` of a resource every rank on the machine uses."""
    return free_bytes // local_ranks()


def disk_free_bytes(path: str) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return int(shutil.disk_usage(probe).free)


def locked_memory_limit_bytes() -> int | None:
    """RLIMIT_MEMLOCK (ulimit -l) in bytes; None when unlimited. CUDA's pinned allocations
    are not bounded by it (the driver locks pages itself), but a too-large pinned pool is
    still unswappable RAM taken from the rest of the system."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


# Measured free memory is never planned to the last byte: the process also needs room outside
# the plan (the allocator's slack, temporaries while a block is materialised, Python objects,
# the page cache other programs lean on). A plan that only fits by eating into this reserve
# is refused up front rather than ending in the kernel's OOM killer.
RESERVE_FRACTION = 0.05
RESERVE_MIN_BYTES = 256 << 20


def memory_reserve_bytes(free_bytes: int) -> int:
    """What is kept back from `free_bytes` of RAM (or device memory) measured free."""
    return min(free_bytes, max(RESERVE_MIN_BYTES, int(free_bytes * RESERVE_FRACTION)))


def check_fits(tier: str, need_bytes: int, budget_bytes: int | None, free_bytes: int,
               what: str, hint: str) -> None:
    """Refuse `need_bytes` on `tier` if it exceeds the explicit budget or what is free (RAM and
    device memory keep `memory_reserve_bytes` of what is free in reserve; disks do not)."""
    reserve = memory_reserve_bytes(free_bytes) if tier in ("device", "host") else 0
    usable = free_bytes - reserve
    limit = usable if budget_bytes is None else min(budget_bytes, usable)
    if need_bytes > limit:
        kept = f", keeping {format_bytes(reserve)} in reserve" if reserve else ""
        source = (f"the {tier} budget of {format_bytes(budget_bytes)}"
                  if budget_bytes is not None and budget_bytes <= usable
                  else f"the {format_bytes(free_bytes)} free on the {tier} tier{kept}")
        raise BudgetError(f"{what} needs {format_bytes(need_bytes)} on the {tier} tier, more than "
                          f"{source}; {hint}")


_PIN_WARNED = False
# Page-locked memory cannot be swapped or reclaimed: pinning most of the RAM starves every
# other program (and this one's pageable allocations). We pin at most this fraction of the
# RAM available when the cap is fixed, summed over the live pinned buffers; the rest are
# pageable (the documented fallback: same results, but copies from or to them are synchronous).
# Several ranks on one machine each take their share (node_share) of that RAM.
# RLIMIT_MEMLOCK (ulimit -l) is not used as the cap: CUDA's pinned allocator (cudaHostAlloc)
# locks pages through the driver and is not bound by it; see docs/RELIABILITY.md.
PIN_RAM_FRACTION = 0.5
_pinned_bytes = 0
_pin_cap_bytes: int | None = None  # fixed by freeze_pin_cap(); None: measured per request
_pinned_lock = threading.Lock()


def pin_possible(pin: bool) -> bool:
    return pin and torch.cuda.is_available()


def pinned_bytes(nbytes: int) -> int:
    """What `nbytes` of pinned memory really takes: torch's caching host allocator rounds every
    request up to a power of two (CachingHostAllocator.h, allocate()) and keeps freed blocks
    cached for reuse. Plans and the cap count this size, not the request (desk review H4)."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def freeze_pin_cap() -> int:
    """Fix the pinned-memory cap for the rest of the process from the RAM available now (the
    first engine or streamer to start does it, before allocating). Measured per request
    instead, every earlier allocation, pageable ones included, would lower the cap, and the
    buffers requested last -- the upload ring, landing buffers -- would lose their pinning."""
    global _pin_cap_bytes
    with _pinned_lock:
        if _pin_cap_bytes is None:
            _pin_cap_bytes = int((node_share(host_free_bytes()) + _pinned_bytes)
                                 * PIN_RAM_FRACTION)
        return _pin_cap_bytes


def reset_pin_cap(cap_bytes: int | None = None) -> None:
    """Set (or with None, unfix) the cap: for tests and for a process that starts over."""
    global _pin_cap_bytes
    with _pinned_lock:
        _pin_cap_bytes = cap_bytes


def pin_limit_bytes() -> int:
    """The most pinned host memory live at once (see PIN_RAM_FRACTION)."""
    cap = _pin_cap_bytes
    return cap if cap is not None else int(node_share(host_free_bytes()) * PIN_RAM_FRACTION)


def pin_allowed(nbytes: int) -> bool:
    """Whether `nbytes` (already rounded: pinned_bytes) more may be pinned on top of the live
    pinned buffers."""
    limit = pin_limit_bytes()
    with _pinned_lock:
        return _pinned_bytes + nbytes <= limit


def pinned_live_bytes() -> int:
    """Pinned host memory held by live buffers (rounded sizes)."""
    with _pinned_lock:
        return _pinned_bytes


def _reserve_pinned(nbytes: int) -> bool:
    """Count `nbytes` (rounded) against the cap if it fits; False when it does not."""
    global _pinned_bytes
    limit = pin_limit_bytes()  # outside the lock: it may measure RAM
    with _pinned_lock:
        if _pinned_bytes + nbytes > limit:
            return False
        _pinned_bytes += nbytes
        return True


def _unpinned(nbytes: int) -> None:
    global _pinned_bytes
    with _pinned_lock:
        _pinned_bytes -= nbytes


def _warn_pageable(nbytes: int, why: str) -> None:
    global _PIN_WARNED
    if not _PIN_WARNED:
        warnings.warn(f"pinning {format_bytes(nbytes)} of host memory {why}; using pageable "
                      f"memory: same results, but gradient copies and weight uploads from or "
                      f"into it become synchronous (the GPU waits on the host)")
        _PIN_WARNED = True


def pinned_or_pageable(nbytes: int, pin: bool, allocate) -> torch.Tensor:
    """`allocate(pinned: bool)` under the pinned-memory policy: pinned when asked, CUDA exists
    and the rounded size fits the cap, else (or if pinning fails) pageable, with one warning.
    The one place every pinned host allocation goes through."""
    if not pin_possible(pin):
        return allocate(False)
    rounded = pinned_bytes(nbytes)
    if not _reserve_pinned(rounded):
        _warn_pageable(nbytes, f"would exceed the pinned-memory cap of "
                               f"{format_bytes(pin_limit_bytes())} (half the available RAM)")
        return allocate(False)
    try:
        t = allocate(True)
    except RuntimeError as e:
        _unpinned(rounded)
        _warn_pageable(nbytes, f"failed ({e})")
        return allocate(False)
    # on the storage, not the tensor: callers keep views (`.view(dtype)`, slices) and drop the
    # tensor returned here; the memory stays pinned until the last view is gone
    weakref.finalize(t.untyped_storage(), _unpinned, rounded)
    return t


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A flat host tensor, page-locked when asked and CUDA exists (pinned memory is what lets
    device<->host copies run asynchronously at full link speed); see pinned_or_pageable."""
    return pinned_or_pageable(numel * dtype.itemsize, pin,
                              lambda pinned: torch.empty(numel, dtype=dtype, pin_memory=pinned))


def host_aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """A 4 KiB-aligned uint8 host buffer (an O_DIRECT target) of exactly `nbytes`, under the same
    pinned-memory policy. Exact size: pinned blocks are page-aligned already, and asking for
    more to align by hand would double the block under the allocator's power-of-two rounding."""
    from nvme.io import aligned_empty
    return pinned_or_pageable(nbytes, pin, lambda pinned: aligned_empty(nbytes, pin=pinned))


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    t = host_empty(numel, dtype, pin)
    t.zero_()
    return t


# What one component will allocate: (tier, kind) -> bytes. Each component's `plan_bytes()`
# (beside its constructor) returns one; the training planner adds them up (train_plan.py), and
# the component records the same numbers in the MemoryAccount as it allocates.
PlanBytes = dict[tuple[Tier, Kind], int]


def all_finite(t: torch.Tensor) -> bool:
    """No inf/nan in `t` (True for a non-float tensor). One read of `t` -- a sum, which any inf
    or nan makes non-finite -- and the elementwise test only when the sum is not finite (it
    may have overflowed); `isfinite(t).all()` writes a bool tensor of t's size first (2.4 s of
    a 1.5 GB checkpoint's 11 s on this project's CPU)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    total = t.sum(dtype=torch.float32 if t.element_size() < 4 else None)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def no_pinning(nbytes: int) -> int:
    """What a pageable buffer of `nbytes` takes (the `pin` argument of plan_bytes when buffers
    are not pinned; pinned_bytes when they are)."""
    return nbytes


class MemoryAccount:
    """Bytes held per (tier, kind), with the peak of each tier's total. Thread-safe: gradient
    landing and IO workers update it too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)
        self._kind_peak: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, tier: str, kind: str, nbytes: int) -> None:
        assert tier in TIERS and kind in KINDS, (tier, kind)
        with self._lock:
            self._bytes[tier, kind] += nbytes
            total = sum(v for (t, _), v in self._bytes.items() if t == tier)
            self._peak[tier] = max(self._peak[tier], total)
            self._kind_peak[tier, kind] = max(self._kind_peak[tier, kind], self._bytes[tier, kind])

    def sub(self, tier: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[tier, kind] -= nbytes
            assert self._bytes[tier, kind] >= 0, (tier, kind)

    def held(self, tier: str, kind: str | None = None) -> int:
        with self._lock:
            return sum(v for (t, k), v in self._bytes.items()
                       if t == tier and (kind is None or k == kind))

    def peak(self, tier: str) -> int:
        with self._lock:
            return self._peak[tier]

    def kind_peaks(self) -> dict[tuple[str, str], int]:
        """{(tier, kind): the most bytes of that kind held at once}: what a plan must cover."""
        with self._lock:
            return {k: v for k, v in self._kind_peak.items() if v}

    def report(self) -> dict[str, dict[str, int]]:
        """{tier: {kind: bytes, ..., "total": bytes, "peak": bytes}} for every tier."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for tier in TIERS:
                kinds = {k: self._bytes.get((tier, k), 0) for k in KINDS}
                kinds = {k: v for k, v in kinds.items() if v}
                kinds["total"] = sum(kinds.values())
                kinds["peak"] = self._peak[tier]
                out[tier] = kinds
            return out


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_SETUP_DEPTH = 0
_SETUP_LOCK = threading.Lock()
_MMAP_MAX = 32 << 20  # the most glibc's own adaptation raises the mmap threshold to
_after_setup_bytes = _MMAP_MAX  # the threshold after this set-up: below its blocks' sizes


def _mallopt(param: int, value: int) -> bool:
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").mallopt(param, int(value)))
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


@contextlib.contextmanager
def large_frees_to_os(smallest_block_bytes: int | None = None, threshold_bytes: int = 1 << 20):
    """While setting up (a model's blocks materialised, written to swap, loaded into a
    streamer), glibc serves every allocation >= threshold with its own mmap, released on free.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB),
    after which block-sized temporaries (a layer's fp32 master while it is initialised, a
    staging copy) come from malloc arenas that are not returned to the OS: RSS then grows with
    the number of blocks although nothing is held (measured: 8 -> 32 streamed blocks went from
    1.54x to 1.12x peak RSS with the low threshold).

    Only while setting up: kept for the whole run, every activation >= 1 MiB of every forward
    and backward became a fresh mmap that the kernel zeroes page by page -- the plain PyTorch
    loop in the same process took 3.8x the page faults and 1.3-1.4x the step time (small
    Llama, fp32, batch 4 x 256; docs/BENCHMARKS.md). On leaving the outermost set-up the
    regime glibc itself would have adapted to (mmap threshold 32 MiB, trim threshold twice
    that) -- but below half the smallest block's bytes (`smallest_block_bytes`, in the compute
    dtype), so block-sized buffers made during training (a lazily made gradient buffer, a
    fetch's staging) still go back to the OS and RSS keeps not growing with depth, while the
    activations of a block (smaller than its weights at training batch sizes) reuse heap
    memory. Nested uses (the engine's set-up building a streamer) count once; process-wide; a
    no-op where the C library is not glibc."""
    global _SETUP_DEPTH, _after_setup_bytes
    with _SETUP_LOCK:
        if _SETUP_DEPTH == 0:  # the outermost set-up: the latest model decides
            _after_setup_bytes = _MMAP_MAX
        if smallest_block_bytes is not None:
            _after_setup_bytes = min(_after_setup_bytes,
                                     max(threshold_bytes, smallest_block_bytes // 2))
        _SETUP_DEPTH += 1
        if _SETUP_DEPTH == 1:
            _mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
    try:
        yield
    finally:
        with _SETUP_LOCK:
            _SETUP_DEPTH -= 1
            if _SETUP_DEPTH == 0:
                _mallopt(_M_MMAP_THRESHOLD, _after_setup_bytes)
                _mallopt(_M_TRIM_THRESHOLD, 2 * _after_setup_bytes)


def cpu_model() -> str:
    """The CPU's model name, as lscpu prints it (every benchmark records it: results differ
    between CPUs more than between runs)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class LinkCounter:
    """Bytes moved over one link and the seconds spent moving them (where measurable)."""
    nbytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float = 0.0) -> None:
        self.nbytes += nbytes
        self.seconds += seconds

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def format_report(report: dict[str, dict[str, int]]) -> str:
    lines = []
    for tier, kinds in report.items():
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items()
                          if k not in ("total", "peak"))
        lines.append(f"{tier:>6}: {format_bytes(kinds['total']):>11} (peak "
                     f"{format_bytes(kinds['peak'])}){': ' + parts if parts else ''}")
    return "\n".join(lines)
