"""Gradients leave the device during backward.

Every trainable parameter gets a post-accumulate-grad hook. When autograd has finished a
parameter's gradient for this backward, the hook copies it device->host into that
parameter's slice of its block's landing buffer and frees the device copy — one crossing per
gradient per micro-batch, while backward goes on with earlier layers. With gradient
accumulation the landing buffer is fp32 and later micro-batches are added into it on the host.

As each parameter's *final* gradient of an accumulation window lands, its L2 norm is taken,
so the global norm (for clipping) and the inf/nan check (for fp16 loss scaling) are known the
moment backward ends and the optimizer step can start at once.

On CUDA the copies run on a side stream (ordered after the producing kernels by an event),
into pinned memory, and a worker thread does the host-side part (accumulate, norm) once each
copy's event completes, so the Python thread driving backward never blocks on a copy. On the
CPU device the same steps run inline in the hook.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable

import torch

from offload.blocks import Block, ParamSlot
from offload.gpu import host_delay, host_event, on_stream, side_stream_delay
from offload.tiers import LinkCounter, MemoryAccount, host_empty, host_zeros


POOL_TIMEOUT_S = 600.0
NORM_CHUNK = 1 << 22  # elements cast to fp32 at a time when a 16-bit gradient's norm is taken
# On CUDA, device gradients waiting for their copy to the host are bounded to this many of the
# largest block's gradients: past it the hook waits for the oldest copy (back-pressure), so the
# caching allocator never holds an unplanned backlog of up to the whole model's gradients
# (train_plan counts exactly this bound; desk review M5).
D2H_BACKLOG_BLOCKS = 2


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
                 landing_device: torch.device = torch.device("cpu"), pin: bool = False,
                 pool_buffers: int = 0, pooled_blocks: set[int] | None = None):
        self.blocks = blocks
        self.grad_dtype = grad_dtype
        self.accum_steps = accum_steps
        self.d2h = d2h
        # the asynchronous path: gradients produced on a GPU landing in host memory
        self.cuda = source_device.type == "cuda" and landing_device.type == "cpu"
        self.device = source_device
        # Accumulating several micro-batches of 16-bit gradients in 16 bits would lose
        # precision, so with accumulation the landing buffer is fp32.
        self.landing_dtype = torch.float32 if accum_steps > 1 else grad_dtype
        tier = "host" if landing_device.type == "cpu" else "device"
        # Pooled landing (the overlapped step without accumulation): each block's gradients are
        # consumed by its step as soon as they are complete, so a few block-sized buffers,
        # taken when a block's first gradient lands and given back after its step, replace one
        # buffer per block — host memory for gradients no longer grows with the model.
        self.pooled = pool_buffers > 0
        self._lazy: set[int] = set()  # buffers made at first landing, freed after the step
        self._extra: set[int] = set()  # the same, made when the pool cannot serve (_take_pooled)
        self._account, self._pin_landing = account, pin
        self.landing: list[torch.Tensor | None]
        if self.pooled:
            assert accum_steps == 1 and tier == "host", "pooled landing needs accum 1 on the host"
            # the layers share the pool; other blocks (embeddings, head: their gradients are
            # complete only at the very end of backward) keep a buffer of their own
            self._pooled = set(range(len(blocks))) if pooled_blocks is None else set(pooled_blocks)
            largest = max(blocks[i].numel for i in self._pooled)
            self._pool: queue.Queue = queue.Queue()
            for _ in range(pool_buffers):
                self._pool.put(host_zeros(largest, self.landing_dtype, pin))
            account.add(tier, "grads", pool_buffers * largest * self.landing_dtype.itemsize)
            # When gradients come from the CPU, those buffers are made when their first
            # gradient lands and freed after their step: autograd's own transients for the
            # same block (a tied embedding's two dense gradients and their sum: three
            # vocab x hidden tensors) peak just before, and would otherwise sit on top of a
            # buffer held since start-up. From a GPU they stay allocated: pinned memory is
            # slow to allocate, and autograd's transients are in device memory there.
            self._lazy = set() if self.cuda else set(range(len(blocks))) - self._pooled
            self.landing = [None if i in self._pooled or i in self._lazy else
                            host_zeros(b.numel, self.landing_dtype, pin)
                            for i, b in enumerate(blocks)]
            for i, b in enumerate(blocks):
                if i not in self._pooled and i not in self._lazy:
                    account.add(tier, "grads", b.numel * self.landing_dtype.itemsize)
            self._base: list[torch.Tensor | None] = [None] * len(blocks)
            self.pool_wait_s = 0.0
        else:
            self.landing = [host_zeros(b.numel, self.landing_dtype, pin) if tier == "host" else
                            torch.zeros(b.numel, dtype=self.landing_dtype, device=landing_device)
                            for b in blocks]
            for t in self.landing:
                account.add(tier, "grads", t.numel() * t.element_size())
        # A device->host copy cannot add into its destination, so on CUDA with accumulation
        # each micro-batch lands in a pinned staging buffer first and is added on the host.
        self.staging: list[torch.Tensor] | None = None
        if self.cuda and accum_steps > 1:
            self.staging = [host_empty(b.numel, grad_dtype, pin) for b in blocks]
            for t in self.staging:
                account.add("host", "buffers", t.numel() * t.element_size())
        self.slot_norm: dict[str, torch.Tensor] = {}  # param name -> fp32 0-d norm (final grads)
        self.micro = 0  # micro-batch index inside the accumulation window
        # slots that received a gradient in this window (the first one overwrites the buffer,
        # later ones add) and slots whose gradient is final (norm taken)
        self.touched: list[set[str]] = [set() for _ in blocks]
        self.landed: list[set[str]] = [set() for _ in blocks]
        self.on_block_done: Callable[[int], None] | None = None  # block index, all grads final
        self.block_event: dict[int, "torch.cuda.Event"] = {}
        self._hooks: list = []
        self._errors: list[BaseException] = []
        if self.cuda:
            self.stream = torch.cuda.Stream(source_device)
            self._work: queue.Queue = queue.Queue()
            self._pending = 0
            self._cv = threading.Condition()
            # staging slices a copy has been issued into whose host add has not run yet: the
            # next micro-batch's copy into the same slice waits for it (_land_cuda)
            self._staged_busy: set[tuple[int, str]] = set()
            # (copied event, bytes) of the copies in flight on the side stream, oldest first
            self._in_flight: collections.deque = collections.deque()
            self._in_flight_bytes = 0
            self.backlog_bytes = D2H_BACKLOG_BLOCKS * max(b.numel for b in blocks) * grad_dtype.itemsize
            self._worker = threading.Thread(target=self._run_worker, daemon=True,
                                            name="offload-grad-landing")
            self._worker.start()

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

    @property
    def is_last_micro(self) -> bool:
        return self.micro == self.accum_steps - 1

    def _make_hook(self, bi: int, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            param.grad = None  # the device copy is freed as soon as the copy below is done
            nbytes = grad.numel() * grad.element_size()
            # A slot's first gradient of the window overwrites, later ones add — by slot, not
            # by micro-batch index: a block may get no gradient in some micro-batches
            # (LayerDrop, conditional computation, frozen paths).
            first = slot.name not in self.touched[bi]
            self.touched[bi].add(slot.name)
            if self.cuda:
                self._land_cuda(bi, slot, grad, first)
            else:
                t0 = time.perf_counter()
                self._land_host(bi, slot, grad.reshape(-1), first)
                self.d2h.add(nbytes, time.perf_counter() - t0)
                if self.is_last_micro:
                    self._after_land(bi, slot)
                return
            self.d2h.add(nbytes)
        return hook

    def buffer(self, bi: int) -> torch.Tensor:
        """Block bi's landing buffer (pooled: taken from the pool on first use)."""
        t = self.landing[bi]
        if t is None and bi in self._lazy:
            # every slot is overwritten by its gradient or zeroed by finish_window before use
            t = self.landing[bi] = host_empty(self.blocks[bi].numel, self.landing_dtype,
                                              self._pin_landing)
            self._account.add("host", "grads", t.numel() * t.element_size())
        elif t is None:
            t0 = time.perf_counter()
            base = self._take_pooled(bi)
            self.pool_wait_s += time.perf_counter() - t0
            if base is None:  # see _take_pooled: a buffer of its own, freed after its step
                self._extra.add(bi)
                t = self.landing[bi] = host_empty(self.blocks[bi].numel, self.landing_dtype,
                                                  self._pin_landing)
                self._account.add("host", "grads", t.numel() * t.element_size())
                return t
            self._base[bi] = base
            t = self.landing[bi] = base[:self.blocks[bi].numel]
        return t

    def _take_pooled(self, bi: int) -> torch.Tensor | None:
        """A pool buffer; None when every pool buffer is held by a block still waiting for
        gradients (one that got no gradient for some parameter completes only at step()):
        waiting would never end, so the caller makes a buffer of its own instead."""
        deadline = time.perf_counter() + POOL_TIMEOUT_S
        while True:
            try:
                return self._pool.get(timeout=0.02)
            except queue.Empty:
                held = [i for i, b in enumerate(self._base) if b is not None]
                if held and all(len(self.landed[i]) < len(self.blocks[i].slots) for i in held):
                    return None
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"gradient landing pool exhausted for {POOL_TIMEOUT_S} s "
                                       f"(block {self.blocks[bi].name}); the step thread is not "
                                       f"returning buffers") from None

    def add_second_set(self) -> None:
        """A second full set of landing buffers (the delayed update: a job steps from one set
        while the next backward lands in the other). Not with pooling."""
        assert not self.pooled and all(t is not None and t.device.type == "cpu" for t in self.landing)
        self._other = [host_zeros(t.numel(), t.dtype, self._pin_landing) for t in self.landing]
        for t in self._other:
            self._account.add("host", "grads", t.numel() * t.element_size())

    def swap_sets(self) -> list[torch.Tensor]:
        """Switch landing to the other set; returns the set just filled (call after wait())."""
        filled, self.landing, self._other = self.landing, self._other, self.landing
        return filled

    def release_buffer(self, bi: int) -> None:
        """Pooled: block bi has been stepped; its buffer goes back to the pool (or is freed,
        for a lazily made one)."""
        if self.pooled and (bi in self._lazy or bi in self._extra) and self.landing[bi] is not None:
            self._extra.discard(bi)
            t, self.landing[bi] = self.landing[bi], None
            self._account.sub("host", "grads", t.numel() * t.element_size())
        elif self.pooled and bi in self._pooled and self._base[bi] is not None:
            base, self._base[bi], self.landing[bi] = self._base[bi], None, None
            self._pool.put(base)

    def _land_host(self, bi: int, slot: ParamSlot, src: torch.Tensor, first: bool) -> None:
        dst = self.buffer(bi)[slot.offset:slot.offset + slot.numel]
        if first:
            dst.copy_(src)
        else:
            dst.add_(src)

    def _after_land(self, bi: int, slot: ParamSlot) -> None:
        dst = self.buffer(bi)[slot.offset:slot.offset + slot.numel]
        # norm in fp32 whatever the landing dtype: the same number clip_grad_norm_ computes
        # per parameter before combining them.
        self.slot_norm[slot.name] = fp32_norm(dst)
        landed = self.landed[bi]
        landed.add(slot.name)
        # read once: on CUDA this runs on the landing worker while the main thread clears the
        # attribute when backward returns; checking and then calling the attribute could call
        # None (desk review M1). A block whose callback was missed is stepped at step().
        on_done = self.on_block_done
        if len(landed) == len(self.blocks[bi].slots) and on_done is not None:
            on_done(bi)

    # -- CUDA path --------------------------------------------------------------------------
    def _land_cuda(self, bi: int, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        # The gradient was produced by kernels on the backward's current stream; the side
        # stream must not read it before they finish, hence the event wait (not a device sync).
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        # the latest such event of a block marks the point after every kernel that read its
        # weights in this backward: an overlapped step may overwrite them after it
        self.block_event[bi] = produced
        # a slot's first gradient of a window overwrites, so it can land straight in the landing
        # buffer when no dtype change is needed; anything else goes through staging + a host add.
        direct = first and self.landing_dtype == self.grad_dtype
        if not direct:
            # One staging slice per slot serves every micro-batch. A DMA into pinned memory is
            # ordered only by its stream, so nothing on the GPU stops this copy from landing
            # while the worker still reads the previous micro-batch's values out of the same
            # slice (lost and double-counted gradients; desk review H1): that order is made
            # here, on the host, before the copy is issued. The worker is usually done long
            # before, so this rarely waits.
            key = (bi, slot.name)
            with self._cv:
                self._cv.wait_for(lambda: key not in self._staged_busy)
                self._staged_busy.add(key)
        nbytes = grad.numel() * grad.element_size()
        self._bound_backlog(nbytes)
        dst_buf = self.buffer(bi) if direct else self.staging[bi]  # type: ignore[index]
        dst = dst_buf[slot.offset:slot.offset + slot.numel]
        with on_stream(self.stream):
            self.stream.wait_event(produced)
            side_stream_delay(self.stream)  # test knob (offload/gpu.py): a late copy
            dst.copy_(grad.reshape(-1), non_blocking=True)
            # the caching allocator may hand this memory to someone else once the Python
            # reference is gone; record_stream keeps it until the side stream's copy is done
            grad.record_stream(self.stream)
            copied = host_event()  # the worker sleeps on it (blocking event, not a spin)
            copied.record(self.stream)
        self._in_flight.append((copied, nbytes))
        self._in_flight_bytes += nbytes
        with self._cv:
            self._pending += 1
        self._work.put((copied, bi, slot, None if direct else dst, first, self.micro))

    def _bound_backlog(self, nbytes: int) -> None:
        """Keep the device gradients still waiting for their copy within backlog_bytes: drop
        finished copies from the front (query: no wait), then, if still over, wait for the
        oldest ones (autograd's thread blocks: backward produces faster than the link drains)."""
        while self._in_flight and (self._in_flight[0][0].query() or
                                   self._in_flight_bytes + nbytes > self.backlog_bytes):
            ev, n = self._in_flight.popleft()
            ev.synchronize()
            self._in_flight_bytes -= n

    def _run_worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            copied, bi, slot, staged, first, micro = item
            try:
                copied.synchronize()  # blocks this worker only; releases the GIL
                host_delay()  # test knob (offload/gpu.py): a slow worker
                if staged is not None:
                    self._land_host(bi, slot, staged, first)
                if micro == self.accum_steps - 1:
                    self._after_land(bi, slot)
            except BaseException as e:  # surfaced to the caller in wait()
                self._errors.append(e)
            finally:
                with self._cv:
                    self._pending -= 1
                    if staged is not None:
                        self._staged_busy.discard((bi, slot.name))
                    self._cv.notify_all()

    # -- completion -------------------------------------------------------------------------
    def wait(self) -> float:
        """Block until every issued gradient copy has landed. Returns seconds waited."""
        t0 = time.perf_counter()
        if self.cuda:
            with self._cv:
                self._cv.wait_for(lambda: self._pending == 0)
            self._in_flight.clear()  # every copy is done: the worker waited on each
            self._in_flight_bytes = 0
        if self._errors:
            raise self._errors.pop(0)
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
                    self._after_land(bi, slot)  # on_block_done is unset: step() steps it
                else:
                    dst = self.buffer(bi)[slot.offset:slot.offset + slot.numel]
                    dst.zero_()
                    # on the landing buffer's device: offload="none" keeps the norms of the
                    # other slots on the GPU, and stack() needs one device (desk review L1)
                    self.slot_norm[slot.name] = torch.zeros((), dtype=torch.float32,
                                                            device=dst.device)
                    self.landed[bi].add(slot.name)

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
        if self.cuda:
            self._work.put(None)
            self._worker.join(timeout=5)
