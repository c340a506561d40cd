"""The safetensors file layout: write named tensors, read any tensor's bytes into a given buffer.

A .safetensors file is `u64 little-endian header length N`, `N bytes of JSON`, then the data
section. The JSON maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}`
(offsets relative to the data section) plus an optional `"__metadata__"` dict of str -> str.

Files written here pad the JSON header with spaces (the format allows trailing whitespace) so
that the data section starts on a 4 KiB boundary: a tensor that starts the data section, or any
tensor whose offset is a multiple of 4 KiB, can then be read with O_DIRECT straight into an
aligned buffer. The same reader serves our swap files and Hugging Face checkpoint shards.

Headers come from strangers (downloaded checkpoints), so parsing is defensive: the header
length is bounded before anything is allocated, every entry is type- and range-checked, and
ranges may neither overlap nor point past the end of the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

DATA_ALIGN_BYTES = 4096
# A header this large is already absurd (a 1000-tensor header is ~100 KB); bounding it first
# means a hostile length field can never make us allocate gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_FROM_NAME: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPE_FROM_NAME[_name] = getattr(torch, _attr)
NAME_FROM_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_FROM_NAME.items()}


class FormatError(ValueError):
    """A .safetensors file (or a request against one) is malformed; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("need a contiguous CPU tensor")
    flat = t.reshape(-1)  # a view for contiguous tensors; also handles 0-d
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


# safetensors metadata holding {tensor name: CRC of its bytes} as JSON, under the key of the CRC
# used: written by write_file(checksums=True) (caches, exported checkpoints), verified by every
# whole-tensor read (SafetensorsFile.read_into) and by range readers given it
# (TensorRange.checksum); the file stays a standard safetensors file (other readers ignore
# unknown metadata). CRC-32C (hardware, the crc32c package) where it is installed, else zlib's
# CRC-32 (the GPU machine may lack the package: its files then say so)
CHECKSUM_KEYS = {"crc32c": "offload.crc32c", "crc32": "offload.crc32"}


def _crc_func(kind: str):
    if kind == "crc32":
        return zlib.crc32
    try:
        from crc32c import crc32c
    except ImportError:
        return None
    return crc32c


WRITE_CHECKSUM = "crc32c" if _crc_func("crc32c") is not None else "crc32"


def crc_of(t: torch.Tensor, kind: str | None = None) -> int:
    """The CRC `kind` ("crc32c": Castagnoli; "crc32": zlib's; default WRITE_CHECKSUM) of a
    contiguous CPU tensor's bytes."""
    return _crc_func(kind or WRITE_CHECKSUM)(tensor_bytes(t)) if t.numel() else 0


def stored_checksums(metadata: Mapping[str, str] | None, path: str) -> tuple[str, dict[str, int]]:
    """(CRC kind, {tensor name: CRC}) a file's metadata carries ({} when it carries none)."""
    for kind, key in CHECKSUM_KEYS.items():
        raw = (metadata or {}).get(key)
        if raw is None:
            continue
        if _crc_func(kind) is None:
            raise FormatError(f"{path}: written with CRC-32C checksums, which need the crc32c "
                              f"package here to be checked (pip install crc32c)")
        try:
            sums = json.loads(raw)
        except ValueError:
            sums = None
        if not isinstance(sums, dict) or not all(type(v) is int and 0 <= v < 1 << 32
                                                 for v in sums.values()):
            raise FormatError(f"{path}: its {key!r} metadata is not a map of CRC values; the file "
                              f"is damaged")
        return kind, sums
    return WRITE_CHECKSUM, {}


def checksum_metadata(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, int]]:
    """(the metadata entry write_file(checksums=True) adds, the CRCs in it): each tensor's CRC
    (WRITE_CHECKSUM) under that kind's CHECKSUM_KEYS key."""
    sums = {n: crc_of(t.detach().to("cpu").contiguous(), WRITE_CHECKSUM) for n, t in tensors.items()}
    return {CHECKSUM_KEYS[WRITE_CHECKSUM]: json.dumps(sums, separators=(",", ":"))}, sums


def check_crc(path: str, name: str, got: int, want: int) -> None:
    """Raise FormatError when tensor `name`'s bytes (CRC `got`) are not the ones written (`want`)."""
    if got != want:
        raise FormatError(f"{path}: tensor {name!r} fails its checksum (CRC written {want:08x}, "
                          f"read {got:08x}): the file is damaged")


