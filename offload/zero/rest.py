"""ZeRO stage 3's resident blocks: each rank keeps only its shard of their 16-bit weights, and
every module gathers its own parameters from the owners just before it runs.

At stage 3 the decoder layers are streamed from each rank's shard (offload/zero/group.py
ShardGather). What is left -- the non-layer block: embeddings, final norm, vocabulary head,
which for a 128K vocabulary is an eighth of an 8B model -- must not stay whole on every rank
either, or per-rank memory stops falling with N by exactly that much. It is one block for the
optimizer (its masters, moments and gradient shards are cut like any block's), but it is used
at two ends of the step: the embedding at the start of forward, the norm and head at its end
(and, through autograd, at the start of backward). So its 16-bit weights are gathered per
*module*, not per block:

  * the block's home on the device is this rank's shard [lo, hi) of its padded flat buffer;
    the optimizer step writes the updated shard there, and nothing is all-gathered after it;
  * a forward pre-hook on each module that owns some of the block's parameters (embed_tokens,
    norm, lm_head) fills, for each of them, a fresh tensor from the ranks whose shards overlap
    its range -- one broadcast per owner, of exactly the overlapping elements, so only that
    parameter's bytes are ever allocated (an all-gather of equal pieces would need the whole
    block) -- and binds the parameter to it;
  * the forward hook unbinds it again. What backward needs, autograd holds: the head's and the
    norm's weights are saved tensors of their products (packed as aliases of the gathered
    storage, since autograd saves a parameter as the variable itself), freed when those backward
    nodes have run; the embedding's backward needs no weight at all. So the peak is one module's
    parameters beside the rest (the head, held from its forward into the start of backward).

An unbound parameter is a zero-stride view of one NaN with the parameter's shape: autograd
accumulates a gradient into it as into the real one (a zero-size tensor would fail the shape
check), and the gradient landing hooks take it from there (offload/grads/landing.py). A model that uses
such a parameter outside its own module's forward (F.linear(x, self.embed.weight) in a parent)
computes NaNs, which the engine's non-finite loss check stops on -- never a silently different
number; models.llama's head is a module for this reason (VocabHead), as transformers' is. A
tied head is the embedding's parameter: gathered twice per forward, as a separate head would be.

Every rank runs the same forwards, so the hooks' broadcasts pair up in order on a process group
of their own (the streamer's gathers run on another, on its stage thread). Bytes are counted as
the stage-3 fetches are; ranks sent per update: 3x the block's 16-bit bytes x (N-1)/N at most.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from offload.memory.blocks import Block, replace_parameter
from offload.memory.tiers import MemoryAccount
from offload.zero.group import ZeroGroup


def unbound_like(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A parameter's stand-in while its weights are not gathered: the right shape, no memory,
    NaN wherever it is read (module docstring)."""
    return torch.full((1,), float("nan"), dtype=dtype, device=device).expand(shape)


class RestGather:
    """Stage 3: block `block` (resident, not a layer) kept as this rank's shard `home`; its
    modules gather their parameters from the owners around their forwards (module docstring)."""

    def __init__(self, model: nn.Module, block: Block, home: torch.Tensor, zero: ZeroGroup,
                 account: MemoryAccount, dtype: torch.dtype, device: torch.device):
        self.block, self.home, self.zero = block, home, zero
        self.account, self.dtype, self.device = account, dtype, device
        self.size = zero.shards(block.numel).size  # S: elements of each rank's shard
        self.group = dist.new_group(ranks=list(range(zero.world)))  # every rank calls it, once
        self._replace_meta(model)
        slots = {id(s.param): s for s in block.slots}
        self._hooks = []
        self._saving: dict[int, object] = {}  # module id -> its saved-tensor hooks while it runs
        for module in model.modules():
            owned = [(key, slots[id(p)]) for key, p in module._parameters.items()
                     if p is not None and id(p) in slots]
            if owned:
                self._hooks.append(module.register_forward_pre_hook(self._gather_hook(module, owned)))
                self._hooks.append(module.register_forward_hook(self._release_hook(module, owned)))
        self.unbind_all()

    # -- binding -----------------------------------------------------------------------------
    def _replace_meta(self, model: nn.Module) -> None:
        """A parameter on the meta device cannot take storage in place: a real one (unbound)
        replaces it in every module that holds it, as blocks.bind_views does."""
        for s in self.block.slots:
            if s.param.device.type != "meta":
                continue
            s.param = replace_parameter(model, s.param, nn.Parameter(
                unbound_like(s.shape, self.dtype, self.device), requires_grad=s.param.requires_grad))

    def unbind_all(self) -> None:
        for s in self.block.slots:
            s.param.data = unbound_like(s.shape, self.dtype, self.device)

    def gather(self, slot) -> torch.Tensor:
        """Slot `slot`'s full weights: from each rank whose shard overlaps its range, that part
        (this rank copies its own from the home)."""
        a, b = slot.offset, slot.offset + slot.numel
        out = torch.empty(slot.numel, dtype=self.dtype, device=self.device)
        S, rank = self.size, self.zero.rank
        for r in range(a // S, (b - 1) // S + 1):  # the owners of [a, b)
            pa, pb = max(a, r * S), min(b, (r + 1) * S)
            piece = out[pa - a:pb - a]
            if r == rank:
                piece.copy_(self.home[pa - r * S:pb - r * S])
            dist.broadcast(piece, src=r, group=self.group)
        self.zero.comm.add(self.zero.fetch_kind, slot.numel, out.element_size(), self.zero.world)
        return out.view(slot.shape)

    def _gather_hook(self, module: nn.Module, owned):
        def hook(_module, _args):
            stale = self._saving.pop(id(module), None)
            if stale is not None:  # its last forward raised before the forward hook ran
                stale.__exit__(None, None, None)
            gathered = {}
            for _key, slot in owned:
                slot.param.data = self.gather(slot)
                gathered[slot.param.untyped_storage().data_ptr()] = slot.param.detach()
                self.account.add("device", "buffers", slot.numel * self.dtype.itemsize)
            # Autograd saves a parameter (a leaf) as the variable itself, not its storage: in
            # backward it would read whatever .data is bound then -- the NaN stand-in. So while
            # this module runs, a saved parameter is packed as a detached alias of the gathered
            # storage, which then lives exactly as long as the backward node that saved it.
            def pack(t):
                alias = gathered.get(t.untyped_storage().data_ptr()) if t.device == self.device else None
                return t if alias is None or alias.shape != t.shape else alias
            self._saving[id(module)] = ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx.__enter__()
        return hook

    def _release_hook(self, module: nn.Module, owned):
        def hook(_module, _args, _out):
            self._saving.pop(id(module)).__exit__(None, None, None)
            for _key, slot in owned:
                slot.param.data = unbound_like(slot.shape, self.dtype, self.device)
                self.account.sub("device", "buffers", slot.numel * self.dtype.itemsize)
        return hook

    def close(self) -> None:
        for ctx in self._saving.values():  # a forward that raised left its hooks pushed
            ctx.__exit__(None, None, None)
        self._saving.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def largest_module_numel(model: nn.Module, blocks: list[Block]) -> int:
    """The most elements one module's forward gathers: the sum over its own parameters that
    belong to `blocks` (the resident blocks at stage 3), largest over the modules; what
    train_plan counts for the gathers."""
    ours = {id(s.param): s.numel for b in blocks for s in b.slots}
    return max((sum(ours[id(p)] for p in m._parameters.values() if p is not None and id(p) in ours)
                for m in model.modules()), default=0)
