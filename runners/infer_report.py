"""runners.infer's report: the run's metrics (speed, bytes per tier and link, the floor, peak
memory, the kernels that ran, the experts of an MoE model) and the lines printed from them."""

from __future__ import annotations

import math
import sys

import torch

from offload import kernel_trust
from offload.config import format_bytes
from offload.infer.floor import memory_floor
from offload.memory.tiers import peak_rss_bytes
from offload.quant.matmul import kernels_run
from runners.infer_experts import expert_metrics, expert_report
from runners.report import kernels_line


def run_metrics(results, plan, links, device, batch, calls_before: dict[str, int] | None = None,
                expert_store=None, memory: tuple[float, int] | None = None) -> dict:
    """The run's numbers. `memory`: (RAM read GB/s, the embedding table's bytes when it is not
    the head) for the memory floor of a step on the CPU (offload/infer/floor.py)."""
    calls_before = calls_before or {}
    pre_tok = sum(r.prompt_tokens for r in results)
    pre_s = sum(r.prefill_s for r in results)
    dec_tok = sum(r.decode_tokens for r in results)
    dec_s = sum(r.decode_s for r in results)
    steps = sum(r.decode_steps for r in results)
    moved = {"h2d": sum(r.kv_h2d_bytes for r in results), "disk": 0}
    wait_s = 0.0
    for r in results:
        if r.decode_stream is not None:
            for k in moved:
                moved[k] += r.decode_stream.moved_bytes[k]
            wait_s += r.decode_stream.wait_s
    floor_step = plan.floor_s_per_step(links)
    step_s = dec_s / steps if steps else math.nan
    # A step faster than the floor means the links were measured below what the run got (a
    # cache between us and the disk warming up as every step re-reads the same bytes): no
    # percentage above 100 is printed; the bandwidth the run's own counters show is.
    beat = bool(floor_step and steps and step_s < floor_step)
    peak_dev = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes())
    out = {
        "prefill_tokens_per_s": pre_tok / pre_s if pre_s else 0.0,
        "decode_tokens_per_s": dec_tok / dec_s if dec_s else 0.0,
        "decode_s_per_step": step_s, "batch_size": batch, "decode_steps": steps,
        "bytes_per_token": {"cpu": moved["h2d"] / dec_tok if dec_tok else 0.0,
                            "nvme": moved["disk"] / dec_tok if dec_tok else 0.0},
        "blocks_per_tier": {t: plan.count(t) for t in ("device", "cpu", "nvme")},
        "link_gbps": {"h2d": links.h2d_gbps, "disk": links.disk_gbps},
        "floor_s_per_step": floor_step,
        "floor_s_per_token": floor_step / batch,
        "percent_of_floor": (100.0 * floor_step / step_s if floor_step and steps and not beat
                             else None),
        "run_disk_gbps": moved["disk"] / steps / step_s / 1e9 if steps and step_s > 0 else 0.0,
        "beat_floor": beat,
        "compute_wait_s": wait_s,
        "peak_device_bytes": peak_dev, "peak_host_bytes": peak_rss_bytes(),
        # which quantized product kernels ran, and what was checked on this CPU before any
        # fast kernel was trusted (offload/kernel_trust.py)
        "kernels": {"quantized_calls": {k: n - calls_before.get(k, 0) for k, n in kernels_run().items()
                                        if n > calls_before.get(k, 0)},
                    "checked": kernel_trust.verdicts()},
    }
    if memory is not None and steps:
        # positions a step attends over: the prompt (as padded) plus half the steps, on average
        mean_pos = sum((r.prompt_tokens / batch + (r.decode_steps + 1) / 2) * r.decode_steps
                       for r in results) / steps
        out["memory"] = memory_floor(plan, memory[1], mean_pos, memory[0], step_s)
    if plan.experts is not None:
        out["experts"] = expert_metrics(results, plan.experts, expert_store)
        # the routed experts' reads count in the run's bytes per token
        dec_tok = sum(r.decode_tokens for r in results)
        for key, tier in (("disk", "nvme"), ("h2d", "cpu")):
            out["bytes_per_token"][tier] += out["experts"]["decode_bytes_per_token"][key]
        if steps and step_s > 0:
            out["run_disk_gbps"] = out["bytes_per_token"]["nvme"] * dec_tok / steps / step_s / 1e9
    return out


def print_report(m: dict) -> None:
    if m["percent_of_floor"] is not None:
        pct = f"{m['percent_of_floor']:.0f}% of floor"
    elif m["beat_floor"]:
        pct = (f"faster than the floor: disk-bound at {m['run_disk_gbps']:.2f} GB/s by the run's "
               f"own counters (the probe measured less)")
    else:
        pct = "floor n/a (nothing streamed)"
    print(f"prefill {m['prefill_tokens_per_s']:.1f} tok/s | decode {m['decode_tokens_per_s']:.2f} tok/s "
          f"(batch {m['batch_size']}, {m['decode_s_per_step']:.3f} s/step)", file=sys.stderr)
    print(f"streamed per token: host->device {format_bytes(m['bytes_per_token']['cpu'])}, "
          f"nvme {format_bytes(m['bytes_per_token']['nvme'])} | links: h2d "
          f"{m['link_gbps']['h2d']:.2f} GB/s, disk {m['link_gbps']['disk']:.2f} GB/s | floor "
          f"{m['floor_s_per_step']:.3f} s/step, {pct} | compute waited {m['compute_wait_s']:.2f} s",
          file=sys.stderr)
    if "memory" in m:
        print(memory_line(m["memory"]), file=sys.stderr)
    print(f"peak memory: device {format_bytes(m['peak_device_bytes'])}, host (RSS) "
          f"{format_bytes(m['peak_host_bytes'])}", file=sys.stderr)
    if "experts" in m:
        print(expert_report(m["experts"]), file=sys.stderr)
    line = kernels_line(m["kernels"])
    if line:
        print(line, file=sys.stderr)


def memory_line(f: dict) -> str:
    """What a decode step read from RAM and how close it came to reading only that."""
    pct = f"{f['percent_of_floor']:.0f}% of it" if f["percent_of_floor"] is not None else "n/a"
    return (f"read per step from RAM: {format_bytes(f['read_per_step_bytes'])} (weights "
            f"{format_bytes(f['weights_per_step_bytes'])}, KV cache {format_bytes(f['kv_per_step_bytes'])})"
            f" at {f['read_gbps']:.1f} GB/s: memory floor {f['floor_s_per_step']:.4f} s/step, {pct}")
