"""Routed experts as their own placement unit: each expert of each mixture-of-experts layer lives
on the device, in host RAM or on NVMe by itself, and only the experts a step routes tokens to are
brought to where they are computed.

The block streamer (streamer.py) moves a layer's *dense part* (attention, norms, router) as it
moves any block; the layer's experts are left out of its flat buffer (`skip`) and handed to an
`ExpertStore`. An MoE module asks the store for the experts that got tokens, in ascending order
(`experts(layer, hit, x)`, a generator), and computes each one as it is yielded:

  device  the expert's weights stay on the device, bound once;
  cpu     in host RAM (pinned under CUDA). `compute="where"`: bound there once and computed on the
          CPU, only the tokens' activations cross the link (llama.cpp's --cpu-moe, KTransformers);
          `compute="copy"`: copied into a device buffer when routed. On a CPU device both are the
          same memory: bound in place (unless `zero_copy_host=False`, which tests use to run the
          copy path the GPU takes);
  nvme    read from its file ranges (the checkpoint's safetensors, or the quantized cache) into a
          buffer when routed, each expert one read per contiguous run, O_DIRECT where the buffer
          can be lined up with the file.

Buffers: one pool of `window + prefetch_slots + cache_slots` buffers, each the largest expert,
allocated once (memory flat in the number of experts). At most `window` are read ahead for the
running layer (its experts are consumed in order, the next read queued as one is used), at most
`prefetch_slots` hold the *next* layer's predicted experts, at most `cache_slots` keep experts
bound after use (the expert cache). Prediction: the next MoE layer's router applied to this
layer's input (a copy of every router is kept for that), its top-k per token; the reads are
queued once this layer's last own read is queued, so they never delay it. Precision and recall
of the prediction are counted against what the next layer then routes.

The cache: per-layer routing counts decayed by `decay` at each call of the layer (frequency over
a recent window); after use an expert is kept if the cache has room or if its count beats the
coldest kept expert's (which is evicted). Cached experts stay bound, so a hit costs nothing. The
bytes are the same either way: outputs are bit-identical with and without the cache.

Ordering under CUDA (not yet run on a GPU): reads land in pinned staging; the copy into a device
buffer is issued on `copy_stream` after the buffer's `free` event (recorded on the compute stream
when its previous expert was released), and the compute stream waits on the buffer's `ready`
event before the expert runs -- no host synchronisation of the device.
"""

from __future__ import annotations

import collections
import time
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nvme.io import ALIGN, IOEngine, aligned_empty
from offload.gpu import on_stream
from offload.memory.blocks import Block, bind_views
from offload.memory.layout import StreamError, TensorRange, layout_block, verify_ranges
from offload.memory.tiers import host_aligned
from offload.stream.expert_placement import COMPUTE_MODES, EXPERT_HOMES, ExpertStats, host_arenas
from offload.stream.slots import byte_view

class _Buffer:
    """One pool buffer: `raw` where experts are computed (the device, or 4 KiB-aligned host
    memory on a CPU device); `staging` (host) where NVMe bytes land first under CUDA or when
    they must be converted; `host` where an NVMe expert is converted for the CPU under CUDA."""

    def __init__(self, raw: torch.Tensor, staging: torch.Tensor | None, host: torch.Tensor | None,
                 cuda: bool):
        self.raw, self.staging, self.host = raw, staging, host
        self.owner: tuple[int, int] | None = None
        self.kind = ""  # "demand", "prefetch" or "cache" while owned
        self.handles: list = []  # reads in flight into it
        self.on: str | None = None  # "device" or "host": where the bound expert is computed
        self.free = torch.cuda.Event() if cuda else None
        self.free_recorded = False
        self.ready = torch.cuda.Event() if cuda else None


