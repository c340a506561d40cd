"""Sequential read/write bandwidth of nvme.IOEngine against raw baselines, in one run.

For each repetition, in rotating order, the same bytes are moved by
  * `dd` with O_DIRECT (bs = --dd-block-mib),
  * a plain multi-threaded `os.preadv`/`os.pwritev` O_DIRECT loop (one per thread/block config),
  * the engine (one per thread/block config, plus the defaults),
  * `safetensors.torch.save_file` / `load_file` (page cache dropped before loading if allowed),
  * the swap store (checksummed, fsynced writes; reads with and without verification).
Writes go to a fresh file and include the final fsync; reads are cold (O_DIRECT, or after
dropping the page cache). Each figure is the median over --reps repetitions, in GB/s (1e9 B/s).

Usage: python scripts/bench_nvme.py --dir /tmp/nvme-bench --size-mib 1024 --reps 3
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch

from nvme import IOEngine, SwapStore, aligned_empty
from nvme.io import DEFAULT_BLOCK_BYTES, DEFAULT_THREADS, drop_caches, tensor_bytes

MiB = 1 << 20


def dd(src: str, dst: str, block: int, count: int, write: bool) -> float:
    flag = ["oflag=direct", "conv=fsync"] if write else ["iflag=direct"]
    out = subprocess.run(["dd", f"if={src}", f"of={dst}", f"bs={block}", f"count={count}", *flag],
                         capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([0-9.e+-]+) s", out)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {out!r}")
    return float(m.group(1))


def raw_loop(path: str, buf: torch.Tensor, threads: int, block: int, write: bool) -> float:
    """The baseline: threads pulling block indices and calling preadv/pwritev with O_DIRECT on
    slices of the same page-aligned buffer, then one fsync for writes."""
    mv = tensor_bytes(buf)
    n = len(mv)
    flags = os.O_DIRECT | (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY)
    fd = os.open(path, flags, 0o644)
    nxt = iter(range(0, n, block))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                start = next(nxt, None)
            if start is None:
                return
            view = mv[start:start + block]
            (os.pwritev if write else os.preadv)(fd, [view], start)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt


def engine_run(eng: IOEngine, path: str, buf: torch.Tensor, write: bool) -> float:
    t0 = time.perf_counter()
    if write:
        eng.submit_write(path, 0, buf, fsync=True).wait()
    else:
        eng.submit_read(path, 0, buf).wait()
    return time.perf_counter() - t0


def unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/tmp/nvme-bench")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--block-mib", default="1,8,32")
    ap.add_argument("--configs", default="",
                    help="explicit thread:block_mib pairs (e.g. 8:16,4:64) instead of the grid")
    ap.add_argument("--dd-block-mib", type=int, default=8)
    ap.add_argument("--no-safetensors", action="store_true")
    ap.add_argument("--no-store", action="store_true")
    args = ap.parse_args()

    size = args.size_mib * MiB
    os.makedirs(args.dir, exist_ok=True)
    data, scratch = os.path.join(args.dir, "data.bin"), os.path.join(args.dir, "write.bin")
    buf = aligned_empty(size)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    threads = [int(x) for x in args.threads.split(",")]
    blocks = [int(x) * MiB for x in args.block_mib.split(",")]
    grid = {(t, b) for t in threads for b in blocks}
    if args.configs:
        grid = {(int(t), int(b) * MiB) for t, b in (c.split(":") for c in args.configs.split(","))}
    configs = sorted(grid | {(DEFAULT_THREADS, DEFAULT_BLOCK_BYTES)})
    engines = {c: IOEngine(threads=c[0], block_bytes=c[1]) for c in configs}
    cold = drop_caches()
    with IOEngine() as eng:
        eng.submit_write(data, 0, buf, fsync=True).wait()
        direct = eng.direct_supported(data)
    ddb = args.dd_block_mib * MiB

    def fresh(fn):  # writes go to a new file each time
        def run():
            unlink(scratch)
            return fn()
        return run

    # (method, op) -> thunk returning seconds
    cases: dict[tuple[str, str], object] = {}
    cases[("dd O_DIRECT", "write")] = fresh(lambda: dd("/dev/zero", scratch, ddb, size // ddb, True))
    cases[("dd O_DIRECT", "read")] = lambda: dd(data, "/dev/null", ddb, size // ddb, False)
    for (t, b) in configs:
        loop, eng = f"pread/pwrite loop t={t} b={b // MiB}M", f"engine t={t} b={b // MiB}M"
        cases[(loop, "write")] = fresh(lambda t=t, b=b: raw_loop(scratch, buf, t, b, True))
        cases[(loop, "read")] = lambda t=t, b=b: raw_loop(data, buf, t, b, False)
        cases[(eng, "write")] = fresh(lambda e=engines[(t, b)]: engine_run(e, scratch, buf, True))
        cases[(eng, "read")] = lambda e=engines[(t, b)]: engine_run(e, data, buf, False)
    buffered = IOEngine(direct=False)  # default threads/blocks, through the page cache
    cases[("engine defaults, buffered (direct=False)", "write")] = fresh(
        lambda: engine_run(buffered, scratch, buf, True))
    cases[("engine defaults, buffered (direct=False)", "read")] = (
        lambda: (drop_caches(), engine_run(buffered, data, buf, False))[1])
    if not args.no_safetensors:
        from safetensors.torch import load_file, save_file
        st_path = os.path.join(args.dir, "st.safetensors")
        chunk = min(64 * MiB, size)
        st_tensors = {f"t{i}": buf[i * chunk:(i + 1) * chunk] for i in range(size // chunk)}

        def st_save():
            unlink(st_path)
            t0 = time.perf_counter()
            save_file(st_tensors, st_path)
            fd = os.open(st_path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            return time.perf_counter() - t0

        def st_load():
            # load_file maps the file lazily: the bytes are only read when touched, so copy
            # them into the destination buffer (which is what a caller needs them for).
            drop_caches()
            t0 = time.perf_counter()
            for name, t in load_file(st_path).items():
                st_tensors[name].copy_(t)
            return time.perf_counter() - t0
        cases[("safetensors save_file+fsync / load_file+copy", "write")] = st_save
        cases[("safetensors save_file+fsync / load_file+copy", "read")] = st_load
    store_dir = os.path.join(args.dir, "store")
    if not args.no_store:
        shutil.rmtree(store_dir, ignore_errors=True)
        store = SwapStore(store_dir, engine=engines[(DEFAULT_THREADS, DEFAULT_BLOCK_BYTES)])

        def store_write():
            store.remove("x") if "x" in store.names() else None
            t0 = time.perf_counter()
            store.write("x", buf).wait()
            return time.perf_counter() - t0

        def store_read(verify):
            t0 = time.perf_counter()
            store.read_into("x", buf, verify=verify).wait()
            return time.perf_counter() - t0
        cases[("swap store (crc32 + fsync + rename)", "write")] = store_write
        cases[("swap store read, crc32 verified", "read")] = lambda: store_read("always")
        cases[("swap store read, not verified", "read")] = lambda: store_read("never")

    keys = list(cases)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for rep in range(args.reps):
        shift = rep * len(keys) // max(args.reps, 1)
        for k in keys[shift:] + keys[:shift]:
            times[k].append(cases[k]())  # type: ignore[operator]
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    if not args.no_store:
        store.close()
    for e in [*engines.values(), buffered]:
        e.close()
    gbps = {k: size / statistics.median(v) / 1e9 for k, v in times.items()}

    print(f"# {size // MiB} MiB per run, median of {args.reps}; dir {args.dir}; "
          f"O_DIRECT {'yes' if direct else 'no'}; page cache dropped before buffered reads: "
          f"{'yes' if cold else 'no'}; {os.cpu_count()} CPUs")
    print("| method | write GB/s | read GB/s |\n|---|---|---|")
    names = list(dict.fromkeys(k[0] for k in keys))
    for name in names:
        w, r = gbps.get((name, "write")), gbps.get((name, "read"))
        print(f"| {name} | {w:.2f} |" if w else f"| {name} | - |", f"{r:.2f} |" if r else "- |")
    default = f"engine t={DEFAULT_THREADS} b={DEFAULT_BLOCK_BYTES // MiB}M"
    for op in ("write", "read"):
        raw = {k[0]: v for k, v in gbps.items() if k[1] == op and (k[0].startswith("dd") or k[0].startswith("pread"))}
        eng = {k[0]: v for k, v in gbps.items() if k[1] == op and k[0].startswith("engine t=")}
        best_raw = max(raw, key=raw.get)
        best_eng = max(eng, key=eng.get)
        paired = sorted(gbps[(f"engine t={t} b={b // MiB}M", op)] /
                        gbps[(f"pread/pwrite loop t={t} b={b // MiB}M", op)] for t, b in configs)
        print(f"{op}: engine / pread-pwrite loop at the same config: median "
              f"{statistics.median(paired):.2f}x (range {paired[0]:.2f}-{paired[-1]:.2f}x "
              f"over {len(paired)} configs)")
        print(f"{op}: best raw baseline {best_raw} {raw[best_raw]:.2f} GB/s; "
              f"engine defaults ({default}) {eng[default]:.2f} GB/s = {eng[default] / raw[best_raw]:.2f}x; "
              f"best engine config ({best_eng}) {eng[best_eng]:.2f} GB/s = {eng[best_eng] / raw[best_raw]:.2f}x")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
