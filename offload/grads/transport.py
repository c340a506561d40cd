"""How a finished gradient reaches its landing buffer (offload/grads/landing.py holds the bookkeeping,
offload/grads/storage.py the buffers).

  Inline  the gradient is where it lands or a plain copy away (the CPU device; offload="none"
          on a GPU): the hook copies or adds it in, takes its norm, and may step its block,
          all on the thread that runs backward.
  Cuda    a GPU gradient landing in host memory: the hook only issues an asynchronous copy on
          a side stream (ordered after the producing kernels by an event) into pinned memory
          and queues it; a worker thread waits for each copy's event and does the host part
          (the add, the norm, the block-done callback). The thread driving backward never
          blocks on a copy, except for back-pressure (_bound_backlog, and a staging slice still
          being read: desk review H1/M5).

Threads (Cuda): `land` runs on autograd's thread; `_run_worker` on the worker; `wait` and
`close` on the main thread. `_pending` and `_staged_busy` are shared between them and guarded
by `_cv`; `_in_flight` is touched by `land` and by `wait` (which runs only once backward has
returned, so never beside `land`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable, Protocol, Sequence

import torch

from offload.memory.blocks import Block, ParamSlot
from offload.gpu import host_delay, host_event, on_stream, side_stream_delay
from offload.memory.tiers import LinkCounter, MemoryAccount, PlanBytes, host_empty, no_pinning


class Landing(Protocol):
    """What a transport needs of the gradients' bookkeeping (offload/grads/landing.py's GradLanding
    passes itself): the blocks and dtypes, where a block's gradient lands, and the host part
    of landing one (the add, the norm, the block-done callback)."""
    blocks: Sequence[Block]
    grad_dtype: torch.dtype
    landing_dtype: torch.dtype
    accum_steps: int
    micro: int
    d2h: LinkCounter

    @property
    def is_last_micro(self) -> bool: ...

    def buffer(self, bi: int) -> torch.Tensor: ...

    def land_host(self, bi: int, slot: ParamSlot, src: torch.Tensor, first: bool) -> bool: ...

    def after_land(self, bi: int, slot: ParamSlot) -> None: ...

# On CUDA, device gradients waiting for their copy to the host are bounded to this many of the
# largest block's gradients: past it the hook waits for the oldest copy (back-pressure), so the
# caching allocator never holds an unplanned backlog of up to the whole model's gradients
# (train_plan counts exactly this bound; desk review M5).
D2H_BACKLOG_BLOCKS = 2


class Inline:
    cuda = False
    stream = None

    def __init__(self, landing: Landing):
        self.landing = landing
        self.block_event: dict[int, "torch.cuda.Event"] = {}  # none: nothing runs async

    def land(self, bi: int, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        g = self.landing
        t0 = time.perf_counter()
        if g.land_host(bi, slot, grad.reshape(-1), first):  # adopted: nothing crossed
            g.d2h.add(grad.numel() * grad.element_size(), time.perf_counter() - t0)
        if g.is_last_micro:
            g.after_land(bi, slot)

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class Cuda:
    cuda = True

    def __init__(self, landing: Landing, device: torch.device, pin: bool,
                 account: MemoryAccount):
        self.landing = landing
        self.device = device
        numels = [b.numel for b in landing.blocks]
        # A device->host copy cannot add into its destination, so with accumulation each
        # micro-batch lands in a pinned staging buffer first and is added on the host.
        self.staging: list[torch.Tensor] | None = None
        if landing.accum_steps > 1:
            self.staging = [host_empty(n, landing.grad_dtype, pin) for n in numels]
            for t in self.staging:
                account.add("host", "buffers", t.numel() * t.element_size())
        self.block_event: dict[int, "torch.cuda.Event"] = {}
        self.stream = torch.cuda.Stream(device)
        self.errors: list[BaseException] = []  # the worker's, raised by wait()
        self._work: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        # staging slices a copy has been issued into whose host add has not run yet: the
        # next micro-batch's copy into the same slice waits for it (land)
        self._staged_busy: set[tuple[int, str]] = set()
        # (copied event, bytes) of the copies in flight on the side stream, oldest first
        self._in_flight: collections.deque = collections.deque()
        self._in_flight_bytes = 0
        self.backlog_bytes = D2H_BACKLOG_BLOCKS * max(numels) * landing.grad_dtype.itemsize
        self.worker = threading.Thread(target=self._run_worker, daemon=True,
                                       name="offload-grad-landing")
        self.worker.start()

    @staticmethod
    def plan_bytes(numels: list[int], itemsize: int, accum_steps: int,
                   pin: Callable[[int], int] = no_pinning) -> PlanBytes:
        """Staging (accumulation) and the device gradients the backlog bound lets wait."""
        out = {("device", "grads"): D2H_BACKLOG_BLOCKS * max(numels) * itemsize}
        if accum_steps > 1:
            out["host", "buffers"] = sum(pin(n * itemsize) for n in numels)
        return out

    def land(self, bi: int, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        g = self.landing
        # The gradient was produced by kernels on the backward's current stream; the side
        # stream must not read it before they finish, hence the event wait (not a device sync).
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        # the latest such event of a block marks the point after every kernel that read its
        # weights in this backward: an overlapped step may overwrite them after it
        self.block_event[bi] = produced
        # a slot's first gradient of a window overwrites, so it can land straight in the landing
        # buffer when no dtype change is needed; anything else goes through staging + a host add.
        direct = first and g.landing_dtype == g.grad_dtype
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
        dst_buf = g.buffer(bi) if direct else self.staging[bi]  # type: ignore[index]
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
        self._work.put((copied, bi, slot, None if direct else dst, first, g.micro))
        g.d2h.add(nbytes)

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
        g = self.landing
        torch.cuda.set_device(self.device)  # a new thread starts on device 0 (review 2 P8)
        while True:
            item = self._work.get()
            if item is None:
                return
            copied, bi, slot, staged, first, micro = item
            try:
                copied.synchronize()  # blocks this worker only; releases the GIL
                host_delay()  # test knob (offload/gpu.py): a slow worker
                if staged is not None:
                    g.land_host(bi, slot, staged, first)
                if micro == g.accum_steps - 1:
                    g.after_land(bi, slot)
            except BaseException as e:  # surfaced to the caller in wait()
                self.errors.append(e)
            finally:
                with self._cv:
                    self._pending -= 1
                    if staged is not None:
                        self._staged_busy.discard((bi, slot.name))
                    self._cv.notify_all()

    def wait(self) -> None:
        """Until every issued copy has landed and been handled by the worker."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)
        self._in_flight.clear()  # every copy is done: the worker waited on each
        self._in_flight_bytes = 0
        if self.errors:
            raise self.errors.pop(0)

    def close(self) -> None:
        self._work.put(None)
        self.worker.join(timeout=5)