class ExpertStore:
    """Every routed expert of the model's MoE layers, placed one by one (see the module docstring).

    experts: per model layer, the MoE layer's ModuleList of experts (None for a dense layer).
    homes: per model layer, one of EXPERT_HOMES per expert (None for a dense layer).
    files: per layer, per expert, where its parameters are stored (names relative to the expert
    module); required for nvme experts, else the source when given (else the modules' values).
    routers: per layer, (weight, bias or None) of the router, for the next-layer prediction; None
    disables prediction there. top_k: experts per token; predict_k: experts per token the
    prediction names (default top_k: more raise its recall, and the bytes read ahead).
    dtype: the compute dtype, or torch.uint8 for quantized experts (byte blocks, as the streamer).
    compute (under CUDA, for experts not on the device): "copy" to the device, "where" on the
    CPU, or "auto": on the CPU when a call routes at most `where_max_tokens` tokens per expert
    on average (the planner's cost model sets it), else copied."""

    def __init__(self, experts: Sequence[nn.ModuleList | None], homes: Sequence[Sequence[str] | None], *,
                 device: torch.device | str, dtype: torch.dtype,
                 files: Sequence[Sequence[Sequence[TensorRange]] | None] | None = None,
                 routers: Sequence[tuple[torch.Tensor, torch.Tensor | None] | None] | None = None,
                 top_k: int = 1, predict_k: int | None = None, window: int = 2,
                 prefetch_slots: int = 0, cache_slots: int = 0,
                 decay: float = 0.95, compute: str = "copy", where_max_tokens: float = 0.0,
                 zero_copy_host: bool | None = None, pin: bool = True, io: IOEngine | None = None):
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        if compute not in COMPUTE_MODES:
            raise StreamError(f"compute must be one of {COMPUTE_MODES}")
        if window < 1 or prefetch_slots < 0 or cache_slots < 0:
            raise StreamError("window must be >= 1, prefetch_slots and cache_slots >= 0")
        self.zero_copy_host = (not self.cuda) if zero_copy_host is None else zero_copy_host
        if self.cuda and self.zero_copy_host:
            raise StreamError("zero_copy_host is only possible when the device is the CPU")
        self.compute = compute
        # the most tokens per routed expert (call average) computed on the CPU under CUDA
        self.where_max_tokens = (float("inf") if compute == "where" else
                                 -1.0 if compute == "copy" or not self.cuda else where_max_tokens)
        self.pin = pin and self.cuda
        self.top_k, self.window, self.decay = top_k, window, decay
        self.predict_k = predict_k or top_k
        self.quota = {"prefetch": prefetch_slots, "cache": cache_slots}
        self.stats = ExpertStats()
        self.layers = [i for i, e in enumerate(experts) if e is not None]
        self.modules = {i: experts[i] for i in self.layers}
        self.homes: dict[int, list[str]] = {}
        self.blocks: dict[tuple[int, int], Block] = {}
        self._runs: dict[tuple[int, int], list] = {}
        self._checks: dict[tuple[int, int], list] = {}
        self._shift: dict[tuple[int, int], int] = {}
        self._stored_dtype: dict[tuple[int, int], torch.dtype | None] = {}
        self._values: dict[tuple[int, int], dict] = {}  # module-sourced weights, until loaded
        self._host: dict[tuple[int, int], torch.Tensor] = {}  # cpu-home flats (compute dtype)
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        self._io, self._own_io = (io, False) if io is not None else (None, True)
        self.routers = {i: r for i, r in enumerate(routers or ()) if r is not None and i in self.modules}
        self._next = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self.freq = {i: torch.zeros(len(self.modules[i]), dtype=torch.float64) for i in self.layers}
        self.load = {i: torch.zeros(len(self.modules[i]), dtype=torch.int64) for i in self.layers}
        self._cached: dict[tuple[int, int], _Buffer] = {}
        self._prefetched: dict[tuple[int, int], _Buffer] = {}
        self._predicted: dict[int, set[int]] = {}
        self._protect: set[tuple[int, int]] = set()  # the running call's experts: never evicted
        self.host_bytes = 0  # host RAM of cpu-home experts
        self._grouped: dict[int, dict[str, torch.Tensor]] = {}  # see grouped_weights
        for i in self.layers:
            h = list(homes[i])
            if len(h) != len(self.modules[i]) or any(x not in EXPERT_HOMES for x in h):
                raise StreamError(f"layer {i}: give one of {EXPERT_HOMES} for each of its "
                                  f"{len(self.modules[i])} experts")
            self.homes[i] = h
            for e, module in enumerate(self.modules[i]):
                ranges = files[i][e] if files is not None and files[i] is not None else None
                self._layout((i, e), module, ranges, h[e])
            self._load_layer(i)
        self._allocate()

    # ---- setup ----------------------------------------------------------------------------------
    @property
    def io(self) -> IOEngine:
        if self._io is None:
            self._io = IOEngine()
        return self._io

    def _fixed(self, key: tuple[int, int]) -> bool:
        """Bound once for the whole run where it lives: on the device, or in host RAM on a CPU
        device (the device's own memory) unless the copy path is asked for (zero_copy_host)."""
        home = self.homes[key[0]][key[1]]
        return home == "device" or (home == "cpu" and not self.cuda and self.zero_copy_host)

    def _layout(self, key: tuple[int, int], module: nn.Module, ranges, home: str) -> None:
        out = layout_block(key[1], module, list(ranges) if ranges is not None else None,
                           residency=home, adopted=False, device=self.device, dtype=self.dtype,
                           empty=self._empty)
        self.blocks[key], self._runs[key], self._checks[key] = out.block, out.runs, out.checks
        self._shift[key], self._stored_dtype[key] = out.shift, out.stored_dtype
        if out.host_values is not None:
            self._values[key] = out.host_values
        self._unbind(key)

    def _load_layer(self, i: int) -> None:
        """Layer i's experts that are not on NVMe into their homes: a device arena, or host
        arenas. Where one arena holds every expert of the layer at one stride, the layer's
        weights are also viewed as [experts, ...] tensors (`grouped_weights`)."""
        on_device = [e for e, h in enumerate(self.homes[i]) if h == "device" and self.cuda]
        if on_device:
            stride = max(-(-self.expert_bytes((i, e)) // 256) * 256 for e in on_device)
            arena = torch.empty(stride * len(on_device), dtype=torch.uint8, device=self.device)
            for m, e in enumerate(on_device):
                key, nbytes = (i, e), self.expert_bytes((i, e))
                host = aligned_empty(nbytes + ALIGN)
                self._fill(key, byte_view(host, self._shift[key], nbytes))
                arena[m * stride:m * stride + nbytes].copy_(byte_view(host, self._shift[key], nbytes))
                bind_views(self.blocks[key], arena[m * stride:m * stride + nbytes].view(self.dtype))
            self._note_arena(i, on_device, arena, stride)
        on_host = [e for e, h in enumerate(self.homes[i]) if h == "cpu" or (h == "device" and not self.cuda)]
        sizes = [self.expert_bytes((i, e)) for e in on_host]
        for arena_bytes, members in host_arenas(sizes, self.pin):
            arena = host_aligned(arena_bytes, self.pin)
            self.host_bytes += arena_bytes
            # pinned arenas (a GPU run's, copied on): each expert lined up with its file offset,
            # so the one load is a direct read; pageable (a CPU device's, computed in place):
            # one stride for all (host_arenas sizes them alike), read through a bounce buffer
            uniform = not self.pin
            pos, stride = 0, None
            for m in members:
                key = (i, on_host[m])
                nbytes = self.expert_bytes(key)
                view = byte_view(arena, pos + (0 if uniform else self._shift[key]), nbytes)
                self._fill(key, view)
                self._host[key] = view.view(self.dtype)
                if self._fixed(key):
                    bind_views(self.blocks[key], self._host[key])
                step = -(-nbytes // ALIGN) * ALIGN + ALIGN
                stride = step if stride in (None, step) else -1
                pos += step
            if uniform and stride and stride > 0:
                self._note_arena(i, [on_host[m] for m in members], arena, stride)

    def _note_arena(self, i: int, experts: list[int], arena: torch.Tensor, stride: int) -> None:
        """Layer i's weights as [E, ...] views of `arena` (expert m at byte m * stride), when
        every expert of the layer is there, bound for the whole run, in the compute dtype."""
        keys = [(i, e) for e in range(len(self.homes[i]))]
        if (experts != list(range(len(keys))) or self.dtype == torch.uint8
                or not all(self._fixed(k) for k in keys) or stride % self.dtype.itemsize):
            return
        slots = [[(s.name, s.offset, tuple(s.shape)) for s in self.blocks[k].slots] for k in keys]
        if any(x != slots[0] for x in slots):
            return
        typed = arena.view(self.dtype)
        views = {}
        for name, offset, shape in slots[0]:
            inner = [1]
            for d in reversed(shape[1:]):
                inner.insert(0, inner[0] * d)
            views[name] = torch.as_strided(typed, (len(keys), *shape), (stride // self.dtype.itemsize, *inner),
                                           typed.storage_offset() + offset)
        self._grouped[i] = views

    def grouped_weights(self, layer: int) -> dict[str, torch.Tensor] | None:
        """{parameter name: [experts, ...] view} of `layer`'s experts when all of them are bound
        for the whole run in one arena at one stride (a grouped product can take them at once),
        else None."""
        return self._grouped.get(layer)

    def _fill(self, key, dst: torch.Tensor) -> None:
        """An expert's bytes (compute dtype) into `dst` (uint8) from its file ranges or module."""
        if self._runs[key] and self._stored_dtype[key] in (None, self.dtype):
            self._read_into(key, dst)
        elif self._runs[key]:  # another dtype in the file: read, then convert
            raw = aligned_empty(self._stored_bytes(key) + ALIGN)
            stored = byte_view(raw, self._shift[key], self._stored_bytes(key))
            self._read_into(key, stored)
            dst.view(self.dtype).copy_(stored.view(self._stored_dtype[key]))
        else:
            values = self._values.pop(key)
            for s in self.blocks[key].slots:
                dst.view(self.dtype)[s.offset:s.offset + s.numel].copy_(values[s.name].reshape(-1))

    def _allocate(self) -> None:
        """The buffer pool, once: sized for the largest expert that travels."""
        moving = [k for k in self.blocks if not self._fixed(k)]
        self._pool: list[_Buffer] = []
        self._free: list[_Buffer] = []
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda and moving else None
        if not moving:
            return
        largest = max(self.expert_bytes(k) for k in moving)
        on_nvme = [k for k in moving if self.homes[k[0]][k[1]] == "nvme"]
        stored = max((self._stored_bytes(k) for k in on_nvme), default=0)
        converts = any(self._stored_dtype[k] not in (None, self.dtype) for k in on_nvme)
        for _ in range(self.window + self.quota["prefetch"] + self.quota["cache"]):
            if self.cuda:
                raw = torch.empty(largest, dtype=torch.uint8, device=self.device)
                raw.record_stream(self.copy_stream)  # written there, freed on the compute stream
            else:
                raw = aligned_empty(largest + ALIGN)
            # under CUDA a read lands in host staging, whence it is copied on or computed on
            # the CPU; on a CPU device only a read to convert needs it
            staging = (host_aligned(stored + ALIGN, self.pin) if on_nvme and (self.cuda or converts)
                       else None)
            host = (aligned_empty(largest) if self.cuda and converts and self.where_max_tokens >= 0
                    else None)  # an NVMe expert converted for the CPU
            self._pool.append(_Buffer(raw, staging, host, self.cuda))
        self._free = list(self._pool)

    def expert_bytes(self, key: tuple[int, int]) -> int:
        """Bytes of one expert where it is computed (compute dtype, or its quantized bytes)."""
        return self.blocks[key].numel * self.dtype.itemsize

    def _stored_bytes(self, key) -> int:
        return self.blocks[key].numel * (self._stored_dtype[key] or self.dtype).itemsize

    def pool_bytes(self) -> int:
        """Bytes of the buffer pool where experts are computed (the device under CUDA)."""
        return sum(b.raw.numel() for b in self._pool)

    def _unbind(self, key) -> None:
        """Point the expert's parameters at an empty tensor: a use without a fetch fails loudly."""
        for s in self.blocks[key].slots:
            s.param.data = self._empty

    # ---- reads ----------------------------------------------------------------------------------
    def _read_into(self, key, dst: torch.Tensor, submit_only: bool = False) -> list:
        """Read expert `key`'s stored bytes into `dst` (uint8); the handles when `submit_only`."""
        handles = [self.io.submit_read(r.path, r.offset, dst[r.buf_offset:r.buf_offset + r.nbytes])
                   for r in self._runs[key]]
        if submit_only:
            return handles
        IOEngine.wait_all(handles)
        verify_ranges(key[1], self._checks[key], dst)
        return []

    def _stored_view(self, buf: _Buffer, key) -> torch.Tensor:
        """Where `key`'s bytes land as read: host staging when there is one, else the buffer."""
        raw = buf.staging if buf.staging is not None else buf.raw
        return byte_view(raw, self._shift[key], self._stored_bytes(key))

    def _start(self, key: tuple[int, int], kind: str) -> _Buffer:
        """Take a free buffer for expert `key` and start bringing it in (an NVMe read)."""
        buf = self._free.pop(0)
        buf.owner, buf.kind, buf.on = key, kind, None
        buf.handles = []
        if self.homes[key[0]][key[1]] == "nvme":
            buf.handles = self._read_into(key, self._stored_view(buf, key), submit_only=True)
            self.stats.moved_bytes["disk"] += self._stored_bytes(key)
        return buf

    def _land(self, buf: _Buffer, on_host: bool) -> None:
        """Wait for `buf`'s expert, check it, bring it where it is computed (the device, or host
        RAM when `on_host` under CUDA), converted to the compute dtype, and bind it there."""
        key, t0 = buf.owner, time.perf_counter()
        nvme = self.homes[key[0]][key[1]] == "nvme"
        nbytes = self.expert_bytes(key)
        same = self._stored_dtype[key] in (None, self.dtype)
        if nvme:
            IOEngine.wait_all(buf.handles)
            buf.handles = []
            src = self._stored_view(buf, key)
            verify_ranges(key[1], self._checks[key], src)
        else:
            src = self._host[key].view(torch.uint8)
        if self.cuda and on_host:  # computed on the CPU from the bytes as read (NVMe only)
            flat = src.view(self.dtype) if same else buf.host[:nbytes].view(self.dtype)
            if not same:
                flat.copy_(src.view(self._stored_dtype[key]))
        elif self.cuda:
            dst = buf.raw[:nbytes]
            with on_stream(self.copy_stream):
                if buf.free_recorded:  # the buffer's previous expert's kernels first
                    self.copy_stream.wait_event(buf.free)
                if same or not nvme:
                    dst.copy_(src, non_blocking=True)
                else:  # the stored dtype crosses the link, converted on the device
                    dst.view(self.dtype).copy_(src.to(self.device, non_blocking=True)
                                               .view(self._stored_dtype[key]))
                buf.ready.record(self.copy_stream)
            # the compute stream, not the host, waits for the copy
            torch.cuda.current_stream(self.device).wait_event(buf.ready)
            self.stats.moved_bytes["h2d"] += src.numel()
            flat = dst.view(self.dtype)
        else:
            dst = byte_view(buf.raw, self._shift[key], nbytes)
            if not nvme:
                dst.copy_(src)
                self.stats.moved_bytes["h2d"] += nbytes
            elif not same:
                dst.view(self.dtype).copy_(src.view(self._stored_dtype[key]))  # converts
            flat = dst.view(self.dtype)
        bind_views(self.blocks[key], flat)
        buf.on = "host" if self.cuda and on_host else "device"
        self.stats.wait_s += time.perf_counter() - t0

    def _give_back(self, buf: _Buffer, used: bool) -> None:
        """`buf`'s expert is done: kept in the cache, or the buffer goes back to the pool."""
        key = buf.owner
        if used and self.quota["cache"] and buf.on is not None and self._admit(key):
            buf.kind = "cache"
            self._cached[key] = buf
            return
        if buf.handles:  # a prefetch never used: its reads finish before the buffer is reused
            IOEngine.wait_all(buf.handles)
            buf.handles = []
        if buf.on is not None:
            self._unbind(key)
        if self.cuda:
            buf.free.record(torch.cuda.current_stream(self.device))
            buf.free_recorded = True
        buf.owner, buf.kind, buf.on = None, "", None
        self._free.append(buf)

    def _admit(self, key: tuple[int, int]) -> bool:
        """Keep expert `key` bound after use? Room in the cache, or hotter than the coldest kept
        (which is evicted; never one the running call still needs)."""
        if len(self._cached) < self.quota["cache"]:
            return True
        score = float(self.freq[key[0]][key[1]])
        evictable = [k for k in self._cached if k not in self._protect]
        if not evictable:
            return False
        victim = min(evictable, key=lambda k: (float(self.freq[k[0]][k[1]]), k))
        if float(self.freq[victim[0]][victim[1]]) >= score:
            return False
        self._give_back(self._cached.pop(victim), used=False)
        return True

    def _count(self, kind: str) -> int:
        return sum(1 for b in self._pool if b.kind == kind)

    # ---- the MoE layer's side -------------------------------------------------------------------
    def experts(self, layer: int, hit: Sequence[int], x: torch.Tensor,
                tokens: Sequence[int] | None = None) -> Iterator[tuple[int, nn.Module, torch.device | None]]:
        """(expert id, module, the device to compute it on when not the activations' own) for the
        experts of `layer` in `hit` (ascending), each usable while the caller holds it: those
        here already first (bound, cached, prefetched and landed), then the others as their
        reads land, the next read queued as one is used. `x` [N, hidden]: the layer's input, for
        the prediction of the next layer. `tokens`: tokens routed to each expert of `hit`."""
        hit = list(hit)
        mods, st = self.modules[layer], self.stats
        on_host, taken = self._begin(layer, hit, tokens)

        def travels(e: int) -> bool:  # needs a buffer this call
            key = (layer, e)
            if self._fixed(key) or key in self._cached or e in taken:
                return False
            return not (on_host and self.homes[layer][e] == "cpu")  # else computed in its arena

        need = collections.deque(e for e in hit if travels(e))
        st.demand_reads += len(need)
        pending: dict[int, _Buffer] = dict(taken)
        predicted = False
        self._protect = {(layer, e) for e in hit}  # cached ones stay until this call is done

        def top_up() -> None:
            nonlocal predicted
            while need and self._free and self._count("demand") < self.window:
                e = need.popleft()
                pending[e] = self._start((layer, e), "demand")
            if not need and not predicted:  # this layer's reads are all queued: the next's now
                predicted = True
                self._predict(layer, x)

        top_up()
        order = self._order(layer, hit, pending, need)
        try:
            for e in order:
                key = (layer, e)
                if self._fixed(key):
                    st.in_place += 1
                    yield e, mods[e], None
                elif key in self._cached:
                    st.cache_hits += 1
                    yield e, mods[e], self._where(self._cached[key])
                elif e not in pending and e not in need:  # cpu home, computed on the CPU
                    st.in_place += 1
                    bind_views(self.blocks[key], self._host[key])
                    try:
                        yield e, mods[e], torch.device("cpu")
                    finally:
                        self._unbind(key)
                else:
                    if e not in pending:  # reads are queued in `hit` order: e heads the queue
                        top_up()
                    if e not in pending:
                        raise StreamError(f"layer {layer}: no buffer for expert {e} (pool of "
                                          f"{len(self._pool)}: window {self.window} + prefetch + cache)")
                    buf = pending.pop(e)
                    self._land(buf, on_host)
                    try:
                        yield e, mods[e], self._where(buf)
                    finally:
                        self._protect.discard(key)
                        self._give_back(buf, used=True)
                    top_up()
        finally:
            for buf in pending.values():  # an exception mid-layer: nothing stays taken
                self._give_back(buf, used=False)
            self._protect = set()

    def _begin(self, layer: int, hit: list[int], tokens: Sequence[int] | None) -> tuple[bool, dict]:
        """A call of `layer` starts: counted; under CUDA whether its experts are computed on the
        CPU (few tokens each) or copied over; the prefetched buffers it routed to taken, the
        others (predicted, not routed) given back. Returns (on the CPU, {expert: buffer})."""
        st = self.stats
        counts = torch.tensor(list(tokens) if tokens is not None else [1] * len(hit), dtype=torch.float64)
        self._account(layer, hit, counts)
        on_host = self.cuda and bool(hit) and float(counts.mean()) <= self.where_max_tokens
        taken = {e: self._prefetched.pop((layer, e)) for e in hit if (layer, e) in self._prefetched}
        st.prefetch_hits += len(taken)
        for key in [k for k in self._prefetched if k[0] == layer]:  # predicted, not routed
            st.wasted_bytes += self._stored_bytes(key) if self.homes[layer][key[1]] == "nvme" else 0
            self._give_back(self._prefetched.pop(key), used=False)
        return on_host, taken

    def _order(self, layer: int, hit: list[int], pending: dict, need) -> list[int]:
        """The order `experts` yields in: what is here first (bound, cached, prefetched and
        landed), so that the reads still in flight overlap its compute; the rest in the order
        their reads were queued (the caller adds the outputs in ascending order whatever this)."""
        def ready(e: int) -> bool:
            key = (layer, e)
            if self._fixed(key) or key in self._cached:
                return True
            if e in pending:  # prefetched: its reads may have landed already
                return all(h.done() for h in pending[e].handles)
            return e not in need  # else a cpu-home expert computed where it lives
        first = [e for e in hit if ready(e)]
        return first + [e for e in hit if e not in set(first)]

    def served_grouped(self, layer: int, hit: Sequence[int], tokens: Sequence[int], x: torch.Tensor) -> None:
        """`layer`'s experts ran at once from `grouped_weights`: counted as served in place, and
        the next layer's prediction made (it may live elsewhere)."""
        hit = list(hit)
        self._account(layer, hit, torch.tensor(list(tokens), dtype=torch.float64))
        self.stats.in_place += len(hit)
        self._predict(layer, x)

    def _account(self, layer: int, hit: list[int], counts: torch.Tensor) -> None:
        """Counters, routing frequency (decayed: the cache's measure) and the prediction's score."""
        st = self.stats
        st.calls += 1
        st.routed += len(hit)
        st.tokens += int(counts.sum())
        self.freq[layer] *= self.decay
        if hit:
            self.freq[layer][hit] += counts
            self.load[layer][hit] += counts.to(torch.int64)
        if layer in self._predicted:
            guess = self._predicted.pop(layer)
            st.predicted += len(guess)
            st.predicted_right += len(guess & set(hit))
            st.routed_predicted_layers += len(hit)

    def _where(self, buf: _Buffer) -> torch.device | None:
        return torch.device("cpu") if buf.on == "host" else None

    def _predict(self, layer: int, x: torch.Tensor) -> None:
        """Guess the next MoE layer's experts (its router on this layer's input, top-k per token)
        and start reading the NVMe ones, most-voted first, within the prefetch quota."""
        nxt = self._next.get(layer)
        if nxt is None or nxt not in self.routers or x.shape[0] == 0:
            return
        w, b = self.routers[nxt]
        with torch.no_grad():
            logits = F.linear(x.to(w.device, w.dtype), w, b)
            ids = torch.topk(logits, min(self.predict_k, logits.shape[-1]), dim=-1).indices
            votes = torch.bincount(ids.flatten(), minlength=logits.shape[-1]).tolist()
        guess = [e for e, v in enumerate(votes) if v > 0]
        self._predicted[nxt] = set(guess)
        for e in sorted(guess, key=lambda e: (-votes[e], e)):
            key = (nxt, e)
            if self._count("prefetch") >= self.quota["prefetch"] or not self._free:
                return
            if self.homes[nxt][e] == "nvme" and key not in self._cached and key not in self._prefetched:
                self._prefetched[key] = self._start(key, "prefetch")

    # ---- lifetime and reports -------------------------------------------------------------------
    def release_all(self) -> None:
        """Prefetches dropped (their reads waited for); cached experts stay."""
        for key in list(self._prefetched):
            self._give_back(self._prefetched.pop(key), used=False)
        self._predicted.clear()

    def drop_cache(self) -> None:
        for key in list(self._cached):
            self._give_back(self._cached.pop(key), used=False)

    def close(self) -> None:
        self.release_all()
        self.drop_cache()
        if self._own_io and self._io is not None:
            self._io.close()
            self._io = None

    def imbalance(self) -> float | None:
        """Expert load imbalance: the busiest expert's tokens over the mean, averaged over layers."""
        ratios = [float(c.max() / c.float().mean()) for c in self.load.values() if c.sum() > 0]
        return sum(ratios) / len(ratios) if ratios else None
