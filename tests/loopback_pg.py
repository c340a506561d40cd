"""A process group of 2 ranks held by one process: rank 0, whose peer (rank 1) mirrors it.

The 1-GPU stand-in for the ZeRO-3 paths that a GPU machine with one device cannot reach with
NCCL (review 2, section 2, gap 1): every collective runs locally, on the tensors' own device
and the calling thread's current stream, as if rank 1 held what rank 0 holds --
  all-gather        every part is a copy of this rank's part;
  reduce-scatter    this rank's part of the input, times 2 (the mirror's equal gradient);
  all-reduce        SUM doubles, MIN / MAX / AVG leave the tensor as it is;
  broadcast         from rank 0: nothing to do; from rank 1: seeded random numbers, the same at
                    every call (what the mirror holds of a module rank 0 does not hold);
  barrier           nothing.
The numbers are not those of any real 2-rank job, but they are finite and deterministic, and
rank 0 runs every line of its stage-3 code: the shard homes, the sharded fetch (its copy, then
the gather), the step into the homes, the gathers of the non-layer modules.

    with loopback_world():
        engine = offload.initialize(model, dict(..., zero_stage=3))
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, BarrierOptions,
                                        BroadcastOptions, ReduceOp, ReduceScatterOptions,
                                        _create_work_from_future)
from torch.futures import Future

WORLD = 2
BACKEND = "offload_loopback"


def _done(result=None):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class LoopbackGroup(dist.ProcessGroup):
    """Rank 0 of WORLD, its peers mirrors of it (module docstring)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensor_list, opts=AllreduceOptions()):
        if opts.reduceOp == ReduceOp.SUM:
            for t in tensor_list:
                t.mul_(self._world)
        return _done(tensor_list)

    def allreduce_coalesced(self, tensor_list, opts=AllreduceOptions()):
        return self.allreduce(tensor_list, opts)

    def barrier(self, opts=BarrierOptions()):
        return _done()

    def broadcast(self, tensor_list, opts=BroadcastOptions()):
        if opts.rootRank != self._rank:
            for t in tensor_list:  # what the mirror holds of a module: seeded, the same each time
                g = torch.Generator().manual_seed(t.numel())
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
        return _done(tensor_list)

    def allgather(self, output_tensors, input_tensor, opts=AllgatherOptions()):
        for outs, t in zip(output_tensors, input_tensor):
            for o in outs:
                if o.data_ptr() != t.data_ptr():
                    o.copy_(t)
        return _done(output_tensors)

    def all_gather_single(self, output_tensor, input_tensor, opts=AllgatherOptions()):
        return self.allgather([list(output_tensor.chunk(self._world))], [input_tensor], opts)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=ReduceScatterOptions()):
        mine = input_tensor.chunk(self._world)[self._rank]
        output_tensor.copy_(mine)
        if opts.reduceOp == ReduceOp.SUM:
            output_tensor.mul_(self._world)
        return _done(output_tensor)

    _reduce_scatter_base = reduce_scatter_single


def _create(prefix_store, rank, world_size, timeout):
    return LoopbackGroup(rank, world_size)


_registered = False


@contextlib.contextmanager
def loopback_world():
    """The default process group is a LoopbackGroup (rank 0 of 2) inside; destroyed after."""
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
        _registered = True
    assert not dist.is_initialized(), "a process group exists already"
    dist.init_process_group(BACKEND, rank=0, world_size=WORLD, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def loopback_run(cfg: dict, model_fn, batches, loss_fn) -> tuple[dict, list[float]]:
    """Train `model_fn()` under loopback_world() on rank 0's half of each batch: (masters,
    losses)."""
    import offload
    with loopback_world():
        model = model_fn()
        engine = offload.initialize(model, cfg)
        losses = []
        try:
            for ids in batches:
                loss = loss_fn(model, ids[:ids.shape[0] // WORLD])
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            return engine.master_params(), losses
        finally:
            engine.close()
