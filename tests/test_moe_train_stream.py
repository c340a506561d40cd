"""Streamed training of a mixture of experts reads only the routed experts' weights (issue 37,
offload/stream/routed.py), against torch.optim.AdamW on transformers' model and the routers'
own choices:

- state and weights on NVMe, 10 updates of a small random Qwen3MoeForCausalLM (transformers,
  fp32; 32 experts top-2, most without tokens each update): masters and losses equal torch's
  AdamW on transformers' model within 1e-6 -- with every byte of the slots and of the step's
  weight ring that should not be read poisoned with NaN before each use (the unrouted experts'
  regions keep NaN: a read of one, or a write of an unstepped unit, would reach the loss);
- the weight bytes read per update are exactly, per forward, each layer's dense part and the
  experts its router chose (counted by hooks on `route`), twice -- forward, then backward's
  fetch (which also serves the recompute) -- but for the last layer, kept bound from forward
  to backward: not whole layers, and nothing read back by the step;
- with accumulation and activation checkpointing (the recompute routes again: nothing more is
  read) as without;
- each expert's weights file carries its own CRC: damaged, its read once routed stops the run.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload.models.moe import SparseMoE  # noqa: E402
from offload.stream.routed import RoutedStreamer  # noqa: E402
from offload.train.stepper import BlockStepper  # noqa: E402
from test_engine import lm_batches  # noqa: E402
from test_moe_train import one_thread  # noqa: E402,F401
from test_moe_train_io import VOCAB, check_against_torch, checkpoint, nvme_moe, run  # noqa: E402,F401

UPDATES, SEQ = 10, 8


class ForwardRouting:
    """Per training forward (a micro-batch; the recompute adds nothing new), each layer's set
    of routed experts, from the MoE modules' own `route`."""

    def __init__(self, model):
        self.forwards: list[dict[int, set[int]]] = []
        model.register_forward_pre_hook(lambda m, a: self.forwards.append({}) if torch.is_grad_enabled() else None)
        for li, layer in enumerate(model.model.layers):
            moe = next(m for m in layer.modules() if isinstance(m, SparseMoE))
            moe.register_forward_pre_hook(lambda m, a, li=li: self._route(m, li, a[0]))

    def _route(self, moe, li, hidden):
        if torch.is_grad_enabled():
            with torch.no_grad():
                _, ids = moe.route(hidden.reshape(-1, hidden.shape[-1]))
            self.forwards[-1].setdefault(li, set()).update(int(e) for e in ids.flatten())

    def take(self, dense: list[int], expert: int, item: int) -> int:
        """Bytes a window's forwards and backwards must read: per forward each layer's dense
        part and routed experts, twice but for the last layer."""
        out, last = 0, len(dense) - 1
        for f in self.forwards:
            for li, d in enumerate(dense):
                out += (1 if li == last else 2) * (d + expert * len(f.get(li, ()))) * item
        self.forwards = []
        return out


@pytest.fixture
def poisoned(monkeypatch):
    """NaN in every slot before a fetch lands in it, and in the step's weight ring slot before
    the kernel writes it: what should not be read or written stays NaN."""
    read_runs, target = RoutedStreamer._read_runs, BlockStepper._target

    def poison_slot(self, i, dst):
        dst.view(self.dtype).fill_(float("nan"))
        read_runs(self, i, dst)

    def poison_ring(self, u, bi):
        out16, where = target(self, u, bi)
        if where[0] == "nvme":
            out16.fill_(float("nan"))
        return out16, where
    monkeypatch.setattr(RoutedStreamer, "_read_runs", poison_slot)
    monkeypatch.setattr(BlockStepper, "_target", poison_ring)


# "step": transformers' fused experts (untouched ones replayed when routed to again, their new
# weights written to their own files); "skip": one module per expert (an untouched expert's file
# is never written again: a write of an unstepped unit from the poisoned ring would show)
@pytest.mark.parametrize("semantics,accum,checkpointing", [("step", 1, False), ("step", 2, True),
                                                           ("skip", 1, False)])
def test_streamed_weights_read_are_dense_part_plus_routed_experts(semantics, accum, checkpointing,
                                                                  checkpoint, tmp_path, poisoned):
    model, reference_model, cfg = nvme_moe(checkpoint, semantics, tmp_path, grad_accum_steps=accum,
                                           activation_checkpointing=checkpointing)
    routing = ForwardRouting(model)
    data = lm_batches(UPDATES * accum, VOCAB, seq=SEQ)
    reads, expected, whole = [], [], []

    def on_update(engine):
        streaming = engine.parts.streaming
        assert isinstance(streaming.streamer, RoutedStreamer)
        expert = engine.experts[0].hi - engine.experts[0].lo
        dense = [engine.blocks[bi].numel - sum(r.hi - r.lo for r in engine.experts if r.block == bi)
                 for bi in sorted(engine.parts.layer_of, key=engine.parts.layer_of.get)]
        expected.append(routing.take(dense, expert, 4))
        whole.append(2 * accum * sum(engine.blocks[bi].numel for bi in engine.parts.layer_of) * 4)
        reads.append(engine.last_report.bytes["stream_disk"] + engine.last_report.bytes["weights_read"])

    masters, losses, engine = run(model, cfg, data, on_update)
    print(f"weights read {sum(reads)} B over {UPDATES} updates, dense + routed {sum(expected)} B, "
          f"whole layers {sum(whole)} B")
    assert reads == expected
    assert sum(reads) < 0.6 * sum(whole)
    assert engine.parts.streaming.streamer.routed_reads > 0
    if semantics == "step":  # the replay's weight writes went to experts' own files
        assert engine.replay.replayed > 0
    check_against_torch(semantics, masters, losses, model, reference_model, data, accum)


def test_damaged_expert_weights_file_stops_training(checkpoint, tmp_path):
    """Each expert's weights file carries its own CRC, checked when it is read once routed."""
    import os

    import offload
    from offload.memory.layout import StreamError
    from test_engine import hf_loss
    from test_run_guards import flip_byte
    model, _, cfg = nvme_moe(checkpoint, "step", tmp_path)
    data = lm_batches(2, VOCAB, seq=SEQ)
    engine = offload.initialize(model, cfg)
    try:
        engine.backward(hf_loss(model, data[0]))
        engine.step()
        swap = engine.store.dir
        # every one of layer 0's 32 experts' files damaged, its dense units left whole
        layer0 = engine.parts.streaming.unit_names(engine.blocks[engine.parts.streaming.layer_block[0]],
                                                   engine.parts.streaming.units[0])
        experts = [n for k, n in enumerate(layer0) if k in engine.parts.streaming.expert_unit[0].values()]
        assert len(experts) == 32 and len(layer0) > 32
        files = {n: engine.store.info(n).file for n in experts}
        for f in files.values():
            flip_byte(os.path.join(swap, f))
        with pytest.raises(StreamError, match="checksum mismatch in streamed weights"):
            hf_loss(model, data[1])
    finally:
        engine.close()
