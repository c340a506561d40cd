"""A chat template rendered the way transformers renders it, bounded in time, memory and depth.

A chat template is a Jinja program that arrives with a stranger's checkpoint. It renders in
microseconds when it is honest; a hostile or broken one can try to hang (nested loops), to
allocate gigabytes in one expression (`'%5000000000s' % x`, `'x' | center(10**10)`,
`'a'.ljust(...)`, `s | replace('a', big)`, `xs | batch(10**9, 0)`) or to recurse without end (a
macro calling itself). Each of those ends here in one `TemplateLimitError` line before the
allocation, not in a MemoryError, OverflowError or RecursionError traceback:

- time: every step of a `range` loop and every output chunk checks a deadline (TEMPLATE_SECONDS);
- size: the output, every `*` / `**`, every `%` and `str.format` width or precision, every
  argument of the string methods and filters that build a longer string or list than they are
  given, are checked against TEMPLATE_MAX_CHARS before they run;
- depth: Python's own recursion limit, turned into the same one line;
- anything else the template raises is one line too (`render` never lets it through).

The environment otherwise matches transformers' apply_chat_template (trim_blocks, lstrip_blocks,
loopcontrols, the `{% generation %}` tag, `tojson`, `raise_exception`, `strftime_now`, and `tools`
/ `documents` defined as none), so honest templates render the same text byte for byte. Extra
template variables (Qwen3's `enable_thinking`) are passed as transformers passes its keyword
arguments: over the special tokens, beside `messages`; `template_variables` names the variables a
template reads, so a caller can tell whether a switch means anything to it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from datetime import datetime
from typing import Any, Mapping, Sequence

TEMPLATE_SECONDS = 5.0  # a chat template renders in microseconds; a stranger's may try to hang
TEMPLATE_MAX_CHARS = 1 << 24  # 16 M characters: far past any context window
# Compiling is most of a render (~20 ms for Qwen3's template, against well under 1 ms to run it):
# a template up to this size is compiled once and kept (the few a process uses)
CACHED_TEMPLATE_CHARS = 1 << 20

# widths and precisions in printf-style (%10.3s, %*s) and str.format ({:>10}, {0:{1}}) specs
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")
_NUMBER = re.compile(r"\d+")
# string methods whose result can be far longer than the string: the int argument bounds it
_GROWING_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs"}


class TemplateLimitError(ValueError):
    """The template went past a bound (time, size, depth) or could not be rendered."""


class TemplateRaised(TemplateLimitError):
    """The template itself refused the messages (its `raise_exception`)."""


def _too_big(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and abs(n) > TEMPLATE_MAX_CHARS


def check_format(fmt: str, args: Any = ()) -> None:
    """Refuse a format string whose widths or precisions would build a string past the limit
    (`*` takes them from the arguments)."""
    values = args if isinstance(args, tuple) else (args,)
    for m in _PERCENT_SPEC.finditer(fmt):
        for g in m.groups():
            if g == "*" and any(_too_big(v) for v in values):
                raise TemplateLimitError(f"a '*' width over {TEMPLATE_MAX_CHARS} in a % format")
            if g and g != "*" and int(g) > TEMPLATE_MAX_CHARS:
                raise TemplateLimitError(f"a % format width {g} is over {TEMPLATE_MAX_CHARS}")
    for m in _BRACE_SPEC.finditer(fmt):
        if any(int(n) > TEMPLATE_MAX_CHARS for n in _NUMBER.findall(m.group(1))):
            raise TemplateLimitError(f"a format width in {m.group(0)[:40]!r} is over "
                                     f"{TEMPLATE_MAX_CHARS}")


def _check_replace(s: str, old: str, new: str, count: int = -1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = (s.count(old) if old else len(s) + 1)
        n = n if count is None or count < 0 else min(n, count)
        if len(s) + n * max(0, len(new) - len(old)) > TEMPLATE_MAX_CHARS:
            raise TemplateLimitError(f"a replace builds a string over {TEMPLATE_MAX_CHARS} long")


def _bounded_filter(name: str, fn):
    """A builtin filter with its size arguments checked first."""
    passes_context = hasattr(fn, "jinja_pass_arg")  # its first argument is jinja's, not data

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        data = args[1:] if passes_context else args
        values = [a for a in data if not isinstance(a, (str, list, tuple, dict))] + list(kwargs.values())
        if name == "format" and data and isinstance(data[0], str):
            check_format(data[0], tuple(data[1:]))
        elif name == "replace" and len(data) >= 3:
            _check_replace(*data[:4])
        elif any(_too_big(v) for v in values):
            raise TemplateLimitError(f"the '{name}' filter was given a size over {TEMPLATE_MAX_CHARS}")
        return fn(*args, **kwargs)
    return checked


@functools.lru_cache(maxsize=None)
def _generation_tag():
    """The `{% generation %}...{% endgeneration %}` tag: transformers marks the assistant's text
    with it (for its assistant-token masks); rendering, it writes its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


