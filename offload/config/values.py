"""The values a configuration is made of: byte sizes, dtypes, placements, the names of the
step paths and gradient storages, reading a config file safely, and the error every config
check raises."""

from __future__ import annotations

import math
import os
import re
import stat
from typing import Literal, get_args

import torch


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None, what: str = "budget") -> int | None:
    """'12GiB', '500MB', '1.5 GiB', 4096 -> bytes; None stays None (= no explicit budget)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like '12GiB' or a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{what}: must be a non-negative size, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot read {value!r} as a size; write e.g. '12GiB', '500MB' "
                          f"or a byte count")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(size):
        raise ConfigError(f"{what}: {str(value)[:40]!r} is not a finite size")
    return int(size)


def format_bytes(n: int | float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DtypeName = Literal["fp32", "bf16", "fp16"]
# where optimizer state (offload) or 16-bit weights (offload_params) live
Placement = Literal["none", "cpu", "nvme"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
StepPathName = Literal["after", "overlapped", "speculative", "delayed"]  # how the step meets backward
# offload/grads/storage.py; "sharded": ZeRO stage 2's (offload/zero/grads.py), "double_sharded"
# its two sets of shards for the delayed update
GradStorageName = Literal["per_block", "pooled", "double", "adopted", "sharded", "double_sharded"]
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                  "half": "fp16"}


def dtype_name(name: str) -> str:
    key = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPES:
        raise ConfigError(f"dtype: {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return key


def read_regular_file(path: str, max_bytes: int) -> bytes | None:
    """The bytes of `path` when it is a regular file of at most `max_bytes`, else None (a FIFO,
    a device like /dev/zero, a directory, something larger). OSError propagates."""
    # O_NONBLOCK: a FIFO must not block the open; no effect on a regular file
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        raw = f.read(max_bytes + 1)  # the file may have grown since fstat
    return raw if len(raw) <= max_bytes else None
