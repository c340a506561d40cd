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
  * `GpuPhaseTimer`: the GPU's own time per phase (forward, backward) from timing events,
    read only once complete, so reporting it adds no synchronisation (desk review L5).
  * `host_delay()`: with OFFLOAD_CUDA_HOST_DELAY_S set, a host sleep in the gradient-landing
    worker before it touches a landed gradient (a slow worker: desk review H1 and M1).
  * `compute_stream_delay(device)`: with OFFLOAD_CUDA_COMPUTE_DELAY_CYCLES set, a GPU sleep
    queued on the *compute* stream before the device optimizer's kernels of each block (a late
    step: a copy stream not ordered after the step then reads the old weights; review 2 P2).
The knobs are read from the environment at every call, so a test can set them per run; unset,
they cost one dict lookup.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

SIDE_DELAY_ENV = "OFFLOAD_CUDA_SIDE_DELAY_CYCLES"
HOST_DELAY_ENV = "OFFLOAD_CUDA_HOST_DELAY_S"
COMPUTE_DELAY_ENV = "OFFLOAD_CUDA_COMPUTE_DELAY_CYCLES"


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


def compute_stream_delay(device: torch.device) -> None:
    """Queue the configured GPU sleep on `device`'s current stream (the device optimizer step
    calls it first); nothing off CUDA."""
    cycles = int(_env_number(COMPUTE_DELAY_ENV))
    if cycles > 0 and device.type == "cuda" and hasattr(torch.cuda, "_sleep"):
        with torch.cuda.device(device):
            torch.cuda._sleep(cycles)


def host_delay() -> None:
    """Sleep the configured host delay (the landing worker calls it before each gradient)."""
    seconds = _env_number(HOST_DELAY_ENV)
    if seconds > 0:
        time.sleep(seconds)


class GpuPhaseTimer:
    """GPU time of forward and backward from CUDA timing events on the compute stream. Reading
    an event pair never waits: pairs whose end has not completed yet (`query()`) stay queued
    and count toward a later update, so the report costs no synchronisation (desk review L5)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._open: dict[str, "torch.cuda.Event"] = {}
        self._pairs: list[tuple[str, "torch.cuda.Event", "torch.cuda.Event"]] = []

    def start(self, phase: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._open[phase] = ev

    def stop(self, phase: str) -> None:
        start = self._open.pop(phase, None)
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pairs.append((phase, start, end))

    def collect(self) -> dict[str, float]:
        out = {"forward": 0.0, "backward": 0.0}
        waiting = []
        for phase, start, end in self._pairs:
            if end.query():
                out[phase] += start.elapsed_time(end) / 1e3  # ms -> s
            else:
                waiting.append((phase, start, end))
        self._pairs = waiting
        return out
