"""The Hugging Face tokenizer files a GGUF file's metadata describes, built with `tokenizers`.

The behaviour matched is that of transformers' own GGUF tokenizer conversion (5.24,
integrations/gguf/gguf_tokenizer_mapping.py), checked token for token on the real files:
- `gpt2` (byte-level BPE: SmolLM2, Llama 3, Qwen2): the vocabulary in the byte alphabet, the
  file's merges, the pre-tokenizer split of `tokenizer.ggml.pre`;
- `llama` (SentencePiece turned into BPE with byte fallback): Gemma 2/3 files (no merges stored:
  they are derived from the vocabulary, best first in the order the tokens are listed, and the
  tokens of two or more spaces are spelled with U+2581 as the model's vocabulary spells them; the
  normalizer writes spaces as U+2581, no prefix space); Phi-3 (a U+2581 prefixed by the
  normalizer); Llama 2 / Mistral v0.1 style (Metaspace, prefix space on the first word, merges
  from the file or derived from the token scores).
Control tokens become special added tokens and user-defined ones plain added tokens, so they
are matched whole. BOS/EOS are added as `tokenizer.ggml.add_bos_token` / `add_eos_token` say
(SentencePiece files that say nothing get BOS, as llama.cpp does).
"""

from __future__ import annotations

from typing import Any, Callable

from offload.models.gguf_names import GGUFError

SPACE = "\u2581"  # SentencePiece's visible space
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp token types
GEMMA_VOCABS = ("gemma", "gemma2", "gemma3")  # architectures whose SentencePiece files are Gemma's
# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as the models' own tokenizer.json files
# write them (byte-level BPE vocabularies whose merges were learned on these splits); any other
# value gets the GPT-2 split that ByteLevel applies itself.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_chars()


def tokenizer_files(meta: Callable[..., Any], arch: str, max_length: int | None,
                    path: str) -> dict[str, str | dict]:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json
    of the GGUF file whose metadata `meta(key, default=None)` reads."""
    kind = meta("tokenizer.ggml.model")
    tokens = list(meta("tokenizer.ggml.tokens", []) or [])
    if not tokens:
        raise GGUFError(f"{path}: holds no tokenizer (tokenizer.ggml.tokens is empty); convert the "
                        f"model with its tokenizer.json instead")
    types = list(meta("tokenizer.ggml.token_type", []) or [1] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, types)
        add_bos_default = False
    elif kind == "llama":
        tok = _sentencepiece(meta, arch, tokens, types, path)
        add_bos_default = True
    else:
        raise GGUFError(f"{path}: tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2' and "
                        f"SentencePiece 'llama' are); convert the model with its tokenizer.json instead")
    special = {name: tokens[i] for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                 ("unk_token", "unknown_token_id"),
                                                 ("pad_token", "padding_token_id"))
               for i in [meta(f"tokenizer.ggml.{key}")] if type(i) is int and 0 <= i < len(tokens)}
    if kind == "llama" and arch in GEMMA_VOCABS and "<mask>" in tokens:
        special["mask_token"] = "<mask>"
    _named_special(tok, special)
    add_bos = bool(meta("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta("tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tok, special, add_bos, add_eos)
    config: dict[str, Any] = dict(special, add_bos_token=add_bos, add_eos_token=add_eos,
                                  tokenizer_class="PreTrainedTokenizerFast")
    if max_length:
        config["model_max_length"] = max_length
    template = meta("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    generation = {k: v for k, v in (("bos_token_id", meta("tokenizer.ggml.bos_token_id")),
                                    ("eos_token_id", meta("tokenizer.ggml.eos_token_id")),
                                    ("pad_token_id", meta("tokenizer.ggml.padding_token_id")))
                  if type(v) is int}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": config,
            "special_tokens_map.json": special, "generation_config.json": generation}


def _post_processor(tok, special: dict[str, str], add_bos: bool, add_eos: bool):
    """BOS/EOS around each sequence, as transformers' fast tokenizers template them."""
    from tokenizers import processors

    bos = special.get("bos_token") if add_bos else None
    eos = special.get("eos_token") if add_eos else None

    def seq(name: str, type_id: int) -> str:
        parts = ([f"{bos}:{type_id}"] if bos else []) + [f"${name}:{type_id}"] + \
            ([f"{eos}:{type_id}"] if eos else [])
        return " ".join(parts)
    single = seq("A", 0)
    pair = f"{single} {seq('B', 1)}"
    used = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=used)


