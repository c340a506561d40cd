"""What every runner shares: one-line errors with a non-zero exit, device selection."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

import torch

EXIT_BAD_INPUT = 2


class RunnerError(Exception):
    """Bad input: printed as one line, exit status 2, no traceback."""


def fail(message: str) -> NoReturn:
    raise RunnerError(message)


def pick_device(gpu: int | None) -> torch.device:
    """--gpu N -> cuda:N, checked against what is visible; absent -> cpu."""
    if gpu is None:
        return torch.device("cpu")
    if gpu < 0:
        fail(f"--gpu {gpu}: a GPU index is >= 0")
    if not torch.cuda.is_available():
        fail(f"--gpu {gpu}: no CUDA GPU is visible on this machine; leave out --gpu to run on the CPU")
    count = torch.cuda.device_count()
    if gpu >= count:
        fail(f"--gpu {gpu}: only {count} GPU(s) visible (indices 0..{count - 1})")
    return torch.device("cuda", gpu)


def _bad_input_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user's input is wrong (not a bug): shown as one line."""
    from nvme.format import FormatError
    from offload.checkpoint import CheckpointNotFound
    from offload.config import ConfigError
    from offload.data import DataError
    from offload.engine import StateError
    from offload.models import CheckpointError
    from offload.models import ConfigError as ModelConfigError
    from offload.tiers import BudgetError

    types: list[type[BaseException]] = [RunnerError, ConfigError, ModelConfigError, DataError,
                                        CheckpointError, BudgetError, StateError, FormatError,
                                        CheckpointNotFound]
    try:
        from nvme import SwapError
        types.append(SwapError)
    except ImportError:
        pass
    return tuple(types)


def run_main(run: Callable, args) -> int:
    """Call run(args); known bad-input errors become `error: <message>` and exit status 2."""
    bad_input = _bad_input_types()
    try:
        return run(args)
    except bad_input as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permission denied, ...: the OS said no, with a path
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
