"""Async IO engine: reads and writes of byte ranges between files and caller-owned buffers.

`IOEngine.submit_read(path, offset, buf)` / `submit_write(...)` return an `IOHandle` at once;
worker threads do the IO with positional `preadv`/`pwritev` (which release the GIL), and
`handle.wait()` / `engine.wait_all(handles)` collect the results or raise the failure.

A request is cut into tasks. With O_DIRECT (used where the filesystem accepts it, detected once
per device), the part of the request that covers whole 4 KiB file pages is cut into blocks of
`block_bytes` and read/written with O_DIRECT: straight from the caller's buffer when its
address lines up with the file offset modulo 4 KiB, else through a per-thread page-aligned
bounce buffer. The unaligned head and tail (less than a page each) go through the page cache.
Without O_DIRECT (e.g. ramfs, or `direct=False`) every block is buffered IO.

Each request may also compute a CRC of its bytes: every block's CRC is taken in the worker
that moved it (while the data is hot in cache, in parallel across threads, the GIL released)
and the block CRCs are joined with `crc_combine`, so the checksum costs no extra pass over
memory. The CRC is CRC-32C (Castagnoli, the SSE4.2 / ARMv8 instruction, ~16 GB/s a core
through the `crc32c` package) when that package is installed, else zlib's CRC-32 (~3.7 GB/s):
`CHECKSUM` names the one in use, and a request may ask for either by name.

Failures raise `IOEngineError` naming the operation, path, offset, length and the OS error.
The engine knows nothing about tensors' meaning: buffers are just bytes.
"""

from __future__ import annotations

import collections
import ctypes
import errno as errno_mod
import math
import os
import tempfile
import threading
import zlib

try:  # hardware CRC-32C; zlib's CRC-32 is the fallback (4.5x slower, measured)
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the package is a declared dependency
    _crc32c = None

CRC_FUNCS = {"crc32": zlib.crc32}
if _crc32c is not None:
    CRC_FUNCS["crc32c"] = _crc32c
CHECKSUM = "crc32c" if _crc32c is not None else "crc32"
from typing import Callable, Iterable

import numpy as np
import torch

from nvme.format import tensor_bytes

ALIGN = 4096  # O_DIRECT alignment of memory, file offsets and lengths (safe for any device)
# Defaults chosen with scripts/bench_nvme.py on this machine's virtio disk (docs/benchmarks/nvme.md):
# bandwidth grows with the bytes in flight (threads x block) up to a few hundred MiB; in the
# sweeps 16 threads x 32 MiB and 8-16 threads x 64 MiB were on top (run-to-run noise is +-15%),
# 8 x 16 MiB about 15% lower. Idle threads cost nothing, so 16 x 32 MiB: 512 MiB in flight.
DEFAULT_THREADS = 16
DEFAULT_BLOCK_BYTES = 32 << 20
# Bounce buffers (for buffers misaligned with the file) are per thread, made on first need and
# used a chunk at a time, so they cost at most threads x 8 MiB whatever block_bytes is.
BOUNCE_BYTES = 8 << 20
# Bounds the blocks queued ahead of the workers; `submit_*` blocks while the queue is full, which
# also bounds open file descriptors (each unfinished request holds one or two).
DEFAULT_QUEUE_DEPTH = 64

_BUFFERED, _DIRECT, _BOUNCE = 0, 1, 2


class IOEngineError(OSError):
    """An IO request failed. `path`, `offset`, `length` name the failing byte range; `errno` is
    the OS error number (None for a truncated file or a checksum mismatch)."""

    def __init__(self, op: str, path: str, offset: int, length: int, reason: str,
                 err_no: int | None = None, request: "IOHandle | None" = None):
        msg = f"{op} of {length} bytes at offset {offset} in {path} failed: {reason}"
        if request is not None and (request.offset, request.nbytes) != (offset, length):
            msg += f" (part of a {request.nbytes}-byte {op} at offset {request.offset})"
        super().__init__(err_no, msg)
        self.op, self.path, self.offset, self.length, self.reason = op, path, offset, length, reason

    def __str__(self) -> str:
        return self.strerror


def os_reason(e: OSError) -> str:
    code = errno_mod.errorcode.get(e.errno, "?") if e.errno is not None else "?"
    return f"[Errno {e.errno} {code}] {e.strerror or e}"


# ---------------------------------------------------------------------------------------------
# CRC combination: crc(A + B) from crc(A), crc(B) and len(B), for either CRC.
# A CRC is affine in its start value: crc(B, c) ^ crc(B, 0) = M_n c, with M_n a linear map
# over GF(2) that depends only on n = len(B). So crc(A + B) = M_n crc(A) ^ crc(B).
# M_1 is read off the CRC function itself; M_{2^(k+1)} = M_{2^k} o M_{2^k}; M_n is the product over the set
# bits of n. Each map is stored as 4 byte-indexed tables so applying it is 4 lookups.

