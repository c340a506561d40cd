"""What a block streamer (offload/stream/streamer.py) counts: bytes served per residency, bytes
moved from disk and host to the device, fetches, and the time compute waited and the stage
thread worked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

Residency = Literal["device", "cpu", "nvme"]  # where a block's 16-bit weights live between uses
RESIDENCIES: tuple[str, ...] = get_args(Residency)


@dataclass
class StreamStats:
    """Counters since construction (take deltas with `copy()` for per-token figures)."""
    served_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESIDENCIES, 0))
    moved_bytes: dict[str, int] = field(default_factory=lambda: {"disk": 0, "h2d": 0})
    fetches: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "nvme": 0})
    wait_s: float = 0.0  # host time compute spent blocked in wait() on unfinished fetches
    stage_busy_s: float = 0.0  # time the stage thread spent reading/copying

    def copy(self) -> "StreamStats":
        return StreamStats(dict(self.served_bytes), dict(self.moved_bytes), dict(self.fetches),
                           self.wait_s, self.stage_busy_s)

    def minus(self, earlier: "StreamStats") -> "StreamStats":
        return StreamStats({k: v - earlier.served_bytes[k] for k, v in self.served_bytes.items()},
                           {k: v - earlier.moved_bytes[k] for k, v in self.moved_bytes.items()},
                           {k: v - earlier.fetches[k] for k, v in self.fetches.items()},
                           self.wait_s - earlier.wait_s, self.stage_busy_s - earlier.stage_busy_s)
