"""The KV cache in host RAM (offload/infer/kv_cache.py): the same tokens and logits as the cache on the
device, with streamed blocks too; the planner puts it there only when throughput mode cannot fit
the batch's cache on the device, and reports the batch it allows against the one without."""

from __future__ import annotations

import json

import pytest
import torch

from offload.infer.generate import SamplingParams, generate
from offload.infer.kv_cache import OffloadedKVCache, offloaded_kv_device_bytes
from offload.models import CheckpointReader, KVCache, build_model, load_streamed, preset, save_pretrained
from offload.models.llama import kv_cache_bytes
from offload.infer.plan import plan_inference
from offload.memory.tiers import BudgetError

CFG = preset("tiny")
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43]]  # left-padded into one batch


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, "cpu", torch.float32, source=3)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=2)])
def test_offloaded_cache_gives_the_same_tokens(model, sampling):
    with torch.inference_mode():
        want = generate(model, PROMPTS, max_new_tokens=9, sampling=sampling)
        got = generate(model, PROMPTS, max_new_tokens=9, sampling=sampling, kv_tier="host")
    assert got.tokens == want.tokens
    # every decode step brought the past positions of every layer in
    assert got.kv_h2d_bytes > 0 and want.kv_h2d_bytes == 0


def test_offloaded_cache_holds_what_the_device_cache_holds(model):
    """Prefill then two decode steps by hand: logits equal and the host copy equals the device
    cache position for position (layout [max_len, B, kvh, D] vs [B, kvh, max_len, D])."""
    B, T, L = 2, 6, CFG.num_hidden_layers
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(4))
    dev = KVCache(CFG, B, T + 2, dtype=torch.float32)
    off = OffloadedKVCache(CFG, B, T + 2, device="cpu", dtype=torch.float32, ahead=2)
    assert off.device_nbytes == offloaded_kv_device_bytes(CFG, B, T + 2, torch.float32, ahead=2)
    assert off.nbytes == kv_cache_bytes(CFG, B, T + 2, torch.float32)
    with torch.inference_mode():
        for step in range(3):
            x = ids if step == 0 else ids[:, step:step + 1]
            a, b = model(x, kv_cache=dev), model(x, kv_cache=off)
            assert torch.equal(a, b), step
    off.sync()
    for i in range(L):
        assert torch.equal(off.host[i][0].permute(1, 2, 0, 3)[:, :, :T + 2], dev.keys[i][:, :, :T + 2])
        assert torch.equal(off.host[i][1].permute(1, 2, 0, 3)[:, :, :T + 2], dev.values[i][:, :, :T + 2])


def test_offloaded_cache_with_streamed_blocks(tmp_path, model):
    save_pretrained(model, tmp_path)
    with torch.inference_mode():
        want = generate(model, PROMPTS, max_new_tokens=6).tokens
    with CheckpointReader(tmp_path) as reader:
        m, streamer = load_streamed(reader, ["nvme", "cpu", "nvme", "device"], device="cpu",
                                    dtype=torch.float32, zero_copy_host=False, fetch_delay_s=0.002)
        try:
            with torch.inference_mode():
                got = generate(m, PROMPTS, max_new_tokens=6, streamer=streamer, kv_tier="host")
        finally:
            streamer.close()
    assert got.tokens == want


def _gpu_plan(batch, device_budget, host_budget, mode="throughput", kv_tier="auto", **kw):
    """A 32-layer model of 100 MB blocks and 1 MB of KV per layer per sequence, on a GPU."""
    L = 32
    base = dict(block_bytes=[100 << 20] * L, stored_block_bytes=[100 << 20] * L,
                non_block_bytes=200 << 20, batch_size=batch, context=1024,
                kv_bytes_per_seq=L << 20, workspace_per_seq=1 << 20, device_budget=device_budget,
                host_budget=host_budget, device_is_host=False, mode=mode, kv_tier=kv_tier,
                num_layers=L, kv_positions_per_step=768)
    base.update(kw)
    return plan_inference(**base)


def test_planner_moves_the_kv_cache_to_host_only_when_it_must():
    small = _gpu_plan(8, 8 << 30, 64 << 30)
    assert small.kv_tier == "device"  # 256 MB of cache fits beside the weights
    big = _gpu_plan(256, 8 << 30, 64 << 30)  # 8 GB of cache: more than the device
    assert big.kv_tier == "host"
    assert big.device_need <= big.device_budget and big.host_need <= big.host_budget
    assert big.max_batch >= 256 > big.max_batch_device_kv >= 1
    # the floor counts the past positions brought in per step (256 seqs x 32 layers x 768/1024 MB)
    assert big.kv_h2d_bytes_per_step == 256 * (32 << 20) * 768 // 1024
    assert big.streamed_per_step()["h2d"] >= big.kv_h2d_bytes_per_step
    text = big.describe()
    assert "KV cache" in text and "host RAM" in text and "with the KV cache on the device" in text
    # latency mode never moves it; the refusal names throughput mode
    with pytest.raises(BudgetError, match="--mode throughput"):
        _gpu_plan(256, 8 << 30, 64 << 30, mode="latency")
    # host RAM too small for the cache: refused, not accepted and OOM later
    with pytest.raises(BudgetError):
        _gpu_plan(256, 8 << 30, 6 << 30)
    forced = _gpu_plan(8, 8 << 30, 64 << 30, kv_tier="host")
    assert forced.kv_tier == "host"


def test_runner_kv_cache_host_same_tokens(tmp_path, capsys):
    from runners.common import run_main
    from runners.infer import main

    def run(*extra):
        out = tmp_path / f"o{len(extra)}.json"
        rc = run_main(main, ["--model", "tiny", "--offload-dir", str(tmp_path), "--batch-size", "3",
                             "--max-new-tokens", "5", "--ignore-eos", "--probe-seconds", "0",
                             "--output-json", str(out), *extra])
        err = capsys.readouterr().err
        assert rc == 0, err
        return json.load(open(out)), err

    dev, _ = run()
    host, err = run("--kv-cache", "host", "--mode", "throughput")
    assert host["generated_ids"] == dev["generated_ids"]
    assert host["plan"]["kv_tier"] == "host" and "KV cache" in err