def _apply_columns(cols: list[int], c: int) -> int:
    r, i = 0, 0
    while c:
        if c & 1:
            r ^= cols[i]
        c >>= 1
        i += 1
    return r


def _byte_tables(cols: list[int]) -> tuple[list[int], ...]:
    tables = []
    for b in range(4):
        t = [0] * 256
        for v in range(1, 256):
            low = v & -v
            t[v] = t[v ^ low] ^ cols[8 * b + low.bit_length() - 1]
        tables.append(t)
    return tuple(tables)


def _power_tables(fn, levels: int = 48) -> list[tuple[list[int], ...]]:
    zero = fn(b"\0")
    cols = [fn(b"\0", 1 << i) ^ zero for i in range(32)]
    out = []
    for _ in range(levels):
        out.append(_byte_tables(cols))
        cols = [_apply_columns(cols, c) for c in cols]
    return out


_POW_TABLES: dict[str, list] = {}
_POW_LOCK = threading.Lock()


def crc_combine(crc1: int, crc2: int, len2: int, name: str = "crc32") -> int:
    """The CRC of A + B given crc(A), crc(B) and len(B) (like zlib's crc32_combine), for the
    CRC `name` ("crc32": zlib's, "crc32c": Castagnoli)."""
    tables = _POW_TABLES.get(name)
    if tables is None:
        with _POW_LOCK:
            tables = _POW_TABLES.get(name) or _power_tables(CRC_FUNCS[name])
            _POW_TABLES[name] = tables
    k = 0
    while len2:
        if len2 & 1:
            t0, t1, t2, t3 = tables[k]
            crc1 = t0[crc1 & 255] ^ t1[(crc1 >> 8) & 255] ^ t2[(crc1 >> 16) & 255] ^ t3[crc1 >> 24]
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


# ---------------------------------------------------------------------------------------------

def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only), so the next reads come from the
    disk: cold-cache measurements for benchmarks. False where it is not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def aligned_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8, *,
                  align: int = ALIGN, pin: bool = False) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose first byte is `align`-aligned (usable as an
    O_DIRECT buffer). With `pin` (and CUDA present) the memory is page-locked: torch's pinned
    host allocator hands out whole cudaHostAlloc blocks, which are page-aligned, so the exact
    size is tried first (over-allocating would double the block under its power-of-two rounding);
    only a misaligned result falls back to over-allocating and slicing."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pin = pin and torch.cuda.is_available()
    if pin:
        raw = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % align == 0:
            return raw[:nbytes].view(dtype).view(shape)
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % align
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def _buffer_view(buf, writable: bool) -> tuple[memoryview, int]:
    """(byte memoryview, address of first byte) of a contiguous CPU tensor or buffer object."""
    if isinstance(buf, torch.Tensor):
        return tensor_bytes(buf), buf.data_ptr()
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("IO buffers must be contiguous")
    mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("a read needs a writable buffer")
    addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data if len(mv) else 0
    return mv, addr


class IOHandle:
    """One submitted request. `wait()` blocks until it is finished and raises its failure;
    `done()` polls. After a successful wait, `crc32` holds the checksum if one was asked for
    (of the kind `checksum` names: "crc32c" or "crc32")."""

    def __init__(self, op: str, path: str, offset: int, nbytes: int, buf=None):
        self.op, self.path, self.offset, self.nbytes = op, path, offset, nbytes
        self.error: BaseException | None = None
        self.crc32: int | None = None
        self.checksum: str | None = None
        self._buf = buf  # keeps the caller's memory alive while workers touch it
        self._event = threading.Event()
        self._pending = 0
        self._fds: list[int] = []
        self._crcs: list[int] | None = None
        self._lens: list[int] = []
        self._fsync = False
        self._on_done: Callable[["IOHandle"], None] | None = None
        self._tasks: list = []
        self._started = False
        self._mem: memoryview | None = None  # the buffer's bytes
        self._addr = 0                        # and their address
        self._fd = -1                         # buffered descriptor (also used for fsync)
        self._direct_fd: int | None = None    # O_DIRECT descriptor, if the filesystem allows

    @classmethod
    def finished(cls, op: str, path: str, offset: int, nbytes: int,
                 error: BaseException | None = None) -> "IOHandle":
        """A handle that is already complete (for work done synchronously)."""
        h = cls(op, path, offset, nbytes)
        h.error = error
        h._event.set()
        return h

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> "IOHandle":
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.op} of {self.nbytes} bytes at offset {self.offset} in "
                               f"{self.path} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done() else "pending"
        return f"<IOHandle {self.op} {self.path}@{self.offset}+{self.nbytes} {state}>"


