"""ZeRO stages 0-3 across data-parallel ranks (offload/zero/group.py) on one machine, next to
PyTorch's own sharded data parallelism (FSDP2, torch.distributed.fsdp.fully_shard) on the same
model and world size: median step time, per-rank model-state bytes per tier beside the ZeRO
formulas, and the bytes one rank sends per update beside 2Φ(N-1)/N (3Φ(N-1)/N at stage 3).
`--stage3-worlds 2 4` adds stage-3 rows at those world sizes: per-rank RSS as N grows.

Each row is a fresh set of N rank processes of this script (gloo, torchrun's environment), so a
row's RSS is its own and a broken row cannot hang the next; rank results come back as JSON files.

    python scripts/bench_zero.py                         # 2 ranks, ~4M-param Llama, fp32, CPU
    python scripts/bench_zero.py --ranks 3 --steps 5 --nvme-dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import psutil
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import offload  # noqa: E402
from offload.memory.tiers import cpu_model  # noqa: E402

MIB = 2**20
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_gather_fetch")
BASE_ROW = "offload s0 cpu"  # "vs s0": every row against plain data parallelism (ours)
SHORT = {"all_reduce": "ar", "reduce_scatter": "rs", "all_gather": "ag", "all_gather_fetch": "agf"}


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "offload" (our engine), "fsdp2" (fully_shard), "torch" (plain one-process loop)
    world: int
    stage: int  # the ZeRO stage whose formula applies (FSDP2 shards weights too: stage 3)
    offload: str = "none"  # engine: where optimizer state lives; fsdp2: "cpu" = CPUOffloadPolicy
    state_bytes: int = 12  # optimizer state per parameter: fp32 masters + 2 moments, or moments
    params: str = "none"  # engine stage 3: where each rank's shard of the layers' weights lives


def plan_rows(args: argparse.Namespace) -> list[Row]:
    n = args.ranks
    tiers = ["cpu"] + (["nvme"] if args.nvme_dir else [])
    rows = [Row(f"offload s{s} {t}", "offload", n, s, t) for t in tiers for s in (0, 1, 2)]
    rows += [Row(f"offload s3 {t} N{w}", "offload", w, 3, t, params="cpu")
             for w in args.stage3_worlds or [n] for t in tiers]
    # fp32 params are their own masters in torch.optim.AdamW: 8 bytes of moments per parameter
    rows += [Row("fsdp2", "fsdp2", n, 3, "none", 8), Row("fsdp2+cpuoffload", "fsdp2", n, 3, "cpu", 8)]
    # one process on all the cores over the whole global batch: the same work, no collectives
    rows += [Row("offload s0 cpu 1p", "offload", 1, 0, "cpu"), Row("torch 1p", "torch", 1, 0, "none", 8)]
    return rows


# -- one rank -------------------------------------------------------------------------------
def make_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)  # every rank builds the same model (the engine broadcasts rank 0's anyway)
    ffn = -(-args.hidden * 8 // 3 // 16) * 16  # Llama's 8/3 ratio, a multiple of 16
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=ffn, num_hidden_layers=args.layers,
                                   num_attention_heads=max(1, args.hidden // 64),
                                   max_position_embeddings=args.seq + 1)
    return transformers.LlamaForCausalLM(cfg).float()


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds of `t` (a DTensor's local shard, FSDP2's parameters and state)."""
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def timed(step, warmup: int, steps: int) -> list[float]:
    """Seconds per update (forward, backward, clip, optimizer step) after `warmup` updates."""
    out = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def run_offload(row: Row, args: argparse.Namespace, ids: torch.Tensor) -> dict:
    model = make_model(args)
    cfg = offload.OffloadConfig(zero_stage=row.stage, offload=row.offload, dtype="fp32",
                                offload_params=row.params,
                                device="cpu", lr=args.lr, weight_decay=0.01, grad_clip=args.clip,
                                nvme_dir=args.nvme_row_dir if row.offload == "nvme" else None)
    engine = offload.initialize(model, cfg)
    waits: list[float] = []

    losses: list[float] = []

    def step() -> None:
        loss = lm_loss(model, ids)
        engine.backward(loss)
        engine.step()
        waits.append(engine.last_report.comm_wait_s)
        losses.append(loss.item())

    try:
        step_s = timed(step, args.warmup, args.steps)
        rep, peaks = engine.account.report(), engine.account.kind_peaks()
        sent = {k: v for k, v in engine.last_report.bytes.items() if k in COLLECTIVES and v}
        # a streamer's device slots are counted as weights by the engine; ZeRO's formula counts
        # the weights' homes (each rank's shards), so the slots are reported beside them
        slots = engine.slot_bytes
    finally:
        engine.close()
    tiers = {t: {k: v for k, v in kinds.items() if v} for t, kinds in rep.items() if kinds["total"]}
    # each kind's most bytes held at once, over all tiers: adopted gradients (one process) are
    # autograd's own and counted only between backward and the step, so not at the end
    kind_sum = lambda *kinds: sum(v for (_, k), v in peaks.items() if k in kinds)  # noqa: E731
    return {"step_s": step_s, "comm_wait_s": statistics.median(waits[args.warmup:]), "sent": sent,
            "loss": losses[-1], "loss0": losses[0],
            "tiers": tiers, "weights": kind_sum("weights") - slots, "slots": slots,
            "grads": kind_sum("grads"), "state": kind_sum("masters", "moments"),
            "masters": kind_sum("masters")}