@functools.lru_cache(maxsize=None)
def _bounded_sandbox():
    """The sandbox class with the bounds above (set `deadline` before rendering; it is per
    thread, so one compiled template can render in several). Made once: jinja2 is imported
    lazily."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._render = threading.local()
            self.globals["range"] = self.bounded_range
            for name in ("center", "indent", "format", "replace", "batch", "slice", "wordwrap",
                         "truncate", "filesizeformat", "round"):
                if name in self.filters:
                    self.filters[name] = _bounded_filter(name, self.filters[name])

        @property
        def deadline(self) -> float:
            return getattr(self._render, "deadline", float("inf"))

        @deadline.setter
        def deadline(self, value: float) -> None:
            self._render.deadline = value

        def bounded_range(self, *args):
            for i in safe_range(*args):
                self.check()
                yield i

        def check(self, size: int = 0) -> None:
            if time.monotonic() > self.deadline:
                raise TemplateLimitError(f"the chat template ran past {TEMPLATE_SECONDS:g} s")
            if size > TEMPLATE_MAX_CHARS:
                raise TemplateLimitError(f"the chat template wrote more than {TEMPLATE_MAX_CHARS} "
                                         f"characters")

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateLimitError("the chat template raises a number to a power over 64")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                            len(seq) * n > TEMPLATE_MAX_CHARS:
                        raise TemplateLimitError("the chat template builds a string or list over "
                                                 f"{TEMPLATE_MAX_CHARS} long")
            if operator == "%" and isinstance(left, str):
                check_format(left, right)
            return super().call_binop(context, operator, left, right)

        def format_string(self, s, args, kwargs, format_func=None):
            check_format(s)
            return super().format_string(s, args, kwargs, format_func)

        def wrap_str_format(self, value):
            owner = getattr(value, "__self__", None)
            wrapped = super().wrap_str_format(value)
            if not isinstance(owner, str) or wrapped is None:
                return wrapped
            check_format(owner)

            def checked(*args, **kwargs):  # a nested width ({0:>{1}}) comes from the arguments
                if _NESTED_SPEC.search(owner) and any(_too_big(v) for v in (*args, *kwargs.values())):
                    raise TemplateLimitError(f"a format width argument over {TEMPLATE_MAX_CHARS}")
                return wrapped(*args, **kwargs)
            return checked

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                if name in _GROWING_METHODS and any(_too_big(v) for v in (*args, *kwargs.values())):
                    raise TemplateLimitError(f"str.{name} was given a size over {TEMPLATE_MAX_CHARS}")
                if name == "replace" and len(args) >= 2:
                    _check_replace(owner, *args[:3])
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


RESERVED = frozenset(["messages", "add_generation_prompt", "tools", "documents"])


def _environment():
    """A fresh bounded sandbox with transformers' settings and helpers."""
    def raise_exception(message: str) -> None:
        raise TemplateRaised(f"chat template: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    # The environment settings transformers renders with, so whitespace matches byte for byte
    env = _bounded_sandbox()(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile(template: str):
    """(environment, compiled template); kept for templates up to CACHED_TEMPLATE_CHARS."""
    if len(template) > CACHED_TEMPLATE_CHARS:
        env = _environment()
        return env, env.from_string(template)
    return _compile_cached(template)


@functools.lru_cache(maxsize=16)
def _compile_cached(template: str):
    env = _environment()
    return env, env.from_string(template)


def template_variables(template: str) -> frozenset[str]:
    """The names `template` reads from its context and does not set itself (`messages`,
    `bos_token`, `enable_thinking`, ...); empty for a template that does not parse. Parsing runs
    nothing of the template."""
    try:
        from jinja2 import meta
        return frozenset(meta.find_undeclared_variables(_environment().parse(template)))
    except Exception:  # noqa: BLE001 - a stranger's program; rendering it says what is wrong
        return frozenset()


def render(template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
           special: Mapping[str, str], variables: Mapping[str, Any] | None = None) -> str:
    """`template` applied to `messages` with the special tokens' text and the extra `variables`
    (which win over a special token of the same name, as transformers' keyword arguments do; the
    names in RESERVED are the renderer's own); TemplateLimitError (one line) on any bound or
    failure."""
    try:
        import jinja2
    except ImportError:  # pragma: no cover - a declared dependency
        raise TemplateLimitError("chat templates need the 'jinja2' package (pip install jinja2)") from None
    clash = RESERVED.intersection(variables or {})
    if clash:
        raise TemplateLimitError(f"template variable {sorted(clash)[0]!r} is set by the renderer itself")
    context = {**special, **(variables or {}), "messages": list(messages),
               "add_generation_prompt": add_generation_prompt, "tools": None, "documents": None}
    try:
        env, compiled = _compile(template)
        env.deadline = time.monotonic() + TEMPLATE_SECONDS
        out, size = [], 0
        for chunk in compiled.generate(**context):
            size += len(chunk)
            env.check(size)
            out.append(chunk)
        return "".join(out)
    except TemplateRaised:
        raise
    except TemplateLimitError as e:
        raise TemplateLimitError(f"chat template cannot be rendered: {e}") from None
    except RecursionError:
        raise TemplateLimitError("chat template cannot be rendered: it recursed too deeply (a "
                                 "macro that calls itself without end)") from None
    except jinja2.TemplateError as e:
        raise TemplateLimitError(f"chat template cannot be rendered: {str(e)[:200]}") from None
    except Exception as e:  # noqa: BLE001 - a stranger's program: any failure is one line
        raise TemplateLimitError(f"chat template cannot be rendered ({type(e).__name__}: "
                                 f"{str(e)[:200]})") from None
