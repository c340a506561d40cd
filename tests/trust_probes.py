"""Probes for tests/test_kernel_trust.py, imported by kernel_trust's child processes: each case
names what the "kernel" does on it."""

from __future__ import annotations

import os
import signal
import time


def behave(case: tuple) -> str | None:
    what = case[0]
    if what == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "abort":
        os.abort()
    if what == "hang":
        time.sleep(600)
    if what == "raise":
        raise ArithmeticError("wrong lane")
    if what == "wrong":
        return "relative error 9.4e+30"
    return None
