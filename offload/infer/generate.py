"""Generation: prefill + decode with a KV cache on the device, greedy or sampled, batched.

Several prompts run as one batch (left-padded, with an attention mask), so every decode step is
one forward over [batch, 1] tokens: a streamed block's weights are brought in once per step for
the whole batch, which is what makes batching pay when weights stream from host RAM or NVMe.
Tokens are handed to `on_tokens` as they are produced, so a caller can print them at once.

Sampling follows the usual order: temperature, then top-k, then top-p, then a draw from a
seeded CPU generator (so results do not depend on the device). temperature 0 is greedy argmax,
which is what the identity tests against `transformers` use.

Works with any model whose forward takes (input_ids, attention_mask=, kv_cache=, last_only=)
like `offload.models.LlamaForCausalLM`; block streaming is transparent (forward hooks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from offload.infer.kv_cache import OffloadedKVCache
from offload.models import KVCache, LlamaForCausalLM
from offload.stream.stats import StreamStats
from offload.stream.experts import ExpertStats
from offload.stream.streamer import BlockStreamer


class GenerationError(ValueError):
    """Bad generation input (empty prompt, token id out of range, bad sampling parameters)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] fp32 -> temperature-scaled logits with the tokens top-k / top-p exclude set
    to -inf."""
    scaled = logits / params.temperature
    if not bool(torch.isfinite(scaled).all()) and bool(torch.isfinite(logits).all()):
        # a temperature so small that logits / t overflows (1e-45): shifting by the row's
        # maximum first keeps the same distribution in range (the top token(s) at 0, the rest
        # at -inf), which is what such a temperature means
        scaled = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    logits = scaled
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before > params.top_p  # the most likely token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (any device) -> next token ids [B] (int64, CPU). Non-finite logits end the
    generation (GenerationError): no token drawn from them means anything."""
    logits = logits.float()
    finite = torch.isfinite(logits).all(-1)  # [B]
    if params.greedy:  # one transfer for both (the host waits for it anyway)
        tokens, ok = torch.stack([logits.argmax(-1), finite.long()]).cpu()
        _check_finite(ok)
        return tokens
    _check_finite(finite.cpu())
    probs = filter_logits(logits.cpu(), params).softmax(-1)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_finite(ok: torch.Tensor) -> None:
    if not bool(ok.all()):
        rows = [int(k) + 1 for k in torch.nonzero(ok == 0).flatten()[:4]]
        raise GenerationError(
            f"the model computed inf/nan logits (prompt{'s' if len(rows) > 1 else ''} "
            f"{', '.join(map(str, rows))} of the batch): nothing generated from them means anything. "
            f"Likely causes: a LoRA adapter whose scale (lora_alpha / r) is far too large, or "
            f"damaged or overflowing weights (in fp16, try --dtype bf16 or fp32)")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt, a stop token included when it ended a row
    prompt_tokens: int  # real (unpadded) prompt tokens over the batch
    decode_tokens: int  # tokens produced by decode steps (not counting the prefill's token)
    decode_steps: int
    prefill_s: float
    decode_s: float
    prefill_stream: StreamStats | None = None
    decode_stream: StreamStats | None = None
    finished: list[bool] = field(default_factory=list)  # ended by a stop token
    kv_h2d_bytes: int = 0  # an offloaded KV cache: past positions brought to the device
    # an MoE model's experts placed one by one (offload/stream/experts.py): what they cost
    prefill_experts: ExpertStats | None = None
    decode_experts: ExpertStats | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    if not prompts:
        raise GenerationError("no prompts given")
    for k, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerationError(f"prompt {k + 1} is empty")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise GenerationError(f"prompt {k + 1}: token id {bad[0]} is out of range for a vocabulary "
                                  f"of {vocab_size} (valid: 0..{vocab_size - 1})")


@dataclass(frozen=True)
class _Batch:
    """Prompts as one left-padded batch: ids [B, T], the attention mask over prompt and new
    positions [B, T + new] (on the device), the pad id, and whether any row is padded."""
    ids: torch.Tensor
    mask: torch.Tensor
    pad: int
    padded: bool


def _left_padded(prompts: Sequence[Sequence[int]], cfg, max_new_tokens: int,
                 device: torch.device) -> _Batch:
    B, lengths = len(prompts), [len(p) for p in prompts]
    T = max(lengths)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else 0
    ids = torch.full((B, T), pad, dtype=torch.long)  # [B, T], left-padded
    mask = torch.zeros((B, T + max_new_tokens), dtype=torch.long)  # [B, T + new]
    for r, p in enumerate(prompts):
        ids[r, T - len(p):] = torch.tensor([int(t) for t in p])
        mask[r, T - len(p):] = 1  # generated positions (T:) are real tokens too
    return _Batch(ids, mask.to(device), pad, min(lengths) != T)


def _kv_cache(cfg, kv_tier: str, batch: int, length: int, device: torch.device,
              dtype: torch.dtype):
    if kv_tier == "host":
        return OffloadedKVCache(cfg, batch, length, device=device, dtype=dtype)
    if kv_tier == "device":
        return KVCache(cfg, batch, length, device=device, dtype=dtype)
    raise GenerationError(f"kv_tier must be 'device' or 'host', got {kv_tier!r}")


