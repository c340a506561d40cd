"""One data-parallel rank of tests/test_moe_train_ranks.py: trains a mixture of experts whose
routing is disjoint across ranks (rank r's tokens reach only its own group of experts) under the
configurations it is given, records which experts its tokens reached, and (rank 0) writes the
masters, losses and every rank's experts for the test to compare.

Run as N processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
    python tests/moe_ranks.py SPEC.json OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402
from offload.models import load_model  # noqa: E402
from offload.models.moe import SparseMoE  # noqa: E402
from offload.train.experts import set_untouched_experts  # noqa: E402


def group_batches(spec: dict, world: int) -> list[torch.Tensor]:
    """Global micro-batches [rows, seq], the same in every process: the rows of rank r (its
    slice of rows // world) hold only tokens of vocabulary group r (tokens whose embeddings
    carry that group's marker; tests/test_moe_train_ranks.py disjoint_moe)."""
    g = torch.Generator().manual_seed(1)
    groups, vocab, rows, seq = spec["groups"], spec["vocab"], spec["rows"], spec["seq"]
    size, per = vocab // groups, rows // world
    out = []
    for _ in range(spec["updates"]):
        ids = torch.randint(0, size, (rows, seq), generator=g)
        offsets = torch.tensor([(r // per) % groups * size for r in range(rows)])[:, None]
        out.append(ids + offsets)
    return out


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits = (out.logits if hasattr(out, "logits") else out)[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def record_routes(model) -> set[tuple[int, int]]:
    """(layer, expert) pairs this process's training forwards route tokens to."""
    seen: set[tuple[int, int]] = set()

    def hook(moe, args, li):
        if torch.is_grad_enabled():
            with torch.no_grad():
                _, ids = moe.route(args[0].reshape(-1, args[0].shape[-1]))
            seen.update((li, int(e)) for e in ids.flatten())
    for li, layer in enumerate(model.model.layers):
        moe = next(m for m in layer.modules() if isinstance(m, SparseMoE))
        moe.register_forward_pre_hook(lambda m, a, li=li: hook(m, a, li))
    return seen


def train(spec: dict, cfg_kw: dict, rank: int, world: int) -> dict:
    """`cfg_kw` may carry "untouched": "skip" (one module per expert's semantics: an expert
    without tokens on every rank is not stepped) beside OffloadConfig's fields."""
    cfg_kw = dict(cfg_kw)
    untouched = cfg_kw.pop("untouched", "step")
    model = load_model(spec["checkpoint"])
    set_untouched_experts(model, untouched)
    routes = record_routes(model)
    data = group_batches(spec, world)
    per = spec["rows"] // world
    engine = offload.initialize(model, offload.OffloadConfig(**cfg_kw))
    losses = []
    try:
        for ids in data:
            loss = lm_loss(model, ids[rank * per:(rank + 1) * per])
            engine.backward(loss)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            engine.step()
        masters = engine.master_params()  # a collective at stages 1-2: every rank calls it
        replay = engine.plan.expert_replay
        skips = dict(engine.slot_skips)
    finally:
        engine.close()
    every = [None] * world
    dist.all_gather_object(every, sorted(routes))
    return {"masters": masters, "losses": losses, "routes": every, "replay": replay,
            "skips": skips}


if __name__ == "__main__":
    from zero_ranks import main
    main(train)
