"""One tokenizer for both runners and the data pipeline, built from the checkpoint's own files.

A checkpoint's tokenizer is several files, and each holds part of the truth:
- `tokenizer.json`: vocabulary, merges, normaliser, pre-tokenizer and the post-processor that
  adds BOS where the model expects it (read by the Rust `tokenizers` library, the only faithful
  reader of that format);
- `tokenizer_config.json`: the special tokens by name (bos/eos/pad/unk) and the Jinja chat
  template (or `chat_template.jinja` beside it);
- `generation_config.json`: the ids generation stops on (often several: Llama 3 ends turns with
  <|eot_id|> but documents with <|end_of_text|>).
A GGUF file holds the same facts in its metadata; `offload.models.gguf` turns them into these
files, so a GGUF model and its export go through this one class.

Nothing is guessed from token names: EOS is the checkpoint's eos_token (tokenizer_config) or its
generation config's first eos id, and a checkpoint that names neither has no EOS. The end of an
assistant turn is read off the chat template itself (the special token the template writes right
after an assistant's text), so training data and generation agree on where a turn ends.

Without a tokenizer.json (presets with random weights, the built-in tiny model) the tokenizer is
`ByteTokenizer`: UTF-8 bytes plus BOS and EOS ids, no chat template.

Chat templates are rendered as `transformers`' `apply_chat_template` renders them (same Jinja
sandbox settings and helpers), so the text is byte-identical, and bounded in time, memory and
recursion (offload/data/template.py). Template variables beyond the messages (Qwen3's
`enable_thinking`) are passed as `template_vars`, as transformers passes its keyword arguments.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from offload.data.template import RESERVED, TemplateLimitError, render, template_variables

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_FILE = "generation_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
# "tool" carries a tool's answer back (Qwen3's template renders it as a <tool_response>); the
# template itself decides what a role means, or refuses it
ROLES = ("system", "user", "assistant", "tool")
# what a template variable may hold: the scalars a flag or a JSON config can give
_VAR_TYPES = (bool, int, float, str, type(None))
# a tokenizer file or config of a real checkpoint is at most tens of MB
MAX_FILE_BYTES = 256 << 20

Message = Mapping[str, str]


class TokenizerError(ValueError):
    """The tokenizer files are missing, broken, or cannot do what was asked."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """generation_config's eos_token_id: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def check_messages(messages: Sequence[Message], where: str = "messages") -> list[dict[str, str]]:
    """Messages as plain dicts; each needs a role of system/user/assistant and string content."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError(f"{where}: expected a non-empty list of messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TokenizerError(f"{where}[{k}]: each message needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise TokenizerError(f"{where}[{k}]: role {m['role'][:40]!r} is not one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_template_vars(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra chat template variables as a plain dict: identifier names other than the renderer's
    own (messages, add_generation_prompt, tools, documents), scalar values."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise TokenizerError("template variables: expected a mapping of names to values")
    for name, value in variables.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise TokenizerError(f"template variable {str(name)[:40]!r}: a name must be an identifier "
                                 f"not starting with '_'")
        if name in RESERVED:
            raise TokenizerError(f"template variable {name!r} is set by the renderer itself")
        if not isinstance(value, _VAR_TYPES):
            raise TokenizerError(f"template variable {name!r}: the value must be a boolean, number, "
                                 f"string or null, not {type(value).__name__}")
    return dict(variables)


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255), BOS=256, EOS=257; needs no files, any text round-trips."""
    vocab_size = 258
    bos_id: int | None = 256
    eos_id: int | None = 257
    chat_template = None
    end_of_turn_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8", errors="replace"))
        return [self.bos_id] + ids if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stop_ids(self) -> list[int]:
        return [self.eos_id]

    def files(self) -> dict[str, str | dict]:
        return {}


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special ids, chat rendering, and its files."""

    def __init__(self, tokenizer_json: str, config: Mapping[str, Any] | None = None,
                 generation: Mapping[str, Any] | None = None, template: str | None = None,
                 source: str = "tokenizer"):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:  # pragma: no cover - a declared dependency
            raise TokenizerError("the 'tokenizers' package is needed to read tokenizer.json") from None
        try:
            self._tok = RustTokenizer.from_str(tokenizer_json)
        except BaseException as e:  # noqa: BLE001 - the Rust side raises plain Exceptions, or panics
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise TokenizerError(f"{source}: cannot be read as a tokenizer ({str(e)[:200]})") from None
        self.source = source
        self._json = tokenizer_json
        self.config: dict[str, Any] = dict(config or {})
        self.generation: dict[str, Any] = dict(generation or {})
        template = template or self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) and template else None
        self.separate_template = self.chat_template is not None and not self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_id = self._id_of(self.bos_token, "bos_token")
        if self.bos_id is None:
            self.bos_id = next(iter(_ids(self.generation.get("bos_token_id"))), None)
        self.eos_id = self._id_of(self.eos_token, "eos_token")
        if self.eos_id is None:
            self.eos_id = next(iter(_ids(self.generation.get("eos_token_id"))), None)
        if self.eos_token is None and self.eos_id is not None:
            self.eos_token = self._tok.id_to_token(self.eos_id)
        if self.bos_token is None and self.bos_id is not None:
            self.bos_token = self._tok.id_to_token(self.bos_id)
        # (template, the names it reads), read off the template when first asked
        self._template_variables: tuple[str, frozenset[str]] | None = None
        self.end_of_turn_id = self._end_of_turn() if self.chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer":
        """The tokenizer of a checkpoint directory (it must have a tokenizer.json)."""
        def read(name: str) -> str | None:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                return None
            if os.path.getsize(path) > MAX_FILE_BYTES:
                raise TokenizerError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not a tokenizer file")
            try:
                with open(path, encoding="utf-8") as f:
                    return f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{path}: cannot be read ({e})") from None

        def read_json(name: str) -> dict[str, Any]:
            text = read(name)
            if text is None:
                return {}
            try:
                value = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise TokenizerError(f"{os.path.join(model_dir, name)}: not valid JSON ({str(e)[:200]})") from None
            if not isinstance(value, dict):
                raise TokenizerError(f"{os.path.join(model_dir, name)}: must be a JSON object")
            return value

        text = read(TOKENIZER_FILE)
        if text is None:
            raise TokenizerError(f"{model_dir}: no {TOKENIZER_FILE}")
        return cls(text, read_json(CONFIG_FILE), read_json(GENERATION_FILE), read(TEMPLATE_FILE),
                   source=os.path.join(model_dir, TOKENIZER_FILE))

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{self.source}: {what} {token[:60]!r} (tokenizer_config.json) is not in "
                                 f"the vocabulary; the tokenizer files do not belong together")
        return i

    # ---- encoding -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def _rust(self, fn, *args, **kwargs):
        """A call into the Rust tokenizer: its errors (a TypeError for a lone surrogate) and its
        panics (pyo3's PanicException is a BaseException, past `except Exception`) become one
        TokenizerError naming the tokenizer."""
        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - see above
            raise TokenizerError(f"{self.source}: the tokenizer failed on this text "
                                 f"({type(e).__name__}: {str(e)[:200]})") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._rust(self._tok.encode, text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` as written (special tokens it spells are kept, none added) and each
        token's (start, end) character span in it."""
        enc = self._rust(self._tok.encode, text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._rust(self._tok.encode_batch, texts,
                                           add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stop_ids(self) -> list[int]:
        """Ids that end generation: the checkpoint's EOS, every eos id of its generation config,
        and the token its chat template ends an assistant turn with."""
        ids = _ids(self.generation.get("eos_token_id"))
        ids += [i for i in (self.eos_id, self.end_of_turn_id) if i is not None]
        return sorted(set(ids))

    # ---- chat ---------------------------------------------------------------------------------
    @property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (empty without one): whether a
        switch such as `enable_thinking` means anything to this model."""
        if self.chat_template is None:
            return frozenset()
        if self._template_variables is None or self._template_variables[0] != self.chat_template:
            self._template_variables = (self.chat_template, template_variables(self.chat_template))
        return self._template_variables[1]

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    template_vars: Mapping[str, Any] | None = None) -> str:
        """The chat template applied to `messages`, as transformers' apply_chat_template renders it
        (`template_vars` as its keyword arguments, e.g. {"enable_thinking": False})."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: this model has no chat template "
                                 f"(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        special = {k: _token_text(v) or "" for k, v in self.config.items()
                   if k.endswith("_token") and _token_text(v) is not None}
        special.setdefault("bos_token", self.bos_token or "")
        special.setdefault("eos_token", self.eos_token or "")
        try:  # bounded: a template comes with a stranger's checkpoint (offload/data/template.py)
            return render(self.chat_template, check_messages(messages), add_generation_prompt, special,
                          check_template_vars(template_vars))
        except TemplateLimitError as e:
            raise TokenizerError(str(e)) from None

    def encode_chat(self, messages: Sequence[Message] | str, system: str | None = None,
                    add_generation_prompt: bool = True,
                    template_vars: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation (or one user prompt), ready for the assistant to answer.
        The template writes its own special tokens, so none are added on top."""
        if isinstance(messages, str):
            messages = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": messages}]
        return self.encode(self.render_chat(messages, add_generation_prompt, template_vars),
                           add_special_tokens=False)

    def _end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant's text, if any."""
        marker = "\u2063offload-turn-end\u2063"
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        try:
            text = self.render_chat(probe, add_generation_prompt=False)
        except TokenizerError:
            return None
        at = text.rfind(marker)
        if at < 0:
            return None
        ids, offsets = self.encode_with_offsets(text[at + len(marker):])
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        for i, _ in zip(ids, offsets):
            token = self._tok.id_to_token(i)
            if token in specials:
                return i
            if token is not None and token.strip("\u0120\u010a \n"):  # plain text came first
                return None
        return None

    # ---- files --------------------------------------------------------------------------------
    def files(self) -> dict[str, str | dict]:
        """The checkpoint files that reproduce this tokenizer (for an export): tokenizer.json,
        tokenizer_config.json (with the chat template), special_tokens_map.json and, when the
        source had one, generation_config.json."""
        config = dict(self.config)
        if self.chat_template and not self.separate_template:
            config["chat_template"] = self.chat_template
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        out: dict[str, str | dict] = {TOKENIZER_FILE: self._json, CONFIG_FILE: config}
        if self.separate_template:
            out[TEMPLATE_FILE] = self.chat_template
        special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if _token_text(config.get(k)) is not None}
        if special:
            out[SPECIAL_MAP_FILE] = special
        if self.generation:
            out[GENERATION_FILE] = dict(self.generation)
        return out


class StreamDecoder:
    """Turns a row's growing list of ids into newly completed text. Decoding the whole sequence
    and printing the difference keeps multi-byte characters and merged spaces right; text that
    ends in an incomplete character (U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer | ByteTokenizer):
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
    return Tokenizer.from_dir(model_dir)
