"""A multi-turn chat over one KV cache that lives as long as the conversation.

Each turn renders the whole conversation through the checkpoint's chat template, exactly as a
fresh `generate()` would see it, and compares those ids with the ids whose keys and values are
already in the cache. The longest common prefix stays; only the rest is fed. So a second turn
costs its own tokens, not the whole history — and a template that renders earlier turns
differently once a new one arrives (some drop reasoning from past turns, some move the system
prompt), or a reply whose re-tokenization differs from the ids that were sampled, is still
exact: the cache is cut back to where the ids first differ and recomputed from there.

The cache is allocated once for `max_context` positions. A turn that would not fit (prompt plus
--max-new-tokens) is refused before anything is fed, in one line, and the conversation stays as
it was: the user can /reset or ask something shorter. Nothing is dropped silently.

Works over streamed blocks like `generate()`: the model's hooks fetch each block per forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from offload.infer.generate import GenerationError, SamplingParams, next_tokens
from offload.models import KVCache, LlamaForCausalLM
from offload.stream.streamer import BlockStreamer
from offload.data.tokenizer import StreamDecoder, Tokenizer


class ChatOverflow(GenerationError):
    """The conversation would outgrow the KV cache (--max-context)."""


@dataclass
class Turn:
    text: str  # the assistant's reply, special tokens removed
    ids: list[int]  # generated ids, the stop token included when one ended the turn
    prompt_tokens: int  # ids the rendered conversation has before the reply
    fed_tokens: int  # of those, how many were run through the model this turn (the rest were cached)
    seconds: float
    stopped: bool  # ended by a stop token (not by max_new_tokens)

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, *, max_context: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 streamer: BlockStreamer | None = None, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Sequence[int] | None = None, system: str | None = None,
                 template_vars: Mapping[str, Any] | None = None):
        if tokenizer.chat_template is None:
            raise GenerationError("a chat needs a tokenizer with a chat template")
        if max_context < 2:
            raise GenerationError(f"--max-context must be at least 2, got {max_context}")
        self.model, self.tokenizer, self.streamer = model, tokenizer, streamer
        self.device, self.sampling = torch.device(device), sampling
        self.stop_ids = set(tokenizer.stop_ids() if stop_ids is None else stop_ids)
        # [1, kv_heads, max_context, head_dim] per layer, allocated once for the conversation
        self.cache = KVCache(model.config, 1, max_context, device=self.device, dtype=dtype)
        self.system = system
        # the chat template's extra variables, every turn (--thinking: {"enable_thinking": False})
        self.template_vars = dict(template_vars or {})
        self.generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = ([{"role": "system", "content": self.system}]
                                               if self.system else [])
        self.cached_ids: list[int] = []  # ids whose keys/values are in cache[:, :, :len]
        self.cache.reset()

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed `ids` after the cached ones; logits of the last [1, V]."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        logits = self.model(x, kv_cache=self.cache, last_only=True)  # [1, 1, V]
        self.cached_ids += ids
        return logits[:, -1]

    @torch.inference_mode()
    def reply(self, user_text: str, max_new_tokens: int,
              on_text: Callable[[str], None] | None = None) -> Turn:
        """The assistant's answer to `user_text`, streamed to `on_text` piece by piece."""
        if max_new_tokens < 1:
            raise GenerationError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        messages = self.messages + [{"role": "user", "content": user_text}]
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                         template_vars=self.template_vars)
        if len(ids) + max_new_tokens > self.cache.max_len:
            raise ChatOverflow(f"this turn needs {len(ids)} prompt + {max_new_tokens} new tokens, more "
                               f"than --max-context {self.cache.max_len}; /reset the conversation, ask "
                               f"something shorter or raise --max-context")
        keep = min(common_prefix(ids, self.cached_ids), len(ids) - 1)  # feed at least one token
        self.cache.length = keep  # positions past `keep` are overwritten as they are fed
        self.cached_ids = self.cached_ids[:keep]
        decoder = StreamDecoder(self.tokenizer)
        out: list[int] = []
        stopped = False
        t0 = time.perf_counter()
        try:
            logits = self._forward(ids[keep:])
            while True:
                tok = int(next_tokens(logits, self.sampling, self.generator)[0])
                out.append(tok)
                if tok in self.stop_ids:
                    stopped = True
                    break
                if on_text is not None:
                    piece = decoder.push(tok)
                    if piece:
                        on_text(piece)
                if len(out) == max_new_tokens:
                    break
                logits = self._forward([tok])
        except BaseException:
            if self.streamer is not None:
                self.streamer.release_all()
            self.cached_ids, self.cache.length = [], 0  # a half-fed cache is not to be trusted
            raise
        if on_text is not None:
            rest = decoder.flush()
            if rest:
                on_text(rest)
        seconds = time.perf_counter() - t0
        text = self.tokenizer.decode([t for t in out if t not in self.stop_ids])
        self.messages = messages + [{"role": "assistant", "content": text}]
        return Turn(text=text, ids=out, prompt_tokens=len(ids), fed_tokens=len(ids) - keep,
                    seconds=seconds, stopped=stopped)
