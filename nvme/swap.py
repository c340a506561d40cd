"""Swap store: a directory of swap files holding named flat tensors, moved by an IOEngine.

Layout of a store directory:
  LOCK                    flock()ed exclusively while a SwapStore has the directory open
                          (holds "offload-swap-lock <pid>"; a LOCK with other content is
                          someone else's file and is refused, never overwritten)
  manifest.json           {"format", "step", "tensors": {name: entry}}, replaced atomically
  <name>.safetensors      one standard safetensors file per name (data 4 KiB-aligned), whose
                          __metadata__ carries the CRC-32 of the tensor's bytes
  <name>.safetensors.tmp  a write in progress (deleted when a store opens the directory, for
                          names the store's own manifest or files know: nothing else in the
                          directory is ever touched, so it may be shared with other files)

A write goes to the .tmp name through the engine (the CRC is taken block by block as the data
goes out), then the header with the CRC is written, the file fsynced, renamed over the real
name, and the directory fsynced. So a crash at any moment leaves under each real name either
the previous complete file or the new complete file, and each file carries its own checksum.
The in-memory state (what `info`/`read_into` see) changes only after the rename: a failed
write leaves the store exactly as it was. Because each file is self-describing, the files are
the truth on open; the manifest adds the step counter and remembers which names must exist.

Reads check the CRC by policy: "cold" (default) verifies the first read of every tensor that
this store did not write itself, "always", or "never". A read of a name with a write still in
flight copies the data from the write's source tensor, so it always sees the newest value.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import threading
from functools import partial

import torch

from nvme.format import (NAME_FROM_DTYPE, FormatError, fsync_dir, header_bytes, read_header,
                         tensor_bytes)
from nvme.io import CHECKSUM, IOEngine, IOEngineError, IOHandle, aligned_empty, os_reason
# the files' side (entries, names, checksum kinds, the lock), re-exported: callers import them here
from nvme.swap_files import (FORMAT, LOCK, MANIFEST, SUFFIX, TMP, ChecksumError, SwapEntry,
                             SwapError, checksum_kind, file_name, take_store_lock)

__all__ = ["SwapStore", "SwapEntry", "SwapError", "ChecksumError", "file_name", "FORMAT", "LOCK",
           "MANIFEST", "SUFFIX", "TMP"]


def _gib(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.1f} {unit})"
    return f"{n} bytes"


class _Pending:
    """A write in flight: its source tensor (read-after-write serves from it) and space held."""

    def __init__(self, tensor: torch.Tensor, reserve: int):
        self.tensor, self.reserve = tensor, reserve
        self.finished = threading.Event()


class SwapStore:
    """Named flat tensors in swap files under `directory`, with write-behind and read-ahead.

    engine: the IOEngine to use (a default one is made, and closed with the store, if None).
    verify: "cold" | "always" | "never" checksum policy for reads (see module docstring).
    durable: fsync files and the directory around each rename (off: atomic against process
    crashes, not against power loss).
    """

    def __init__(self, directory, engine: IOEngine | None = None, verify: str | bool = "cold",
                 durable: bool = True):
        self.dir = os.path.abspath(os.fspath(directory))
        self.verify = self._policy(verify)
        self.durable = durable
        os.makedirs(self.dir, exist_ok=True)
        self._lock_fd = -1
        self._take_lock()
        self._own_engine = engine is None
        self.engine = engine or IOEngine()
        self._mutex = threading.Lock()
        self._entries: dict[str, SwapEntry] = {}
        self._broken: dict[str, str] = {}   # name -> why it cannot be read
        self._warm: set[str] = set()        # names whose bytes this session wrote or verified
        self._pending: dict[str, _Pending] = {}
        self._handles: list[IOHandle] = []  # write handles not yet collected by flush()
        self._step = 0
        self._closed = False
        try:
            self._load()
        except BaseException:
            self._release()
            raise

    # -- opening -------------------------------------------------------------------------------
    @staticmethod
    def _policy(verify) -> str:
        if isinstance(verify, bool):
            verify = "always" if verify else "never"
        verify = {"on": "always", "off": "never"}.get(verify, verify)
        if verify not in ("cold", "always", "never"):
            raise ValueError("verify must be 'cold', 'always' or 'never' ('on'/'off', True/False)")
        return verify

    def _take_lock(self) -> None:
        self._lock_fd = take_store_lock(self.dir)

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = -1
        if getattr(self, "_own_engine", False):
            self.engine.close()

    def _load(self) -> None:
        mpath = os.path.join(self.dir, MANIFEST)
        listed: dict[str, SwapEntry] = {}
        if os.path.exists(mpath):
            try:
                with open(mpath) as f:
                    m = json.load(f)
                if m.get("format") != FORMAT:
                    raise ValueError(f"format is {m.get('format')!r}, expected {FORMAT!r}")
                self._step = int(m["step"])
                listed = {n: SwapEntry.from_json(n, d) for n, d in m["tensors"].items()}
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                why = ("nested too deeply" if isinstance(e, RecursionError) else
                       f"missing or unknown key {e}" if isinstance(e, KeyError) else
                       "wrong structure" if isinstance(e, AttributeError) else str(e)[:200])
                raise SwapError(errno_mod.EINVAL, f"swap manifest {mpath} is unreadable: {why} "
                                                  f"(not a manifest this program wrote, or "
                                                  f"damaged; move it away to start afresh)") from None
        files, tmps = set(), []
        for f in os.listdir(self.dir):
            if f.endswith(SUFFIX + TMP):
                tmps.append(f)
            elif f.endswith(SUFFIX):
                files.add(f)
        # The files are the truth: each names its tensor and carries its checksum.
        for f in sorted(files):
            try:
                infos, meta = read_header(os.path.join(self.dir, f))
            except FormatError as e:
                for n, e_ in listed.items():
                    if e_.file == f:
                        self._broken[n] = f"its file's header is damaged: {e}"
                continue
            if len(infos) != 1 or meta.get("format") != FORMAT or "crc32" not in meta:
                continue  # not one of ours
            (info,) = infos.values()
            try:
                kind = checksum_kind(meta.get("checksum", "crc32"))
            except ValueError:
                continue  # not readable here: listed names are reported as broken below
            self._entries[info.name] = SwapEntry(info.name, info.dtype, info.shape, info.nbytes,
                                                 int(meta["crc32"], 16), f, info.offset, kind)
        # a write that never reached its rename — of a tensor this store knows; a .tmp file
        # under any other name is not ours and stays
        known = {e.file for e in listed.values()} | {e.file for e in self._entries.values()}
        for f in tmps:
            if f[:-len(TMP)] in known:
                os.unlink(os.path.join(self.dir, f))
        for n, e in listed.items():
            if n not in self._entries:
                self._entries[n] = e
                self._broken.setdefault(n, f"its file {os.path.join(self.dir, e.file)} is "
                                               f"missing or not a swap file")

    # -- manifest ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._mutex:
            return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> SwapEntry:
        """The last successfully written (renamed) version of `name`."""
        with self._mutex:
            e = self._entries.get(name)
        if e is None:
            raise KeyError(f"swap store {self.dir} has no tensor named {name!r}")
        return e

    @property
    def step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        """Set the step counter; it reaches disk with the manifest at commit() / close()."""
        self._step = int(step)

    def commit(self, step: int | None = None) -> None:
        """Wait for all writes (raising the first failure), then atomically replace the manifest
        with the current names, shapes, dtypes, sizes, checksums and step."""
        if step is not None:
            self.set_step(step)
        self.flush()
        self._write_manifest()

    def _write_manifest(self) -> None:
        with self._mutex:
            body = {"format": FORMAT, "step": self._step,
                    "tensors": {n: e.to_json() for n, e in sorted(self._entries.items())}}
        path = os.path.join(self.dir, MANIFEST)
        tmp = path + TMP
        data = json.dumps(body, indent=1).encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(self.dir)
        except OSError as e:
            try:  # the previous manifest stays; no half-written temporary is left beside it
                os.unlink(tmp)
            except OSError:
                pass
            raise SwapError(e.errno, f"writing swap manifest {path} ({len(data)} bytes at offset "
                                     f"0) failed: {os_reason(e)}") from None

    # -- space ---------------------------------------------------------------------------------
    def free_bytes(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def stored_bytes(self) -> int:
        """Bytes of this store's files on disk now (what rewriting every tensor reuses)."""
        total = 0
        with self._mutex:
            files = [e.file for e in self._entries.values()]
        for f in files:
            try:
                total += os.stat(os.path.join(self.dir, f)).st_size
            except OSError:
                pass
        return total

    def preflight(self, total_bytes: int) -> int:
        """Check that `total_bytes` more can be written here; returns the free bytes. The error
        says how much is needed and how much is free."""
        free = self.free_bytes()
        with self._mutex:
            held = sum(p.reserve for p in self._pending.values())
        if total_bytes + held > free:
            more = f" plus {_gib(held)} held by writes in flight" if held else ""
            raise SwapError(errno_mod.ENOSPC, f"swap directory {self.dir} needs {_gib(total_bytes)}"
                                              f"{more}, but only {_gib(free)} are free there")
        return free

    # -- writes --------------------------------------------------------------------------------
    def write(self, name: str, tensor: torch.Tensor) -> IOHandle:
        """Start writing `tensor` (CPU) as `name`, replacing any previous version atomically.
        Returns at once (after any earlier write of the same name has finished); the tensor
        must not be modified until the handle's wait() returns."""
        self._check_open()
        if tensor.device.type != "cpu":
            raise ValueError(f"swap write of {name!r}: tensor is on {tensor.device}, need CPU")
        if tensor.dtype not in NAME_FROM_DTYPE:
            raise ValueError(f"swap write of {name!r}: dtype {tensor.dtype} is not supported")
        t = tensor.detach()
        t = t if t.is_contiguous() else t.contiguous()
        header = header_bytes({name: t}, self._meta(0))
        need = len(header) + t.numel() * t.element_size()
        final = os.path.join(self.dir, file_name(name))
        tmp = final + TMP
        self.preflight(need)
        pending = _Pending(t, need)
        while True:  # one write per name at a time: wait for the previous one, then claim it
            with self._mutex:
                prev = self._pending.get(name)
                if prev is None:
                    self._pending[name] = pending
                    break
            prev.finished.wait()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            os.close(fd)
            h = self.engine.submit_write(tmp, len(header), t, checksum=True, on_done=partial(
                self._finish_write, name, t, tmp, final, len(header), pending))
        except BaseException as e:
            self._abandon(name, tmp, pending)
            if isinstance(e, OSError):
                raise self._write_error(name, final, e) from e
            raise
        with self._mutex:
            self._handles = [x for x in self._handles if not x.done()] + [h]
        return h

    @staticmethod
    def _meta(crc: int, checksum: str = CHECKSUM) -> dict[str, str]:
        # fixed width for one checksum kind: the header's size is known before the CRC is
        return {"format": FORMAT, "crc32": f"{crc:08x}", "checksum": checksum}

    def _write_error(self, name: str, final: str, e: BaseException) -> SwapError:
        err = getattr(e, "errno", None) or errno_mod.EIO
        return SwapError(err, f"swap write of {name!r} to {final} failed: {e}; the store "
                              f"still holds the previous version")

    def _finish_write(self, name, t, tmp, final, data_offset, pending, h: IOHandle) -> None:
        """Runs in an engine worker when the data is written (or failed)."""
        try:
            if h.error is not None:
                raise h.error
            header = header_bytes({name: t}, self._meta(h.crc32, h.checksum))
            if len(header) != data_offset:
                raise AssertionError("swap header size changed between planning and writing")
            fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            try:
                done = 0
                while done < len(header):
                    try:
                        done += os.pwrite(fd, header[done:], done)
                    except OSError as e:
                        raise IOEngineError("write", tmp, done, len(header) - done,
                                            os_reason(e), e.errno) from None
                if self.durable:
                    try:
                        os.fsync(fd)
                    except OSError as e:
                        raise IOEngineError("fsync", tmp, 0, data_offset + h.nbytes,
                                            os_reason(e), e.errno) from None
            finally:
                os.close(fd)
            entry = SwapEntry(name, t.dtype, tuple(t.shape), h.nbytes, h.crc32,
                              os.path.basename(final), data_offset, h.checksum)
            with self._mutex:
                os.replace(tmp, final)  # the commit point for this tensor
                self._entries[name] = entry
                self._broken.pop(name, None)
                self._warm.add(name)
                del self._pending[name]
            pending.finished.set()
            if self.durable:
                fsync_dir(self.dir)
        except BaseException as e:
            if not pending.finished.is_set():
                self._abandon(name, tmp, pending)
            if isinstance(e, OSError) and not isinstance(e, SwapError):
                raise self._write_error(name, final, e) from e
            raise

    def _abandon(self, name: str, tmp: str, pending: _Pending) -> None:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        with self._mutex:
            if self._pending.get(name) is pending:
                del self._pending[name]
        pending.finished.set()

    def flush(self) -> None:
        """Wait for every write in flight; raise the first failure among them (each failure is
        also raised by its own handle)."""
        with self._mutex:
            handles, self._handles = self._handles, []
        try:
            IOEngine.wait_all(handles)
        except SwapError:
            raise
        except OSError as e:
            raise SwapError(e.errno, str(e)) from e

    def remove(self, name: str) -> None:
        """Delete `name` and its file (after any write of it in flight)."""
        self._check_open()
        while True:
            with self._mutex:
                prev = self._pending.get(name)
                if prev is None:
                    e = self._entries.pop(name, None)
                    self._broken.pop(name, None)
                    self._warm.discard(name)
                    break
            prev.finished.wait()
        if e is None:
            raise KeyError(f"swap store {self.dir} has no tensor named {name!r}")
        try:
            os.unlink(os.path.join(self.dir, e.file))
        except FileNotFoundError:
            pass
        if self.durable:
            fsync_dir(self.dir)

    # -- reads ---------------------------------------------------------------------------------
    def read_into(self, name: str, out: torch.Tensor, verify: str | bool | None = None) -> IOHandle:
        """Start reading `name` into `out` (contiguous CPU, same byte size). Returns a handle;
        `out` is filled once wait() returns. A write of `name` still in flight is served from
        its source tensor (done by the time this returns)."""
        self._check_open()
        policy = self.verify if verify is None else self._policy(verify)
        nbytes = out.numel() * out.element_size()
        with self._mutex:
            pending = self._pending.get(name)
            entry = self._entries.get(name) if pending is None else None
            if pending is None and entry is None:
                raise KeyError(f"swap store {self.dir} has no tensor named {name!r}")
            have = pending.tensor.numel() * pending.tensor.element_size() if pending else entry.nbytes
            if nbytes != have or not out.is_contiguous() or out.device.type != "cpu":
                raise ValueError(f"swap read of {name!r}: tensor is {have} bytes, buffer is "
                                 f"{nbytes} bytes {'' if out.is_contiguous() else 'non-contiguous '}"
                                 f"on {out.device} (need contiguous CPU of the same size)")
            if pending is not None:
                # Copied under the mutex: the write cannot finish (and free the caller to reuse
                # its tensor) until the copy is over.
                if nbytes:
                    tensor_bytes(out)[:] = tensor_bytes(pending.tensor)
            else:
                if name in self._broken:
                    raise SwapError(errno_mod.ENOENT, f"swap store {self.dir}: cannot read "
                                                      f"{name!r}: {self._broken[name]}")
                check = policy == "always" or (policy == "cold" and name not in self._warm)
                path = os.path.join(self.dir, entry.file)
                try:  # opened under the mutex: pins the file a concurrent rename may replace
                    h = self.engine.submit_read(path, entry.offset, out,
                                                checksum=entry.checksum if check else False,
                                                on_done=partial(self._finish_read, entry, path, check),
                                                start=False)
                except OSError as e:
                    raise SwapError(e.errno, f"swap read of {name!r}: {e}") from e
        if pending is not None:
            return IOHandle.finished("read", os.path.join(self.dir, file_name(name)), 0, nbytes)
        return self.engine.start(h)

    def _finish_read(self, entry: SwapEntry, path: str, checked: bool, h: IOHandle) -> None:
        if h.error is not None:
            raise SwapError(getattr(h.error, "errno", None) or errno_mod.EIO,
                            f"swap read of {entry.name!r}: {h.error}") from h.error
        if not checked:
            return
        if h.crc32 != entry.crc32:
            raise ChecksumError(errno_mod.EIO, (
                f"checksum mismatch in swap tensor {entry.name!r}: {path}, {entry.nbytes} bytes "
                f"at offset {entry.offset}: recorded {entry.checksum} {entry.crc32:08x}, read back "
                f"{h.crc32:08x}; the file is corrupt"))
        with self._mutex:
            self._warm.add(entry.name)

    def read(self, name: str, verify: str | bool | None = None) -> torch.Tensor:
        """Read `name` into a new page-aligned tensor of its shape and dtype (blocking)."""
        with self._mutex:
            pending = self._pending.get(name)
            src = pending.tensor if pending else None
        e = None if src is not None else self.info(name)
        out = aligned_empty(tuple(src.shape) if e is None else e.shape,
                            src.dtype if e is None else e.dtype)
        self.read_into(name, out, verify).wait()
        return out

    # -- closing -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SwapError(errno_mod.EBADF, f"swap store {self.dir} is closed")

    def close(self) -> None:
        """Finish all writes, write the manifest, release the lock (and an own engine)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            try:
                self._write_manifest()
            finally:
                self._release()

    def destroy(self) -> int:
        """Close the store and delete what it created: its tensors' files, the manifest and the
        lock (and the directory when that leaves it empty). Returns the bytes freed. Other files
        in the directory are left alone."""
        self.flush()
        freed = self.stored_bytes()
        with self._mutex:
            files = [e.file for e in self._entries.values()]
            self._entries.clear()
        for f in files:
            try:
                os.unlink(os.path.join(self.dir, f))
            except FileNotFoundError:
                pass
        self._closed = True
        try:
            os.unlink(os.path.join(self.dir, MANIFEST))
        except FileNotFoundError:
            pass
        try:
            os.unlink(os.path.join(self.dir, LOCK))  # still held: no other store can be in it
        finally:
            self._release()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass  # other files live there
        return freed

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_lock_fd", -1) >= 0 and not getattr(self, "_closed", True):
            os.close(self._lock_fd)
            self._lock_fd = -1
