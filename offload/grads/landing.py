"""Gradients leave the device during backward.

Every trainable parameter gets a post-accumulate-grad hook. When autograd has finished a
parameter's gradient for this backward, the hook hands it to the transport, which puts it into
that parameter's slice of its block's landing buffer and frees the device copy -- one crossing
per gradient per micro-batch, while backward goes on with earlier layers. With gradient
accumulation the landing buffer is fp32 and later micro-batches are added into it on the host.

As each parameter's *final* gradient of an accumulation window lands, its L2 norm is taken,
so the global norm (for clipping) and the inf/nan check (for fp16 loss scaling) are known the
moment backward ends and the optimizer step can start at once.

Three parts, each with one job:
  GradLanding (here)         the window's bookkeeping: which slots got a gradient, which are
                             final, their norms, when a block is done;
  storage (grad_storage.py)  the buffers: per block, pooled, double (the delayed update), or
                             none (adopted: autograd's own tensors, kept where they were made);
  transport (grad_transport.py)  how a gradient gets there: inline, or a CUDA side stream and
                             a landing worker.

Threading contract -- who calls what:
  main thread      attach / detach, begin_micro, wait, finish_window, missing, global_norm,
                   swap_sets, close; sets `on_block_done` before a backward and clears it when
                   backward returns (the step path does: offload/train/paths.py).
  backward         (autograd's thread: the main thread on CPU) the hooks -> transport.land:
                   inline, also land_host, after_land and so on_block_done; on CUDA it only
                   issues the copy.
  landing worker   (CUDA) land_host for staged copies, after_land -> on_block_done.
  step thread      buffer(bi) / release_buffer(bi) for a block whose gradients are final (after
                   its on_block_done, or after wait()); block_finite(bi) from on_block_done.
`touched` is written by the hooks, `landed` and `slot_norm` by whoever runs after_land (one
thread per configuration: inline on backward's, on CUDA the worker's); the main thread reads
them after wait(), which orders it after every landing (the transport's condition variable).
"""

from __future__ import annotations

import time
from typing import Callable, Literal

import torch

from offload.memory.blocks import Block, ParamSlot
from offload.config import GradStorageName
from offload.grads.storage import Adopted, Double, PerBlock, Pooled
from offload.grads.transport import Cuda, Inline
from offload.memory.tiers import LinkCounter, MemoryAccount, PlanBytes, no_pinning

NORM_CHUNK = 1 << 22  # elements cast to fp32 at a time when a 16-bit gradient's norm is taken


def landing_dtype(grad_dtype: torch.dtype, accum_steps: int) -> torch.dtype:
    """fp32 when micro-batches are summed (16-bit sums would lose precision), else the
    gradients' own dtype."""
    return torch.float32 if accum_steps > 1 else grad_dtype


