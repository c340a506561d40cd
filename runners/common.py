"""CLI helpers shared by the runners (infer now, finetune later): one-line errors with exit code
2 instead of tracebacks, `--gpu N` device selection, `--dtype`, and the budget flags.

Library code raises typed exceptions; `run_main` turns the expected ones into `error: ...` on
stderr. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable, NoReturn, Sequence

import torch

from offload.config import ConfigError as OffloadConfigError
from offload.config import parse_bytes
from offload.memory.tiers import BudgetError

EXIT_USAGE = 2


class RunnerError(Exception):
    """Bad input the user can fix; printed as one line."""


def expected_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "bad input or environment", not "bug"."""
    from nvme.format import FormatError
    from nvme.io import IOEngineError
    from nvme.swap import SwapError
    from offload.train.checkpoint import CheckpointNotFound
    from offload.data.formats import DataError
    from offload.train.engine import StateError
    from offload.infer.generate import GenerationError
    from offload.lora import LoraError
    from offload.models import CheckpointError
    from offload.models import ConfigError as ModelConfigError
    from offload.stream.streamer import StreamError
    from offload.data.tokenizer import TokenizerError
    return (RunnerError, OffloadConfigError, ModelConfigError, BudgetError, CheckpointError,
            GenerationError, TokenizerError, StreamError, FormatError, IOEngineError, SwapError,
            DataError, StateError, CheckpointNotFound, LoraError)


def note_unused_tensors(reader) -> None:
    """Say so when a checkpoint holds tensors the model never reads (a different architecture's
    extras, an adapter left merged in): ignored, but not without a word."""
    unused = getattr(reader, "unexpected", [])
    if unused:
        shown = ", ".join(unused[:3]) + (f", ... ({len(unused)} in all)" if len(unused) > 3 else "")
        print(f"note: {reader.path}: {len(unused)} stored tensor(s) are not used by "
              f"{reader.config.architecture} and are ignored: {shown}", file=sys.stderr)


def fail(message: str) -> NoReturn:
    """Stop with bad input: `error: message` on stderr, exit code 2 (through run_main)."""
    raise RunnerError(message)


def run_main(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None,
             prefix: str = "") -> int:
    """Run `main`, turning expected failures into one line on stderr and exit code 2
    (`prefix`: before each such line, e.g. which rank of several said it)."""
    try:
        return main(argv)
    except expected_errors() as e:
        msg = str(e).strip().splitlines()
        print(f"{prefix}error: {' '.join(line.strip() for line in msg) or type(e).__name__}",
              file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # argparse's usage errors (already printed as one line)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permission denied, ...: the OS said no; name the file
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"{prefix}error: {e.strerror or e}{where}", file=sys.stderr)
        return 1


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (plus its usage) and exit code 2, like ours."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


# ---- device and dtype ---------------------------------------------------------------------------
def add_device_args(parser: argparse.ArgumentParser, default_dtype: str = "auto") -> None:
    parser.add_argument("--gpu", type=int, default=None, metavar="N",
                        help="run on cuda:N (absent: CPU)")
    parser.add_argument("--dtype", default=default_dtype, choices=["auto", "fp32", "bf16", "fp16"],
                        help="compute dtype (auto: fp32 on CPU, bf16 on a GPU that supports it)")


def select_device(gpu: int | None) -> torch.device:
    """cuda:N after checking it exists; CPU when `gpu` is None."""
    if gpu is None:
        return torch.device("cpu")
    if gpu < 0:
        raise RunnerError(f"--gpu {gpu}: the index must be >= 0")
    if not torch.cuda.is_available():
        raise RunnerError(f"--gpu {gpu}: no CUDA device is available here (this torch build or "
                          f"machine has no GPU); leave out --gpu to run on the CPU")
    count = torch.cuda.device_count()
    if gpu >= count:
        raise RunnerError(f"--gpu {gpu}: only {count} CUDA device(s) here (valid: 0..{count - 1})")
    device = torch.device("cuda", gpu)
    # the current device too: whatever uses it (object collectives, a bare allocation) would
    # otherwise make a context on GPU 0 (review 2 P8)
    torch.cuda.set_device(device)
    return device


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def batch_to_device(batch, device: torch.device):
    """A micro-batch (offload.data.formats.Batch) on `device` without making the host wait: on
    CUDA each tensor is pinned first and copied with non_blocking -- a copy from pageable
    memory synchronises with the compute stream, so the host could not queue micro-batch k+1
    before k's backward ended (review 2 P11). Pinned blocks are not reused before their copy:
    torch's host allocator records the copy's stream."""
    if device.type != "cuda":
        return batch.to(device)
    def move(t):
        return None if t is None else t.pin_memory().to(device, non_blocking=True)
    return dataclasses.replace(batch, ids=move(batch.ids), mask=move(batch.mask),
                               position_ids=move(batch.position_ids),
                               document_ids=move(batch.document_ids))


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return _DTYPES[name]


def dtype_label(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype))


# ---- budgets ------------------------------------------------------------------------------------
def group_size_arg(value: str) -> int:
    """--group-size: input columns per scale (0: the mode's default), or "channel" for one
    scale per output row (int8)."""
    from offload.models.quantized import PER_CHANNEL
    if value.strip().lower() == "channel":
        return PER_CHANNEL
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: use a number of columns (e.g. 32, 64, 128) "
                                         f"or channel") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: use a number of columns >= 0 or channel")
    return n


GROUP_SIZE_HELP = ("--quantize: input columns per scale (default: int8 32, as llama.cpp's Q8_0; "
                   "int4 64); channel: one scale per output row (int8 only: faster at batch 1, "
                   "less faithful)")


def add_budget_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", default=None, metavar="SIZE",
                        help="device memory budget, e.g. 20GiB (default: what is free)")
    parser.add_argument("--cpu-memory", default=None, metavar="SIZE",
                        help="host RAM budget, e.g. 16GiB (default: what is available)")
    parser.add_argument("--offload-dir", default=None, metavar="DIR",
                        help="directory for generated weights and NVMe files")


def parse_size(value: str | None, flag: str) -> int | None:
    try:
        size = parse_bytes(value, flag)
    except OffloadConfigError as e:
        raise RunnerError(str(e)) from None
    if size is not None and size <= 0:
        raise RunnerError(f"{flag}: must be a positive size, got {value!r}")
    return size


def check_budget_flags(args: argparse.Namespace, device: torch.device) -> tuple[int | None, int | None]:
    """(device budget, host budget) in bytes from the flags; --gpu-memory needs a GPU."""
    gpu_mem = parse_size(args.gpu_memory, "--gpu-memory")
    cpu_mem = parse_size(args.cpu_memory, "--cpu-memory")
    if gpu_mem is not None and device.type != "cuda":
        raise RunnerError("--gpu-memory applies to a GPU (--gpu N); on the CPU the budget is --cpu-memory")
    return gpu_mem, cpu_mem


def writable_dir(path: str, flag: str) -> str:
    """Create `path` if needed and check it can be written."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RunnerError(f"{flag} {path}: not writable: cannot create it ({e.strerror}); choose a "
                          f"directory on a writable disk") from None
    # write a probe file: os.access says yes to root even on read-only mounts
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("x")
        os.unlink(probe)
    except OSError as e:
        raise RunnerError(f"{flag} {path}: not writable ({e.strerror}); choose a directory on a "
                          f"writable disk") from None
    return path
