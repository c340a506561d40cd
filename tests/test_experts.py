"""Routed experts as their own placement unit (offload/stream/experts.py, offload/infer/
expert_plan.py): small random MoE checkpoints saved by transformers (tests/families.py
MOE_FAMILIES), every expert on the device, in host RAM (in place, and through the copy path a
GPU takes) or on NVMe, with and without the expert cache and the next-layer prefetch: fp32 logits
within 1e-5 and greedy tokens identical to transformers; int8 / int4 experts against transformers
over the dequantized weights; NVMe bytes per decode step equal to the routed experts' bytes of a
routing trace taken independently (forward hooks and the routers), and the prediction's
precision and recall equal to the trace's; the plan's placement and its refusals; dry-run plans
of the MoE presets on a 24 GB GPU with 64 GB of RAM."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import (GPT_OSS_FAMILIES, MOE_FAMILIES, Case, dequantized_reference,  # noqa: E402
                      case_prompts, make_cases, run_infer, save_family_checkpoint)
from nvme.io import IOEngine  # noqa: E402
from offload.infer.expert_plan import ComputeCosts, choose_compute, plan_experts  # noqa: E402
from offload.memory.tiers import BudgetError, pinned_bytes  # noqa: E402
from offload.models import CheckpointReader, load_streamed, preset  # noqa: E402
from offload.models.moe import SparseMoE  # noqa: E402
from offload.models.quantized import QuantSettings, load_quantized_streamed, quantize_checkpoint  # noqa: E402
from offload.stream.expert_placement import ExpertPlacement, host_arenas  # noqa: E402
from runners.common import run_main  # noqa: E402
from runners.infer import main as infer_main  # noqa: E402

NAMES = list(MOE_FAMILIES) + list(GPT_OSS_FAMILIES)
NEW = 6
PROMPT, SHORT, LONG_IDS = case_prompts(977)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    return make_cases(tmp_path_factory, NAMES, PROMPT, SHORT, LONG_IDS, NEW)


def _load(path, placement: ExpertPlacement, weights: str = "nvme", io: IOEngine | None = None):
    reader = CheckpointReader(path)
    L = reader.config.num_hidden_layers
    model, streamer = load_streamed(reader, [weights] * L, device="cpu", dtype=torch.float32,
                                    zero_copy_host=False, experts=placement, io=io)
    return reader, model, streamer


def _close(reader, model, streamer) -> None:
    streamer.close()
    model.expert_store.close()
    reader.close()


# ---- equal to transformers, wherever the experts live ---------------------------------------------
PLACEMENTS = {
    "device": ExpertPlacement("device"),
    "cpu in place": ExpertPlacement("cpu"),
    "cpu copied, cache": ExpertPlacement("cpu", zero_copy_host=False, cache_slots=3),
    "nvme": ExpertPlacement("nvme", prefetch_slots=0),
    "nvme, prefetch, cache": ExpertPlacement("nvme", cache_slots=4),
    "mixed": ExpertPlacement([["device", "cpu", "nvme", "nvme"] * 2] * 3, cache_slots=2),
}


@pytest.mark.parametrize("where", list(PLACEMENTS))
@pytest.mark.parametrize("name", NAMES)
def test_experts_anywhere_equal_transformers(cases, name, where):
    case = cases[name]
    reader, model, streamer = _load(case.path, PLACEMENTS[where])
    try:
        store = model.expert_store
        assert all(m.store is store for m in model.modules() if isinstance(m, SparseMoE))
        case.check(model, streamer, single=where == "nvme, prefetch, cache")
        moved = store.stats.moved_bytes
        assert (moved["disk"] > 0) == ("nvme" in where or where == "mixed")
        assert (moved["h2d"] > 0) == (where == "cpu copied, cache")  # else in place
        if "cache" in where:
            assert store.stats.cache_hits > 0
        # only the dense parts went through the block streamer
        assert all(".experts." not in s.name for b in streamer.blocks for s in b.slots)
    finally:
        _close(reader, model, streamer)


def test_cache_and_prefetch_leave_the_logits_bit_identical(cases):
    case = cases["qwen3_moe"]
    outs = []
    for placement in (ExpertPlacement("nvme", prefetch_slots=0), ExpertPlacement("nvme", cache_slots=5)):
        reader, model, streamer = _load(case.path, placement)
        try:
            with torch.no_grad():
                outs.append([model(LONG_IDS), model(LONG_IDS[:1, :7])])
            if placement.cache_slots:
                assert model.expert_store.stats.cache_hits > 0
                assert model.expert_store.stats.prefetch_hits > 0
        finally:
            _close(reader, model, streamer)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_equal_transformers_over_the_dequantized_weights(cases, mode, tmp_path):
    case = cases["mixtral"]
    with CheckpointReader(case.path) as reader:
        blocks = quantize_checkpoint(reader, QuantSettings(mode), torch.float32, cache_root=str(tmp_path))
        ref = dequantized_reference(case, blocks)
        L = reader.config.num_hidden_layers
        homes = [["nvme"] * 4 + ["cpu"] * 4] * L
        model, streamer = load_quantized_streamed(
            reader, blocks, ["nvme"] * L, device="cpu", dtype=torch.float32, zero_copy_host=False,
            experts=ExpertPlacement(homes, cache_slots=2))
        try:
            case.check(model, streamer, hf=ref, tokens=case.greedy_of(ref))
            assert model.expert_store.stats.moved_bytes["disk"] > 0
        finally:
            streamer.close()
            model.expert_store.close()


# ---- bytes read: the routed experts', no more ------------------------------------------------------
class RoutingTrace:
    """Each MoE call's input and the experts its router picks, by forward hooks: a reference
    taken apart from the store."""

    def __init__(self, model):
        self.calls: list[tuple[int, set[int], torch.Tensor]] = []
        self.step_bytes: list[int] = []
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.hooks = [m.register_forward_pre_hook(self._record(i)) for i, m in enumerate(self.moes)]

    def _record(self, layer: int):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            _, ids = module.route(x)
            self.calls.append((layer, set(ids.flatten().tolist()), x.clone()))
        return hook

    def predicted_vs_routed(self, top_k: int) -> tuple[int, int, int]:
        """(predicted, predicted and routed, routed) over every layer after the first: layer
        l+1's router on layer l's input, top-k per token, against what layer l+1 routed."""
        predicted = right = routed = 0
        for (l, _, x), (nxt, hit, _) in zip(self.calls, self.calls[1:]):
            if nxt != l + 1:
                continue
            logits = torch.nn.functional.linear(x, self.router[nxt])
            guess = set(torch.topk(logits, top_k, dim=-1).indices.flatten().tolist())
            predicted, right, routed = predicted + len(guess), right + len(guess & hit), routed + len(hit)
        return predicted, right, routed


def test_nvme_bytes_per_decode_step_are_the_routed_experts_bytes(cases):
    """Experts on NVMe, dense parts on the device, no cache, no prefetch: every decode step reads
    exactly the experts its tokens were routed to (the IO engine's own byte count, against a
    routing trace from hooks); with prefetch, what it read ahead is counted apart and the
    prediction's precision and recall are the trace's."""
    case = cases["qwen3_moe"]
    io = IOEngine()
    from offload.infer.generate import generate
    try:
        for prefetch in (0, 2):
            reader, model, streamer = _load(case.path, ExpertPlacement("nvme", prefetch_slots=prefetch),
                                            weights="device", io=io)
            store = model.expert_store
            one = store._stored_bytes((0, 0))
            trace = RoutingTrace(model)
            trace.router = {i: m.gate.weight.detach().clone() for i, m in enumerate(trace.moes)}
            per_step: list[tuple[int, int]] = []  # (bytes read, routed experts' bytes)
            marks = {}
            model.register_forward_pre_hook(lambda m, a: marks.update(io=io.bytes_read, n=len(trace.calls)))
            model.register_forward_hook(lambda m, a, o: per_step.append(
                (io.bytes_read - marks["io"], one * sum(len(h) for _, h, _ in trace.calls[marks["n"]:]))))
            try:
                res = generate(model, [PROMPT], max_new_tokens=NEW, streamer=streamer)
                st = store.stats
                if prefetch == 0:
                    assert len(per_step) == NEW  # the prefill and NEW - 1 decode steps
                    for got, want in per_step:
                        assert want > 0 and abs(got - want) <= 0.01 * want, per_step
                    assert st.moved_bytes["disk"] == one * st.routed == one * sum(
                        len(h) for _, h, _ in trace.calls)
                else:
                    assert st.prefetch_hits > 0
                    issued = st.prefetch_hits + st.wasted_bytes // one
                    assert st.moved_bytes["disk"] == one * (st.demand_reads + issued)
                    assert st.demand_reads + st.prefetch_hits == st.routed
                predicted, right, routed = trace.predicted_vs_routed(model.config.num_experts_per_tok)
                assert (st.predicted, st.predicted_right, st.routed_predicted_layers) == (predicted, right, routed)
                assert res.decode_experts.routed > 0
            finally:
                _close(reader, model, streamer)
    finally:
        io.close()


# ---- the plan ----------------------------------------------------------------------------------
GiB = 1 << 30


def test_plan_on_a_cpu_device_fills_ram_then_nvme():
    kw = dict(layers=4, experts=8, expert_bytes=1 << 20, stored_expert_bytes=1 << 20, top_k=2,
              device_is_host=True)
    all_in = plan_experts(**kw, device_room=GiB, host_room=GiB)
    assert all_in.count("cpu") == 32 and all_in.pool_bytes == 0
    part = plan_experts(**kw, device_room=20 << 20, host_room=20 << 20, cache_bytes=2 << 20)
    assert 0 < part.count("cpu") < 32 and part.count("nvme") == 32 - part.count("cpu")
    assert part.host_bytes + part.pool_bytes <= 20 << 20
    assert part.cache_slots == 2 and part.prefetch_slots == 2
    # evenly over the layers, so that every layer reads about as much
    per_layer = [h.count("nvme") for h in part.homes]
    assert max(per_layer) - min(per_layer) <= 1
    assert part.per_step(1)["disk"] == pytest.approx(2 * sum(per_layer) / 8 * (1 << 20))
    with pytest.raises(BudgetError, match="--experts cpu.*--experts nvme"):
        plan_experts(**kw, device_room=20 << 20, host_room=20 << 20, force="cpu")


def test_plan_on_a_gpu_fills_the_device_then_host_then_nvme():
    kw = dict(layers=4, experts=8, expert_bytes=3 << 20, stored_expert_bytes=3 << 20, top_k=2,
              device_is_host=False)
    plan = plan_experts(**kw, device_room=40 << 20, host_room=40 << 20)
    assert plan.count("device") > 0 and plan.count("cpu") > 0 and plan.count("nvme") > 0
    assert plan.count("device") * (3 << 20) + plan.pool_bytes <= 40 << 20
    assert plan.host_bytes <= 40 << 20
    for layer in plan.homes:  # device share first, host RAM's, then NVMe's: never overlapping
        assert layer == sorted(layer, key=["device", "cpu", "nvme"].index) and len(layer) == 8
    with pytest.raises(BudgetError, match="--experts device.*raise --gpu-memory"):
        plan_experts(**kw, device_room=40 << 20, host_room=GiB, force="device")


def test_host_arenas_count_what_pinned_memory_takes():
    sizes = [9_437_184] * 128  # a Qwen3-30B-A3B expert in bf16, 128 per layer
    pinned = host_arenas(sizes, pinned=True)
    assert sorted(i for _, m in pinned for i in m) == list(range(128))
    need = sum(-(-s // 4096) * 4096 + 4096 for s in sizes)
    total = sum(a for a, _ in pinned)
    assert all(a == pinned_bytes(a) for a, _ in pinned)  # powers of two
    assert need <= total < 1.05 * need  # a few percent, not the 1.7x of one buffer per expert
    assert host_arenas(sizes, pinned=False) == [(need, list(range(128)))]


def test_copy_or_cpu_is_chosen_by_the_crossover():
    one = 3 * 2048 * 768 * 2  # a Qwen3-30B-A3B expert in bf16
    fast_cpu = ComputeCosts(h2d_gbps=12.0, cpu_gbps=60.0, cpu_gflops=500.0)
    n, why = choose_compute(one, one // 2, 2048, 2, fast_cpu)
    assert 1 <= n < 1000 and "CPU up to" in why  # decode on the CPU, a long prefill copied
    slow_cpu = ComputeCosts(h2d_gbps=25.0, cpu_gbps=5.0, cpu_gflops=50.0)
    assert choose_compute(one, one // 2, 2048, 2, slow_cpu)[0] == 0.0


@pytest.mark.parametrize("name", ["qwen3-30B-A3B", "qwen3-235B-A22B", "mixtral-8x7B", "gpt-oss-120b",
                                  "deepseek-v3"])
def test_moe_presets_fit_a_24gb_gpu_and_64gb_of_ram(name, tmp_path, capsys):
    """Dry runs planned for one 24 GB GPU and 64 GB of RAM in bf16: the dense parts and as many
    experts as fit on the device, then RAM, the rest on NVMe; bytes per token shown. DeepSeek-V3's
    dense parts (34 GB) do not fit the device: its blocks are placed around the experts' buffers
    (plan_inference's reserved_bytes), its 3 dense layers have no experts."""
    out = tmp_path / "plan.json"
    rc = run_main(infer_main, ["--model", name, "--dry-run", "--gpu", "0", "--gpu-memory", "24GiB",
                               "--cpu-memory", "64GiB", "--dtype", "bf16", "--probe-seconds", "0",
                               "--offload-dir", str(tmp_path), "--output-json", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    plan, cfg = json.loads(out.read_text())["plan"], preset(name)
    experts = plan["experts"]
    assert sum(experts["homes"].values()) == len(cfg.moe_layers) * cfg.num_experts
    assert plan["device_need"] <= 24 * GiB and plan["host_need"] <= 64 * GiB
    assert experts["homes"]["device"] > 0
    per = experts["bytes_per_token"]
    total_bytes = len(cfg.moe_layers) * cfg.num_experts * experts["expert_bytes"]
    if total_bytes > 80 * GiB:  # more experts than GPU and RAM hold: some read from NVMe
        assert experts["homes"]["nvme"] > 0 and per["disk"] > 0
    assert "experts per decoded token" in err and "top-" in err


def test_runner_experts_on_nvme_with_a_cache_give_transformers_tokens(cases, tmp_path, capsys):
    """python -m runners.infer --experts nvme --expert-cache: transformers' greedy tokens, the
    plan's expert lines and the run's expert report (bytes per token, hit rate, prefetch)."""
    case = cases["olmoe"]
    res, err = run_infer(case.path, PROMPT, NEW, tmp_path, capsys, "--experts", "nvme",
                         "--expert-cache", "96KiB", "--offload-dir", tmp_path)
    assert res["generated_ids"] == case.greedy()["single"]
    assert "on NVMe" in err and "experts per decoded token" in err and "cache hit rate" in err
    m = res["metrics"]["experts"]
    assert m["homes"]["nvme"] == case.hf.config.num_hidden_layers * 8
    assert m["decode_bytes_per_token"]["disk"] > 0 and m["prefetch_precision"] is not None
    assert res["metrics"]["bytes_per_token"]["nvme"] >= m["decode_bytes_per_token"]["disk"]
    assert res["plan"]["experts"]["homes"]["nvme"] == m["homes"]["nvme"]


def test_expert_flags_on_a_dense_model_are_refused_in_one_line(tmp_path, capsys):
    rc = run_main(infer_main, ["--experts", "nvme", "--offload-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "has none (drop the flag)" in err
    assert not list(tmp_path.iterdir())  # refused before anything was generated


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_a_bf16_checkpoint_computed_in_fp32_converts_each_expert(home, tmp_path):
    """Experts stored in bf16, computed in fp32: read (NVMe: into staging, per routed expert;
    RAM: once) and converted; equal to transformers loading the same file in fp32."""
    save_family_checkpoint("qwen3_moe", tmp_path, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reader, model, streamer = _load(tmp_path, ExpertPlacement(home, zero_copy_host=False, cache_slots=2))
    try:
        store = model.expert_store
        assert store._stored_dtype[(0, 0)] == torch.bfloat16
        with torch.no_grad():
            torch.testing.assert_close(model(LONG_IDS), hf(LONG_IDS).logits, rtol=0, atol=1e-5)
        one = store._stored_bytes((0, 0))
        assert one == store.expert_bytes((0, 0)) // 2  # what crosses the disk is the bf16 bytes
        if home == "nvme":
            assert store.stats.moved_bytes["disk"] == one * (store.stats.demand_reads + store.stats.prefetch_hits
                                                             + store.stats.wasted_bytes // one)
    finally:
        _close(reader, model, streamer)


def test_the_plan_counts_what_the_store_allocates(cases):
    """The experts' plan on a CPU device against the store built from it: host arenas, the
    buffer pool and staging are the bytes the plan counted (plan equals allocation)."""
    case = cases["mixtral"]
    with CheckpointReader(case.path) as reader:
        cfg = reader.config
        one = sum(loc.nbytes for loc in reader.block_locations(0) if ".experts.0." in loc.name)
    per = one + 8192 + 4096  # an expert's arena share is at most this; leave room for 5 in RAM
    plan = plan_experts(layers=cfg.num_hidden_layers, experts=cfg.num_experts, expert_bytes=one,
                        stored_expert_bytes=one, top_k=cfg.num_experts_per_tok, device_room=1 << 40,
                        host_room=5 * per + 7 * (one + 4096), device_is_host=True, cache_bytes=2 * one,
                        staging_needed=False)
    assert 0 < plan.count("cpu") < cfg.num_hidden_layers * cfg.num_experts
    reader, model, streamer = _load(case.path, plan.placement())
    try:
        store = model.expert_store
        assert store.host_bytes == plan.host_bytes
        assert store.pool_bytes() == plan.pool_bytes
        assert all(b.staging is None for b in store._pool)  # fp32 file, fp32 compute: none planned
        case.check(model, streamer)
    finally:
        _close(reader, model, streamer)
