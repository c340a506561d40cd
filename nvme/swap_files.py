"""The swap directory's files (nvme/swap.py moves the data): what one swap file holds (its
`SwapEntry`), the file name a tensor name maps to, which checksum kinds can be read here, and
the directory's LOCK file. See nvme/swap.py for the layout and the write protocol."""

from __future__ import annotations

import errno as errno_mod
import hashlib
import os
from dataclasses import dataclass

import torch

from nvme.format import DTYPE_FROM_NAME, NAME_FROM_DTYPE, lock_pid_file
from nvme.io import CRC_FUNCS, os_reason

FORMAT = "offload-swap/1"
MANIFEST, LOCK, SUFFIX, TMP = "manifest.json", "LOCK", ".safetensors", ".tmp"
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class SwapError(OSError):
    """A swap store operation failed; the message says which store, tensor, file and why."""

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


class ChecksumError(SwapError):
    """The bytes read back do not match the checksum recorded when they were written."""


@dataclass(frozen=True)
class SwapEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc32: int
    file: str     # file name inside the store directory
    offset: int   # where the tensor's bytes start in that file
    checksum: str = "crc32"  # which CRC `crc32` is: "crc32c" (Castagnoli) or "crc32" (zlib)

    def to_json(self) -> dict:
        return {"dtype": NAME_FROM_DTYPE[self.dtype], "shape": list(self.shape),
                "nbytes": self.nbytes, "crc32": f"{self.crc32:08x}", "checksum": self.checksum,
                "file": self.file, "offset": self.offset}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "SwapEntry":
        # The file is always file_name(name): a manifest naming any other path (`../x`, `/etc/x`)
        # is not ours, and must never make remove() or a read touch a file outside the store.
        if d["file"] != file_name(name):
            raise ValueError(f"tensor {name[:200]!r} is listed in file {str(d['file'])[:200]!r}, "
                             f"expected {file_name(name)!r}")
        return cls(name, DTYPE_FROM_NAME[d["dtype"]], tuple(d["shape"]), int(d["nbytes"]),
                   int(d["crc32"], 16), str(d["file"]), int(d["offset"]),
                   checksum_kind(d.get("checksum", "crc32")))


def file_name(name: str) -> str:
    """A file name for tensor `name`: safe characters kept, others %-escaped (so the mapping is
    one-to-one); long names are cut and made unique with a hash."""
    safe = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    if safe.startswith("."):
        safe = "%2E" + safe[1:]
    if len(safe) > 180:
        safe = safe[:160] + "~" + hashlib.sha1(name.encode()).hexdigest()[:16]
    return safe + SUFFIX


LOCK_TEXT = "offload-swap-lock"


def _is_lock_text(text: str) -> bool:
    """A LOCK this program wrote: "offload-swap-lock <pid>" (or a bare pid, as before)."""
    words = text.split()
    return (len(words) == 2 and words[0] == LOCK_TEXT and words[1].isdigit()) or \
        (len(words) == 1 and words[0].isdigit())


def checksum_kind(name) -> str:
    if name not in ("crc32", "crc32c"):
        raise ValueError(f"unknown checksum kind {str(name)[:40]!r}")
    if name not in CRC_FUNCS:
        raise ValueError(f"written with {name} checksums, which need the crc32c package here "
                         f"(pip install crc32c)")
    return name


def take_store_lock(directory: str) -> int:
    """flock the store's LOCK file (writing our pid into it) and return its descriptor; a LOCK
    holding anything but ours is never overwritten, and a held lock names its holder."""
    path = os.path.join(directory, LOCK)
    held = b""
    try:  # what the file holds: a LOCK this program did not write is never overwritten
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            held = os.pread(fd, 256, 0)
        finally:
            os.close(fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise SwapError(e.errno, f"swap directory {directory}: cannot read {path}: "
                                 f"{os_reason(e)}") from None
    if held and not _is_lock_text(held.decode(errors="replace")):
        raise SwapError(errno_mod.EEXIST, f"swap directory {directory}: {path} is not a lock "
                                          f"file of this program (it holds other data) and "
                                          f"would be overwritten; move it away or choose "
                                          f"another directory")
    try:
        return lock_pid_file(path, LOCK_TEXT)
    except BlockingIOError as e:
        holder = getattr(e, "holder", "unknown")
        who = "this process" if holder == str(os.getpid()) else f"process {holder}"
        raise SwapError(e.errno, f"swap directory {directory} is locked by another "
                                 f"SwapStore in {who}; two stores must never share a swap "
                                 f"directory (close the other one, or use another "
                                 f"directory)") from None
    except OSError as e:
        raise SwapError(e.errno, f"swap directory {directory}: cannot lock {path}: "
                                 f"{os_reason(e)}") from None
