"""runners.serve's HTTP side: OpenAI's endpoints on Starlette, over one `BatchEngine`.

    GET  /health                 {"status": "ok", "in_flight": n, "waiting": m} (no key needed)
    GET  /v1/models              the one model, by its served name (/v1/models/{name}: it alone)
    POST /v1/chat/completions    the checkpoint's chat template; stream: server-sent events
    POST /v1/completions         plain text (or token ids) continued

Requests are checked in runners/serve_schema.py (OpenAI's 4xx bodies). The prompt is rendered
and tokenized off the event loop; the request is queued on the engine (429 past the queue's
bound) and its ids come back from the engine's thread: each is decoded there (StreamDecoder:
multi-byte characters kept whole), stop strings are looked for in the text (text that could be
the start of one is held back, and the request ends at one), and the new text is handed to the
event loop. A client that goes away cancels its request: its row is freed at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from offload.data.tokenizer import StreamDecoder, TokenizerError
from offload.infer.batching import BatchEngine, QueueFull, Request
from offload.infer.generate import GenerationError, SamplingParams
from runners.serve_schema import APIError, Spec, bad, chat_spec, completion_spec

log = logging.getLogger("offload.serve")
MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) before it is parsed


@dataclass
class Served:
    """The loaded model and what requests default to (runners.serve's flags)."""
    model: Any
    tokenizer: Any
    name: str
    context: int
    device: torch.device
    dtype: torch.dtype
    streamer: Any
    stop_ids: list[int]
    template_vars: dict
    defaults: Any  # argparse namespace: temperature, top_k, top_p, seed, max_new_tokens


class _Text:
    """A request's ids as text, on the engine's thread: pieces handed to `emit`, stop strings cut."""

    def __init__(self, tokenizer, stop_ids, stops: list[str], emit):
        self.decoder, self.stop_ids, self.stops, self.emit = StreamDecoder(tokenizer), stop_ids, stops, emit
        self.held, self.text, self.hit = "", "", False

    def push(self, piece: str) -> bool:
        """Take new text; False once a stop string is found (the text ends before it)."""
        self.held += piece
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._out(self.held[:cut])
            self.held, self.hit = "", True
            return False
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(self.held) + 1))
                    if self.held.endswith(s[:k])), default=0)
        self._out(self.held[:len(self.held) - keep])
        self.held = self.held[len(self.held) - keep:]
        return True

    def on_token(self, tok: int) -> bool:
        if tok in self.stop_ids:
            return True
        return self.push(self.decoder.push(tok))

    def finish(self) -> None:
        if not self.hit and self.push(self.decoder.flush()):
            self._out(self.held)
            self.held = ""

    def _out(self, text: str) -> None:
        if text:
            self.text += text
            self.emit(text)


def _sampling(spec: Spec, defaults) -> SamplingParams:
    temperature = defaults.temperature if spec.temperature is None else spec.temperature
    top_p = defaults.top_p if spec.top_p is None else spec.top_p
    if top_p == 0:  # only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    seed = defaults.seed if spec.seed is None else spec.seed % 2 ** 63
    return SamplingParams(temperature, defaults.top_k if spec.top_k is None else spec.top_k, top_p, seed)


