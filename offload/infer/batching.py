"""Continuous batching: every request in flight shares each decode step's pass over the blocks.

A server's requests arrive and end at any time. `BatchEngine` keeps one KV cache of `slots`
rows x `max_len` positions and runs steps on its own thread; a step

  1. frees the rows of requests that ended or were cancelled (a client that went away),
  2. admits queued requests into free rows: each prompt is prefilled **alone** (batch 1, no
     mask: the very forward a solo `generate()` runs), its keys and values copied into its row,
  3. runs one decode forward over [rows in flight, 1] tokens -- a streamed block is brought in
     once for all of them, which is what makes N requests cost little more than one when the
     weights come from NVMe -- and hands each row its next token.

Rows with different lengths share one cache `length` L: row r holds its positions in
[L - len_r, L), left-padded, with an attention mask marking them; `position_ids` follow the mask
(each row's real tokens count from 0), so every row computes what it would alone. The rows in
flight are kept packed at the front (a finished row is replaced by the last one) and the
longest row always starts at 0 (the cache is shifted left when it leaves, right when a longer
prompt joins): a lone request decodes with no mask at all, exactly as `generate()` does, and no
row ever waits for room. The shifts copy the cache rows in flight, far fewer bytes than a step
reads.

Each request has its own sampling parameters and seeded generator (the draws a solo run makes),
its own stop ids and token limit. `on_token(id) -> bool` is called on the engine's thread with
every id (False ends the request: a stop string found in its text); `on_done(reason, error)`
once, with "stop", "length", "cancelled" or "error". A forward that fails ends the requests in
it with the error and the engine goes on serving; a full queue refuses at submit (QueueFull).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from offload.infer.generate import GenerationError, SamplingParams, check_prompts, next_tokens
from offload.models import KVCache

log = logging.getLogger("offload.infer.batching")


class QueueFull(GenerationError):
    """Every row is busy and the waiting queue is at its bound: try again later (HTTP 429)."""


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: Sequence[int] = ()
    on_token: Callable[[int], bool] | None = None  # engine thread; False ends the request
    on_done: Callable[[str, BaseException | None], None] | None = None  # engine thread, once
    tokens: list[int] = field(default_factory=list)
    submitted: float = 0.0
    first_token: float | None = None  # perf_counter of the first generated id
    finished: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False  # set from any thread: the row is freed at the next step
    taken: bool = False  # off the queue: prefilling or in a row (the engine's bookkeeping)

    def cancel(self) -> None:
        self.cancelled = True


class _View:
    """The first `n` rows of the engine's cache, as the `KVCache` the model calls (slices along
    the batch dimension are views: the model's writes land in the shared tensors)."""

    def __init__(self, cache: KVCache, n: int, length: int):
        self.cache, self.batch_size, self.max_len, self.length = cache, n, cache.max_len, length

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.keys[i][:self.batch_size], self.cache.values[i][:self.batch_size]

    def written(self, i: int, start: int, end: int) -> None:
        pass