class _Rows:
    """Each row's generated ids: a row ends at its first stop id (kept in its output);
    `on_tokens(step, ids)` hears every step, None for the rows that had ended."""

    def __init__(self, batch: int, stop_ids: Sequence[int],
                 on_tokens: Callable[[int, list[int | None]], None] | None):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.finished = [False] * batch
        self.stops = set(int(s) for s in stop_ids)
        self.on_tokens = on_tokens

    def take(self, step: int, tok: torch.Tensor) -> None:
        emitted: list[int | None] = []
        for r, t in enumerate(tok.tolist()):
            if self.finished[r]:
                emitted.append(None)
                continue
            self.out[r].append(t)
            emitted.append(t)
            if t in self.stops:
                self.finished[r] = True
        if self.on_tokens is not None:
            self.on_tokens(step, emitted)


def _decode(model: LlamaForCausalLM, batch: _Batch, cache, tok: torch.Tensor, rows: _Rows,
            max_new_tokens: int, sampling: SamplingParams, generator: torch.Generator | None,
            device: torch.device) -> tuple[int, int]:
    """The steps after the prefill's token, one [B, 1] forward each, until every row ended or
    `max_new_tokens` were made: (steps, tokens made by rows still running)."""
    B, T = batch.ids.shape
    steps, decode_tokens = 0, 0
    # LongRoPE (Phi-3): a forward reaching past the original context rotates with the long
    # factors, so the cached keys (rotated with the short ones) are recomputed once, at the
    # step that crosses, as transformers' generate does
    switch = getattr(model.model.rotary, "switch_after", None)
    fed: list[torch.Tensor] = []  # [B] per decode step, for that recompute
    while steps + 1 < max_new_tokens and not all(rows.finished):
        active = B - sum(rows.finished)
        feed = torch.where(torch.tensor(rows.finished), torch.full_like(tok, batch.pad), tok)  # [B]
        fed.append(feed)
        length = T + steps + 1
        mask = batch.mask[:, :length] if batch.padded else None
        if switch is not None and cache.length == switch < length:
            cache.reset()
            everything = torch.cat([batch.ids, torch.stack(fed, dim=1)], dim=1)  # [B, length]
            logits = model(everything.to(device), attention_mask=mask, kv_cache=cache, last_only=True)
        else:
            logits = model(feed.view(B, 1).to(device), attention_mask=mask, kv_cache=cache,
                           last_only=True)
        tok = next_tokens(logits[:, -1], sampling, generator)
        steps += 1
        decode_tokens += active
        rows.take(steps, tok)
    return steps, decode_tokens


@torch.inference_mode()
def generate(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             streamer: BlockStreamer | None = None,
             on_tokens: Callable[[int, list[int | None]], None] | None = None,
             kv_tier: str = "device") -> GenerationResult:
    """Generate up to `max_new_tokens` for every prompt as one batch.

    kv_tier "host": the KV cache in host RAM, one layer at a time on the device
    (offload/infer/kv_cache.py) -- for a batch whose cache does not fit the device.

    on_tokens(step, ids): after each step, the new id of every row (None for finished rows).
    A row ends at its first stop id (kept in its output); the batch ends when all have."""
    cfg = model.config
    check_prompts(prompts, cfg.vocab_size)
    if max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    device = torch.device(device)
    batch = _left_padded(prompts, cfg, max_new_tokens, device)
    B, T = batch.ids.shape
    cache = _kv_cache(cfg, kv_tier, B, T + max_new_tokens, device, dtype)
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    rows = _Rows(B, stop_ids, on_tokens)
    snap = streamer.stats.copy() if streamer is not None else None
    store = getattr(model, "expert_store", None)
    esnap = store.stats.copy() if store is not None else None
    try:
        t0 = time.perf_counter()
        logits = model(batch.ids.to(device), attention_mask=batch.mask[:, :T] if batch.padded else None,
                       kv_cache=cache, last_only=True)  # [B, 1, V]
        tok = next_tokens(logits[:, -1], sampling, generator)  # [B]; .cpu() waits for compute
        prefill_s = time.perf_counter() - t0
        pre_stats = None
        if streamer is not None:
            pre_stats, snap = streamer.stats.copy().minus(snap), streamer.stats.copy()
        pre_experts = None
        if store is not None:
            pre_experts, esnap = store.stats.copy().minus(esnap), store.stats.copy()
        rows.take(0, tok)
        t1 = time.perf_counter()
        steps, decode_tokens = _decode(model, batch, cache, tok, rows, max_new_tokens, sampling,
                                       generator, device)
        decode_s = time.perf_counter() - t1
    except BaseException:
        if streamer is not None:
            streamer.release_all()
        if store is not None:
            store.release_all()
        raise
    dec_stats = streamer.stats.copy().minus(snap) if streamer is not None else None
    dec_experts = None
    if store is not None:
        store.release_all()  # the last step's predictions: nothing comes after it
        dec_experts = store.stats.copy().minus(esnap)
    return GenerationResult(tokens=rows.out, prompt_tokens=sum(len(p) for p in prompts),
                            decode_tokens=decode_tokens, decode_steps=steps, prefill_s=prefill_s,
                            decode_s=decode_s, prefill_stream=pre_stats, decode_stream=dec_stats,
                            finished=rows.finished, kv_h2d_bytes=getattr(cache, "h2d_bytes", 0),
                            prefill_experts=pre_experts, decode_experts=dec_experts)