def _object_without_duplicates(path: str):
    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            if key in out:  # json.loads would keep the last one silently; other readers the first
                raise FormatError(f"{path}: header has the key {key[:200]!r} twice")
            out[key] = value
        return out
    return hook


# The product of a shape's dimensions must fit torch's int64 sizes and strides even when one of
# them is 0 (a zero-byte tensor with dimensions [0, 2**62, 4] has no bytes to check against).
_MAX_NUMEL = 2**62


def _parse_header(path: str, raw: bytes, file_bytes: int, data_start: int
                  ) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    try:
        header = json.loads(raw, object_pairs_hook=_object_without_duplicates(path))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        # ValueError also covers integers too long to convert, RecursionError deep nesting
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise FormatError(f"{path}: header is not valid JSON ({what})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    data_bytes = file_bytes - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name[:200]!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{where}: entry must have exactly dtype, shape, data_offsets")
        dtype_name = entry["dtype"]
        dtype = DTYPE_FROM_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise FormatError(f"{where}: unknown dtype {str(dtype_name)[:40]!r} "
                              f"(known: {', '.join(DTYPE_FROM_NAME)})")
        shape, offs = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"{where}: shape must be a list of non-negative integers, "
                              f"got {str(shape)[:80]}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int for o in offs) or not 0 <= offs[0] <= offs[1]):
            raise FormatError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                              f"got {str(offs)[:80]}")
        if offs[1] > data_bytes:
            raise FormatError(f"{where}: data_offsets {offs} run past the end of the file "
                              f"(data section is {data_bytes} bytes; truncated download?)")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(max(d, 1) for d in shape) > _MAX_NUMEL // itemsize:
            raise FormatError(f"{where}: shape {str(shape)[:80]} is absurdly large")
        nbytes = math.prod(shape) * itemsize
        if nbytes != offs[1] - offs[0]:
            raise FormatError(f"{where}: shape {shape} of {dtype_name} needs {nbytes} bytes "
                              f"but data_offsets span {offs[1] - offs[0]}")
        infos[name] = TensorInfo(name, dtype, tuple(shape), data_start + offs[0], nbytes)
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos.values() if i.nbytes)
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise FormatError(f"{path}: tensors {name_a!r} and {name_b!r} overlap in the file")
    return infos, metadata


def open_regular(path: str) -> int:
    """Open `path` read-only, refusing anything but a regular file (a FIFO would block the open
    or the reads, a device or /proc file has no meaningful size). Symlinks are followed; callers
    that must stay inside a directory check the resolved path themselves."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; no effect on regular files
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise FormatError(f"{path}: cannot open ({e.strerror})") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise FormatError(f"{path}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{path}: not a regular file")
    return fd


def _read_header_fd(fd: int, path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    file_bytes = os.fstat(fd).st_size
    if file_bytes < 8:
        raise FormatError(f"{path}: file is {file_bytes} bytes, too short for a safetensors header")
    (header_bytes,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path))
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > file_bytes:
        raise FormatError(f"{path}: header length {header_bytes} is impossible for a "
                          f"{file_bytes}-byte file (not a safetensors file, or truncated)")
    raw = _pread_exact(fd, header_bytes, 8, path)
    return _parse_header(path, raw, file_bytes, 8 + header_bytes)


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a .safetensors header: ({name: TensorInfo}, metadata). Reads only the header bytes."""
    path = os.fspath(path)
    fd = open_regular(path)
    try:
        return _read_header_fd(fd, path)
    finally:
        os.close(fd)


def _pread_exact(fd: int, nbytes: int, offset: int, path: str) -> bytes:
    chunks, got = [], 0
    while got < nbytes:
        try:
            chunk = os.pread(fd, nbytes - got, offset + got)
        except OSError as e:
            raise FormatError(f"{path}: read of {nbytes - got} bytes at offset {offset + got} "
                              f"failed ({e.strerror})") from None
        if not chunk:
            raise FormatError(f"{path}: unexpected end of file at offset {offset + got} "
                              f"(wanted {nbytes} bytes from {offset})")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def preadinto(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill `buf` from the file at `offset`, looping over short reads; a short file is an error."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise FormatError(f"{path}: truncated: wanted {len(buf)} bytes at offset {offset}, "
                              f"file ends after {done}")
        done += n