class API:
    def __init__(self, served: Served, engine: BatchEngine, api_key: str | None):
        self.s, self.engine, self.api_key = served, engine, api_key

    # ---- checks ---------------------------------------------------------------------------------
    def check_key(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not token or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'"
                           if token or given else "no API key given: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def body(self, request: HTTPRequest) -> Any:
        self.check_key(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise bad(f"the request body is not valid JSON: {str(e)[:120]}", code="invalid_json") from None

    def check_model(self, spec: Spec) -> None:
        if spec.model is not None and spec.model != self.s.name:
            raise APIError(404, f"the model {spec.model[:80]!r} does not exist; this server serves "
                           f"{self.s.name!r}", "model", "model_not_found")

    def prompt_ids(self, spec: Spec) -> list[int]:
        """(On a worker thread.) The chat rendered through the template, or the text encoded."""
        tok = self.s.tokenizer
        try:
            if spec.messages is not None:
                if tok.chat_template is None:
                    raise bad("this model has no chat template: use /v1/completions", "messages")
                return tok.encode_chat(spec.messages, add_generation_prompt=True,
                                       template_vars=self.s.template_vars)
            return spec.prompt if isinstance(spec.prompt, list) else tok.encode(spec.prompt)
        except TokenizerError as e:  # the template refused these messages (roles, order)
            raise bad(f"the chat template refused these messages: {str(e)[:300]}", "messages") from None

    def budget(self, spec: Spec, ids: list[int]) -> int:
        """max_tokens for this prompt: given, or the server's default, or the rest of the context."""
        ctx, P = self.s.context, len(ids)
        where = "messages" if spec.messages is not None else "prompt"
        if P >= ctx:
            raise bad(f"this model's context is {ctx} tokens; the {where} alone take {P} tokens",
                      where, "context_length_exceeded")
        if spec.max_tokens is not None:
            if P + spec.max_tokens > ctx:
                raise bad(f"this model's context is {ctx} tokens; you asked for {P + spec.max_tokens} "
                          f"({P} in the {where}, {spec.max_tokens} in the completion)",
                          "max_tokens", "context_length_exceeded")
            return spec.max_tokens
        default = self.s.defaults.max_new_tokens
        return min(default, ctx - P) if default else ctx - P

    # ---- endpoints ------------------------------------------------------------------------------
    async def health(self, request: HTTPRequest) -> JSONResponse:
        alive = self.engine.alive()
        busy, waiting = self.engine.load()
        return JSONResponse({"status": "ok" if alive else "engine stopped", "model": self.s.name,
                             "in_flight": busy, "waiting": waiting, "steps": self.engine.steps},
                            status_code=200 if alive else 503)

    def _model(self) -> dict:
        return {"id": self.s.name, "object": "model", "created": 0, "owned_by": "offload",
                "max_model_len": self.s.context}

    async def models(self, request: HTTPRequest) -> JSONResponse:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: HTTPRequest) -> JSONResponse:
        self.check_key(request)
        self.check_model(Spec(model=request.path_params["model"]))
        return JSONResponse(self._model())

    async def chat(self, request: HTTPRequest):
        spec = chat_spec(await self.body(request))
        return await self.complete(request, spec, chat=True)

    async def completions(self, request: HTTPRequest):
        spec = completion_spec(await self.body(request), self.s.model.config.vocab_size)
        return await self.complete(request, spec, chat=False)

    async def complete(self, request: HTTPRequest, spec: Spec, chat: bool):
        self.check_model(spec)
        ids = await run_in_threadpool(self.prompt_ids, spec)
        try:
            sampling = _sampling(spec, self.s.defaults)
        except GenerationError as e:
            raise bad(str(e)) from None
        job = _Job(self, spec, ids, chat, sampling, asyncio.get_running_loop())
        try:
            self.engine.submit(job.req)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", code="rate_limit_exceeded") from None
        except GenerationError as e:
            raise bad(str(e)) from None
        if spec.stream:
            return StreamingResponse(job.events(request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await job.whole(request)


class _Job:
    """One request between the event loop and the engine's thread."""

    def __init__(self, api: API, spec: Spec, ids: list[int], chat: bool, sampling: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.api, self.spec, self.ids, self.chat, self.loop = api, spec, ids, chat, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        served = api.s
        self.text = _Text(served.tokenizer, set(served.stop_ids), spec.stop, self._put_text)
        self.req = Request(prompt=ids, max_new_tokens=api.budget(spec, ids), sampling=sampling,
                           stop_ids=set(served.stop_ids), on_token=self.text.on_token,
                           on_done=self._done)

    def _put_text(self, piece: str) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", piece))

    def _done(self, reason: str, error: BaseException | None) -> None:  # engine thread, once
        if reason in ("stop", "length"):
            self.text.finish()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", reason, error))
        self._log(reason, error)

    def _log(self, reason: str, error: BaseException | None) -> None:
        r = self.req
        out = len(r.tokens)
        ttft = (r.first_token - r.submitted) if r.first_token else float("nan")
        total = (r.finished or time.perf_counter()) - r.submitted
        rate = (out - 1) / (r.finished - r.first_token) if out > 1 and r.first_token and \
            r.finished > r.first_token else float("nan")
        log.info("%s: %d prompt + %d completion tokens, first token %.3f s, %.2f tok/s after it, "
                 "%.3f s in all, finish %s%s", self.id, len(self.ids), out, ttft, rate, total, reason,
                 f" ({error})" if error is not None else "")

    def usage(self) -> dict:
        n = len(self.req.tokens)
        return {"prompt_tokens": len(self.ids), "completion_tokens": n,
                "total_tokens": len(self.ids) + n}

    def _choice(self, text: str, reason: str | None, delta: bool) -> dict:
        if self.chat:
            key, value = ("delta", {"content": text} if text else {}) if delta else \
                ("message", {"role": "assistant", "content": text})
            choice = {"index": 0, key: value, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.spec.return_token_ids and reason is not None:
            choice["token_ids"] = list(self.req.tokens)
        return choice

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.api.s.name,
               "system_fingerprint": None, "choices": choices}
        if self.spec.return_token_ids:
            out["prompt_token_ids"] = self.ids
        return out

    @staticmethod
    def _error(reason: str, error: BaseException | None) -> APIError:
        return APIError(500, f"generation failed: {error}" if error is not None else
                        f"generation ended: {reason}", code="generation_failed")

    async def whole(self, request: HTTPRequest) -> JSONResponse:
        pieces: list[str] = []
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.req.cancel()
                        return JSONResponse({}, status_code=499)
                    continue
                if item[0] == "text":
                    pieces.append(item[1])
                    continue
                _, reason, error = item
                if reason not in ("stop", "length"):
                    raise self._error(reason, error)
                body = self._envelope([self._choice("".join(pieces), reason, delta=False)], chunk=False)
                body["usage"] = self.usage()
                return JSONResponse(body)
        finally:
            self.req.cancel()  # a no-op once it ended; frees the row if this handler was cancelled

    async def events(self, request: HTTPRequest):
        def sse(obj: Any) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        try:
            if self.chat:
                first = self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], chunk=True)
                yield sse(first)
            while True:
                item = await self.queue.get()
                if item[0] == "text":
                    yield sse(self._envelope([self._choice(item[1], None, delta=True)], chunk=True))
                    continue
                _, reason, error = item
                if reason not in ("stop", "length"):
                    yield sse(self._error(reason, error).body())
                    break
                yield sse(self._envelope([self._choice("", reason, delta=True)], chunk=True))
                if self.spec.include_usage:
                    last = self._envelope([], chunk=True)
                    last["usage"] = self.usage()
                    yield sse(last)
                break
            yield "data: [DONE]\n\n"
        finally:
            self.req.cancel()  # the client went away (or we are done): the row is freed


def build_app(served: Served, *, api_key: str | None = None, slots: int = 8,
              max_queue: int = 64) -> Starlette:
    engine = BatchEngine(served.model, slots=slots, max_len=served.context, device=served.device,
                         dtype=served.dtype, streamer=served.streamer, max_queue=max_queue)
    api = API(served, engine, api_key)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request, exc: HTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail) or "error").body(),
                            status_code=exc.status_code)

    async def server_error(request, exc: Exception):
        log.exception("unexpected error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    routes = [Route("/health", api.health, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model:path}", api.model, methods=["GET"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error,
                                        Exception: server_error})
    app.state.engine, app.state.api = engine, api
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    return app
