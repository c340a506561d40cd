"""python -m runners.infer: generate with a model larger than the device (ZeRO-Inference).

    python -m runners.infer                                   # tiny random model on CPU, seconds
    python -m runners.infer --model /ckpt/Llama-3.2-1B --prompt "Hello" --max-new-tokens 32
    python -m runners.infer --model 70B --gpu 0 --cpu-memory 100GiB --dry-run

Steps: resolve the model (a checkpoint directory, or a preset whose random weights are generated
once into a cache directory), measure link bandwidths (~1 s), plan where each block lives and
print the plan, load, generate (tokens printed as they come), report speed against the floor.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

# Idle OpenMP threads sleep rather than spin between parallel regions: read once, when torch's
# OpenMP runtime starts, so it is set before torch is imported (a user's own setting wins).
# Spinning threads take the cores the batch-1 split projection runs on (models/kernels.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm

from nvme.format import held_lock
from offload.config import format_bytes, read_regular_file
from offload.infer.generate import SamplingParams, check_prompts, generate
from offload.models import (PRESETS, CheckpointReader, ModelConfig, init_parameter_, kv_cache_bytes,
                            norm_init_value, num_active_params, num_block_params, num_params,
                            parameter_shapes, preset, save_pretrained)
from offload.infer.plan import (MODES, Links, measure_links, plan_inference, streamer_disk_gbps,
                             workspace_bytes)
from offload.models import kernels, load_streamed
from offload.models.quantized import HEAD_SPEC, head_bytes, load_quantized_streamed, quantized_block_bytes
from offload.infer.floor import READ_PROBE_SECONDS, memory_read_gbps
from offload.quant.matmul import kernels_run
from offload.memory.tiers import device_free_bytes, disk_free_bytes, host_free_bytes
from offload.data.tokenizer import StreamDecoder, load_tokenizer
from runners.common import (GROUP_SIZE_HELP, Parser, RunnerError, add_budget_args, add_device_args,
                            check_budget_flags, dtype_label, group_size_arg, note_unused_tensors,
                            run_main, select_device, select_dtype, writable_dir)
from runners.infer_checks import chat_template_vars, check_flags, check_interactive, check_tokenizer
from runners.infer_lora import add_adapter_arg, attach_adapter, check_adapter
from runners.infer_quant import convert_quantized, quant_scratch, quant_source
from runners.infer_experts import (add_expert_args, check_expert_flags, expert_sizes, experts_reserve,
                                   plan_model_experts)
from runners.infer_report import print_report, run_metrics

DEFAULT_IDS = [1, 15, 27, 100, 7, 42]
MAX_PROMPT_FILE_BYTES = 64 << 20


def build_parser() -> Parser:
    p = Parser(prog="python -m runners.infer", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="checkpoint directory, .gguf file "
                   f"(converted once into a cache) or preset ({', '.join(PRESETS)}); default tiny")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (needs tokenizer.json)")
    p.add_argument("--prompt-file", help="one prompt per line, run as a batch")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--system", default=None, help="a system message before each --chat prompt")
    p.add_argument("--thinking", choices=["on", "off"], help="--chat: the template's enable_thinking "
                   "(Qwen3; vLLM's chat_template_kwargs): off answers without reasoning")
    p.add_argument("--interactive", action="store_true", help="a multi-turn chat on stdin (implies "
                   "--chat): replies stream as they are generated and the KV cache is kept between "
                   "turns; /reset starts over, /exit or end of input ends")
    p.add_argument("--max-context", type=int, default=None, help="--interactive: positions of the "
                   "conversation's KV cache (default: the model's context, at most 4096)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--init-seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per batch (one prompt is repeated to fill it)")
    add_device_args(p)
    p.add_argument("--weights", default="auto", choices=["auto", "device", "cpu", "nvme"],
                   help="auto = planner; the others put every block in that tier")
    add_budget_args(p)
    add_adapter_arg(p)
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="store and stream the decoder layers' projection weights as group-wise "
                        "int8 or int4 codes with fp16 scales, dequantized where they are used; "
                        "converted once into --offload-dir (default ~/.cache/offload)/quant and "
                        "reused. A GGUF model's Q8_0 (int8) or Q4_0/Q4_1 (int4) tensors are taken "
                        "as they are")
    p.add_argument("--group-size", type=group_size_arg, default=0, metavar="N|channel",
                   help=GROUP_SIZE_HELP)
    p.add_argument("--activations", default="fp32", choices=["fp32", "int8"],
                   help="with --quantize, on the CPU: the products' inputs as given (fp32, the "
                        "default) or quantized per 32 values to int8 and multiplied in integer dot "
                        "products, as llama.cpp does (faster; different math, so the tokens may "
                        "change: docs/benchmarks/quant.md measures the agreement)")
    p.add_argument("--quantize-head", default="int8", choices=["int8", "none"],
                   help="with --quantize: the vocabulary head (read whole every step) in int8 "
                        "groups of 32, llama.cpp's Q8_0 (default), or kept in the compute dtype")
    add_expert_args(p)
    p.add_argument("--mode", default="latency", choices=MODES)
    p.add_argument("--kv-cache", default="auto", choices=["auto", "device", "host"],
                   help="where the KV cache lives: auto = the device, unless --mode throughput on a "
                        "GPU cannot fit the batch's cache there (then host RAM, one layer at a time "
                        "on the device)")
    p.add_argument("--nvme-ahead", type=int, default=2, help="blocks read ahead from NVMe")
    p.add_argument("--probe-seconds", type=float, default=1.0,
                   help="time spent measuring link bandwidths at start-up; the streamer then "
                        "reads its NVMe blocks for twice this to set the floor")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--output-json", metavar="FILE")
    return p


# ---- model resolution -------------------------------------------------------------------------------
def resolve_model(args, dtype: torch.dtype) -> tuple[ModelConfig, str | None, bool]:
    """(config, checkpoint dir or None when a preset's weights are not generated yet, is_random)."""
    name = args.model
    looks_like_path = os.sep in name or name.startswith(".") or os.path.exists(name)
    if not looks_like_path and name in PRESETS:
        cfg = preset(name)
        cache = args.offload_dir or os.path.join("~", ".cache", "offload")
        path = os.path.join(os.path.abspath(os.path.expanduser(cache)),
                            f"{name}-seed{args.init_seed}-{dtype_label(dtype)}")
        return cfg, path, True
    if not os.path.exists(name):
        raise RunnerError(f"--model {name}: no such directory, and not a preset "
                          f"(presets: {', '.join(PRESETS)})")
    if os.path.isfile(name):  # a GGUF file: converted once into a cached checkpoint directory
        from offload.models.gguf import gguf_checkpoint_dir, is_gguf
        if not is_gguf(name):
            raise RunnerError(f"--model {name}: a file, but not a GGUF model (give a .gguf file, a "
                              f"checkpoint directory or a preset name)")
        name = gguf_checkpoint_dir(name, dtype)
    with CheckpointReader(name) as reader:  # CheckpointError: no config.json, bad arch, ...
        note_unused_tensors(reader)
        return reader.config, name, False


def random_checkpoint(cfg: ModelConfig, path: str, seed: int, dtype: torch.dtype) -> None:
    """Write seeded random weights as a checkpoint, one tensor at a time (reused when present).
    Two runs generating the same one into one --offload-dir take turns (the second reuses it)."""
    if _has_checkpoint(path, cfg):
        return
    writable_dir(path, "--offload-dir")
    with held_lock(path.rstrip(os.sep) + ".lock", "offload-random-weights", 6 * 3600.0,
                   on_wait=lambda pid: print(f"note: process {pid} is writing {path}; waiting for "
                                             f"it", file=sys.stderr)):
        if not _has_checkpoint(path, cfg):
            _write_random(cfg, path, seed, dtype)


def _has_checkpoint(path: str, cfg: ModelConfig) -> bool:
    try:
        with CheckpointReader(path) as reader:
            return reader.config.to_hf(dtype="x") == cfg.to_hf(dtype="x")
    except Exception:  # noqa: BLE001 - absent or stale: (re)generated
        return False


def _write_random(cfg: ModelConfig, path: str, seed: int, dtype: torch.dtype) -> None:
    shapes = parameter_shapes(cfg)
    need = num_params(cfg) * dtype.itemsize
    free = disk_free_bytes(path)
    if need > free:
        raise RunnerError(f"random weights for this preset need {format_bytes(need)} on disk, "
                          f"{format_bytes(free)} free at {path}; use --offload-dir elsewhere")

    def tensors():
        for name, shape in tqdm(shapes.items(), desc="generating random weights", unit="tensor",
                                file=sys.stderr):
            t = torch.empty(shape, dtype=torch.float32)
            init_parameter_(name, t, seed, cfg.initializer_range, norm_init_value(cfg))
            yield name, t.to(dtype)

    save_pretrained(tensors(), path, config=cfg, dtype=dtype, max_shard_bytes=1 << 30)


def read_prompts(args, tokenizer, cfg: ModelConfig) -> list[list[int]]:
    texts = list(args.prompt)
    if args.prompt_file:
        try:
            raw = read_regular_file(args.prompt_file, MAX_PROMPT_FILE_BYTES)
        except OSError as e:
            raise RunnerError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
        if raw is None:
            raise RunnerError(f"--prompt-file {args.prompt_file}: not a regular text file "
                              f"of at most {format_bytes(MAX_PROMPT_FILE_BYTES)}")
        try:
            lines = [line for line in raw.decode().splitlines() if line.strip()]
        except UnicodeDecodeError as e:
            raise RunnerError(f"--prompt-file {args.prompt_file}: not UTF-8 text ({e})") from None
        if not lines:
            raise RunnerError(f"--prompt-file {args.prompt_file}: holds no prompt (every line is "
                              f"blank); write one prompt per line")
        texts += lines
    for k, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogateescape)
            raise RunnerError(f"prompt {k + 1} is not valid UTF-8 text; pass UTF-8 (or token ids "
                              f"with --prompt-ids)") from None
    if texts and tokenizer is None:
        raise RunnerError("text prompts need a tokenizer.json in the model directory, which this "
                          "model lacks; give token ids with --prompt-ids 1,2,3")
    if args.chat and tokenizer is None:
        raise RunnerError("--chat needs a tokenizer.json with a chat template in the model directory")
    prompts = [tokenizer.encode_chat(t, system=args.system, template_vars=args.template_vars)
               if args.chat else tokenizer.encode(t) for t in texts]
    for spec in args.prompt_ids:
        try:
            prompts.append([int(x) for x in spec.replace(" ", "").split(",") if x])
        except ValueError:
            raise RunnerError(f"--prompt-ids {spec!r}: expected comma-separated integers") from None
    if not prompts:
        prompts = [[t % cfg.vocab_size for t in DEFAULT_IDS]]
    check_prompts(prompts, cfg.vocab_size)
    return prompts


