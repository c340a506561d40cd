"""The errors training raises about its own state (imported by the counters, the step paths and
the state files alike, so none of them imports another for them)."""

from __future__ import annotations


class StateError(RuntimeError):
    """A saved training state cannot be restored into this engine."""


class NonFiniteError(StateError):
    """Training produced inf/nan where it must not go on (too many skipped updates in a row,
    or a state about to be saved); nothing non-finite was written."""
