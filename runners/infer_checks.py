"""What runners.infer refuses before it loads anything: flag values and combinations, a tokenizer
that does not belong to the model, an --interactive conversation that cannot fit its context."""

from __future__ import annotations

import math
import sys

from offload.models import ModelConfig
from offload.models.quantized import QuantSettings
from offload.quant.format import QuantError
from runners.common import RunnerError

MAX_BATCH = 1 << 16  # one prompt is repeated this many times in memory before any plan


def check_flags(args) -> None:
    """Refuse flag values and combinations before anything is read or measured."""
    if args.max_new_tokens < 1:
        raise RunnerError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size is not None and not 1 <= args.batch_size <= MAX_BATCH:
        raise RunnerError(f"--batch-size must be in [1, {MAX_BATCH}], got {args.batch_size}")
    for flag, seed in (("--seed", args.seed), ("--init-seed", args.init_seed)):
        if not 0 <= seed < 2**63:
            raise RunnerError(f"{flag} must be in [0, 2**63), got {seed}")
    if not 0 <= args.probe_seconds <= 60:  # NaN fails this too (it would measure forever)
        raise RunnerError(f"--probe-seconds must be in [0, 60], got {args.probe_seconds}")
    if args.nvme_ahead < 1:
        raise RunnerError(f"--nvme-ahead must be >= 1, got {args.nvme_ahead}")
    if args.quantize != "none":
        try:
            QuantSettings(args.quantize, args.group_size).spec()
        except QuantError as e:
            raise RunnerError(f"--quantize {args.quantize} --group-size {args.group_size}: {e}") from None
    elif args.group_size:
        raise RunnerError("--group-size sets the --quantize groups: add --quantize int8|int4")
    if args.quantize == "none" and getattr(args, "activations", "fp32") != "fp32":
        raise RunnerError(f"--activations {args.activations} quantizes the inputs of the --quantize "
                          f"products: add --quantize int8|int4 (or drop --activations)")
    if args.interactive:
        args.chat = True
        if args.prompt or args.prompt_file or args.prompt_ids or args.batch_size not in (None, 1):
            raise RunnerError("--interactive reads the prompts from stdin: drop --prompt, "
                              "--prompt-file, --prompt-ids and --batch-size")
    elif args.max_context is not None:
        raise RunnerError("--max-context sizes the --interactive conversation's cache: add --interactive")
    if args.system is not None and not args.chat:
        raise RunnerError("--system is the system message of a chat: add --chat")
    if args.thinking is not None and not args.chat:
        raise RunnerError("--thinking switches the chat template's reasoning: add --chat")
    if not math.isfinite(args.temperature):
        raise RunnerError(f"--temperature must be a finite number >= 0, got {args.temperature}")


def check_tokenizer(tokenizer, cfg: ModelConfig, path: str) -> None:
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise RunnerError(f"the tokenizer of {path} has {tokenizer.vocab_size} tokens, more than "
                          f"the model's vocabulary of {cfg.vocab_size}: its ids would index past "
                          f"the embedding (tokenizer and weights do not belong together)")
    if tokenizer is not None and tokenizer.vocab_size < cfg.vocab_size:
        print(f"note: the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary "
              f"{cfg.vocab_size} (padded); generated ids past the tokenizer decode to nothing",
              file=sys.stderr)


def check_interactive(args, tokenizer, cfg: ModelConfig) -> None:
    """--interactive: a chat template, and the conversation's context (--max-context)."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise RunnerError("--interactive needs a model whose tokenizer has a chat template "
                          "(tokenizer.json and tokenizer_config.json's chat_template)")
    args.max_context = args.max_context or min(cfg.max_position_embeddings, 4096)
    if not 2 <= args.max_context <= cfg.max_position_embeddings:
        raise RunnerError(f"--max-context must be in [2, {cfg.max_position_embeddings}] (the "
                          f"model's context), got {args.max_context}")
    if args.max_new_tokens >= args.max_context:
        raise RunnerError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt "
                          f"in --max-context {args.max_context}")


def chat_template_vars(args, tokenizer) -> dict:
    """--thinking as the chat template's variables: {"enable_thinking": on/off}, what vLLM's
    chat_template_kwargs and llama.cpp's --jinja pass to Qwen3's template. A template that does
    not read enable_thinking renders the same either way: said in one line, and the run goes on
    (vLLM likewise drops the chat_template_kwargs a template does not read)."""
    if args.thinking is None:
        return {}
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and "enable_thinking" not in tokenizer.template_variables:
        print(f"note: --thinking {args.thinking}: this model's chat template does not read "
              f"enable_thinking, so the flag changes nothing", file=sys.stderr)
    return {"enable_thinking": args.thinking == "on"}