# ---- main -------------------------------------------------------------------------------------
def _device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    # A dry run may plan for a GPU this machine does not have (sizing a workstation from a
    # laptop): its memory is --gpu-memory, and the link to it cannot be measured here.
    args.planned_gpu = args.dry_run and args.gpu is not None and args.gpu >= 0 and \
        not torch.cuda.is_available()
    if args.planned_gpu:
        if args.gpu_memory is None:
            raise RunnerError(f"--gpu {args.gpu}: no CUDA device here; a --dry-run can plan for one "
                              f"of a given size: add --gpu-memory SIZE (e.g. 80GiB)")
        device = torch.device("cuda", args.gpu)
        return device, torch.bfloat16 if args.dtype == "auto" else select_dtype(args.dtype, device)
    device = select_device(args.gpu)
    return device, select_dtype(args.dtype, device)


def _batches(args, tokenizer, cfg: ModelConfig) -> tuple[list[list[list[int]]], int]:
    """(the prompts in batches of --batch-size, the context they need)."""
    prompts = read_prompts(args, tokenizer, cfg) if not args.interactive else [[0]]
    batch = args.batch_size or len(prompts)
    if len(prompts) == 1 and batch > 1:
        prompts = prompts * batch
    batches = [prompts[k:k + batch] for k in range(0, len(prompts), batch)]
    context = args.max_context if args.interactive else max(len(p) for p in prompts) + args.max_new_tokens
    return batches, context


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    device, dtype, gpu_budget, cpu_budget, cfg, path, is_random, tokenizer = setup(args)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.interactive:
        check_interactive(args, tokenizer, cfg)
    batches, context = _batches(args, tokenizer, cfg)
    if is_random:
        print(f"WARNING: preset {args.model!r} has no checkpoint: RANDOM weights (seed {args.init_seed}) "
              f"in {path}. This measures speed, not text.", file=sys.stderr)
        if not args.dry_run:
            random_checkpoint(cfg, path, args.init_seed, dtype)
    reader = open_reader(path)
    try:
        quant = quant_source(args, cfg)
        return _run(args, cfg, reader, tokenizer, batches, context, device, dtype, gpu_budget,
                    cpu_budget, sampling, quant)
    finally:
        if reader is not None:
            reader.close()