def _added_tokens(tok, tokens: list[str], types: list[int], control_ok: Callable[[str], bool]) -> None:
    """Control tokens as special added tokens, user-defined ones (in the vocabulary) as plain
    added tokens: both are matched whole in the text, as llama.cpp matches them."""
    from tokenizers import AddedToken

    vocab = tok.get_vocab()
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == _CONTROL and control_ok(t)]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in vocab]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def _named_special(tok, special: dict[str, str]) -> None:
    """The named special tokens (bos, eos, unk, pad, mask) are special added tokens too, whatever
    their type in the file (Llama 2's <unk> is 'unknown', not 'control'): transformers adds them
    so. Only ones in the vocabulary: an id past it would be past the model's embedding."""
    from tokenizers import AddedToken

    vocab = tok.get_vocab()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in special.values() if t in vocab])


# ---- byte-level BPE ------------------------------------------------------------------------------
def _byte_level(meta: Callable[..., Any], tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges", []) or []]
    byte_chars = set(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if set(t) <= byte_chars:
            vocab.setdefault(t, i)
        else:  # a token written as plain text (some converters do): spell it in byte-level
            vocab.setdefault("".join(_BYTE_TO_CHAR[b] for b in t.encode("utf-8")), i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(meta("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _added_tokens(tok, tokens, types, lambda t: set(t) <= byte_chars)
    return tok


# ---- SentencePiece as BPE with byte fallback -----------------------------------------------------
def derived_merges(vocab: dict[str, int], score: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every way to cut a token into two tokens
    of the vocabulary, ranked by the token's score (highest first), a longer left piece first
    where scores tie, and the vocabulary's order after that (transformers' order)."""
    pairs = []
    for token, s in score.items():
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                pairs.append((left, right, s))
    pairs.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)  # stable: ties keep order
    return [(left, right) for left, right, _ in pairs]


def _sentencepiece(meta: Callable[..., Any], arch: str, tokens: list[str], types: list[int], path: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = arch in GEMMA_VOCABS
    if not gemma and meta("tokenizer.ggml.add_space_prefix") is False:
        raise GGUFError(f"{path}: SentencePiece tokenizer with tokenizer.ggml.add_space_prefix = false "
                        f"is not supported (llama.cpp honours it, transformers' GGUF tokenizer does "
                        f"not); convert the model with its tokenizer.json instead")
    listed = tokens
    if gemma:  # runs of spaces are listed as spaces; the vocabulary's merges spell them U+2581
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    stored = meta("tokenizer.ggml.merges")
    if stored:
        merges = [tuple(m.split(" ", 1)) for m in stored]
    elif gemma:  # Gemma's scores do not follow its merge order; the listing order does
        merges = derived_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        scores = list(meta("tokenizer.ggml.scores", []) or [])
        if len(scores) != len(tokens):
            raise GGUFError(f"{path}: tokenizer.ggml.scores lists {len(scores)} scores for "
                            f"{len(tokens)} tokens and there are no merges; the file is damaged")
        merges = derived_merges(vocab, dict(zip(tokens, scores)))
    unk = meta("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if type(unk) is int and 0 <= unk < len(tokens) else "<unk>"
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                       **({"unk_token": unk_token} if gemma else {}))
    tok = Tokenizer(model)
    pieces = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        pieces.append(decoders.Strip(" ", 1, 0))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        pieces.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(pieces)
    _added_tokens(tok, listed, types, lambda t: True)
    return tok


__all__ = ["derived_merges", "tokenizer_files"]