class BatchEngine:
    def __init__(self, model, *, slots: int, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, streamer=None, max_queue: int = 64):
        if slots < 1 or max_len < 2 or max_queue < 0:
            raise ValueError(f"slots >= 1, max_len >= 2, max_queue >= 0; got {slots}, {max_len}, "
                             f"{max_queue}")
        self.model, self.cfg = model, model.config
        self.device, self.dtype, self.streamer = torch.device(device), dtype, streamer
        self.slots, self.max_len, self.max_queue = slots, max_len, max_queue
        self.cache = KVCache(self.cfg, slots, max_len, device=self.device, dtype=dtype)
        self.mask = torch.zeros((slots, max_len), dtype=torch.long, device=self.device)
        self.rows: list[Request] = []  # in flight, row k of the cache
        self.lengths: list[int] = []  # positions each row holds (ending at self.length)
        self.last: list[int] = []  # each row's id to feed next
        self.generators: list[torch.Generator | None] = []
        self.length = 0
        self.busy = 0  # requests taken off the queue and not ended (prefilling or in a row)
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.steps = 0  # decode steps run (for tests and the log)
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- any thread -----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request (GenerationError for a prompt that cannot run, QueueFull)."""
        check_prompts([req.prompt], self.cfg.vocab_size)
        if req.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if len(req.prompt) + req.max_new_tokens > self.max_len:
            raise GenerationError(f"{len(req.prompt)} prompt + {req.max_new_tokens} new tokens need "
                                  f"more than the {self.max_len} positions of the context")
        req.submitted = time.perf_counter()
        with self.lock:
            if self.busy + len(self.queue) >= self.slots + self.max_queue:
                raise QueueFull(f"{self.busy} requests in flight and {len(self.queue)} waiting "
                                f"(the bound); try again later")
            self.queue.append(req)
            self.lock.notify()

    def load(self) -> tuple[int, int]:
        """(requests in flight, requests waiting)."""
        with self.lock:
            return self.busy, len(self.queue)

    def alive(self) -> bool:
        """The engine's thread is running (False before start and after stop)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="offload-serve", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not self.queue and not self.rows:
                    self.lock.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug here must not leave requests hanging
                log.exception("a step failed; the requests in flight end with its error")
                self._reset(e)
        for req in list(self.rows) + list(self.queue):
            self._end(req, "cancelled")

    # ---- the engine's thread --------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Free ended rows, admit waiting requests, run one decode step over the rows in flight."""
        self._free()
        self._admit()
        if self.rows:
            self._decode()
            self._free()
        if not self.rows and getattr(self.model, "expert_store", None) is not None:
            self.model.expert_store.release_all()

    def _end(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        if req.finish_reason is not None:
            return
        req.finish_reason, req.finished = reason, time.perf_counter()
        if req.taken:
            with self.lock:
                self.busy -= 1
        if req.on_done is not None:
            try:
                req.on_done(reason, error)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
                log.exception("on_done of a request failed")

    def _take(self, k: int, req: Request, tok: int) -> None:
        """Row k's (or an admitted request's) next id: kept, told, and the row ended when due."""
        req.tokens.append(tok)
        if req.first_token is None:
            req.first_token = time.perf_counter()
        try:
            go_on = req.on_token(tok) if req.on_token is not None else True
        except Exception as e:  # noqa: BLE001 - a caller's callback ends its own request only
            self._end(req, "error", e)
            return
        if tok in req.stop_ids:
            self._end(req, "stop")
        elif go_on is False:
            self._end(req, "stop")
        elif len(req.tokens) >= req.max_new_tokens:
            self._end(req, "length")
        if k >= 0:
            self.last[k] = tok

    def _free(self) -> None:
        """Drop rows that ended or were cancelled: the last row moves into the gap, and the
        cache shifts left so the longest row starts at position 0."""
        k = 0
        while k < len(self.rows):
            req = self.rows[k]
            if req.cancelled:
                self._end(req, "cancelled")
            if req.finish_reason is None:
                k += 1
                continue
            last = len(self.rows) - 1
            if k != last:
                self._copy_row(last, k)
                self.rows[k], self.lengths[k] = self.rows[last], self.lengths[last]
                self.last[k], self.generators[k] = self.last[last], self.generators[last]
            for lst in (self.rows, self.lengths, self.last, self.generators):
                lst.pop()
            self.mask[last].zero_()
        self._shift(max(self.lengths, default=0) - self.length)

    def _copy_row(self, src: int, dst: int) -> None:
        L = self.length
        for t in (*self.cache.keys, *self.cache.values):
            t[dst, :, :L] = t[src, :, :L]
        self.mask[dst, :L] = self.mask[src, :L]

    def _shift(self, d: int) -> None:
        """Move every row in flight d positions right (d > 0) or left (d < 0): L becomes L + d."""
        if d == 0:
            return
        n, L = len(self.rows), self.length
        src, dst = (slice(0, L), slice(d, L + d)) if d > 0 else (slice(-d, L), slice(0, L + d))
        if n:
            for t in (*self.cache.keys, *self.cache.values):
                t[:n, :, dst] = t[:n, :, src].clone()
            self.mask[:n, dst] = self.mask[:n, src].clone()
            if d > 0:
                self.mask[:n, :d] = 0
        self.length = L + d

    def _admit(self) -> None:
        while len(self.rows) < self.slots:
            with self.lock:
                if not self.queue:
                    return
                req = self.queue.popleft()
                req.taken = True
                self.busy += 1
            if req.cancelled:
                self._end(req, "cancelled")
                continue
            try:
                self._prefill(req)
            except Exception as e:  # noqa: BLE001 - this request ends; the engine goes on
                self._release()
                self._end(req, "error", e)

    def _prefill(self, req: Request) -> None:
        """The prompt alone (as a solo generate() runs it), its keys and values into a new row."""
        P = len(req.prompt)
        own = KVCache(self.cfg, 1, P, device=self.device, dtype=self.dtype)
        ids = torch.tensor([req.prompt], dtype=torch.long, device=self.device)  # [1, P]
        logits = self.model(ids, kv_cache=own, last_only=True)  # [1, 1, V]
        gen = None if req.sampling.greedy else torch.Generator().manual_seed(req.sampling.seed)
        tok = int(next_tokens(logits[:, -1], req.sampling, gen)[0])
        self._take(-1, req, tok)
        if req.finish_reason is not None:
            return
        self._shift(max(0, P - self.length))
        k, L = len(self.rows), self.length
        for mine, theirs in zip((*own.keys, *own.values), (*self.cache.keys, *self.cache.values)):
            theirs[k, :, L - P:L] = mine[0]
        self.mask[k].zero_()
        self.mask[k, L - P:L] = 1
        self.rows.append(req)
        self.lengths.append(P)
        self.last.append(tok)
        self.generators.append(gen)

    def _decode(self) -> None:
        n, L = len(self.rows), self.length
        feed = torch.tensor(self.last, dtype=torch.long, device=self.device).view(n, 1)  # [n, 1]
        self.mask[:n, L] = 1
        padded = min(self.lengths) != L
        view = _View(self.cache, n, L)
        try:
            logits = self.model(feed, attention_mask=self.mask[:n, :L + 1] if padded else None,
                                kv_cache=view, last_only=True)[:, -1]  # [n, V]
        except Exception as e:  # noqa: BLE001 - the rows in it end with the error; serving goes on
            self._release()
            self.mask[:n, L] = 0
            for req in self.rows:
                self._end(req, "error", e)
            return
        self.length = L + 1
        self.steps += 1
        for k in range(n):
            self.lengths[k] += 1
            req = self.rows[k]
            if req.finish_reason is not None or req.cancelled:
                continue
            try:
                tok = int(next_tokens(logits[k:k + 1], req.sampling, self.generators[k])[0])
            except GenerationError as e:  # this row's logits were not finite: this row ends
                self._end(req, "error", e)
                continue
            self._take(k, req, tok)

    def _reset(self, error: BaseException) -> None:
        """After an unexpected failure: every request taken off the queue ends, the cache is empty."""
        self._release()
        for req in self.rows:
            self._end(req, "error", error)
        self.rows, self.lengths, self.last, self.generators = [], [], [], []
        self.mask.zero_()
        self.length = 0

    def _release(self) -> None:
        """After a failed forward: the streamer's and expert store's blocks given back."""
        if self.streamer is not None:
            self.streamer.release_all()
        store = getattr(self.model, "expert_store", None)
        if store is not None:
            store.release_all()
