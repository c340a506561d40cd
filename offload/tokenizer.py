"""Tokenization from a checkpoint directory's own files: `tokenizer.json` (read by the Rust
`tokenizers` library, the only faithful reader of that format) and `tokenizer_config.json`
(special tokens, and the Jinja chat template used with `--chat`).

Matches what `transformers` does with the same files: plain prompts are encoded with the
tokenizer's own post-processor (which adds BOS where the model expects it); chat prompts are
rendered with the template (`add_generation_prompt=True`) and encoded without adding special
tokens again, since the template writes them itself.

Without a tokenizer.json, prompts must be given as token ids; `load_tokenizer` returns None and
the caller says so.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(ValueError):
    """The tokenizer files are missing, broken, or cannot do what was asked."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: str):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:  # pragma: no cover - a declared dependency
            raise TokenizerError("the 'tokenizers' package is needed to read tokenizer.json") from None
        path = os.path.join(model_dir, TOKENIZER_FILE)
        try:
            self._tok = RustTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions with its parse error
            raise TokenizerError(f"{path}: cannot be read as a tokenizer ({e})") from None
        self.config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, CONFIG_FILE)
        if os.path.isfile(config_path):
            try:
                with open(config_path) as f:
                    self.config = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{config_path}: not valid JSON ({e})") from None
        self.chat_template = self._find_template(model_dir)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    def _find_template(self, model_dir: str) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not template:  # newer checkpoints keep it in its own file
            jinja = os.path.join(model_dir, "chat_template.jinja")
            if os.path.isfile(jinja):
                with open(jinja) as f:
                    template = f.read()
        return template if isinstance(template, str) and template else None

    # ---- encoding -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, prompt: str, system: str | None = None) -> str:
        """The chat template applied to one user turn, ending with the assistant's header."""
        if self.chat_template is None:
            raise TokenizerError("--chat: this model's tokenizer_config.json has no chat_template")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise TokenizerError("--chat needs the 'jinja2' package to render the chat template "
                                 "(pip install jinja2)") from None

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
            return json.dumps(value, indent=indent, ensure_ascii=False)

        # The same environment settings transformers renders with, so whitespace matches.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template cannot be rendered: {e}") from None

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        return self.encode(self.render_chat(prompt, system), add_special_tokens=False)

    def stop_ids(self) -> list[int]:
        """Token ids that end generation according to the tokenizer (its eos token)."""
        eos = self.token_id(self.eos_token)
        return [] if eos is None else [eos]


class StreamDecoder:
    """Turns a row's growing list of ids into newly completed text. Decoding the whole sequence
    and printing the difference keeps multi-byte characters and merged spaces right; text that
    ends in an incomplete character (U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return ""
        new, self.printed = text[len(self.printed):], text
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        new = text[len(self.printed):] if text.startswith(self.printed) else ""
        self.printed = text
        return new


def load_tokenizer(model_dir: str | None) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer.json."""
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)):
        return None
    return Tokenizer(model_dir)
