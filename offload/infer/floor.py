"""The memory floor of a decode step on the CPU: the bytes one step must read from RAM over RAM's
measured read bandwidth.

A batch-1 decode step on the CPU multiplies every weight once and attends over the KV cache: it
cannot be faster than reading those bytes, the number llama.cpp's speed is judged by (issue 36).
The report prints this floor beside the achieved step time, so a slow step says whether it is
bound by bytes (near 100% of the floor) or by something else (per-op overhead, a slow kernel).

What a step reads (`decode_read_bytes`): every block's weights as the plan holds them (the
quantized bytes of a quantized model; an MoE model's dense parts, plus the routed experts a
step is expected to use at its batch: offload/infer/expert_plan.py's per_step), the head and the
final norm (the non-block weights without the embedding table, of which a step reads one row per
token; a tied table is the head, read whole), and the KV cache up to the step's mean position.
On a GPU the links, not the device's memory, bound a streamed step: the floor there is
InferencePlan.floor_s_per_step's.
"""

from __future__ import annotations

import time

import torch

READ_PROBE_BYTES = 256 << 20  # beyond the last-level cache of every CPU measured
READ_PROBE_SECONDS = 0.25


def memory_read_gbps(seconds: float = READ_PROBE_SECONDS, nbytes: int = READ_PROBE_BYTES) -> float:
    """RAM read bandwidth in GB/s (1e9 B/s): the fastest of repeated sums of an fp32 buffer of
    `nbytes` (a reduction reads every byte once and writes nothing), with torch's threads, for
    about `seconds` and at least 3 calls after a warm-up."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # first touch done by ones(); this warms the threads
    best, calls, t_end = float("inf"), 0, time.perf_counter() + seconds
    while calls < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return nbytes / best / 1e9


def decode_read_bytes(plan, embedding_bytes: int, mean_position: float) -> dict[str, float]:
    """{"weights", "kv", "total"}: bytes one decode step of `plan` (an InferencePlan) reads.
    `embedding_bytes`: the embedding table's bytes when it is not also the head (0 when tied);
    `mean_position`: the mean number of cached positions a step attends over."""
    weights = float(sum(plan.block_bytes) + plan.non_block_bytes - embedding_bytes)
    if plan.experts is not None:  # the routed experts a step is expected to compute
        expected = plan.experts.per_step(plan.batch_size)
        weights += expected["device"] + expected["host"] + expected["h2d"]
    kv = plan.kv_bytes / max(1, plan.context) * mean_position
    return {"weights": weights, "kv": kv, "total": weights + kv}


def memory_floor(plan, embedding_bytes: int, mean_position: float, read_gbps: float,
                 step_s: float) -> dict[str, float | None]:
    """The report's numbers: bytes read per step (and their parts), the read bandwidth, the
    floor in seconds per step and the achieved step's percentage of it (None without a step)."""
    read = decode_read_bytes(plan, embedding_bytes, mean_position)
    floor_s = read["total"] / (read_gbps * 1e9) if read_gbps > 0 else float("nan")
    pct = 100.0 * floor_s / step_s if step_s > 0 and floor_s == floor_s else None
    return {"read_per_step_bytes": read["total"], "weights_per_step_bytes": read["weights"],
            "kv_per_step_bytes": read["kv"], "read_gbps": read_gbps, "floor_s_per_step": floor_s,
            "percent_of_floor": pct}
