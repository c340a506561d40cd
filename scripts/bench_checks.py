"""What the integrity checks of caches and checkpoints cost, against the reads they guard.

    python scripts/bench_checks.py                    # ~30 s, 512 MiB of test data under /tmp
    python scripts/bench_checks.py --mib 2048 --dir /mnt/nvme/tmp --rounds 5

Prints, with the CPU model:
  * crc: CRC-32C (the crc32c package, one core) and zlib CRC-32 over an in-memory buffer, GB/s;
  * read: a checksummed safetensors file of --mib MiB read whole through SafetensorsFile
    (page cache warm, so the read is a memcpy and the check's share is the largest it can be),
    with the per-tensor check and without it (the same file's checksums dropped), GB/s, and the
    check's share of the read time;
  * key: nvme.format.content_digest of that file (the cache key of a conversion), ms.
Medians of --rounds, alternating with and without the check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nvme.format import SafetensorsFile, content_digest, write_file  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def timed(fn, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--dir", default=None)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    nbytes = a.mib << 20
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; {a.mib} MiB, "
          f"median of {a.rounds}")
    buf = torch.empty(nbytes, dtype=torch.uint8).random_()
    mv = memoryview(buf.numpy())
    from crc32c import crc32c
    for name, fn in (("CRC-32C (crc32c)", crc32c), ("CRC-32 (zlib)", zlib.crc32)):
        s = timed(lambda: fn(mv), a.rounds)
        print(f"crc   {name:<18} {nbytes / s / 1e9:6.2f} GB/s")
    d = tempfile.mkdtemp(dir=a.dir)
    path = os.path.join(d, "blocks.safetensors")
    tensors = {f"t{i}": buf[i * (nbytes // 64):(i + 1) * (nbytes // 64)].view(torch.float16) for i in range(64)}
    write_file(path, tensors, {"format": "pt"}, checksums=True)
    with SafetensorsFile(path) as f:
        outs = {n: torch.empty(i.shape, dtype=i.dtype) for n, i in f.tensors.items()}
        sums = dict(f.checksums)
        for n in outs:  # warm the page cache
            f.read_into(n, outs[n])

        def read(check: bool) -> None:
            f.checksums = sums if check else {}
            for n in outs:
                f.read_into(n, outs[n])
        both = {True: [], False: []}
        for _ in range(a.rounds):
            for check in (True, False):
                t0 = time.perf_counter()
                read(check)
                both[check].append(time.perf_counter() - t0)
    on, off = (statistics.median(both[c]) for c in (True, False))
    print(f"read  whole file, checked    {nbytes / on / 1e9:6.2f} GB/s")
    print(f"read  whole file, unchecked  {nbytes / off / 1e9:6.2f} GB/s  (the check: "
          f"{100 * (on - off) / on:.0f}% of a page-cache read)")
    s = timed(lambda: content_digest(path), a.rounds)
    print(f"key   content_digest of the {a.mib} MiB file: {s * 1e3:.1f} ms")
    os.unlink(path)
    os.rmdir(d)


if __name__ == "__main__":
    main()
