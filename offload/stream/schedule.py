"""The order a block streamer's blocks are waited on (offload/stream/streamer.py) and where in it
the last wait was: what `prefetch` looks ahead along and what an out-of-order fetch measures
distance by, to give up the fetched block needed last."""

from __future__ import annotations

from typing import Iterator, Sequence

from offload.memory.layout import StreamError


class Schedule:
    """Block indices in the order they will be waited on (forward; forward then reverse for
    training), cyclic or not, and a cursor at the position of the last wait (-1: none yet)."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.order: list[int] = list(range(n_blocks))
        self.cyclic = True
        self.cursor = -1

    def set(self, order: Sequence[int], cyclic: bool = True) -> None:
        if any(not 0 <= j < self.n_blocks for j in order) or not order:
            raise StreamError(f"schedule must list block indices in [0, {self.n_blocks})")
        self.order, self.cyclic, self.cursor = list(order), cyclic, -1

    def rewind(self) -> None:
        """The cursor back to the start, as if nothing had been waited on."""
        self.cursor = -1

    def distance(self, j: int) -> int:
        """How many positions after the cursor block j is next needed (one lap + 1: never)."""
        n = len(self.order)
        for k in range(1, n + 1):
            if self.order[(self.cursor + k) % n] == j:
                return k
        return n + 1

    def position(self, i: int) -> int:
        """Position of the next occurrence of block i in the schedule after the cursor."""
        n = len(self.order)
        for k in range(1, n + 1):
            pos = (self.cursor + k) % n
            if self.order[pos] == i:
                return pos
        raise StreamError(f"block {i} is not in the schedule {self.order}")

    def advance(self, i: int) -> None:
        """Block i is waited on: the cursor moves to its next position."""
        self.cursor = self.position(i)

    def following(self, after: int | None) -> Iterator[int]:
        """The blocks that follow `after` (from the start when None), at most one lap and never
        back to `after` itself; a schedule that is not cyclic ends at its last position."""
        n = len(self.order)
        if after is None:
            start = -1
        elif self.cursor >= 0 and self.order[self.cursor] == after:
            start = self.cursor  # already waited on: the cursor points at it
        else:
            start = self.position(after)
        for k in range(1, n):
            pos = start + k
            if pos >= n and not self.cyclic:
                return
            yield self.order[pos % n]
