"""glibc's allocation regime around the engine (offload/memory/tiers.py: large_frees_to_os): a low mmap
threshold while setting up, so block-sized temporaries go back to the OS, and afterwards one
below half the smallest block, so activations reuse heap memory (the fixed 1 MiB threshold kept
for the whole run made the plain training loop 1.3-1.4x slower in the same process;
docs/BENCHMARKS.md)."""

from __future__ import annotations

import sys

import pytest

import offload
from offload.memory.tiers import large_frees_to_os

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")


def test_the_set_up_regime_ends_with_the_outermost_set_up(tmp_path):
    """The low threshold holds during set-up only (nested set-ups count once), and the threshold
    left for training is chosen from the model's blocks. (Whether a given allocation then faults
    depends on what the heap already holds, so the speed effect is measured in
    scripts/bench_train.py --fresh, not asserted here.)"""
    from offload.memory import tiers

    with large_frees_to_os(8 << 20):
        with large_frees_to_os():  # nested (the engine building a streamer) counts once
            pass
        assert tiers._SETUP_DEPTH == 1
    assert tiers._SETUP_DEPTH == 0 and tiers._after_setup_bytes == 4 << 20
    from test_engine import MLP
    from offload.memory import tiers

    # after an engine's set-up the threshold sits below half its smallest block (block-sized
    # buffers still go back to the OS: RSS does not grow with depth), capped where glibc's own
    # adaptation stops
    model = MLP(d=2048, depth=2)  # layers of 16 MiB, and a small in/out block
    engine = offload.initialize(model, offload.OffloadConfig(offload="cpu", device="cpu", dtype="fp32"))
    smallest = min(b.numel for b in engine.blocks) * 4
    engine.close()
    assert tiers._after_setup_bytes == min(32 << 20, max(1 << 20, smallest // 2))
    with large_frees_to_os(64 << 20):  # a model of big blocks: glibc's 32 MiB cap
        pass
    assert tiers._after_setup_bytes == 32 << 20