def setup(args):
    """Device, dtype, budgets, the model (config, path, random?) and its tokenizer, with every
    flag checked before anything is generated or loaded (runners.serve starts the same way)."""
    device, dtype = _device_and_dtype(args)
    gpu_budget, cpu_budget = check_budget_flags(args, device)
    cfg, path, is_random = resolve_model(args, dtype)
    check_expert_flags(args, cfg)  # before anything is generated or loaded
    args.lora = check_adapter(args.adapter, cfg)  # before anything is loaded (runners/infer_lora.py)
    tokenizer = None if is_random else load_tokenizer(path)
    check_tokenizer(tokenizer, cfg, path)
    args.template_vars = chat_template_vars(args, tokenizer)
    return device, dtype, gpu_budget, cpu_budget, cfg, path, is_random, tokenizer


def open_reader(path: str | None) -> CheckpointReader | None:
    ready = path is not None and os.path.isfile(os.path.join(path, "config.json"))
    return CheckpointReader(path) if ready else None


def _run(args, cfg, reader, tokenizer, batches, context, device, dtype, gpu_budget, cpu_budget,
         sampling, quant=None) -> int:
    plan, links, measured, qblocks = plan_and_print(args, cfg, reader, len(batches[0]), context, device,
                                                    dtype, gpu_budget, cpu_budget, quant)
    if args.interactive and plan.kv_tier == "host":
        raise RunnerError("--interactive keeps the conversation's KV cache on the device; "
                          "--kv-cache host is for batches (drop it, or lower --max-context)")
    if args.dry_run:
        if args.output_json:
            _write_json(args.output_json, {"plan": _plan_json(plan)})
        return 0
    model, streamer = load_model(args, cfg, reader, plan, qblocks, device, dtype, quant)
    stop = [] if args.ignore_eos else _stop_ids(cfg, tokenizer)
    calls_before = kernels_run()  # this run's quantized products, in the report
    try:
        links = _probe_stream(args, streamer, links, measured)
        if args.interactive:
            return _interactive(args, model, tokenizer, streamer, device, dtype, sampling, stop)
        all_ids, texts, results = _generate_batches(args, model, tokenizer, streamer, batches,
                                                    sampling, stop, device, dtype, plan.kv_tier)
    finally:
        streamer.close()
        if model.expert_store is not None:
            model.expert_store.close()
    memory = None
    if device.type == "cpu" and args.probe_seconds > 0:  # the memory floor (offload/infer/floor.py)
        # the embedding table, unless a step reads it whole as the (dense, tied) head
        head_is_table = cfg.tie_word_embeddings and _head_spec(args, quant) is None
        untied_embedding = 0 if head_is_table else cfg.vocab_size * cfg.hidden_size * dtype.itemsize
        memory = (memory_read_gbps(min(READ_PROBE_SECONDS, args.probe_seconds)), untied_embedding)
    metrics = run_metrics(results, plan, links, device, len(batches[0]), calls_before,
                          getattr(model, "expert_store", None), memory)
    print_report(metrics)
    if args.output_json:
        out = {"generated_ids": all_ids, "metrics": metrics, "plan": _plan_json(plan)}
        if tokenizer is not None:
            out["text"] = texts
        _write_json(args.output_json, out)
    return 0


