"""The expert store on the GPU (issue 35), in the GPU proof kit (`pytest -m cuda`, run by
scripts/gpu_check.py): a small random Qwen3-MoE saved by transformers, greedy generation on
cuda:0 with the experts on the device, in pinned host RAM (copied over, or computed on the CPU
with only their tokens' activations crossing), on NVMe (read into pinned staging, then either),
with the expert cache and the next-layer prefetch, against transformers on the same GPU; and an
accepted plan whose experts do not all fit the device, run through runners.infer, within its
planned device memory.

Without a GPU every test is skipped; OFFLOAD_TEST_CUDA_ON_CPU=1 runs the generation matrix on
the CPU device (the copy path through zero_copy_host=False), so the file itself is exercised."""

from __future__ import annotations

import json

import pytest
import torch

from families import Case, VOCAB
from offload.infer.generate import generate
from offload.models import CheckpointReader, load_streamed
from offload.stream.expert_placement import ExpertPlacement
from tests.test_cuda import DEV, HAVE_CUDA, ON_CPU, _deterministic, cuda_only, run_cli  # noqa: F401

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAVE_CUDA or ON_CPU),
                       reason="needs a CUDA GPU (run `python scripts/gpu_check.py` on one; "
                              "OFFLOAD_TEST_CUDA_ON_CPU=1 runs the CPU-meaningful part here)"),
]

_gen = torch.Generator().manual_seed(31)
PROMPT = torch.randint(3, VOCAB, (12,), generator=_gen).tolist()
NEW = 6
MIXED = [["device", "device", "cpu", "cpu", "nvme", "nvme", "nvme", "cpu"]] * 3
PLACEMENTS = {
    "device": ExpertPlacement("device"),
    "cpu, copied": ExpertPlacement("cpu", compute="copy", cache_slots=2),
    "cpu, on the CPU": ExpertPlacement("cpu", compute="where"),
    "nvme, copied, prefetch": ExpertPlacement("nvme", compute="copy"),
    "nvme, on the CPU, cache": ExpertPlacement("nvme", compute="where", cache_slots=3),
    "mixed, by tokens per expert": ExpertPlacement(MIXED, compute="auto", where_max_tokens=1.5,
                                                   cache_slots=2),
}


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    return Case("qwen3_moe", str(tmp_path_factory.mktemp("qwen3_moe")), PROMPT, PROMPT[:5],
                torch.randint(3, VOCAB, (2, 21), generator=_gen), NEW)


@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_moe_generation_on_the_gpu_matches_transformers(case, where):
    hf = case.hf.to(DEV)
    try:
        with torch.no_grad():
            want = hf.generate(torch.tensor([PROMPT], device=DEV), max_new_tokens=NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
            ref_logits = hf(case.long_ids.to(DEV)).logits
    finally:
        case.hf.to("cpu")
    placement = PLACEMENTS[where]
    if ON_CPU and not HAVE_CUDA:  # the CPU device: host RAM through the copy path the GPU takes
        placement = ExpertPlacement(placement.home, cache_slots=placement.cache_slots, zero_copy_host=False)
    with CheckpointReader(case.path) as reader:
        L = reader.config.num_hidden_layers
        model, streamer = load_streamed(reader, ["nvme", "device", "cpu"][:L], device=DEV,
                                        dtype=torch.float32, experts=placement,
                                        zero_copy_host=None if HAVE_CUDA else False)
        store = model.expert_store
        try:
            got = generate(model, [PROMPT], max_new_tokens=NEW, device=DEV, streamer=streamer).tokens[0]
            with torch.inference_mode():
                logits = model(case.long_ids.to(DEV))
        finally:
            streamer.close()
            store.close()
    assert got == want
    # on the CPU an expert rounds as the CPU does: within fp32's last bits of the GPU's
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    if "nvme" in where or "mixed" in where:
        assert store.stats.moved_bytes["disk"] > 0
    if HAVE_CUDA and "copied" in where:
        assert store.stats.moved_bytes["h2d"] > 0


@cuda_only
def test_moe_peak_device_memory_within_an_accepted_plan(tmp_path):
    """runners.infer --gpu 0 on an MoE whose experts do not all fit the --gpu-memory budget: the
    plan puts some on the device and the rest in host RAM, the run finishes and its peak device
    memory is within what the plan said it needs."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                      moe_intermediate_size=512, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      num_experts=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")  # experts 192 MiB fp32
    out = tmp_path / "out.json"
    r = run_cli("runners.infer", "--gpu", "0", "--model", str(tmp_path / "ckpt"), "--gpu-memory",
                "200MiB", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--dtype", "fp32",
                "--ignore-eos", "--expert-cache", "8MiB", "--output-json", str(out),
                "--offload-dir", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    homes = got["plan"]["experts"]["homes"]
    assert homes["device"] > 0 and homes["cpu"] + homes["nvme"] > 0, homes
    peak = got["metrics"]["peak_device_bytes"]
    assert peak <= got["plan"]["device_need"] <= 200 * 2**20, (peak, got["plan"])
