"""Block streamer: streamed forwards equal resident ones, for every tier, with delayed fetches,
out-of-order use, dtype conversion and a model that is not a Llama."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nvme.format import read_header, write_file
from offload.models import CheckpointReader, build_model, load_model, preset, save_pretrained
from offload.infer.plan import plan_inference, spread
from offload.models import load_streamed
from offload.stream.streamer import BlockStreamer, StreamError, TensorRange
from offload.memory.tiers import BudgetError

CFG = preset("tiny")
TIERS = {
    "device": ["device"] * 4,
    "cpu": ["cpu"] * 4,
    "nvme": ["nvme"] * 4,
    "mixed": ["device", "nvme", "cpu", "nvme"],
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(build_model(CFG, "cpu", torch.float32, source=11), path)
    return path


@pytest.fixture(scope="module")
def reference(ckpt):
    model = load_model(ckpt)  # plain resident execution: the reference
    ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, model(ids)


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("tiers", list(TIERS))
def test_streamed_forward_equals_resident(ckpt, reference, tiers, zero_copy):
    ids, want = reference
    with CheckpointReader(ckpt) as reader:
        # A delay in every fetch: without a correct wait the block would run on stale weights.
        model, streamer = load_streamed(reader, TIERS[tiers], device="cpu", dtype=torch.float32,
                                        zero_copy_host=zero_copy, fetch_delay_s=0.01)
        try:
            with torch.no_grad():
                for _ in range(3):  # later passes reuse slots filled by the cyclic prefetch
                    assert torch.equal(model(ids), want)
        finally:
            streamer.close()
    nvme = sum(t == "nvme" for t in TIERS[tiers])
    assert streamer.stats.fetches["nvme"] >= 3 * nvme
    if nvme:
        assert streamer.stats.moved_bytes["disk"] >= 3 * nvme * streamer.block_bytes(0)


@pytest.mark.parametrize("tiers", ["nvme", "mixed"])
def test_streamer_disk_probe_reads_the_streamed_blocks_and_leaves_it_usable(ckpt, reference, tiers):
    """The floor's disk probe reads the NVMe-tier blocks with the streamer itself (a full
    pipeline: more blocks than its depth in flight), and the model runs exactly as before."""
    from offload.infer.plan import streamer_disk_gbps
    ids, want = reference
    nvme = [i for i, t in enumerate(TIERS[tiers]) if t == "nvme"]
    with CheckpointReader(ckpt) as reader:
        model, streamer = load_streamed(reader, TIERS[tiers], device="cpu", dtype=torch.float32)
        try:
            gbps, nbytes = streamer_disk_gbps(streamer, min_seconds=0.05)
            ahead = min(streamer.depth["nvme"], len(streamer.slots) - 1, len(nvme))
            assert gbps > 0
            assert nbytes >= (ahead + 1) * streamer.block_bytes(nvme[0])
            assert nbytes == streamer.stats.moved_bytes["disk"]  # only NVMe-tier reads
            with torch.no_grad():
                for _ in range(2):
                    assert torch.equal(model(ids), want)
        finally:
            streamer.close()


def test_bf16_checkpoint_converted_after_read(tmp_path):
    save_pretrained(build_model(CFG, "cpu", torch.float32, source=3), tmp_path, dtype=torch.bfloat16)
    ref = load_model(tmp_path, dtype=torch.float32)  # converts bf16 -> fp32 on load
    ids = torch.arange(1, 12).view(1, 11)
    with CheckpointReader(tmp_path) as reader, torch.no_grad():
        model, streamer = load_streamed(reader, ["nvme", "cpu", "nvme", "device"], device="cpu",
                                        dtype=torch.float32, zero_copy_host=False)
        try:
            assert torch.equal(model(ids), ref(ids))
            # the disk moves stored (bf16) bytes: half of an fp32 slot per NVMe block fetched
            disk, fetched = streamer.stats.moved_bytes["disk"], streamer.stats.fetches["nvme"]
            assert fetched >= 2 and disk == fetched * streamer.block_bytes(0) // 2
        finally:
            streamer.close()


def test_explicit_api_reverse_schedule_and_out_of_order(ckpt):
    with CheckpointReader(ckpt) as reader:
        ref = build_model(CFG, "cpu", torch.float32, source=reader)
        model, streamer = load_streamed(reader, ["nvme"] * 4, device="cpu", dtype=torch.float32,
                                        fetch_delay_s=0.005)
    streamer.detach()  # drive it by hand, as training's backward would
    streamer.set_schedule([3, 2, 1, 0], cyclic=False)
    x = torch.randn(1, 5, CFG.hidden_size)
    cos, sin = ref.model.rotary(torch.arange(5).view(1, 5), torch.float32)
    with torch.no_grad():
        for i in [3, 2, 1, 0]:
            streamer.fetch(i)
            streamer.prefetch(after=i)
            streamer.wait(i)
            assert torch.equal(model.model.layers[i](x, cos, sin), ref.model.layers[i](x, cos, sin))
            streamer.release(i)
        # out of schedule order: slots are full of prefetched blocks, one is given up
        streamer.set_schedule([0, 1, 2, 3])
        streamer.prefetch()
        for i in [2, 0, 3, 1]:
            streamer.wait(i)
            assert torch.equal(model.model.layers[i](x, cos, sin), ref.model.layers[i](x, cos, sin))
            streamer.release(i)
        # a released block has no weights: using it without wait() fails loudly
        with pytest.raises(RuntimeError):
            model.model.layers[1](x, cos, sin)
    streamer.close()


class Stack(nn.Module):
    """Not a Llama: plain residual MLP blocks in a ModuleList."""

    def __init__(self, width: int = 16, depth: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width),
                                                  nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def test_generic_modulelist_model_all_tiers(tmp_path):
    torch.manual_seed(0)
    ref = Stack()
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = ref(x)
    # NVMe source: the blocks' tensors in a safetensors file, read by byte range
    path = str(tmp_path / "stack.safetensors")
    write_file(path, {n: p.detach().clone() for n, p in ref.named_parameters()})
    infos, _ = read_header(path)
    files = [[TensorRange(n.split(".", 2)[2], path, infos[n].offset, infos[n].nbytes, infos[n].dtype)
              for n in infos if n.startswith(f"blocks.{i}.")] for i in range(5)]
    for residency, zc in ((["cpu"] * 5, False), (["nvme"] * 5, True),
                          (["device", "nvme", "cpu", "nvme", "cpu"], False)):
        model = Stack()
        model.load_state_dict(ref.state_dict())
        use_files = files if "nvme" in residency else None
        streamer = BlockStreamer(model.blocks, residency, device="cpu", dtype=torch.float32,
                                 files=use_files, zero_copy_host=zc, nvme_ahead=3,
                                 fetch_delay_s=0.005).attach()
        with torch.no_grad():
            assert torch.equal(model(x), want)
            assert torch.equal(model(x), want)
        streamer.close()


def test_bad_residency_refused():
    model = Stack(depth=2)
    with pytest.raises(StreamError, match="residency lists"):
        BlockStreamer(model.blocks, ["cpu"], device="cpu", dtype=torch.float32)
    with pytest.raises(StreamError, match="no file source"):
        BlockStreamer(model.blocks, ["nvme", "cpu"], device="cpu", dtype=torch.float32)
    with pytest.raises(StreamError, match="unknown residency"):
        BlockStreamer(model.blocks, ["gpu", "cpu"], device="cpu", dtype=torch.float32)


# ---- planner -------------------------------------------------------------------------------------
MB = 10**6


def _plan(**kw):
    base = dict(block_bytes=[MB] * 8, stored_block_bytes=[MB] * 8, non_block_bytes=MB // 2,
                batch_size=1, context=16, kv_bytes_per_seq=10**4, workspace_per_seq=10**4,
                device_budget=10**12, host_budget=10**12, device_is_host=False)
    base.update(kw)
    return plan_inference(**base)


def test_planner_modes_and_tiers():
    from offload.infer.plan import WORKSPACE_FIXED_BYTES as W
    fixed = W + MB // 2 + 2 * 10**4
    assert _plan().residency == ["device"] * 8
    # device: fixed + 3 slots + 2 blocks; host: staging for 2 reads + 2 blocks; the rest on NVMe.
    # Host buffers of a GPU plan are pinned: counted at the allocator's power-of-two size (a
    # 10^6-byte block takes 2^20), so the third block that fit unrounded no longer does
    p = _plan(device_budget=fixed + 3 * MB + 2 * MB, host_budget=2 * (MB + 4096) + 3 * MB)
    assert (p.count("device"), p.count("cpu"), p.count("nvme")) == (2, 2, 4)
    assert p.staging_bytes == 2 * 2**20 and p.host_need == 2 * 2**20 + 2 * 2**20
    assert p.device_need <= p.device_budget and p.host_need <= p.host_budget
    assert p.residency.index("device") > 0  # spread out, not packed at the front
    assert p.streamed_per_step() == {"h2d": 2 * MB, "disk": 4 * MB}
    t = _plan(mode="throughput")
    assert t.count("device") == 0 and t.count("cpu") == 8 and t.max_batch > 1000
    assert spread(2, 8) == [2, 6] and spread(0, 8) == []
    # CPU device: one pool; resident blocks and the slots share it
    cpu = _plan(device_is_host=True, host_budget=fixed + 3 * (MB + 4096) + 4 * MB, staging_needed=False)
    assert (cpu.count("device"), cpu.count("cpu"), cpu.count("nvme")) == (4, 0, 4)


def test_planner_refusals_say_what_fits():
    from offload.infer.plan import WORKSPACE_FIXED_BYTES as W
    with pytest.raises(BudgetError, match="below one block"):
        _plan(device_budget=MB // 2)
    with pytest.raises(BudgetError, match="--batch-size 4"):
        _plan(device_budget=W + MB // 2 + 2 * MB + 4 * 2 * 10**4 + 1, batch_size=16)
    with pytest.raises(BudgetError, match="--weights auto"):
        _plan(device_budget=W + 5 * MB, force="device")
    with pytest.raises(BudgetError, match="--cpu-memory"):
        _plan(device_budget=W + MB // 2 + 2 * 10**4 + 3 * MB, host_budget=MB)


def test_illegal_block_transitions_raise(ckpt):
    """The block states move only along the legal edges; a wrong call raises instead of
    returning silently (offload/stream/streamer.py, BlockState)."""
    from offload.stream.streamer import BlockState
    with CheckpointReader(ckpt) as reader:
        model, streamer = load_streamed(reader, ["device", "cpu", "cpu", "nvme"], device="cpu",
                                        dtype=torch.float32, zero_copy_host=False)
    streamer.detach()
    try:
        assert streamer.state == [BlockState.RESIDENT] + [BlockState.ABSENT] * 3
        with pytest.raises(StreamError, match="block 1 is absent, not in use"):
            streamer.release(1)  # never fetched
        with pytest.raises(StreamError, match="not in use"):
            streamer.reuse(1)
        streamer.release(0)  # a resident block stays: the hooks release every block they ran
        assert streamer.state[0] is BlockState.RESIDENT
        streamer.fetch(1)
        assert streamer.state[1] is BlockState.IN_FLIGHT
        streamer.fetch(1)  # on its way already: left as it is
        with pytest.raises(StreamError, match="block 1 is in_flight, not in use"):
            streamer.release(1)  # issued, never waited on
        streamer.wait(1)
        assert streamer.state[1] is BlockState.IN_USE
        with pytest.raises(StreamError, match="in use already"):
            streamer.wait(1)
        streamer.reuse(1)  # the legal way to use a bound block again
        streamer.release(1)
        with pytest.raises(StreamError, match="not in use"):
            streamer.release(1)
        with pytest.raises(StreamError, match="illegal move absent -> in_use"):
            streamer._move(1, BlockState.IN_USE)  # the one transition function guards them all
        streamer.wait(3)  # fetched by wait itself
        streamer.release_all()
        assert streamer.state[1:] == [BlockState.ABSENT] * 3
    finally:
        streamer.close()


def test_a_failed_read_gives_the_slot_back(tmp_path):
    """A fetch whose read fails surfaces in wait(); the block is absent again and its slot free,
    so the streamer can be released and closed cleanly."""
    import os
    from offload.stream.streamer import BlockState
    save_pretrained(build_model(CFG, "cpu", torch.float32, source=5), tmp_path)
    with CheckpointReader(tmp_path) as reader:
        model, streamer = load_streamed(reader, ["nvme"] * 4, device="cpu", dtype=torch.float32)
    streamer.detach()
    try:
        for shard in tmp_path.glob("*.safetensors"):
            os.truncate(shard, 4096)  # every block's bytes are gone

        with pytest.raises(Exception):
            streamer.wait(2)
        assert streamer.state[2] is BlockState.ABSENT
        assert all(s.owner is None for s in streamer.slots) and streamer.pool.has_free()
        streamer.release_all()
    finally:
        streamer.close()