def fp32_norm(flat: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a 1-D tensor, accumulated in fp32 (0-d fp32 tensor). A 16-bit tensor is
    cast a chunk at a time: vector_norm(dtype=float32) casts its whole input first, which for a
    tied 128K-vocabulary embedding is a 1.6 GB transient in the middle of backward. fp32
    input takes the single call, so fp32 results are exactly clip_grad_norm_'s."""
    if flat.dtype == torch.float32 or flat.numel() <= NORM_CHUNK:
        return torch.linalg.vector_norm(flat, dtype=torch.float32)
    parts = [torch.linalg.vector_norm(flat[i:i + NORM_CHUNK], dtype=torch.float32)
             for i in range(0, flat.numel(), NORM_CHUNK)]
    return torch.linalg.vector_norm(torch.stack(parts))


class GradLanding:
    def __init__(self, blocks: list[Block], grad_dtype: torch.dtype, accum_steps: int,
                 account: MemoryAccount, d2h: LinkCounter, *,
                 source_device: torch.device = torch.device("cpu"),
                 landing_tier: Literal["device", "host"] = "host", pin: bool = False,
                 storage: GradStorageName = "per_block", pool_buffers: int = 0,
                 pooled_blocks: set[int] | None = None, buffer_numels: list[int] | None = None,
                 zero=None, step_order: list[int] | None = None):
        """`landing_tier`: "device" keeps gradients where they are made (offload="none"), "host"
        moves them to host RAM; `storage` and `pool_buffers`: OffloadConfig.grad_landing();
        `buffer_numels`: landing buffer lengths when longer than the blocks (ZeRO's padding to
        equal shards, offload/zero/group.py; the tail stays zero). `zero`: the data-parallel group
        across ranks; its gradients are averaged later, so no per-parameter norm is taken here
        (ZeroGroup.global_norm takes it), and storage "sharded" (stage 2) reduces each block
        in `step_order` during backward (offload/zero/grads.py)."""
        self.blocks = blocks
        self.grad_dtype = grad_dtype
        self.accum_steps = accum_steps
        self.d2h = d2h
        # the asynchronous path: gradients produced on a GPU landing in host memory
        self.cuda = source_device.type == "cuda" and landing_tier == "host"
        self.device = source_device
        # Accumulating several micro-batches of 16-bit gradients in 16 bits would lose
        # precision, so with accumulation the landing buffer is fp32.
        self.landing_dtype = landing_dtype(grad_dtype, accum_steps)
        numels = buffer_numels or [b.numel for b in blocks]
        self.local_norms = zero is None
        if storage in ("sharded", "double_sharded"):
            from offload.zero.grads import ShardedLanding
            where = source_device if landing_tier == "device" else torch.device("cpu")
            self.storage = ShardedLanding(
                [b.numel for b in blocks], numels, self.landing_dtype, where, landing_tier, pin,
                account, zero, step_order, [len(b.slots) for b in blocks],
                sets=2 if storage == "double_sharded" else 1)
        elif storage == "pooled":
            assert accum_steps == 1 and landing_tier == "host" and pool_buffers > 0, \
                "pooled landing needs accum 1 on the host"
            self.storage = Pooled(
                numels, self.landing_dtype, pin, account, pool_buffers=pool_buffers,
                pooled_blocks=set(range(len(blocks))) if pooled_blocks is None else pooled_blocks,
                # from a GPU the others' buffers stay allocated: pinned memory is slow to
                # allocate, and autograd's transients are in device memory there
                lazy_rest=not self.cuda, incomplete=self.incomplete,
                names=[b.name for b in blocks])
        elif storage == "adopted":
            assert accum_steps == 1 and not self.cuda, "adopted gradients are never summed or moved"
            self.storage = Adopted(numels, landing_tier, account)
        else:
            kind = {"double": Double, "per_block": PerBlock}[storage]
            where = source_device if landing_tier == "device" else torch.device("cpu")
            self.storage = kind(numels, self.landing_dtype, where, landing_tier, pin, account)
        self.slot_norm: dict[str, torch.Tensor] = {}  # param name -> fp32 0-d norm (final grads)
        self.micro = 0  # micro-batch index inside the accumulation window
        # slots that received a gradient in this window (the first one overwrites the buffer,
        # later ones add) and slots whose gradient is final (norm taken)
        self.touched: list[set[str]] = [set() for _ in blocks]
        self.landed: list[set[str]] = [set() for _ in blocks]
        self.on_block_done: Callable[[int], None] | None = None  # block index, all grads final
        self._hooks: list = []
        self.transport = Cuda(self, source_device, pin, account) if self.cuda else Inline(self)

    @staticmethod
    def plan_bytes(numels: list[int], grad_dtype: torch.dtype, accum_steps: int, *,
                   cuda: bool, landing_tier: Literal["device", "host"], storage: GradStorageName,
                   pool_buffers: int, pooled_blocks: set[int] | None,
                   pin: Callable[[int], int], world: int = 1) -> PlanBytes:
        """What the constructor with these arguments allocates (`cuda`: gradients come from a
        GPU; `pin`: pinned_bytes when host buffers are pinned)."""
        itemsize = landing_dtype(grad_dtype, accum_steps).itemsize
        host_pin = pin if landing_tier == "host" else no_pinning
        if storage == "pooled":
            pooled = set(range(len(numels))) if pooled_blocks is None else pooled_blocks
            out = Pooled.plan_bytes(numels, itemsize, pool_buffers, pooled, host_pin)
        elif storage == "adopted":
            out = Adopted.plan_bytes(numels, itemsize, landing_tier)
        elif storage in ("sharded", "double_sharded"):
            from offload.zero.grads import ShardedLanding
            out = ShardedLanding.plan_bytes(numels, itemsize, landing_tier, world, host_pin,
                                            sets=2 if storage == "double_sharded" else 1)
        else:
            kind = {"double": Double, "per_block": PerBlock}[storage]
            out = kind.plan_bytes(numels, itemsize, landing_tier, host_pin)
        if cuda and landing_tier == "host":
            out.update(Cuda.plan_bytes(numels, grad_dtype.itemsize, accum_steps, pin))
        return out

    @property
    def landing(self) -> list[torch.Tensor | None]:
        """Each block's landing buffer (None: not held now -- pooled)."""
        return self.storage.landing

    @property
    def adopted(self) -> bool:
        """Gradients are autograd's own tensors, one per slot (no flat buffer: `slot_grad`)."""
        return isinstance(self.storage, Adopted)

    @property
    def pooled(self) -> bool:
        return isinstance(self.storage, Pooled)

    @property
    def sharded(self) -> bool:
        """ZeRO stage 2: only this rank's shard of each gradient is kept (zero_grads.py)."""
        return getattr(self.storage, "kind", None) == "sharded"

    def step_pieces(self, bi: int) -> dict[int, torch.Tensor]:
        """Block bi's gradient for the step as {first block offset: flat tensor}: the whole
        landing buffer, one tensor per slot (adopted), or this rank's shard (stage 2)."""
        if self.adopted:
            return {s.offset: self.storage.slot(bi, s.name) for s in self.blocks[bi].slots}
        if self.sharded:
            return {self.storage.ranges[bi][0]: self.storage.owned(bi)}
        return {0: self.buffer(bi)}

    def end_micro(self) -> None:
        """After a backward returned: stage 2 reduces every block not reduced yet (its
        gradients landed first: on CUDA, a wait for the copies of this micro-batch)."""
        if self.sharded:
            self.transport.wait()
            self.storage.end_micro()

    @property
    def stream(self):
        """The CUDA side stream the copies run on (None inline)."""
        return self.transport.stream

    @property
    def block_event(self) -> dict[int, "torch.cuda.Event"]:
        """CUDA: block -> event after the last kernel that produced one of its gradients."""
        return self.transport.block_event

    def incomplete(self, bi: int) -> bool:
        """Block bi still waits for some final gradient in this window."""
        return len(self.landed[bi]) < len(self.blocks[bi].slots)

    # -- hooks ------------------------------------------------------------------------------
    def attach(self) -> None:
        for bi, block in enumerate(self.blocks):
            for slot in block.slots:
                hook = self._make_hook(bi, slot)
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(hook))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def begin_micro(self, micro: int) -> None:
        self.micro = micro
        if micro == 0:
            self.slot_norm.clear()
            self.touched = [set() for _ in self.blocks]
            self.landed = [set() for _ in self.blocks]
        if self.sharded:  # the window's last reductions make each block's mean final
            self.storage.begin_micro(self.is_last_micro)

    @property
    def is_last_micro(self) -> bool:
        return self.micro == self.accum_steps - 1

    def _make_hook(self, bi: int, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            param.grad = None  # the device copy is freed as soon as the copy below is done
            # A slot's first gradient of the window overwrites, later ones add — by slot, not
            # by micro-batch index: a block may get no gradient in some micro-batches
            # (LayerDrop, conditional computation, frozen paths).
            first = slot.name not in self.touched[bi]
            self.touched[bi].add(slot.name)
            self.transport.land(bi, slot, grad, first)
        return hook

    def buffer(self, bi: int) -> torch.Tensor:
        """Block bi's landing buffer (pooled: taken from the pool on first use)."""
        return self.storage.buffer(bi)

    def swap_sets(self) -> list[dict[int, torch.Tensor]]:
        """Switch landing to the other set; returns the set just filled, as each block's
        step_pieces (the delayed update; call after wait() and finish_window())."""
        if self.sharded:  # this rank's shards (stage 2), keyed by their first block offset
            return [{lo: t} for (lo, _), t in zip(self.storage.ranges, self.storage.swap_sets())]
        assert isinstance(self.storage, Double), "swap_sets needs the double landing"
        return [{0: t} for t in self.storage.swap_sets()]

    def release_buffer(self, bi: int) -> None:
        """Block bi has been stepped (pooled: its buffer goes back to the pool)."""
        self.storage.release(bi)

    def slot_grad(self, bi: int, slot: ParamSlot) -> torch.Tensor:
        """Slot `slot` of block bi's gradient, 1-D: its slice of the landing buffer, or the
        adopted tensor itself."""
        if self.adopted:
            return self.storage.slot(bi, slot.name)
        return self.buffer(bi)[slot.offset:slot.offset + slot.numel]

    def land_host(self, bi: int, slot: ParamSlot, src: torch.Tensor, first: bool) -> bool:
        """Put `src` into slot's place (copy on the first gradient of the window, add after);
        False when nothing was copied: the gradient was adopted where it is."""
        if self.adopted:
            self.storage.adopt(bi, slot.name, src)
            return False
        dst = self.buffer(bi)[slot.offset:slot.offset + slot.numel]
        if first:
            dst.copy_(src)
        else:
            dst.add_(src)
        if self.sharded:  # the block's last gradient of this micro-batch starts its reduction
            self.storage.block_landed(bi)
        return True

    def after_land(self, bi: int, slot: ParamSlot) -> None:
        if self.local_norms:
            dst = self.slot_grad(bi, slot)
            # norm in fp32 whatever the landing dtype: the same number clip_grad_norm_
            # computes per parameter before combining them.
            self.slot_norm[slot.name] = fp32_norm(dst)
        landed = self.landed[bi]
        landed.add(slot.name)
        # read once: on CUDA this runs on the landing worker while the main thread clears the
        # attribute when backward returns; checking and then calling the attribute could call
        # None (desk review M1). A block whose callback was missed is stepped at step().
        on_done = self.on_block_done
        if len(landed) == len(self.blocks[bi].slots) and on_done is not None:
            on_done(bi)

    # -- completion -------------------------------------------------------------------------
    def wait(self) -> float:
        """Block until every issued gradient copy has landed. Returns seconds waited."""
        t0 = time.perf_counter()
        self.transport.wait()
        return time.perf_counter() - t0

    def finish_window(self) -> None:
        """After the last micro-batch (and wait()): a slot whose gradients came only in earlier
        micro-batches holds their sum, final now (PyTorch applies it too); a slot that got no
        gradient in the whole window (unused parameters) counts as a zero gradient."""
        for bi, block in enumerate(self.blocks):
            for slot in block.slots:
                if slot.name in self.landed[bi]:
                    continue
                if slot.name in self.touched[bi]:
                    self.after_land(bi, slot)  # on_block_done is unset: step() steps it
                elif self.sharded:  # zeros took part in its reduction (zero_grads.py)
                    self.landed[bi].add(slot.name)
                else:
                    if self.adopted:  # zeros to step from, as PerBlock's
                        self.storage.adopt(bi, slot.name, torch.zeros(
                            slot.numel, dtype=self.landing_dtype, device=self.device))
                    dst = self.slot_grad(bi, slot)
                    dst.zero_()
                    # on the landing buffer's device: offload="none" keeps the norms of the
                    # other slots on the GPU, and stack() needs one device (desk review L1)
                    self.slot_norm[slot.name] = torch.zeros((), dtype=torch.float32,
                                                            device=dst.device)
                    self.landed[bi].add(slot.name)
        if self.sharded:
            self.storage.finish_window()

    def missing(self) -> dict[int, set[str]]:
        """{block index: names of its slots that got no gradient in this window} (after
        finish_window); blocks whose slots all got one are left out."""
        out = {}
        for bi, block in enumerate(self.blocks):
            names = {s.name for s in block.slots} - self.touched[bi]
            if names:
                out[bi] = names
        return out

    def block_finite(self, bi: int) -> bool:
        """Every final gradient of block bi is finite (read off the norms taken as they landed)."""
        norms = [self.slot_norm[s.name] for s in self.blocks[bi].slots if s.name in self.slot_norm]
        return not norms or bool(torch.isfinite(torch.stack(norms)).all())

    def global_norm(self, names_in_order: list[str]) -> torch.Tensor:
        """The L2 norm over all gradients, combined as torch.nn.utils.clip_grad_norm_ does:
        the norm of the per-parameter norms, in parameter order."""
        return torch.linalg.vector_norm(torch.stack([self.slot_norm[n] for n in names_in_order]))

    def close(self) -> None:
        self.detach()
        self.transport.close()
