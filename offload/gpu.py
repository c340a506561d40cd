"""CUDA stream and event helpers shared by every asynchronous path, and the delay knobs the
GPU proof kit (tests/test_cuda.py, scripts/gpu_check.py) uses to expose missing waits.

Why these exist (docs/ARCHITECTURE.md, "CUDA ordering"):
  * `on_stream(s)` enters `s`'s *device* as well as the stream. `torch.cuda.stream(s)` alone,
    on a thread whose current device is 0, restores device 0's stream on exit and so creates a
    CUDA context on GPU 0 (about 0.5 GB) in a `--gpu 1` run (desk review L2).
  * `host_event()` is an event the *host* waits on: `blocking=True` makes
    `synchronize()` sleep instead of busy-spinning a core the CPU optimizer step needs
    (cudaEventBlockingSync; desk review M2). Events only streams wait on stay plain.
  * `side_stream_delay(stream)`: with OFFLOAD_CUDA_SIDE_DELAY_CYCLES set, a GPU sleep queued on
    a side stream before each of its copies. A copy that is not properly ordered against the
    compute stream then reads or writes at the wrong time on every run, instead of once in
    thousands of steps on a fast GPU; results must not change.
  * `host_delay()`: with OFFLOAD_CUDA_HOST_DELAY_S set, a host sleep in the gradient-landing
    worker before it touches a landed gradient (a slow worker: desk review H1 and M1).
Both knobs are read from the environment at every call, so a test can set them per run; unset,
they cost one dict lookup.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

SIDE_DELAY_ENV = "OFFLOAD_CUDA_SIDE_DELAY_CYCLES"
HOST_DELAY_ENV = "OFFLOAD_CUDA_HOST_DELAY_S"


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream"):
    """Run the body with `stream` current, on `stream`'s device (see the module docstring)."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def host_event() -> "torch.cuda.Event":
    """An event the host will synchronize() on: it sleeps rather than spins while waiting."""
    return torch.cuda.Event(blocking=True)


def _env_number(name: str) -> float:
    raw = os.environ.get(name)
    if not raw:
        return 0.0
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give a number") from None


def side_stream_delay(stream: "torch.cuda.Stream") -> None:
    """Queue the configured GPU sleep on `stream` (call with `stream` current or pass it)."""
    cycles = int(_env_number(SIDE_DELAY_ENV))
    if cycles > 0 and hasattr(torch.cuda, "_sleep"):
        with on_stream(stream):
            torch.cuda._sleep(cycles)


def host_delay() -> None:
    """Sleep the configured host delay (the landing worker calls it before each gradient)."""
    seconds = _env_number(HOST_DELAY_ENV)
    if seconds > 0:
        time.sleep(seconds)
