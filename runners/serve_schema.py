"""runners.serve's request bodies, checked the way OpenAI's server checks them: every field a
client sends is either used, ignored (fields this server has no use for, as OpenAI ignores
unknown ones) or refused with a 4xx and OpenAI's JSON error body -- never a 500.

What is refused, each with its own message: tools / functions (no tool calling), logprobs,
n > 1 and several prompts (one choice per request), echo / suffix / best_of, a response_format
other than text, image or audio message parts, a prompt or max_tokens past the context.
Accepted and ignored: presence / frequency penalties, logit_bias, user, metadata, store and any
field this server does not know. `top_k` (vLLM's and llama.cpp's extension) samples as
runners.infer --top-k; `return_token_ids` (vLLM's) adds the ids to the reply."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP = 4  # OpenAI's limit on stop sequences
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class APIError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "invalid_request_error", 404: "invalid_request_error",
                             429: "rate_limit_error", 500: "server_error",
                             503: "server_error"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Spec:
    """One request, checked: messages (chat) or prompt (text or ids), and how to generate."""
    model: str | None
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: the generated (and prompt) ids in the reply


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {_show(v)}", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo:g} and {hi:g}, got {v}", name, "invalid_value")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {_show(v)}", name, "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise bad(f"'{name}' must be {'at least ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}, "
                  f"got {v}", name, "invalid_value")
    return v


def _boolean(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_show(v)}", name, "invalid_type")
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return (text[:40] + "...") if len(text) > 40 else text


def _refuse_unsupported(body: dict) -> None:
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(f"'{name}': tool calling is not supported by this server", name, "unsupported")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise bad(f"'{name}': tool calling is not supported by this server", name, "unsupported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("'logprobs' is not supported by this server", "logprobs", "unsupported")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad(f"'n' must be 1 (one choice per request), got {_show(n)}", "n", "unsupported")
    best = body.get("best_of")
    if best is not None and (not _is_int(best) or best != 1):
        raise bad(f"'best_of' must be 1, got {_show(best)}", "best_of", "unsupported")
    if body.get("echo") not in (None, False):
        raise bad("'echo' is not supported by this server", "echo", "unsupported")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' (insertion) is not supported by this server", "suffix", "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("'response_format': only {\"type\": \"text\"} is supported", "response_format",
                  "unsupported")


def _common(body: Any) -> Spec:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_show(model)}", "model", "invalid_type")
    a, b = body.get("max_completion_tokens"), body.get("max_tokens")
    name = "max_completion_tokens" if a is not None else "max_tokens"
    spec = Spec(model=model, max_tokens=_integer(body, name, 1),
                temperature=_number(body, "temperature", 0.0, 2.0),
                top_p=_number(body, "top_p", 0.0, 1.0), top_k=_integer(body, "top_k", 0),
                seed=_integer(body, "seed", -(2 ** 63), 2 ** 64 - 1),
                stream=_boolean(body, "stream"), return_token_ids=_boolean(body, "return_token_ids"))
    if a is not None and b is not None and a != b:
        raise bad("'max_tokens' and 'max_completion_tokens' differ: give one", "max_tokens")
    spec.stop = _stop(body.get("stop"))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        spec.include_usage = _boolean(opts, "include_usage")
    return spec


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"'stop' must be a string or a list of strings, got {_show(v)}", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' holds at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    return [s for s in stops if s]


def chat_spec(body: Any) -> Spec:
    spec = _common(body)
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages", "invalid_value")
    spec.messages = [_message(m, k) for k, m in enumerate(messages)]
    return spec


def _message(m: Any, k: int) -> dict[str, str]:
    where = f"messages[{k}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with 'role' and 'content'", where, "invalid_type")
    role = m.get("role")
    if not isinstance(role, str):
        raise bad(f"{where}.role must be a string", f"{where}.role", "invalid_type")
    if role in ("tool", "function"):
        raise bad(f"{where}: role {role!r}: tool calling is not supported by this server",
                  f"{where}.role", "unsupported")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of system, developer, user, assistant; got {_show(role)}",
                  f"{where}.role", "invalid_value")
    if m.get("tool_calls"):
        raise bad(f"{where}.tool_calls: tool calling is not supported by this server",
                  f"{where}.tool_calls", "unsupported")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}]: only text parts are supported",
                          f"{where}.content", "unsupported")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text parts, got {_show(content)}",
                  f"{where}.content", "invalid_type")
    return {"role": ROLES[role], "content": content}


def completion_spec(body: Any, vocab_size: int) -> Spec:
    spec = _common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"'prompt': token id {bad_ids[0]} is out of range for a vocabulary of "
                      f"{vocab_size}", "prompt", "invalid_value")
        spec.prompt = list(prompt)
    elif isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt", "invalid_value")
        spec.prompt = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("several prompts in one request are not supported (one choice per request): "
                  "send one request per prompt", "prompt", "unsupported")
    else:
        raise bad(f"'prompt' must be a non-empty string or a list of token ids, got {_show(prompt)}",
                  "prompt", "invalid_type")
    return spec