def run_torch(row: Row, args: argparse.Namespace, ids: torch.Tensor) -> dict:
    """FSDP2 (row.kind "fsdp2", each decoder layer and the whole model a unit) or the plain
    loop: torch.optim.AdamW and clip_grad_norm_ (over DTensors: the norm is all-reduced)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    note = ""
    if row.kind == "torch":
        model = make_model(args)
    else:
        def shard(pin: bool) -> torch.nn.Module:
            m = make_model(args)
            kw = {"offload_policy": CPUOffloadPolicy(pin_memory=pin)} if row.offload == "cpu" else {}
            for layer in m.model.layers:
                fully_shard(layer, **kw)
            return fully_shard(m, **kw)
        try:
            model = shard(pin=True)  # the policy's default
        except RuntimeError as e:  # no accelerator to pin for: try the unpinned policy
            if row.offload != "cpu":
                raise
            note = (f"CPUOffloadPolicy() failed: {str(e).splitlines()[0]}; "
                    f"ran CPUOffloadPolicy(pin_memory=False)")
            model = shard(pin=False)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    held: dict[str, int] = {}

    losses: list[float] = []

    def step() -> None:
        loss = lm_loss(model, ids)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        held["grads"] = sum(local_bytes(p.grad) for p in params)  # the most held: before zeroing
        opt.zero_grad(set_to_none=True)

    step_s = timed(step, args.warmup, args.steps)
    state = sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    return {"step_s": step_s, "comm_wait_s": None, "sent": {}, "tiers": {}, "note": note,
            "loss": losses[-1], "loss0": losses[0],
            "weights": sum(local_bytes(p) for p in params), "grads": held["grads"],
            "state": state, "masters": 0}


def worker(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    row, args = Row(**spec["row"]), argparse.Namespace(**spec["args"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // world))  # N ranks share this machine's cores
    if world > 1:  # ours, with a short timeout: a dead peer ends the row, not after 30 min
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    g = torch.Generator().manual_seed(1)  # the same global batch on every rank
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    per = args.batch // world
    mine = ids[rank * per:(rank + 1) * per]
    rss0 = psutil.Process().memory_info().rss
    out = (run_offload if row.kind == "offload" else run_torch)(row, args, mine)
    rss = psutil.Process().memory_info().rss
    out.update(rss=rss, rss_growth=rss - rss0)
    with open(os.path.join(spec["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# -- the launcher ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(row: Row, args: argparse.Namespace, tmp: str) -> list[dict]:
    """Run `row` as row.world rank processes; every rank's result. On a failed or stuck rank,
    kill the others (they would wait in a collective) and raise with that rank's last line."""
    out_dir = tempfile.mkdtemp(dir=tmp)
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump({"row": asdict(row), "args": vars(args), "out_dir": out_dir}, f)
    port, threads = free_port(), max(1, len(os.sched_getaffinity(0)) // row.world)
    procs, logs = [], []
    for r in range(row.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(row.world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        logs.append(open(os.path.join(out_dir, f"rank{r}.log"), "w"))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                       spec_path], env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    deadline, failed = time.monotonic() + args.timeout, None
    try:
        while failed is None and time.monotonic() < deadline:
            # a rank's peers fail soon after it (gloo: "connection closed by peer"): the first
            # seen, and among those seen together one killed by a signal, is the cause
            done = sorted((p.returncode >= 0, r) for r, p in enumerate(procs)
                          if p.poll() not in (None, 0))
            failed = done[0][1] if done else None
            if all(p.returncode == 0 for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:  # only ours, by their Popen handles
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failed is None and any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{row.name}: ranks still running after --timeout {args.timeout:.0f} s")
    if failed is not None:
        with open(os.path.join(out_dir, f"rank{failed}.log")) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        rc = procs[failed].returncode
        how = f"killed by signal {-rc}" if rc < 0 else f"exited {rc}"
        raise RuntimeError(f"{row.name}: rank {failed} {how}: "
                           f"{lines[-1] if lines else '(no output)'}")
    results = []
    for r in range(row.world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def formula(row: Row, phi: int) -> dict[str, float]:
    """ZeRO's per-rank model-state bytes (fp32: weights 4Φ, grads 4Φ, state KΦ), the state
    sharded from stage 1, gradients from stage 2, weights at stage 3 (FSDP2); and what a rank
    sends per update: 2Φ(N-1)/N elements of 4 bytes (0 in one process)."""
    n = row.world
    return {"weights": 4 * phi / (n if row.stage >= 3 else 1),
            "grads": 4 * phi / (n if row.stage >= 2 else 1),
            "state": row.state_bytes * phi / (n if row.stage >= 1 else 1),
            "sent": (3 if row.stage == 3 else 2) * phi * (n - 1) / n * 4}


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


HEAD = (f"{'row':<18} {'N':>2} {'loss':>10} {'-loss0':>9} {'step s':>7} {'vs s0':>6} {'comm s':>7}   "
        f"{'weights':>13} {'grads':>13} {'state':>13}   {'sent/update':>15}  "
        f"{'rss':>6} {'+rss':>6}  step s min-max")


def print_row(row: Row, res: list[dict], phi: int, base: float | None) -> float:
    """One line: the slowest rank's median step time, the largest rank's bytes (MiB, measured
    / formula); returns that step time."""
    step = max(statistics.median(r["step_s"]) for r in res)
    lo, hi = min(min(r["step_s"]) for r in res), max(max(r["step_s"]) for r in res)
    f = formula(row, phi)
    pair = lambda k: f"{mib(max(r[k] for r in res))}/{mib(f[k])}"  # noqa: E731
    wait = [r["comm_wait_s"] for r in res if r["comm_wait_s"] is not None]
    sent = max(sum(r["sent"].values()) for r in res)
    sent_s = f"{mib(sent)}/{mib(f['sent'])}" if row.kind == "offload" and row.world > 1 else "-"
    base = base or (step if row.name == BASE_ROW else None)
    ratio = f"{step / base:6.2f}" if base else "     -"
    # the last update's loss, the mean over ranks (each rank's is its rows' mean): every row
    # runs the same updates on the same batch, so the numbers must agree to rounding
    loss = statistics.fmean(r["loss"] for r in res)
    moved = loss - statistics.fmean(r["loss0"] for r in res)  # what the updates did
    print(f"{row.name:<18} {row.world:>2} {loss:10.7f} {moved:9.6f} {step:7.3f} {ratio} "
          f"{(f'{max(wait):7.3f}' if wait else '      -')}   {pair('weights'):>13} "
          f"{pair('grads'):>13} {pair('state'):>13}   {sent_s:>15}  "
          f"{mib(max(r['rss'] for r in res)):>6} {mib(max(r['rss_growth'] for r in res)):>6}"
          f"  {lo:.3f}-{hi:.3f}",
          flush=True)
    return step


def details(row: Row, res: list[dict]) -> list[str]:
    out = []
    for rank, r in enumerate(res):
        tiers = "; ".join(f"{t}: " + ", ".join(f"{k} {mib(v)}" for k, v in kinds.items())
                          for t, kinds in r["tiers"].items())
        sent = ", ".join(f"{SHORT[k]} {mib(v)}" for k, v in r["sent"].items())
        if tiers or sent:
            out.append(f"  {row.name:<18} rank {rank}  {tiers}" + (f"  | sent {sent}" if sent else ""))
        if rank == 0 and r["masters"] and not r["weights"]:
            out.append(f"  {row.name:<18} weights 0: the parameters are views of the fp32 masters")
        if rank == 0 and r.get("slots"):
            out.append(f"  {row.name:<18} + {mib(r['slots'])} MiB of device slots the streamer "
                       f"gathers layers into (not in 'weights')")
        if rank == 0 and r.get("note"):
            out.append(f"  {row.name:<18} note: {r['note']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel processes (default 2)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows), split across ranks")
    ap.add_argument("--steps", type=int, default=5, help="timed updates per row (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--nvme-dir", default=None, help="add nvme rows, swap files under this folder")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a row may take")
    ap.add_argument("--rows", nargs="+", default=None, help="only the rows whose name starts so")
    ap.add_argument("--stage3-worlds", type=int, nargs="+", default=None,
                    help="world sizes of the stage-3 rows (default: --ranks)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.batch % args.ranks:
        ap.error(f"--batch {args.batch} does not split into --ranks {args.ranks} equal slices")
    rows = [r for r in plan_rows(args) if not args.rows or any(r.name.startswith(p) for p in args.rows)]
    phi = sum(p.numel() for p in make_model(args).parameters())
    cores = len(os.sched_getaffinity(0))
    # load average: other work on these few cores (oversubscribed OpenMP threads) can slow a
    # step 10x; it is printed so a run on a busy machine reads as one
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}  CPU: {cpu_model()} "
          f"({cores} cores; {max(1, cores // args.ranks)} threads per rank, {cores} in one "
          f"process)  torch {torch.__version__}  load {os.getloadavg()[0]:.2f}")
    print(f"Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}: Φ = {phi:,} "
          f"params, fp32; global batch {args.batch} x {args.seq}; AdamW lr {args.lr}, clip "
          f"{args.clip}; {args.ranks} ranks (gloo); median of {args.steps} updates after "
          f"{args.warmup} warm-up")
    print("bytes: MiB, measured/formula, the largest rank; formula: weights 4Φ, grads 4Φ, state "
          "12Φ (engine: masters+moments) or 8Φ (torch AdamW: moments), /N from stage 1 (state), "
          "2 (grads), 3 (weights: each rank's shards, its gather slots not counted); "
          "sent/update: 2Φ(N-1)/N x 4 B (3Φ at stage 3, an upper bound); step: slowest rank; "
          "rss: MiB at the end, +rss: growth since before the model was built")
    print(HEAD)
    tmp = tempfile.mkdtemp(prefix="bench-zero-")
    args.nvme_row_dir = None
    base, notes = None, []
    try:
        for row in rows:
            if args.nvme_dir:  # a fresh swap folder per row (the engine adds rank folders)
                args.nvme_row_dir = tempfile.mkdtemp(prefix="bench-zero-", dir=args.nvme_dir)
            try:
                res = launch(row, args, tmp)
            finally:
                if args.nvme_row_dir:
                    shutil.rmtree(args.nvme_row_dir, ignore_errors=True)
            step = print_row(row, res, phi, base)
            if row.name == BASE_ROW:
                base = step
            notes += details(row, res)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(notes))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