def check_buffer(info: TensorInfo, out: torch.Tensor, path: str) -> None:
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"{path}: reading {info.name!r} needs a contiguous CPU buffer")
    if out.numel() * out.element_size() != info.nbytes:
        raise ValueError(f"{path}: tensor {info.name!r} is {info.nbytes} bytes "
                         f"{tuple(info.shape)} {info.dtype}, buffer is "
                         f"{out.numel() * out.element_size()} bytes")


class SafetensorsFile:
    """An open .safetensors file: its header, and reads of single tensors into caller buffers.

    `bytes_read` counts tensor bytes read through this object (the header is not counted), so
    callers and tests can check that reading one tensor touches only that tensor's bytes.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = -1
        self.bytes_read = 0
        fd = open_regular(self.path)
        try:  # the header and the reads come from the same open file, whatever the path becomes
            self.tensors, self.metadata = _read_header_fd(fd, self.path)
            self.checksum_kind, self.checksums = stored_checksums(self.metadata, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:  # __init__ may have failed before opening
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def read_into(self, name: str, out: torch.Tensor, engine=None) -> torch.Tensor:
        """Read tensor `name`'s bytes into `out` (contiguous CPU, same byte size; dtype may differ
        only if the caller wants raw bytes). Returns `out`. With an `nvme.IOEngine`, the read
        goes through it (O_DIRECT into `out` where alignment allows, split across threads)."""
        if engine is not None:
            self.submit_read(name, out, engine).wait()
        else:
            info = self.info(name)
            check_buffer(info, out, self.path)
            if info.nbytes:
                preadinto(self._fd, tensor_bytes(out), info.offset, self.path)
            self.bytes_read += info.nbytes
        self.verify(name, out)
        return out

    def read_bytes_into(self, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (contiguous CPU) with the bytes at absolute `offset`: part of a tensor,
        for a caller that splits one stored tensor into several (a fused MoE experts tensor, one
        range per expert). Not checked against a CRC-32C: the file keeps those for whole tensors."""
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"{self.path}: reading bytes at {offset} needs a contiguous CPU buffer")
        nbytes = out.numel() * out.element_size()
        if nbytes:
            preadinto(self._fd, tensor_bytes(out), offset, self.path)
        self.bytes_read += nbytes
        return out

    def verify(self, name: str, out: torch.Tensor) -> None:
        """Check tensor `name`'s bytes just read into `out` against the CRC-32C the file carries
        for it (nothing to check in a file written without checksums)."""
        want = self.checksums.get(name)
        if want is not None:
            check_crc(self.path, name, crc_of(out, self.checksum_kind), want)

    def submit_read(self, name: str, out: torch.Tensor, engine, **kw):
        """Start reading tensor `name` into `out` through `engine` (an `nvme.IOEngine`); returns
        its handle (`.wait()`). Extra keywords go to `engine.submit_read` (e.g. checksum)."""
        info = self.info(name)
        check_buffer(info, out, self.path)
        self.bytes_read += info.nbytes
        return engine.submit_read(self.path, info.offset, out, **kw)

    def read(self, name: str, engine=None) -> torch.Tensor:
        info = self.info(name)
        return self.read_into(name, torch.empty(info.shape, dtype=info.dtype), engine)


def _header_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
                  align_bytes: int) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in NAME_FROM_DTYPE:
            raise FormatError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAME_FROM_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(raw)) // align_bytes) * align_bytes - 8
    return struct.pack("<Q", padded) + raw + b" " * (padded - len(raw))