class IOEngine:
    """Worker threads moving byte ranges between files and memory. See the module docstring.

    threads: worker threads; block_bytes: the most bytes one syscall moves (a multiple of
    4 KiB); queue_depth: the most blocks queued ahead of the workers (submit blocks beyond it);
    direct: "auto" (O_DIRECT where the filesystem accepts it), True (required), False (never).
    `on_done` callbacks run in a worker thread and must not submit to the same engine.
    """

    def __init__(self, threads: int | None = None, block_bytes: int | None = None,
                 queue_depth: int | None = None, direct: bool | str = "auto"):
        self.threads = int(threads or DEFAULT_THREADS)
        self.block_bytes = int(block_bytes or DEFAULT_BLOCK_BYTES)
        self.queue_depth = int(queue_depth or DEFAULT_QUEUE_DEPTH)
        if self.threads < 1 or self.queue_depth < 1:
            raise ValueError("threads and queue_depth must be >= 1")
        if self.block_bytes < ALIGN or self.block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}")
        if direct not in ("auto", True, False):
            raise ValueError("direct must be 'auto', True or False")
        self.direct = direct
        self._direct_ok: dict[int, bool] = {}  # st_dev -> does O_DIRECT work there
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._has_room = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._inflight = 0
        self._closed = False
        self.bytes_read = 0
        self.bytes_written = 0
        self._workers = [threading.Thread(target=self._work, name=f"nvme-io-{i}", daemon=True)
                         for i in range(self.threads)]
        for i, w in enumerate(self._workers):
            try:
                w.start()
            except RuntimeError as e:  # "can't start new thread": no room for its stack
                self._workers = self._workers[:i]
                self.close()
                err = IOEngineError("start", "", 0, 0, str(e))
                err.strerror = (f"cannot start IO thread {i + 1} of {self.threads} ({e}): an "
                                f"address-space or thread limit (ulimit -v / -u) leaves no room "
                                f"for another thread's stack; raise the limit or use fewer IO "
                                f"threads (io_threads)")
                raise err from None

    # -- public API ----------------------------------------------------------------------------
    def submit_read(self, path, offset: int, buf, *, checksum: bool | str = False,
                    on_done: Callable[[IOHandle], None] | None = None,
                    start: bool = True) -> IOHandle:
        """Read len(buf) bytes of `path` starting at `offset` into `buf` (a contiguous CPU tensor
        or writable buffer). Reading past the end of the file is an error.

        checksum: compute `handle.crc32`, the CRC of the bytes (True: of kind CHECKSUM, or
        name one: "crc32c" / "crc32"). on_done(handle): runs in a
        worker once the IO is over, successful or not (`handle.error`); what it raises becomes
        the handle's error. start=False: open the file now (pinning the inode the path names
        at this moment) but queue nothing until `start(handle)`, which never blocks on a lock
        the caller holds; such a handle must be started."""
        return self._submit("read", path, offset, buf, checksum, False, on_done, start)

    def submit_write(self, path, offset: int, buf, *, checksum: bool | str = False,
                     fsync: bool = False,
                     on_done: Callable[[IOHandle], None] | None = None,
                     start: bool = True) -> IOHandle:
        """Write `buf` into `path` at `offset` (the file is created if missing, never truncated).
        `buf` must not change until the handle is done. With `fsync`, the file is fsynced
        before the handle completes. Other arguments as for `submit_read`."""
        return self._submit("write", path, offset, buf, checksum, fsync, on_done, start)

    def start(self, h: IOHandle) -> IOHandle:
        """Queue a handle made with start=False. Blocks while the queue is full."""
        if h._started:
            raise RuntimeError(f"{h!r} was already started")
        if self._closed:
            for fd in h._fds:
                os.close(fd)
            h._fds = []
            raise RuntimeError("IOEngine is closed")
        h._started = True
        with self._lock:
            self._inflight += 1
        if not h._tasks:
            self._complete(h)
            return h
        for i, (foff, moff, n, kind) in enumerate(h._tasks):
            with self._lock:
                while len(self._queue) >= self.queue_depth:
                    self._has_room.wait()
                self._queue.append((h, i, foff, moff, n, kind))
                self._has_work.notify()
        return h

    @staticmethod
    def wait_all(handles: Iterable[IOHandle], timeout: float | None = None) -> None:
        """Wait for every handle, then raise the first failure (so no IO is still running on
        any of the buffers when an exception reaches the caller)."""
        first = None
        for h in handles:
            try:
                h.wait(timeout)
            except TimeoutError:
                raise
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first

    def drain(self) -> None:
        """Block until every submitted request has finished."""
        with self._lock:
            while self._inflight:
                self._idle.wait()

    def close(self) -> None:
        """Finish queued work, then stop the workers. Idempotent."""
        if self._closed:
            return
        self.drain()
        with self._lock:
            self._closed = True
            self._has_work.notify_all()
        for w in self._workers:
            w.join()

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def direct_supported(self, path) -> bool:
        """Whether O_DIRECT would be used for files at `path` (a file, or a directory, which is
        probed with a temporary file)."""
        if self.direct is False:
            return False
        path = os.fspath(path)
        if os.path.isdir(path):
            fd, probe = tempfile.mkstemp(dir=path, prefix=".direct-probe-")
            os.close(fd)
            try:
                return self.direct_supported(probe)
            finally:
                os.unlink(probe)
        fd = self._open_direct(path, os.O_RDONLY, os.stat(path).st_dev)
        if fd is None:
            return False
        os.close(fd)
        return True

    # -- submission ----------------------------------------------------------------------------
    def _submit(self, op, path, offset, buf, checksum, fsync, on_done, start) -> IOHandle:
        if self._closed:
            raise RuntimeError("IOEngine is closed")
        path = os.fspath(path)
        mv, addr = _buffer_view(buf, writable=(op == "read"))
        if offset < 0:
            raise ValueError(f"{path}: negative offset {offset}")
        h = IOHandle(op, path, offset, len(mv), buf)
        h._mem, h._addr, h._fsync, h._on_done = mv, addr, fsync, on_done
        flags = os.O_RDONLY if op == "read" else os.O_WRONLY | os.O_CREAT
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise IOEngineError(op, path, offset, len(mv), f"cannot open: {os_reason(e)}",
                                e.errno) from None
        h._fds.append(fd)
        direct_fd = None
        if self.direct is not False and len(mv) >= ALIGN:
            # Reopen through /proc so both descriptors surely name the same inode, even if the
            # path is renamed over in between.
            same = f"/proc/self/fd/{fd}" if os.path.exists("/proc/self/fd") else path
            try:
                direct_fd = self._open_direct(same, flags & ~os.O_CREAT, os.fstat(fd).st_dev,
                                              shown=path)
                if direct_fd is None and self.direct is True:
                    raise IOEngineError(op, path, offset, len(mv), "O_DIRECT is not supported "
                                        "by this filesystem (use direct='auto')", errno_mod.EINVAL)
            except BaseException:
                os.close(fd)
                raise
            if direct_fd is not None:
                h._fds.append(direct_fd)
        h._fd, h._direct_fd = fd, direct_fd
        tasks = self._plan(offset, len(mv), addr, direct_fd is not None)
        h._lens = [t[2] for t in tasks]
        if checksum:
            h.checksum = CHECKSUM if checksum is True else checksum
            if h.checksum not in CRC_FUNCS:
                raise ValueError(f"checksum {h.checksum!r} is not available here (have: "
                                 f"{', '.join(CRC_FUNCS)}); pip install crc32c")
            h._crc_fn = CRC_FUNCS[h.checksum]
        h._crcs = [0] * len(tasks) if checksum else None
        h._pending = len(tasks)
        h._tasks = tasks
        return self.start(h) if start else h

    def _open_direct(self, path: str, flags: int, dev: int, shown: str | None = None) -> int | None:
        if self._direct_ok.get(dev) is False:
            return None
        try:
            fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno_mod.EINVAL:
                raise IOEngineError("open", shown or path, 0, 0, os_reason(e), e.errno) from None
            self._direct_ok[dev] = False
            return None
        self._direct_ok[dev] = True
        return fd

    def _plan(self, foff: int, n: int, addr: int, direct: bool) -> list[tuple[int, int, int, int]]:
        """Tasks (file offset, offset in buffer, length, kind) in file order."""
        block, end, tasks = self.block_bytes, foff + n, []
        if not direct:
            return [(foff + s, s, min(block, n - s), _BUFFERED) for s in range(0, n, block)]
        a0 = min(-(-foff // ALIGN) * ALIGN, end)
        a1 = max(end // ALIGN * ALIGN, a0)
        if a0 > foff:
            tasks.append((foff, 0, a0 - foff, _BUFFERED))
        kind = _DIRECT if (addr + a0 - foff) % ALIGN == 0 else _BOUNCE
        tasks += [(s, s - foff, min(block, a1 - s), kind) for s in range(a0, a1, block)]
        if end > a1:
            tasks.append((a1, a1 - foff, end - a1, _BUFFERED))
        return tasks

    # -- workers -------------------------------------------------------------------------------
    def _work(self) -> None:
        bounce: list = []  # this thread's page-aligned bounce buffer, made on first need
        while True:
            with self._lock:
                while not self._queue:
                    if self._closed:
                        return
                    self._has_work.wait()
                h, i, foff, moff, n, kind = self._queue.popleft()
                self._has_room.notify()
            err = None
            if h.error is None:
                try:
                    self._do(h, i, foff, moff, n, kind, bounce)
                except BaseException as e:  # noqa: BLE001 - reported through the handle
                    err = e
            self._block_done(h, err)

    def _do(self, h: IOHandle, i: int, foff: int, moff: int, n: int, kind: int, bounce: list):
        view = h._mem[moff:moff + n]
        if kind == _BOUNCE:  # through this thread's aligned buffer, a chunk at a time
            if not bounce:
                t = aligned_empty(min(self.block_bytes, BOUNCE_BYTES))
                bounce += [tensor_bytes(t), t.data_ptr(), t]
            staging, src_or_dst = bounce[0], bounce[1]
            if h.op == "write" and h._crcs is not None:
                h._crcs[i] = h._crc_fn(view)
            for c in range(0, n, len(staging)):
                k = min(len(staging), n - c)
                if h.op == "write":
                    ctypes.memmove(src_or_dst, h._addr + moff + c, k)  # ctypes drops the GIL
                    self._move(h, h._direct_fd, staging[:k], foff + c)
                else:
                    self._move(h, h._direct_fd, staging[:k], foff + c)
                    ctypes.memmove(h._addr + moff + c, src_or_dst, k)
            if h.op == "read" and h._crcs is not None:
                h._crcs[i] = h._crc_fn(view)
            return
        fd = h._direct_fd if kind == _DIRECT else h._fd
        if h.op == "write" and h._crcs is not None:
            h._crcs[i] = h._crc_fn(view)
        self._move(h, fd, view, foff)
        if h.op == "read" and h._crcs is not None:
            h._crcs[i] = h._crc_fn(view)

    def _move(self, h: IOHandle, fd: int, view: memoryview, foff: int) -> None:
        """Move all of `view` at file offset `foff`, looping over short transfers. A direct
        transfer that stops off alignment, or that the filesystem rejects with EINVAL, finishes
        through the buffered descriptor."""
        done, n, write = 0, len(view), h.op == "write"
        while done < n:
            try:
                k = (os.pwritev if write else os.preadv)(fd, [view[done:]], foff + done)
            except OSError as e:
                if fd == h._direct_fd and fd != h._fd and e.errno == errno_mod.EINVAL:
                    fd = h._fd
                    continue
                raise IOEngineError(h.op, h.path, foff + done, n - done, os_reason(e),
                                    e.errno, h) from None
            if k == 0:
                size = os.fstat(h._fd).st_size
                raise IOEngineError(h.op, h.path, foff + done, n - done,
                                    f"unexpected end of file: the file is {size} bytes "
                                    f"(truncated?)", None, h)
            done += k
            if fd == h._direct_fd and done % ALIGN:
                fd = h._fd

    def _block_done(self, h: IOHandle, err: BaseException | None) -> None:
        with self._lock:
            if err is not None and h.error is None:
                h.error = err
            h._pending -= 1
            last = h._pending == 0
        if last:
            self._complete(h)

    def _complete(self, h: IOHandle) -> None:
        if h.error is None and h._fsync:
            try:
                os.fsync(h._fd)
            except OSError as e:
                h.error = IOEngineError("fsync", h.path, h.offset, h.nbytes, os_reason(e), e.errno)
        for fd in h._fds:
            os.close(fd)
        h._fds = []
        if h.error is None and h._crcs is not None:
            crc = 0
            for c, n in zip(h._crcs, h._lens):
                crc = crc_combine(crc, c, n, h.checksum)
            h.crc32 = crc
        if h._on_done is not None:
            try:
                h._on_done(h)
            except BaseException as e:  # noqa: BLE001 - the callback's verdict wins
                h.error = e
        h._mem = h._buf = None
        h._tasks = []
        with self._lock:
            if h.error is None:
                if h.op == "read":
                    self.bytes_read += h.nbytes
                else:
                    self.bytes_written += h.nbytes
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()
        h._event.set()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine: the CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    return crc_combine(crc1, crc2, len2, "crc32")