def plan_and_print(args, cfg, reader, batch: int, context: int, device, dtype, gpu_budget, cpu_budget,
                   quant=None):
    """Plan the placement for `batch` sequences of `context` positions and print it with the
    floor: (plan, links, whether the disk was measured, the quantized blocks or None)."""
    plan, sizes, staging = _plan(args, cfg, reader, batch, context, device, dtype, gpu_budget,
                                 cpu_budget, quant)
    qblocks = (convert_quantized(args, cfg, reader, dtype, quant)
               if quant is not None and reader is not None and not args.dry_run else None)
    links, measured = _probe_links(args, cfg, reader, plan, device, qblocks)
    if sizes is not None:  # an MoE model: its experts in what the dense parts left
        plan_model_experts(args, cfg, plan, sizes, device, dtype, links, staging)
    block = plan.block_bytes[0] if plan.block_bytes else 0
    kind = (dtype_label(dtype) if quant is None else
            f"{args.quantize} (projections{'; head int8' if _head_spec(args, quant) else ''}; "
            f"the rest {dtype_label(dtype)})")
    active = f" ({num_active_params(cfg) / 1e9:.2f}B active)" if cfg.num_experts else ""
    print(f"model: {args.model} ({cfg.architecture}, {num_params(cfg) / 1e9:.2f}B params{active}, "
          f"{cfg.num_hidden_layers} blocks of {format_bytes(block)} in {kind}) on "
          f"{device}", file=sys.stderr)
    print(plan.describe(links if measured else None), file=sys.stderr)
    if getattr(args, "planned_gpu", False):
        print("  floor:  unknown (planned for a GPU that is not here: run on the machine to "
              "measure its host->device and disk links)", file=sys.stderr)
    elif not measured:
        print("  floor:  unknown (disk bandwidth not measured: no checkpoint files to read yet)",
              file=sys.stderr)
    return plan, links, measured, qblocks


