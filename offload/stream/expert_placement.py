"""What an expert placement is, apart from the store that serves it (offload/stream/experts.py):
the homes an expert can have, the options the loaders take (`ExpertPlacement`), how host-RAM
experts are allocated (`host_arenas`, shared with the planner so that plan equals allocation)
and what the store counts (`ExpertStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from nvme.io import ALIGN
from offload.memory.layout import StreamError
from offload.memory.tiers import pinned_bytes

EXPERT_HOMES = ("device", "cpu", "nvme")
COMPUTE_MODES = ("copy", "where", "auto")


@dataclass
class ExpertStats:
    """Counters since construction (`copy()` and `minus()` for per-step figures)."""
    calls: int = 0  # MoE layer forwards served
    routed: int = 0  # experts that got tokens, summed over calls
    tokens: int = 0  # (token, expert) assignments
    in_place: int = 0  # served from their home, nothing moved (device, or cpu in place)
    cache_hits: int = 0  # served from the expert cache
    prefetch_hits: int = 0  # served by a read the prediction had started
    demand_reads: int = 0  # fetched when routed
    moved_bytes: dict[str, int] = field(default_factory=lambda: {"disk": 0, "h2d": 0})
    wasted_bytes: int = 0  # prefetched, then not routed
    predicted: int = 0  # experts predicted for the next layer
    predicted_right: int = 0  # of them, routed
    routed_predicted_layers: int = 0  # experts routed in layers that had a prediction
    wait_s: float = 0.0  # compute waiting for reads

    def copy(self) -> "ExpertStats":
        return ExpertStats(**{**self.__dict__, "moved_bytes": dict(self.moved_bytes)})

    def minus(self, earlier: "ExpertStats") -> "ExpertStats":
        return self._combine(earlier, -1)

    def plus(self, other: "ExpertStats") -> "ExpertStats":
        return self._combine(other, 1)

    def _combine(self, other: "ExpertStats", sign: int) -> "ExpertStats":
        out = {k: v + sign * getattr(other, k) for k, v in self.__dict__.items() if k != "moved_bytes"}
        return ExpertStats(**out, moved_bytes={k: v + sign * other.moved_bytes[k]
                                               for k, v in self.moved_bytes.items()})

    def precision(self) -> float | None:
        return self.predicted_right / self.predicted if self.predicted else None

    def recall(self) -> float | None:
        return (self.predicted_right / self.routed_predicted_layers
                if self.routed_predicted_layers else None)

    def hit_rate(self) -> float | None:
        """Of the routed experts that do not live where they run, the share found in the cache."""
        moved = self.cache_hits + self.prefetch_hits + self.demand_reads
        return self.cache_hits / moved if moved else None


@dataclass(frozen=True)
class ExpertPlacement:
    """How an MoE model's routed experts are placed and served (what the loaders take).

    home: one of EXPERT_HOMES for every expert, or per MoE layer (DeepSeek-V3's first dense
    layers have none) a list per expert (a plan's).
    window: experts read ahead for the running layer (0: the model's top-k, at least 2).
    prefetch_slots: buffers for the next layer's predicted experts (None: top-k; 0: no prefetch,
    the prediction is still made and scored). cache_slots: experts kept after use (0: no cache).
    compute, where_max_tokens, zero_copy_host: see ExpertStore (under CUDA: the plan's choice
    between copying experts to the device and computing them on the CPU)."""
    home: str | Sequence[Sequence[str]] = "cpu"
    window: int = 0
    prefetch_slots: int | None = None
    predict_k: int | None = None  # experts per token the prediction names (None: top-k)
    cache_slots: int = 0
    compute: str = "auto"
    where_max_tokens: float = 0.0
    zero_copy_host: bool | None = None

    def homes_for(self, layers: int, experts: int) -> list[list[str]]:
        if isinstance(self.home, str):
            if self.home not in EXPERT_HOMES:
                raise StreamError(f"expert home {self.home!r}: use one of {EXPERT_HOMES}")
            return [[self.home] * experts for _ in range(layers)]
        return [list(h) for h in self.home]

    def store_args(self, top_k: int) -> dict:
        return {"window": self.window or max(2, top_k),
                "prefetch_slots": top_k if self.prefetch_slots is None else self.prefetch_slots,
                "predict_k": self.predict_k,
                "cache_slots": self.cache_slots, "compute": self.compute,
                "where_max_tokens": self.where_max_tokens, "zero_copy_host": self.zero_copy_host}


def host_arenas(nbytes: Sequence[int], pinned: bool) -> list[tuple[int, list[int]]]:
    """How the host-RAM experts of one layer are allocated: [(arena bytes, the experts in it)].
    Each expert takes its bytes rounded up to 4 KiB, +4 KiB to line it up with its file for a
    direct read. Pageable memory: one arena. Pinned memory comes in powers of two
    (offload/memory/tiers.py pinned_bytes): arenas of the largest power of two the remaining
    experts fill, the last one rounded up -- a few percent lost, not the up to 2x of one
    pinned buffer per expert. The planner counts exactly these bytes."""
    sizes = [-(-n // ALIGN) * ALIGN + ALIGN for n in nbytes]
    if not sizes:
        return []
    if not pinned:
        return [(sum(sizes), list(range(len(sizes))))]
    out, rest = [], list(range(len(sizes)))
    while rest:
        total = sum(sizes[i] for i in rest)
        cap = 1 << (total.bit_length() - 1)  # the largest power of two <= what is left
        members, used = [], 0
        for i in rest:
            if used + sizes[i] <= cap:
                members.append(i)
                used += sizes[i]
        if not members or len(members) == len(rest) and used < total:
            members, used = rest, total  # what is left: one arena, rounded up
        out.append((pinned_bytes(used), members))
        rest = [i for i in rest if i not in set(members)]
    return out
