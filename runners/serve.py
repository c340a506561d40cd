"""python -m runners.serve: an OpenAI-compatible HTTP server over the streamed, quantized model.

    python -m runners.serve --model SmolLM2-135M-Instruct.Q4_1.gguf --port 8000
    python -m runners.serve --model /ckpt/Llama-3.1-70B --gpu 0 --quantize int4 --api-key K

Every placement flag of runners.infer (--weights, --gpu, --gpu-memory / --cpu-memory, --quantize,
--adapter, --kv-cache, --experts, --mode, ...) is taken as it is: the same parser, the same
checks, the same plan (printed with its floor at start) and the same loading code. The model is
loaded once; requests in flight share each decode step's pass over the blocks
(offload/infer/batching.py); the HTTP side is runners/serve_api.py (needs `pip install
'offload[serve]'`: starlette and uvicorn).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as runners.infer (before torch is imported)

from runners import infer  # noqa: E402
from runners.common import Parser, RunnerError, run_main  # noqa: E402

# runners.infer's flags that name prompts or outputs of one run: a server takes them over HTTP
NOT_FOR_SERVE = {"prompt": "--prompt", "prompt_file": "--prompt-file", "prompt_ids": "--prompt-ids",
                 "chat": "--chat", "interactive": "--interactive", "batch_size": "--batch-size",
                 "output_json": "--output-json", "system": "--system"}


def build_parser() -> Parser:
    p = infer.build_parser()
    p.prog, p.description = "python -m runners.serve", __doc__.split("\n\n")[0]
    p.set_defaults(max_new_tokens=None)
    for action in p._actions:  # the help of the flags that mean something else here
        if action.dest == "max_new_tokens":
            action.help = ("the max_tokens of a request that gives none (default: the rest of "
                           "the context)")
        elif action.dest == "max_context":
            action.help = "positions of each request's KV cache row (default: the model's " \
                          "context, at most 4096): prompt + max_tokens must fit"
        elif action.dest in ("temperature", "top_p", "seed"):
            action.help = f"{action.help or ''} (a request's default when it gives none)".strip()
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this "
                   "machine only; 0.0.0.0 serves every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("OFFLOAD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $OFFLOAD_API_KEY; unset: "
                        "no key)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id /v1/models lists and requests name (default: --model's "
                        "file or directory name)")
    g.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together, each a row of the KV cache (default 8)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond the batch; more are answered 429 (default 64)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def check_serve_flags(args) -> None:
    for dest, flag in NOT_FOR_SERVE.items():
        if getattr(args, dest) not in (None, False, []):
            raise RunnerError(f"{flag} is for runners.infer: the server takes prompts over HTTP "
                              f"(POST /v1/chat/completions, /v1/completions)")
    if not 1 <= args.max_batch <= 1024:
        raise RunnerError(f"--max-batch must be in [1, 1024], got {args.max_batch}")
    if not 0 <= args.max_queue <= 1 << 16:
        raise RunnerError(f"--max-queue must be in [0, 65536], got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise RunnerError(f"--port must be in [0, 65535], got {args.port}")
    if args.kv_cache == "host":
        raise RunnerError("--kv-cache host is for runners.infer's batches: the server keeps its rows' "
                          "KV cache on the device (lower --max-batch or --max-context to fit)")
    if args.api_key is not None and not args.api_key.strip():
        raise RunnerError("--api-key is empty")
    # runners.infer's own checks, with what the server means by these flags set aside
    new, context = args.max_new_tokens, args.max_context
    args.max_new_tokens, args.max_context = new or 1, None
    infer.check_flags(args)
    args.max_new_tokens, args.max_context = new, context


def context_of(args, cfg) -> int:
    """Positions per KV cache row: --max-context, else the model's context (at most 4096); a
    LongRoPE model (Phi-3) stops where its rotation would switch (the switch recomputes the cache)."""
    most = cfg.max_position_embeddings
    scaling = getattr(cfg, "rope_scaling", None) or {}
    if scaling.get("original_max_position_embeddings") and scaling.get("long_factor"):
        most = min(most, int(scaling["original_max_position_embeddings"]))
    context = args.max_context or min(most, 4096)
    if not 2 <= context <= most:
        raise RunnerError(f"--max-context must be in [2, {most}] (the model's context), got {context}")
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens < context:
        raise RunnerError(f"--max-new-tokens must be in [1, {context - 1}] (--max-context "
                          f"{context} leaves room for a prompt), got {args.max_new_tokens}")
    return context


def load(args):
    """Check every flag, plan, print the plan and its floor, load: (Served, closer)."""
    device, dtype, gpu_budget, cpu_budget, cfg, path, is_random, tokenizer = infer.setup(args)
    if tokenizer is None:
        raise RunnerError(f"--model {args.model}: the server needs the model's tokenizer.json "
                          f"(a preset's random weights have none)")
    context = context_of(args, cfg)
    reader = infer.open_reader(path)
    planned_new = args.max_new_tokens
    try:
        args.max_new_tokens = planned_new or max(1, context // 2)  # the plan's mean position
        quant = infer.quant_source(args, cfg)
        plan, links, measured, qblocks = infer.plan_and_print(
            args, cfg, reader, args.max_batch, context, device, dtype, gpu_budget, cpu_budget, quant)
        if args.dry_run:
            return None, lambda: reader.close()
        model, streamer = infer.load_model(args, cfg, reader, plan, qblocks, device, dtype, quant)
    except BaseException:
        reader.close()
        raise
    finally:
        args.max_new_tokens = planned_new
    infer._probe_stream(args, streamer, links, measured)

    from runners.serve_api import Served
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    served = Served(model=model, tokenizer=tokenizer, name=name, context=context, device=device,
                    dtype=dtype, streamer=streamer,
                    stop_ids=[] if args.ignore_eos else infer._stop_ids(cfg, tokenizer),
                    template_vars=args.template_vars, defaults=args)

    def close():
        streamer.close()
        if model.expert_store is not None:
            model.expert_store.close()
        reader.close()
    return served, close


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_serve_flags(args)
    try:
        import uvicorn
        from runners.serve_api import build_app
    except ImportError as e:
        raise RunnerError(f"the server needs starlette and uvicorn ({e.name} is missing): "
                          f"pip install 'offload[serve]'") from None
    served, close = load(args)
    try:
        if served is None:  # --dry-run: the plan was printed
            return 0
        app = build_app(served, api_key=args.api_key, slots=args.max_batch, max_queue=args.max_queue)
        print(f"serving {served.name} on http://{args.host}:{args.port}/v1 ({args.max_batch} rows "
              f"of {served.context} positions, queue {args.max_queue}"
              f"{', bearer key required' if args.api_key else ''})", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        close()
    return 0


def entry() -> None:
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