def load_model(args, cfg, reader, plan, qblocks, device, dtype, quant):
    """(model, streamer) placed as `plan` says, the adapter attached."""
    with tqdm(total=cfg.num_hidden_layers, desc="loading blocks", unit="block",
              file=sys.stderr) as bar:
        experts = plan.experts.placement() if plan.experts is not None else None
        if qblocks is not None:
            model, streamer = load_quantized_streamed(
                reader, qblocks, plan.residency, device=device, dtype=dtype,
                nvme_ahead=args.nvme_ahead, progress=lambda i: bar.update(1), experts=experts,
                head=_head_spec(args, quant), activations=args.activations)
        else:
            model, streamer = load_streamed(reader, plan.residency, device=device, dtype=dtype,
                                            nvme_ahead=args.nvme_ahead, experts=experts,
                                            progress=lambda i: bar.update(1))
    attach_adapter(model, args.lora)
    return model, streamer


def _head_spec(args, quant):
    """The quantized head's spec (--quantize with --quantize-head int8), else None."""
    return HEAD_SPEC if quant is not None and getattr(args, "quantize_head", "none") == "int8" else None


def _plan(args, cfg, reader, batch: int, context: int, device, dtype, gpu_budget, cpu_budget,
          quant=None):
    """(the placement for this model, batch and context under the budgets and what is free; an
    MoE model's expert sizes or None; whether NVMe reads need host staging). Quantized blocks are
    planned at their quantized bytes, stored and streamed as they are. An MoE model's blocks are
    planned as their dense parts: the experts are placed after (runners/infer_experts.py)."""
    L, item = cfg.num_hidden_layers, dtype.itemsize
    if quant is not None:
        blocks = [quantized_block_bytes(cfg, s, dtype, i) for i, s in enumerate(quant[1])]
        stored, stored_dtype = blocks, dtype
    else:
        blocks = [num_block_params(cfg, i) * item for i in range(L)]  # DeepSeek's dense layers differ
        stored = ([sum(loc.nbytes for loc in reader.block_locations(i)) for i in range(L)] if reader
                  else blocks)
        stored_dtype = reader.block_locations(0)[0].dtype if reader else dtype
    sizes = expert_sizes(cfg, reader, dtype, quant, blocks, stored)
    if sizes is not None:
        blocks, stored = sizes.dense_block_bytes, sizes.dense_stored_bytes
    host_free = host_free_bytes()
    host_budget = min(cpu_budget, host_free) if cpu_budget else host_free
    if getattr(args, "planned_gpu", False) and cpu_budget:
        host_budget = cpu_budget  # the planned machine's RAM, not this one's
    if getattr(args, "planned_gpu", False):
        dev_budget = gpu_budget  # a GPU planned for, not present: its size is the flag's
    else:
        dev_free = device_free_bytes(device)
        dev_budget = min(gpu_budget, dev_free) if gpu_budget else dev_free
    staging = device.type == "cuda" or stored_dtype != dtype
    return plan_inference(
        block_bytes=blocks, stored_block_bytes=stored,
        non_block_bytes=(num_params(cfg) - sum(num_block_params(cfg, i) for i in range(L))) * item
        + head_bytes(cfg, _head_spec(args, quant), dtype)  # a quantized head's codes
        + (args.lora.device_bytes if getattr(args, "lora", None) else 0),  # resident adapters
        batch_size=batch, context=context,
        kv_bytes_per_seq=kv_cache_bytes(cfg, 1, context, dtype),
        workspace_per_seq=workspace_bytes(max(cfg.hidden_size, cfg.q_size), cfg.intermediate_size,
                                          cfg.num_attention_heads, cfg.vocab_size, context, 1, item,
                                          score_copies=3 if cfg.attn_logit_softcapping else 1),
        device_budget=dev_budget if device.type == "cuda" else host_budget, host_budget=host_budget,
        device_is_host=device.type != "cuda", mode=args.mode,
        force=None if args.weights == "auto" else args.weights, nvme_ahead=args.nvme_ahead,
        kv_tier=args.kv_cache, num_layers=L,
        kv_positions_per_step=max(1, context - args.max_new_tokens // 2),
        staging_needed=staging, reserved_bytes=experts_reserve(args, cfg, sizes, device, dtype, staging),
        scratch_bytes=kernels.scratch_bytes(device, dtype) + quant_scratch(cfg, quant, batch, context,
                                                                            args.max_new_tokens,
                                                                            device, dtype)), sizes, staging



def _probe_links(args, cfg, reader, plan, device, qblocks=None) -> tuple[Links, bool]:
    """The links' bandwidths, the disk probed on the bytes that will stream (NVMe-resident
    blocks: the quantized block files when there are some) when there are any; and whether the
    disk could be measured."""
    if getattr(args, "planned_gpu", False):  # no GPU here: neither link can be measured for it
        return Links(float("nan"), float("nan"), False), False
    shards = sorted({loc.path for loc in reader.locations.values()}) if reader else []
    if qblocks is not None:
        streamed = [(r.path, r.offset, r.nbytes) for i in range(cfg.num_hidden_layers)
                    if plan.residency[i] == "nvme" for r in qblocks.ranges(i)]
    else:
        streamed = [(loc.path, loc.offset, loc.nbytes) for i in range(cfg.num_hidden_layers)
                    if plan.residency[i] == "nvme" for loc in reader.block_locations(i)] if reader else []
    links = measure_links(device, shards, seconds=args.probe_seconds, read_ranges=streamed or None)
    measured = links.disk_gbps > 0
    if not measured:  # nothing to probe yet (a dry run before a preset's weights exist)
        links = Links(links.h2d_gbps, float("nan"), links.disk_direct)
    return links, measured


def _probe_stream(args, streamer, links: Links, measured: bool) -> Links:
    """The disk measured again, now by the loaded streamer on the blocks it will stream, the way
    a decode step reads them (planner.streamer_disk_gbps): the floor the run is judged by. The
    start-up probe read the same bytes with other requests before the model was loaded."""
    if not measured or args.probe_seconds == 0:
        return links
    # twice the start-up probe's time: long enough that a second run measures the same rate
    gbps, nbytes = streamer_disk_gbps(streamer, 2 * args.probe_seconds)
    if not nbytes:
        return links
    print(f"  disk, the streamed blocks read by the streamer: {gbps:.2f} GB/s over "
          f"{format_bytes(nbytes)} (start-up probe {links.disk_gbps:.2f} GB/s); the floor uses this",
          file=sys.stderr)
    return Links(links.h2d_gbps, gbps, links.disk_direct)


def _generate_batches(args, model, tokenizer, streamer, batches, sampling, stop, device, dtype,
                      kv_tier: str = "device"):
    """Generate for each batch of prompts, streaming a single prompt's tokens to stdout and
    printing a batch's rows when done: (all token ids, texts, GenerationResults)."""
    all_ids, texts, results = [], [], []
    for rows in batches:
        decoders = [StreamDecoder(tokenizer) for _ in rows] if tokenizer else None
        single = len(rows) == 1

        def on_tokens(step, ids, decoders=decoders, single=single):
            if not single or ids[0] is None:
                return
            piece = decoders[0].push(ids[0]) if decoders else f"{ids[0]} "
            print(piece, end="", flush=True)

        res = generate(model, rows, max_new_tokens=args.max_new_tokens, sampling=sampling,
                       stop_ids=stop, device=device, dtype=dtype, streamer=streamer,
                       on_tokens=on_tokens, kv_tier=kv_tier)
        results.append(res)
        all_ids += res.tokens
        if decoders:
            if single:
                print(decoders[0].flush(), end="")
            texts += [tokenizer.decode(t) for t in res.tokens]
        if single:
            print()
        else:
            for r, toks in enumerate(res.tokens):
                print(f"[{len(all_ids) - len(res.tokens) + r}] "
                      f"{texts[-len(res.tokens) + r] if decoders else toks}")
    return all_ids, texts, results


def _interactive(args, model, tokenizer, streamer, device, dtype, sampling, stop) -> int:
    """The stdin chat loop: one line a turn, the reply streamed to stdout as it is generated."""
    from offload.data.tokenizer import TokenizerError
    from offload.infer.chat import ChatOverflow, ChatSession

    session = ChatSession(model, tokenizer, max_context=args.max_context, device=device, dtype=dtype,
                          streamer=streamer, sampling=sampling, stop_ids=stop, system=args.system,
                          template_vars=args.template_vars)
    transcript: list[dict] = []
    print(f"chat: {args.max_context} positions of context; /reset starts over, /exit ends",
          file=sys.stderr)
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = _read_line()
        if line is None:  # not text: said, and the session goes on
            continue
        if not line or line.strip() == "/exit":
            break
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        try:
            turn = session.reply(text, args.max_new_tokens,
                                 on_text=lambda piece: print(piece, end="", flush=True))
        except (ChatOverflow, TokenizerError) as e:  # this turn only: the session goes on
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        print(f"[{len(turn.ids)} tokens, {turn.tokens_per_s:.1f} tok/s; {turn.fed_tokens} of "
              f"{turn.prompt_tokens} prompt tokens computed, the rest from the cache]", file=sys.stderr)
        transcript.append({"user": text, "assistant": turn.text, "generated_ids": turn.ids,
                           "prompt_tokens": turn.prompt_tokens, "fed_tokens": turn.fed_tokens,
                           "tokens_per_s": turn.tokens_per_s})
    if args.output_json:
        _write_json(args.output_json, {"transcript": transcript, "messages": session.messages})
    return 0


def _read_line() -> str | None:
    """One line of stdin as text ("" at its end); None, after saying why, for a line that is
    not UTF-8 text (it would reach the tokenizer as lone surrogates and end the session)."""
    raw = getattr(sys.stdin, "buffer", None)
    line = raw.readline() if raw is not None else sys.stdin.readline()
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        text.encode("utf-8")  # lone surrogates from a text stream decoded with surrogateescape
    except UnicodeError as e:
        print(f"error: that line is not UTF-8 text (byte {e.start + 1}); type it again",
              file=sys.stderr)
        return None
    return text


def _plan_json(plan) -> dict:
    return {"residency": plan.residency, "device_need": plan.device_need, "host_need": plan.host_need,
            "block_bytes": plan.block_bytes, "kv_bytes": plan.kv_bytes, "mode": plan.mode,
            "kv_tier": plan.kv_tier, "max_batch": plan.max_batch,
            "max_batch_device_kv": plan.max_batch_device_kv,
            "experts": None if plan.experts is None else {
                "homes": {t: plan.experts.count(t) for t in ("device", "cpu", "nvme")},
                "expert_bytes": plan.experts.expert_bytes,
                "stored_expert_bytes": plan.experts.stored_expert_bytes,
                "pool_bytes": plan.experts.pool_bytes, "host_bytes": plan.experts.host_bytes,
                "bytes_per_token": plan.experts.per_step(1)}}


def _write_json(path: str, obj: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
    except OSError as e:
        raise RunnerError(f"--output-json {path}: {e.strerror}") from None


def _stop_ids(cfg: ModelConfig, tokenizer) -> list[int]:
    eos = cfg.eos_token_id
    ids = list(eos) if isinstance(eos, tuple) else ([] if eos is None else [eos])
    if tokenizer is not None:
        ids += tokenizer.stop_ids()
    return sorted(set(ids))


def entry() -> None:
    sys.exit(run_main(main))


if __name__ == "__main__":
    entry()