def header_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                 align_bytes: int = DATA_ALIGN_BYTES) -> bytes:
    """The length prefix plus space-padded JSON header `write_file` would write for `tensors`
    (in order, packed back to back): its length is where the data section starts."""
    return _header_bytes(tensors, metadata, align_bytes)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or create inside directory `path` durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str] | None = None, *, align_bytes: int = DATA_ALIGN_BYTES,
               atomic: bool = True, engine=None, checksums: bool = False) -> int:
    """Write `tensors` (in the given order) as a standard .safetensors file whose data section
    starts on an `align_bytes` boundary. With `atomic`, the bytes go to a temporary name, are
    fsynced, and are renamed over `path` (then the directory is fsynced), so a crash leaves
    either the old file or the complete new one. With an `nvme.IOEngine`, the tensors' bytes
    are written through it, all at once (O_DIRECT where aligned). With `checksums`, each
    tensor's CRC goes into the metadata (CHECKSUM_KEYS). Returns the file size."""
    path = os.fspath(path)
    if checksums:
        metadata = {**(metadata or {}), **checksum_metadata(tensors)[0]}
    header = _header_bytes(tensors, metadata, align_bytes)
    target = f"{path}.tmp.{os.getpid()}" if atomic else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = _write_all(fd, memoryview(header), target)
        if engine is not None:
            total += _write_with_engine(engine, target, len(header), tensors)
        else:
            for t in tensors.values():
                if t.numel():
                    cpu = t.detach().to("cpu").contiguous()
                    total += _write_all(fd, tensor_bytes(cpu), target)
        if atomic:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        if atomic:
            _unlink_quiet(target)
        raise
    os.close(fd)
    if atomic:
        os.replace(target, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return total


def _write_with_engine(engine, path: str, offset: int, tensors: Mapping[str, torch.Tensor]) -> int:
    handles, total = [], 0
    try:
        for t in tensors.values():
            cpu = t.detach().to("cpu").contiguous()
            nbytes = cpu.numel() * cpu.element_size()
            if nbytes:
                handles.append(engine.submit_write(path, offset, cpu))
            offset += nbytes
            total += nbytes
    finally:
        engine.wait_all(handles)  # even on error: no write may still touch the file afterwards
    return total


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically: a temporary name `<path>.tmp.<pid>`, fsync,
    rename over `path`; the temporary is removed if anything fails, so `path` always holds
    either the old complete file or the new one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: object, *, indent: int = 1,
                      sort_keys: bool = False) -> None:
    """`obj` as JSON, written like write_text_atomic."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def lock_pid_file(path: str, tag: str) -> int:
    """Open `path` (created if missing), flock() it exclusively without waiting and write
    "<tag> <pid>" into it; returns the descriptor (closing it, or the process ending, releases
    the lock). Another holder: BlockingIOError whose `holder` is the pid written there."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            busy = BlockingIOError(e.errno, f"{path} is locked")
            busy.holder = words[-1] if words else "unknown"
            raise busy from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{tag} {os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def held_lock(path: str, tag: str, wait_s: float, on_wait=None):
    """Hold `path` (lock_pid_file) for the block, waiting up to `wait_s` for another holder to
    let go: two processes that would build the same thing (a cache entry, generated weights)
    take turns, the second then finding it built. `on_wait(holder pid)` is called once when it
    has to wait. After `wait_s`: BlockingIOError (holder set)."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            fd = lock_pid_file(path, tag)
            break
        except BlockingIOError as busy:
            if time.monotonic() > deadline:
                raise
            if not waited and on_wait is not None:
                on_wait(busy.holder)
            waited = True
            time.sleep(0.1)
    try:
        yield
    finally:
        os.close(fd)


# the parts of a file `content_digest` reads besides its size: the first MiB (a header, its
# metadata and table of contents) and SAMPLES extents of SAMPLE_BYTES spread evenly to the end
DIGEST_HEAD_BYTES, DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES = 1 << 20, 64, 64 << 10


def content_digest(path: str) -> str:
    """What a cache built from the file `path` is keyed by: a BLAKE2b digest of its size, its
    first MiB and 64 extents of 64 KiB spread evenly over the rest (the last one ending at the
    file's end): 5 MiB read whatever the file's size, so a multi-GB checkpoint is keyed in
    milliseconds. Content, not name or modification time: the same bytes copied or touched key
    the same; another checkpoint of the same size at the same path does not (its weights differ
    in every extent). A change confined to bytes between the samples is not seen: the cache's
    own checksums (verified on every read) catch damage to the cache, not to its source."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode())
        h.update(f.read(DIGEST_HEAD_BYTES))
        if size > DIGEST_HEAD_BYTES:
            span = size - DIGEST_HEAD_BYTES - DIGEST_SAMPLE_BYTES
            for k in range(DIGEST_SAMPLES):
                at = DIGEST_HEAD_BYTES + max(0, span) * k // (DIGEST_SAMPLES - 1)
                h.update(os.pread(f.fileno(), DIGEST_SAMPLE_BYTES, at))
    return h.hexdigest()


def _write_all(fd: int, buf: memoryview, path: str) -> int:
    done = 0
    while done < len(buf):
        try:
            done += os.write(fd, buf[done:])
        except OSError as e:
            raise OSError(e.errno, f"writing {len(buf)} bytes to {path} failed at byte {done}: "
                                   f"{e.strerror}") from None
    return done


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def names_by_file(infos: Iterable[TensorInfo]) -> list[str]:
    """Names in file order (by offset): reading in this order is one sequential sweep."""
    return [i.name for i in sorted(infos, key=lambda i: i.offset)]
