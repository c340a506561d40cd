"""One data-parallel rank of tests/test_zero.py: trains the configurations it is given on its
slice of every global micro-batch and (rank 0) writes what the test compares.

Run as N processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT): the engine initialises the default process group from it, as under torchrun.
    python tests/zero_ranks.py SPEC.json OUT.pt
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind.startswith("checkpoint:"):  # "checkpoint:DIR": our decoder loaded from DIR
        from offload.models import load_model
        return load_model(kind.partition(":")[2])
    if kind in ("tiny", "lora"):
        from offload.models import build_model, preset
        model = build_model(preset("tiny"), device="cpu", source=0)
        if kind == "lora":  # adapters on a frozen base, the same on every rank (seeded)
            from offload.lora import LoraConfig, apply_lora
            apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("q", "v", "down")), seed=1)
        return model
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).float()


def batches(vocab: int, n: int, rows: int, seq: int) -> list[torch.Tensor]:
    """Global micro-batches [rows, seq], the same on every rank (and in the reference)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n)]


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits = (out.logits if hasattr(out, "logits") else out)[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def vocab_of(model) -> int:
    return model.config.vocab_size


def train(spec: dict, cfg_kw: dict, rank: int, world: int) -> dict:
    """`cfg_kw` may carry, beside OffloadConfig's fields: "load" (a saved state to resume
    from), "skip" (updates already done: their micro-batches are skipped), "save" and
    "save_after" (save the state there after that many updates of this run), "poison",
    "updates" and "model" (this configuration's own number of updates and model)."""
    cfg_kw = dict(cfg_kw)
    load, skip = cfg_kw.pop("load", None), cfg_kw.pop("skip", 0)
    save, save_after = cfg_kw.pop("save", None), cfg_kw.pop("save_after", None)
    poison = cfg_kw.pop("poison", None)  # [rank, micro-batch]: that rank's loss becomes inf
    delay = cfg_kw.pop("compute_delay", None)  # cycles: offload/gpu.py's compute-stream knob
    if cfg_kw.get("device") == "cuda":  # one GPU per rank: cuda:LOCAL_RANK (tests/test_cuda_ranks.py)
        cfg_kw["device"] = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    device = torch.device(cfg_kw.get("device", "cpu"))
    updates = cfg_kw.pop("updates", spec["updates"])  # this configuration's own count
    kind = cfg_kw.pop("model", spec["model"])  # and its own model
    model = make_model(kind)
    if rank != 0:  # the engine must start every rank from rank 0's trainable weights
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # frozen ones must already agree (a LoRA base)
                    p.add_(1.0)
    accum = cfg_kw["grad_accum_steps"]
    data = batches(vocab_of(model), (skip + updates) * accum, spec["rows"],
                   spec["seq"])[skip * accum:]
    per = spec["rows"] // world
    from offload.gpu import COMPUTE_DELAY_ENV
    os.environ.pop(COMPUTE_DELAY_ENV, None)
    if delay:
        os.environ[COMPUTE_DELAY_ENV] = str(delay)
    engine = offload.initialize(model, offload.OffloadConfig(**cfg_kw))
    # the current device of this thread and of the engine's step thread (review 2 P8)
    current = ([torch.cuda.current_device(), engine.parts.step_thread.submit(
        torch.cuda.current_device).result()] if device.type == "cuda" else None)
    if load:
        engine.load_state(load)
    losses, sent, overlapped = [], [], []
    for i, ids in enumerate(data):
        loss = lm_loss(model, ids[rank * per:(rank + 1) * per].to(device))
        if poison == [rank, i]:
            loss = loss * float("inf")
        engine.backward(loss)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if engine.step():
            sent.append({k: v for k, v in engine.last_report.bytes.items()
                         if k in ("all_reduce", "reduce_scatter", "all_gather", "all_gather_fetch")})
            overlapped.append(engine.last_report.overlapped_blocks)
            if save and len(sent) == save_after:
                engine.save_state(save)
    masters = {k: v.cpu() for k, v in engine.master_params().items()}
    os.environ.pop(COMPUTE_DELAY_ENV, None)
    memory = engine.account.report()
    plan = {(t, k): v for t, kinds in engine.plan.bytes.items() for k, v in kinds.items() if v}
    peaks = engine.account.kind_peaks()
    engine.close()
    memories = [None] * world
    dist.all_gather_object(memories, memory)
    return {"losses": losses, "masters": masters, "memory": memories, "sent": sent,
            "plan": plan, "peaks": peaks, "global_step": engine.global_step,
            "skipped": engine.skipped_steps, "loss_scale": engine.loss_scale,
            "grad_norm": engine.last_report.grad_norm, "path": engine.path.name,
            "overlapped": overlapped, "current_device": current}


def main(train=train) -> None:
    """Every configuration of the spec through `train` (tests/moe_ranks.py passes its own)."""
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)  # N ranks share this machine's cores
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = []
    for cfg_kw in spec["configs"]:
        cfg_kw = dict(cfg_kw)
        if cfg_kw.get("nvme_dir"):
            cfg_kw["nvme_dir"] = os.path.join(cfg_kw["nvme_dir"], f"run{len(results)}")
        results.append(train(spec, cfg_kw, rank, world))
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
