"""runners.finetune's flags: the parser, their checks, and the OffloadConfig they make (a
--config file as the base, explicit flags over it, defaults under both). Policy only; every
value reaches the library through OffloadConfig, which validates it again."""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch

from offload.lora import SHORT_TARGETS, LoraConfig, LoraError
from runners.common import GROUP_SIZE_HELP, Parser, dtype_label, fail, group_size_arg, select_dtype

DESCRIPTION = ("fine-tune a Llama, Mistral, Qwen2/3, Gemma 2/3 or Phi-3/4 model, or a mixture of "
               "experts (Qwen3-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V3), with offloaded optimizer state")

DEFAULTS = dict(model="tiny", offload="cpu", dtype="auto", steps=100, batch_size=16,
                micro_batch_size=None, seq_len=128, lr=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                weight_decay=0.0, grad_clip=1.0, eval_every=50, eval_batches=50, save_every=0, seed=0)

# OffloadConfig's switches as this runner's flags, for the library's option-combination
# messages (options with values read the same either way: offload='cpu' is --offload cpu)
FLAGS = {"activation_checkpointing": "--activation-checkpointing",
         "offload_activations": "--offload-activations", "delayed_update": "--delayed-update",
         "speculative_step": "--speculative-step"}


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m runners.finetune", description=DESCRIPTION,
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_args(ap)
    _add_schedule_args(ap)
    _add_memory_args(ap)
    _add_lora_args(ap)
    _add_output_args(ap)
    ap.add_argument("--gpu", type=int, default=None,
                    help="CUDA device index (absent: CPU; under torchrun every rank takes "
                         "cuda:LOCAL_RANK whenever a GPU is visible)")
    ap.add_argument("--config", default=None, help="a JSON file of engine options (our keys or DeepSpeed's "
                    "zero_optimization/aio/fp16/bf16/optimizer keys); flags given explicitly win")
    ap.add_argument("--gpu-memory", default=None, help="device budget, e.g. 20GiB (default: free memory)")
    ap.add_argument("--cpu-memory", default=None, help="host budget, e.g. 12GiB (default: available RAM)")
    ap.add_argument("--metrics", default=None, help="JSONL file, one line per update (default OUTPUT/metrics.jsonl)")
    ap.add_argument("--dry-run", action="store_true", help="print the memory plan and exit")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model, the data, where optimizer state lives, the dtype."""
    d = DEFAULTS
    ap.add_argument("--model", default=d["model"], help="a Hugging Face checkpoint directory, a .gguf "
                    "file (F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, Q2_K-Q6_K; dequantized to fp32 once into a "
                    "cache) or a preset name (tiny, small, 1B, 3B, 7B, 8B, 13B, 70B, qwen3-8B, gemma3-27B, "
                    "phi4-14B, ...; presets start from random weights)")
    ap.add_argument("--data", default=None, help="a .txt file, a .jsonl file (one example per line: "
                    "'text', chat 'messages' or ShareGPT 'conversations', 'prompt'/'response', Alpaca "
                    "'instruction'/'input'/'output'), a .json array of such examples, or a directory of "
                    "them; chat and instruction examples go through the model's chat template, loss on "
                    "the assistant's turns; default: the built-in corpus")
    ap.add_argument("--offload", choices=["none", "cpu", "nvme", "auto"], default=None,
                    help=f"where fp32 masters and Adam moments live (default {d['offload']}); auto: the "
                    "planner picks optimizer tier, weight tier, checkpointing and activation offload "
                    "from the budgets")
    ap.add_argument("--offload-dir", default=None, help="directory for NVMe swap files "
                    "(default: OUTPUT/swap); only with --offload nvme")
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default=None,
                    help=f"weights/gradients dtype on the device (default {d['dtype']}: bf16 on a GPU "
                    "(fp16 where bf16 is unsupported), fp32 on the CPU)")


def _add_schedule_args(ap: argparse.ArgumentParser) -> None:
    """Updates, batch sizes and the learning-rate schedule."""
    d = DEFAULTS
    ap.add_argument("--steps", type=int, default=d["steps"], help="optimizer updates")
    ap.add_argument("--batch-size", type=int, default=None, help=f"sequences per update, over all "
                    f"ranks under torchrun (default {d['batch_size']}, or a DeepSpeed --config's "
                    f"train_batch_size)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward/backward "
                    "on each rank; gradient accumulation = batch-size / ranks / micro-batch-size "
                    "(default: batch-size / ranks)")
    ap.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {d['lr']}); "
                    "linear warmup then cosine decay")
    ap.add_argument("--warmup-steps", type=int, default=d["warmup_steps"], help="linear warmup updates")
    ap.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"],
                    help="final learning rate as a fraction of --lr")
    ap.add_argument("--weight-decay", type=float, default=None, help=f"AdamW weight decay (default {d['weight_decay']})")
    ap.add_argument("--grad-clip", type=float, default=None, help=f"max global gradient L2 norm, 0 = off "
                    f"(default {d['grad_clip']})")


def _add_memory_args(ap: argparse.ArgumentParser) -> None:
    """Where the weights and activations live, ZeRO, the delayed update."""
    ap.add_argument("--offload-params", choices=["none", "cpu", "nvme"], default=None,
                    help="where the blocks' 16-bit weights (--lora-rank: the frozen base) live: on the device "
                    "(none), or streamed to it from host RAM (cpu) or NVMe swap files (nvme) (default none)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each block's activations in backward (less memory, ~1/3 more compute)")
    ap.add_argument("--offload-activations", action="store_true",
                    help="keep the checkpointed block inputs in host memory (needs --activation-checkpointing)")
    ap.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                    help="under torchrun, ZeRO stage across the data-parallel ranks: 0 every rank "
                    "keeps all optimizer state, 1 fp32 masters and moments sharded, 2 gradients "
                    "sharded too (default 0, or a --config's zero_optimization.stage); one process: "
                    "no effect")
    ap.add_argument("--delayed-update", action="store_true",
                    help="one-step delayed update (ZeRO-Offload's DPU): each update's CPU step runs "
                    "during the next forward and backward, which use the weights from one update "
                    "earlier; overlaps the step even with clipping (needs --offload cpu/nvme)")
    ap.add_argument("--delayed-update-warmup", type=int, default=0, help="updates applied "
                    "synchronously before --delayed-update starts (default 0)")
    ap.add_argument("--speculative-step", action="store_true",
                    help="overlap the CPU step with backward even with --grad-clip or fp16: each "
                    "block steps as its gradients land, its pre-step state kept (12 bytes per "
                    "parameter in RAM, or on disk with --offload nvme) and restored and stepped "
                    "again when clipping triggers (skipped on an fp16 overflow); exact; one process")


def _add_output_args(ap: argparse.ArgumentParser) -> None:
    """Evaluation, checkpoints, the output directory, resuming, the seed."""
    d = DEFAULTS
    ap.add_argument("--eval-every", type=int, default=d["eval_every"], help="updates between held-out "
                    "evaluations (0 = only at start and end)")
    ap.add_argument("--eval-batches", type=int, default=d["eval_batches"], help="micro-batches of "
                    "the held-out sequences (the data's last 5%%) each evaluation reads, always "
                    "the same ones (0 = all of them; default %(default)s)")
    ap.add_argument("--save-every", type=int, default=d["save_every"], help="updates between checkpoints "
                    "(0 = only at the end)")
    ap.add_argument("--no-final-checkpoint", action="store_true", help="a run that completes writes "
                    "its export only, not a resumable checkpoint (the optimizer state, 12 bytes per "
                    "parameter, written again); a run stopped early still writes one")
    ap.add_argument("--output", default="runs/finetune", help="output directory: model/ (Hugging Face "
                    "layout; with --lora-rank: adapter/, and model/ with --merge), checkpoint/ "
                    "(resumable), metrics.jsonl, loss.png")
    ap.add_argument("--resume", default=None, help="continue from a checkpoint (an --output dir or its "
                    "checkpoint/ dir); the model and data must be the same")
    ap.add_argument("--overwrite", action="store_true", help="start over in an --output that holds a "
                    "previous run (its checkpoint, model, metrics and data are deleted first); without "
                    "it such a directory is refused unless --resume continues the run")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many updates of this "
                    "invocation and save a resumable checkpoint (wall-time-limited jobs); the learning-rate "
                    "schedule still spans --steps")
    ap.add_argument("--seed", type=int, default=d["seed"], help="seed for init and data order")


def _add_lora_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on "
                    "the decoder's projections, the model itself frozen (on the device, or streamed "
                    "with --offload-params), instead of every weight (0: full fine-tuning); writes "
                    "OUTPUT/adapter in PEFT's format (peft.PeftModel.from_pretrained and "
                    "runners.infer --adapter load it)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA's update is scaled by "
                    f"alpha / rank (default {LoraConfig.alpha:g}); needs --lora-rank")
    ap.add_argument("--lora-dropout", type=float, default=None, help="dropout on the adapters' input "
                    f"in training, in [0, 1) (default {LoraConfig.dropout:g}); needs --lora-rank")
    ap.add_argument("--lora-targets", default=None, help="comma-separated projections that get an "
                    f"adapter, of {','.join(SHORT_TARGETS)} (or all; default all); needs --lora-rank")
    ap.add_argument("--merge", action="store_true", help="also fold the trained adapters into the "
                    "model and export the merged model to OUTPUT/model (needs --lora-rank; with "
                    "--quantize, into the dequantized base, as PEFT merges QLoRA)")
    ap.add_argument("--quantize", choices=["none", "int8", "int4"], default="none",
                    help="QLoRA: the frozen base's projections as int8/int4 codes with fp16 scales, "
                    "converted once into --cache-dir (the blocks runners.infer --quantize uses) and "
                    "streamed as stored; needs --lora-rank and --offload-params cpu|nvme")
    ap.add_argument("--group-size", type=group_size_arg, default=0, metavar="N|channel",
                    help=GROUP_SIZE_HELP)
    ap.add_argument("--cache-dir", default=None, help="where --quantize keeps the converted blocks "
                    "(and a preset's generated weights); default ~/.cache/offload, runners.infer's "
                    "default --offload-dir, so inference reuses them")


def check_args(args: argparse.Namespace, world: int = 1) -> None:
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    _check_batch(args, world)
    if not 0 <= args.seed < 2**63:  # torch and the data order take 64-bit seeds
        fail(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.metrics is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.metrics))):
        fail(f"--metrics {args.metrics}: its directory does not exist")
    if args.data is not None:
        _check_data_files(args.data)
    if args.delayed_update_warmup < 0:
        fail(f"--delayed-update-warmup must be >= 0, got {args.delayed_update_warmup}")
    if args.resume is not None and args.overwrite:
        fail("--resume continues a run and --overwrite starts one over: give one of them")
    if args.stop_after is not None and args.stop_after < 1:
        fail(f"--stop-after must be at least 1, got {args.stop_after}")
    if args.warmup_steps < 0 or args.eval_every < 0 or args.save_every < 0 or args.eval_batches < 0:
        fail("--warmup-steps, --eval-every, --eval-batches and --save-every must be >= 0")
    if not 0 <= args.min_lr_ratio <= 1:
        fail(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    lora_config(args)


# which flag a LoraConfig refusal is about, by the words its message names it with
LORA_FLAG_OF = {"LoRA rank": "--lora-rank", "LoRA alpha": "--lora-alpha",
                "LoRA dropout": "--lora-dropout", "LoRA target": "--lora-targets"}


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """The LoRA flags' LoraConfig, None without --lora-rank (full fine-tuning); a bad value or a
    LoRA flag without --lora-rank is one line naming the flag."""
    if args.lora_rank < 0:
        fail(f"--lora-rank must be >= 1 (0 or absent: full fine-tuning), got {args.lora_rank}")
    if not args.lora_rank:
        given = [flag for flag, value in (("--lora-alpha", args.lora_alpha),
                                          ("--lora-dropout", args.lora_dropout),
                                          ("--lora-targets", args.lora_targets)) if value is not None]
        if given:
            one = len(given) == 1
            fail(f"{', '.join(given)} {'is a LoRA setting' if one else 'are LoRA settings'}, and "
                 f"LoRA is off without --lora-rank: add --lora-rank R (e.g. 8), or drop "
                 f"{'it' if one else 'them'}")
        if args.merge:
            fail("--merge folds trained LoRA adapters into the model: add --lora-rank R (a full "
                 "fine-tune's OUTPUT/model is the whole model already)")
        if args.quantize != "none":
            fail(f"--quantize {args.quantize} quantizes the frozen base of a LoRA run (QLoRA): add "
                 f"--lora-rank R; quantized weights are not trained (fine-tune in 16 bits, then "
                 f"runners.infer --quantize)")
        _check_quant_flags(args)
        return None
    _check_quant_flags(args)
    d = LoraConfig
    try:
        return LoraConfig(rank=args.lora_rank,
                          alpha=d.alpha if args.lora_alpha is None else args.lora_alpha,
                          dropout=d.dropout if args.lora_dropout is None else args.lora_dropout,
                          targets=d.targets if args.lora_targets is None else args.lora_targets)
    except LoraError as e:
        flag = next((f for words, f in LORA_FLAG_OF.items() if words in str(e)), "--lora-rank")
        fail(f"{flag}: {e}")


def _check_quant_flags(args: argparse.Namespace) -> None:
    """--group-size and --cache-dir belong to --quantize; a group size the format cannot take
    is one line."""
    from offload.models.quantized import QuantSettings
    from offload.quant.format import QuantError

    if args.quantize == "none":
        for flag, value in (("--group-size", args.group_size), ("--cache-dir", args.cache_dir)):
            if value:
                fail(f"{flag} is a --quantize setting: add --quantize int8|int4 (and --lora-rank), "
                     f"or drop it")
        return
    try:
        QuantSettings(args.quantize, args.group_size).spec()
    except QuantError as e:
        fail(f"--quantize {args.quantize} --group-size {args.group_size}: {e}")


def _lora_combination_error(args: argparse.Namespace, base: dict, auto: bool,
                            world: int) -> str | None:
    """Why the engine options cannot train LoRA adapters here (None when they can), spelt as
    flags. The frozen base is resident or streamed (offload_params), in one process or on each
    of several ranks at stages 0-2 (each rank the whole base, from its own tier)."""
    if not args.lora_rank:
        return None
    params = base.get("offload_params", "none")
    flag = (f"--offload-params {params}" if args.offload_params else
            f"offload_params={params!r} (from --config {args.config})")
    if world > 1 and base.get("zero_stage") == 3:
        return ("--zero-stage 3 with --lora-rank: stage 3 streams each layer's weights from the "
                "ranks' shards, which runners.finetune does not do for a LoRA base; use "
                "--zero-stage 0, 1 or 2")
    return None


def _check_batch(args: argparse.Namespace, world: int = 1) -> None:
    if args.batch_size is None:
        return  # the config file or the default decides (engine_config), then checks again
    if args.batch_size % world:
        fail(f"--batch-size {args.batch_size} is the global batch: it must divide evenly over "
             f"the {world} ranks (a multiple of {world})")
    per_rank = args.batch_size // world
    mb = per_rank if args.micro_batch_size is None else args.micro_batch_size
    if mb < 1 or mb > per_rank or per_rank % mb:
        if world == 1:
            fail(f"--micro-batch-size {mb} must divide --batch-size {args.batch_size}")
        fail(f"--micro-batch-size {mb} must divide each rank's share of the batch ({per_rank} "
             f"= --batch-size {args.batch_size} / {world} ranks)")


def _config_batch(args: argparse.Namespace, base: dict, world: int = 1) -> None:
    """Batch sizes from a DeepSpeed config (train_micro_batch_size_per_gpu, the accumulation
    steps, the ranks) where the flags give none; where both give them they must agree."""
    micro = base.pop("micro_batch_size", None)
    if micro is not None:
        total = micro * base.get("grad_accum_steps", 1) * world
        flags = (args.batch_size, args.micro_batch_size or args.batch_size)
        if args.batch_size is None:
            args.batch_size, args.micro_batch_size = total, args.micro_batch_size or micro
        elif flags != (total, micro):
            fail(f"--batch-size {flags[0]} / micro-batch {flags[1]} disagree with --config "
                 f"{args.config} (train_batch_size {total}, train_micro_batch_size_per_gpu {micro}); "
                 f"drop the flags or the config's batch keys")
    if args.batch_size is None:
        args.batch_size = DEFAULTS["batch_size"]
    _check_batch(args, world)


def _check_data_files(path: str) -> None:
    """--data must name regular files (a FIFO or a link to /dev/zero named *.txt would hang the
    reader or fill the memory); what they contain is checked when they are read."""
    from offload.data.formats import data_files

    if os.path.lexists(path):  # else the data loader says it does not exist
        for p in data_files(path):
            try:
                os.stat(p)
            except OSError as e:
                fail(f"--data {p}: cannot read ({e.strerror})")


def engine_config(args: argparse.Namespace, device: torch.device, world: int = 1,
                  sources: dict[str, str] | None = None):
    """Resolved once: explicit flags over what the config file (if any) sets, this runner's
    defaults under both -- whatever the file leaves out takes the runner's default, never the
    library's, and a DeepSpeed "auto" is what the runner would choose. `world`: data-parallel
    ranks (--batch-size is over all of them). `sources` receives, per field set here, where its
    value came from: "flag", "file" or "default" (the banner prints them)."""
    from offload.config import OffloadConfig, combination_error
    from offload.config import AutoValues, config_file_fields

    per_rank = args.batch_size // world if args.batch_size else None
    mb = args.micro_batch_size or per_rank
    # "auto": bf16 on a GPU -- fp32 there would run full-fp32 GEMMs (TF32 is off by default)
    # and move twice the bytes per gradient and upload (desk review M4)
    dtype = dtype_label(select_dtype(args.dtype, device)) if args.dtype else None
    runner = {key: dtype_label(select_dtype(DEFAULTS[key], device)) if key == "dtype" else DEFAULTS[key]
              for key in ("offload", "dtype", "lr", "weight_decay", "grad_clip")}
    explicit = {"offload": args.offload, "dtype": dtype, "lr": args.lr,
                "weight_decay": args.weight_decay, "grad_clip": args.grad_clip}
    chosen = {k: v if v is not None else runner[k] for k, v in explicit.items()}
    auto = AutoValues(lr=chosen["lr"], weight_decay=chosen["weight_decay"],
                      grad_clip=chosen["grad_clip"], dtype=chosen["dtype"], micro_batch_size=mb,
                      grad_accum_steps=per_rank // mb if args.batch_size else None)
    notes: list[str] = []
    base = config_file_fields(args.config, auto=auto, notes=notes) if args.config else {}
    for note in notes:  # DeepSpeed keys accepted but without effect here: never silently
        print(f"note: {note}", file=sys.stderr)
    origin = {k: "file" for k in base}
    _config_batch(args, base, world)
    for key, value in explicit.items():
        if value is not None:
            base[key], origin[key] = value, "flag"
        elif key not in base:
            base[key], origin[key] = runner[key], "default"
    switches = {"offload_params": args.offload_params, "zero_stage": args.zero_stage,
                "activation_checkpointing": args.activation_checkpointing or None,
                "offload_activations": args.offload_activations or None,
                "delayed_update": args.delayed_update or None,
                "speculative_step": args.speculative_step or None,
                "delayed_update_warmup": args.delayed_update_warmup if args.delayed_update else None}
    for key, value in switches.items():
        if value is not None:
            base[key], origin[key] = value, "flag"
    per_rank = args.batch_size // world
    base["grad_accum_steps"] = per_rank // (args.micro_batch_size or per_rank)
    base["device"] = str(device)
    base["device_budget"] = args.gpu_memory or base.get("device_budget")
    base["host_budget"] = args.cpu_memory or base.get("host_budget")
    auto = base["offload"] == "auto"
    why = _lora_combination_error(args, base, auto, world)
    if why is not None:
        fail(why)
    if auto:
        base["offload"] = "cpu"  # a placeholder: the planner decides after the model is known
    if auto or "nvme" in (base["offload"], base.get("offload_params")):
        base["nvme_dir"] = args.offload_dir or base.get("nvme_dir") or os.path.join(args.output, "swap")
    elif args.offload_dir:
        fail(f"--offload-dir is only used with --offload nvme or --offload-params nvme (got "
             f"offload={base['offload']})")
    # the library's rules about which options go together, spelt as this runner's flags
    options = SimpleNamespace(**{**OffloadConfig().to_dict(), **base})
    why = combination_error(options, spell=lambda field: FLAGS.get(field, field))
    if why is not None:
        fail(why)
    if sources is not None:
        sources.update(origin)
    return OffloadConfig(**base)
