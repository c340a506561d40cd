"""python -m runners.finetune: fine-tune a Llama-family model with offloaded optimizer state.

With no arguments it fine-tunes the built-in tiny model on the built-in corpus on the CPU,
fp32 masters and Adam moments in host RAM; `--offload nvme` sends them through swap files.
With --model DIR (a Hugging Face checkpoint) and --data it is the same command a user runs on a
workstation GPU (--gpu 0).

Policy only: the mechanisms (engine, data, checkpoints, plan) live in `offload`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any

import torch

from offload.config import format_bytes
from offload.zero.group import rank_dir
from offload.zero.rest import largest_module_numel
from runners.common import (batch_to_device, fail, note_unused_tensors, run_main, select_device,
                            writable_dir)
from runners.finetune_args import build_parser, check_args, engine_config
from runners.finetune_checks import check_position, check_targets, model_identity
from runners.finetune_lora import LoraRun
from runners.ranks import Ranks, is_peer_lost, peer_lost
from runners.report import finite_or_null, truncate_metrics
from runners.rundir import RunDirectory, check_resume, check_run_paths, trajectory

# the StepReport fields summed into the run's time split and logged per update
TIME_KEYS = ("forward_s", "backward_s", "grad_wait_s", "cpu_step_s", "io_wait_s", "upload_s",
             "overlap_wait_s", "hidden_cpu_step_s", "hidden_upload_s", "comm_wait_s",
             "forward_gpu_s", "backward_gpu_s")  # the last two: CUDA only (None on the CPU)
def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate for update number `step` (0-based): linear warmup, cosine to min_ratio."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_model(args: argparse.Namespace):
    """(model on meta, its config, the source that fills it block by block, tokenizer).
    A .gguf file is converted once into a Hugging Face directory in the cache (dequantized to
    fp32, block by block) and read from there like any checkpoint."""
    from offload.models import CheckpointReader, build_model, preset, norm_init_value, seeded_init
    from offload.data.tokenizer import ByteTokenizer, load_tokenizer

    path = resolve_checkpoint(args.model)
    if path is not None:
        reader = CheckpointReader(path)
        note_unused_tensors(reader)
        cfg, source = reader.config, reader
        tokenizer = load_tokenizer(path) or ByteTokenizer()
    else:
        cfg = preset(args.model)
        source = seeded_init(args.seed, cfg.initializer_range, norm_init_value(cfg))
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > cfg.vocab_size:
        fail(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
             f"{cfg.vocab_size}")
    return build_model(cfg, device="meta"), cfg, source, tokenizer


def resolve_checkpoint(model: str) -> str | None:
    """The checkpoint directory --model names (a .gguf file converted into the cache first),
    or None for a preset name."""
    if os.path.isfile(model):
        from offload.models.gguf import gguf_checkpoint_dir, is_gguf
        if not is_gguf(model):
            fail(f"--model {model}: a file, but not a GGUF model (give a .gguf file, a checkpoint "
                 f"directory or a preset name)")
        return gguf_checkpoint_dir(model, torch.float32)
    if os.path.isdir(model):
        return model
    if os.sep in model or model.startswith("."):
        fail(f"--model {model}: no such file or directory (give a checkpoint directory, a .gguf "
             f"file or a preset name)")
    return None


class StopRequested:
    """Ctrl-C / SIGTERM set a flag; the loop stops at the next update boundary and saves."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this update and saving a checkpoint "
              f"(press again to abort without saving)", file=sys.stderr)


def evaluate(model, data, micro_batch: int, device: torch.device, max_batches: int = 0) -> float:
    """Held-out loss, in eval mode: LoRA's dropout is off (and draws no random numbers). Over
    the first `max_batches` micro-batches of the held-out sequences (0: all): a large corpus's
    5% would otherwise cost more than the updates between two evaluations."""
    from offload.data.formats import masked_lm_loss

    total, count = 0.0, 0
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i, batch in enumerate(data.eval_batches(micro_batch)):
                if max_batches and i == max_batches:
                    break
                batch = batch.to(device)
                logits = model(batch.ids[:, :-1], **batch.model_inputs())
                n = int(batch.mask.sum())
                total += float(masked_lm_loss(logits, batch.ids[:, 1:], batch.mask)) * n
                count += n
    finally:
        model.train(training)
    return total / max(count, 1)


def run(args: argparse.Namespace) -> int:
    from offload.memory.blocks import group_blocks
    from offload.memory.tiers import BudgetError
    from offload.train.plan import (choose_training_config, estimator_table,
                                    llama_activation_estimate, plan_training)
    from runners.report import Banner

    ranks = Ranks.from_env()  # torchrun's environment; one rank without it
    # under torchrun each rank takes the GPU of its local rank (on a GPU node without --gpu too)
    device = select_device(ranks.gpu(args.gpu))
    ranks.connect(device)
    # every rank runs one command: a flag that differs would have each rank train on settings
    # of its own, or hang in collectives that no longer pair up (each rank picks its own GPU);
    # compared before any rank may refuse them on its own
    ranks.agree("their flags", {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items())
                                if k != "gpu"})
    check_args(args, ranks.world)
    if args.zero_stage and not ranks.many:  # never silently: the flag needs several ranks
        print(f"note: --zero-stage {args.zero_stage} has no effect in one process; launch with "
              f"torchrun --nproc_per_node N to train on N data-parallel ranks", file=sys.stderr)
    sources: dict[str, str] = {}  # where each configured value came from (the banner says)
    cfg = engine_config(args, device, ranks.world, sources)
    lora = LoraRun.from_args(args)  # None: full fine-tuning
    model, model_cfg, source, tokenizer = load_model(args)
    micro = args.micro_batch_size or args.batch_size // ranks.world
    frozen = (None, 0)  # a LoRA base's bytes per layer and outside the layers, as the engine counts
    rest_numel = None
    if lora is not None:  # the trainable blocks are the adapters apply_lora will add
        planned = lora.plan_model(model_cfg, cfg.torch_dtype)
        shape, frozen = lora.adapter_blocks(planned), lora.frozen_plan_bytes(planned, cfg.torch_dtype)
    else:
        blocks = group_blocks(model)[0]
        shape = [(b.numel, b.module is not None) for b in blocks]
        # stage 3: the most one module gathers of the resident blocks (offload/zero/rest.py)
        rest_numel = largest_module_numel(model, [b for b in blocks if b.module is None])
    acts = llama_activation_estimate(model_cfg, micro, args.seq_len, cfg.torch_dtype)
    if lora is not None and lora.quantize:  # one projection's dense weight at a time (review 2 P4)
        dense = lora.dense_transient_bytes(planned, cfg.torch_dtype, device)
        acts = dataclasses.replace(acts, transient=dense)
    choice = None
    if args.offload == "auto":
        try:
            cfg, choice = choose_training_config(
                shape, cfg, device, acts, world=ranks.world, frozen_layer_bytes=frozen[0],
                frozen_resident_bytes=frozen[1], candidates=lora.candidates(ranks.world) if lora else None,
                frozen_in_place=bool(lora and lora.quantize), rest_module_numel=rest_numel)
        except BudgetError:
            if args.dry_run and lora is None:  # still show what each configuration would need
                print(estimator_table(shape, cfg, device, acts))
            raise
    plan = plan_training(shape, cfg, device, acts, world=ranks.world,
                         frozen_layer_bytes=frozen[0], frozen_resident_bytes=frozen[1],
                         frozen_in_place=bool(lora and lora.quantize), rest_module_numel=rest_numel)
    lora_line = lora.describe(model_cfg, shape, frozen, cfg) if lora is not None else None
    advice = lora.budget_advice(cfg, frozen) if lora is not None else None
    banner = Banner(args, cfg, model_cfg, plan, device, choice, ranks.world, lora_line, sources)
    print(banner.render())
    if args.dry_run:  # the ZeRO table prices every weight trained; LoRA's, the methods side by side
        print(estimator_table(shape, cfg, device, acts) if lora is None
              else lora.methods_table(model_cfg, cfg))
        _check_plan(plan, advice)
        print("dry run: the plan fits; nothing was allocated")
        return 0
    writable_dir(args.output, "--output")  # before the plan: a precise error beats "0 B free"
    if cfg.nvme_dir is not None:
        writable_dir(cfg.nvme_dir, "--offload-dir")
    _check_plan(plan, advice)
    metrics_path = args.metrics or os.path.join(args.output, "metrics.jsonl")
    check_run_paths(args.output, args.metrics, cfg.nvme_dir, args.data)
    rundir = RunDirectory(args.output)
    if ranks.main:  # rank 0 holds the run directory for the job
        rundir.lock()  # held until the process ends: one run per --output, whatever the tier
    try:
        return _run_locked(args, cfg, model, model_cfg, source, tokenizer, micro, device, rundir,
                           metrics_path, ranks, lora)
    finally:
        if ranks.main:
            rundir.release()


def _check_plan(plan, advice: str | None) -> None:
    """plan.check(), its refusal followed by `advice` where there is some (a LoRA run's: the
    library's advice is about optimizer state, which is not what fills the device then)."""
    from offload.memory.tiers import BudgetError

    try:
        plan.check()
    except BudgetError as e:
        if not advice:
            raise
        raise BudgetError(f"{e}; {advice}") from None


def _run_locked(args, cfg, model, model_cfg, source, tokenizer, micro, device, rundir,
                metrics_path, ranks: Ranks, lora: LoraRun | None) -> int:
    import tempfile

    from offload.data.formats import BatchOrder, pack, tokenize_to_disk

    if ranks.main:
        rundir.prepare(resume=args.resume, overwrite=args.overwrite, metrics_path=metrics_path)
    ranks.long_barrier()  # the others read the directory rank 0 prepared

    resume_dir, trainer = _resume_point(args, model_cfg)
    # the global micro-batch: a state saved by N ranks resumes on M with the same arithmetic
    now = trajectory(args, cfg, micro * ranks.world, lora.settings() if lora else None)
    if trainer:
        check_resume(trainer.get("trajectory"), now, args.resume)

    # rank 0 keeps the tokens in OUTPUT/data; the others tokenize into a directory of their own
    tokens_dir = (os.path.join(args.output, "data") if ranks.main else
                  tempfile.mkdtemp(prefix=f"offload-tokens-rank{ranks.rank}-"))
    stream = tokenize_to_disk(args.data, tokenizer, tokens_dir, vocab_size=model_cfg.vocab_size)
    data = pack(stream, args.seq_len)
    check_targets(data, args)
    order = BatchOrder(data.num_train, args.seed, trainer.get("data_position", 0))
    if trainer and trainer.get("data_fingerprint") != stream.fingerprint:
        fail(f"--resume {args.resume}: the data differs from the run that saved the checkpoint")

    # what each rank resolved for itself (--offload auto chooses per rank's free memory; the
    # data and model are each rank's own files) must be the same before the engine starts
    ranks.agree("the resolved configuration, data and model", {
        **{f"config {k}": v for k, v in cfg.to_dict().items() if k != "device"},
        "data fingerprint": stream.fingerprint, "model": model_identity(model_cfg, source),
        "resumed at update": trainer.get("step"), "resumed data position": trainer.get("data_position")})
    if lora is not None:  # the base on meta, filled by the engine, and the adapters (finetune_lora.py)
        model, source = lora.build(model_cfg, source, device, cfg.torch_dtype, cfg.offload_params, ranks)
    engine = _start_engine(args, cfg, model, source, device, trainer, resume_dir, lora)
    history: list[dict[str, Any]] = trainer.get("history", [])
    stop = StopRequested()
    try:
        rc = _train(args, engine, model, model_cfg, data, order, stream.fingerprint, tokenizer,
                    micro, device, cfg, stop, trainer, resume_dir, history, metrics_path, now,
                    ranks, lora)
    except BaseException:
        stop.restore()
        # in-process callers must get the swap lock back; a failure while closing (a write
        # that the first error broke) must not hide the first error and its advice
        engine.close(after_error=True)
        raise
    stop.restore()
    engine.close()
    if not ranks.main:
        import shutil
        shutil.rmtree(tokens_dir, ignore_errors=True)
    return rc


def _resume_point(args, model_cfg) -> tuple[str | None, dict[str, Any]]:
    """(the checkpoint directory --resume continues, its trainer state), both empty without
    --resume; refused when the checkpoint is of another model."""
    from offload.train.checkpoint import find_checkpoint, load_trainer_state

    resume_dir = find_checkpoint(args.resume) if args.resume else None
    trainer: dict[str, Any] = load_trainer_state(resume_dir) if resume_dir else {}
    if trainer and trainer.get("model_config") != model_cfg.to_hf():
        saved = trainer.get("model_config")
        if not isinstance(saved, dict):
            fail(f"--resume {args.resume}: the checkpoint's 'model_config' is not an object "
                 f"({type(saved).__name__}); the checkpoint is damaged: resume from another one")
        fail(f"--resume {args.resume}: the checkpoint is from a different model "
             f"({str(saved.get('architectures'))[:80]}, {str(saved.get('num_hidden_layers'))[:20]} "
             f"layers); pass the same --model")
    return resume_dir, trainer


def _start_engine(args, cfg, model, source, device, trainer: dict, resume_dir: str | None,
                  lora: LoraRun | None):
    """The engine over `model`, its state loaded from the checkpoint when resuming (checked
    against the trainer state); closed again if anything here fails."""
    import offload
    from offload.train.checkpoint import set_rng_state

    torch.manual_seed(args.seed)
    engine = offload.initialize(model, cfg, source=source)
    try:
        if lora is not None:  # fingerprinted as the engine read it; a resume's base checked
            lora.take_fingerprint(trainer, args.resume)
        if resume_dir:
            engine.load_state(os.path.join(resume_dir, "engine"))
            if engine.global_step != trainer["step"]:
                fail(f"--resume {args.resume}: the checkpoint is inconsistent: its engine state is "
                     f"at update {engine.global_step}, its trainer state at update "
                     f"{trainer['step']}; resume from another checkpoint")
            check_position(trainer, args, engine.skipped_steps)
    except BaseException:
        engine.close(after_error=True)  # in-process callers get the swap lock back
        raise
    if resume_dir:
        set_rng_state(trainer["rng"], device)
        print(f"resumed from {resume_dir} at update {engine.global_step}")
    return engine


def _train(args, engine, model, model_cfg, data, order, fingerprint, tokenizer, micro, device, cfg,
           stop, trainer, resume_dir, history, metrics_path, now, ranks: Ranks,
           lora: LoraRun | None) -> int:
    from offload.train.checkpoint import rng_state, save_checkpoint

    if resume_dir and ranks.main:  # rows past the checkpoint: updates about to be redone
        truncate_metrics(metrics_path, engine.global_step)
    metrics = open(metrics_path if ranks.main else os.devnull, "a" if resume_dir else "w")
    export_dtype = cfg.torch_dtype
    totals: dict[str, float] = {}

    def checkpoint() -> str:
        state = {"step": engine.global_step, "data_position": order.position, "rng": rng_state(device),
                 "history": history, "model_config": model_cfg.to_hf(),
                 "data_fingerprint": fingerprint, "trajectory": now,
                 "eval_loss0": eval_loss0, "empty_batches": empty_batches,
                 "args": {k: v for k, v in vars(args).items()}}
        if lora is not None:  # the base is re-read on resume: it must be the same one
            state["lora_base_fingerprint"] = lora.base_fingerprint
        return save_checkpoint(os.path.join(args.output, "checkpoint"), engine, model_cfg, state,
                               export_dtype,
                               write_weights=lora.checkpoint_writer() if lora is not None else None)

    eval_loss0 = (evaluate(model, data, micro, device, args.eval_batches) if not resume_dir
                  else trainer.get("eval_loss0"))
    if not resume_dir:
        held = min(data.num_eval, args.eval_batches * micro or data.num_eval)
        print(f"step 0: eval loss {eval_loss0:.4f} ({held} of {data.num_eval} held-out "
              f"sequences; --eval-batches)")
    progress = _progress(args, engine.global_step)
    t_run = time.perf_counter()
    tokens_run = 0
    start_step = engine.global_step
    empty_batches = trainer.get("empty_batches", 0)  # batches skipped for holding no target
    # a stop request on any rank stops every rank at the same update (else the ranks'
    # collectives would no longer pair up): one tiny all-reduce per update across ranks
    while engine.global_step < args.steps and not ranks.any(stop.signal is not None) and (
            args.stop_after is None or engine.global_step - start_step < args.stop_after):
        done = _one_update(args, engine, model, data, order, micro, device, cfg, ranks)
        if done is None:  # a batch without a target token: skipped, counted, saved
            empty_batches += 1
            continue
        tokens_run += args.batch_size * args.seq_len
        _record(args, engine, model, data, micro, device, done, totals, history, metrics, progress)
        if args.save_every and engine.global_step % args.save_every == 0 and engine.global_step < args.steps:
            checkpoint()
    if progress is not None:
        progress.close()
    if empty_batches:
        print(f"batches skipped for holding no target token: {empty_batches}")
    metrics.close()
    wall = time.perf_counter() - t_run
    # decided alike on every rank (a checkpoint is collective; every rank has the same flags and
    # step): asked for, complete, and no rank stopping -- the agreement only when asked for
    skip = (args.no_final_checkpoint and engine.global_step >= args.steps
            and not ranks.any(stop.signal is not None))
    path = None if skip else checkpoint()
    if stop.signal is None and engine.global_step < args.steps and ranks.many and (
            args.stop_after is None or engine.global_step - start_step < args.stop_after):
        stop.signal = signal.SIGTERM  # another rank was asked to stop
    if stop.signal is not None:
        engine.close()
        print(f"stopped by {signal.Signals(stop.signal).name} at update {engine.global_step}; "
              f"resumable checkpoint: {path}  (continue with --resume {args.output})", file=sys.stderr)
        return 128 + stop.signal
    if engine.global_step < args.steps:
        engine.close()
        print(f"stopped after {engine.global_step - start_step} updates (--stop-after) at update "
              f"{engine.global_step} of {args.steps}; resumable checkpoint: {path}  (continue with "
              f"--resume {args.output})")
        return 0
    outputs = _export(args, engine, model, model_cfg, tokenizer, export_dtype, ranks, lora)
    return _finish(args, engine, cfg, history, totals, wall, tokens_run, eval_loss0, path,
                   metrics_path, ranks, outputs)


def _one_update(args, engine, model, data, order, micro: int, device, cfg,
                ranks: Ranks) -> tuple[float, float] | None:
    """One optimizer update over batch_size sequences (this rank's share of them) in
    micro-batches: (summed micro-batch losses, averaged over ranks; seconds); None, with no
    update, when the batch holds no target token on any rank. The update's loss
    is the mean over all its target tokens, whichever micro-batch and rank holds them
    (offload/data/formats.py update_token_divisor)."""
    from offload.data.formats import masked_lm_loss, update_token_divisor

    engine.set_lr(lr_at(engine.global_step, cfg.lr, args.warmup_steps, args.steps,
                        args.min_lr_ratio))
    t0 = time.perf_counter()
    batch = ranks.rows(order.take(args.batch_size))  # every rank takes the same global batch
    parts = [data.batch(batch[i:i + micro]) for i in range(0, len(batch), micro)]
    # target tokens of the whole update, over ranks (counted on the host: no device sync)
    tokens = ranks.total(float(sum(int(p.mask.sum()) for p in parts)))
    if tokens == 0:  # nothing to learn from: no update (every rank agrees: the count is global)
        return None
    divisor = update_token_divisor(tokens, len(parts) * ranks.world)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for part in parts:
        rows = batch_to_device(part, device)  # pinned, non-blocking on CUDA (review 2 P11)
        logits = model(rows.ids[:, :-1], **rows.model_inputs())
        loss = masked_lm_loss(logits, rows.ids[:, 1:], rows.mask, divisor)
        engine.backward(loss)
        engine.step()
        # summed on the device, read once per update: .item() per micro-batch would make
        # the host wait for each backward before queueing the next forward (review L6)
        loss_sum += loss.detach().float()
    return float(ranks.mean(loss_sum)), time.perf_counter() - t0


def _record(args, engine, model, data, micro: int, device, done: tuple[float, float],
            totals: dict[str, float], history: list, metrics, progress) -> None:
    """The update just applied: its metrics row (with an evaluation when due) written, its loss
    in the history, the progress bar moved."""
    loss_sum, dt = done
    row = _update_row(args, engine, loss_sum, dt, micro, totals)
    if args.eval_every and engine.global_step % args.eval_every == 0 or engine.global_step == args.steps:
        with engine.latest_weights():  # a pending delayed update's, trajectory unchanged
            row["eval_loss"] = evaluate(model, data, micro, device, args.eval_batches)
    row = finite_or_null(row)  # inf/nan (a skipped update's loss) as null: valid JSON
    history.append({k: row[k] for k in ("step", "loss") if k in row} |
                   ({"eval_loss": row["eval_loss"]} if "eval_loss" in row else {}))
    metrics.write(json.dumps(row, allow_nan=False) + "\n")
    metrics.flush()
    if progress is not None:
        progress.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                             step_s=f"{dt:.3f}")
        progress.update(1)


def _update_row(args, engine, loss_sum: float, dt: float, micro: int,
                totals: dict[str, float]) -> dict[str, Any]:
    """The metrics row of the update just applied; its time split and bytes added to totals."""
    rep = engine.last_report
    for k in TIME_KEYS + ("rollback_s",):
        totals[k] = totals.get(k, 0.0) + (getattr(rep, k) or 0.0)
    for k, v in rep.bytes.items():
        totals["bytes_" + k] = totals.get("bytes_" + k, 0) + v
    totals["step_s"] = totals.get("step_s", 0.0) + dt
    accum = engine.cfg.grad_accum_steps  # micro-batches per update on each rank
    return {"step": engine.global_step, "loss": loss_sum / accum,
            "lr": engine.lr, "tokens_per_s": args.batch_size * args.seq_len / dt, "step_s": dt,
            "applied": rep.applied, "loss_scale": rep.loss_scale, "grad_norm": rep.grad_norm,
            **({"rolled_back": rep.rolled_back} if engine.path.name == "speculative" else {}),
            "time": {k: getattr(rep, k) for k in TIME_KEYS}}


def _export(args, engine, model, model_cfg, tokenizer, export_dtype, ranks: Ranks,
            lora: LoraRun | None) -> list[str]:
    """A completed run's result, checked to read back: the model in Hugging Face layout; for a
    LoRA run the adapter in PEFT's format, and with --merge the merged model. Returns the
    summary's lines naming them."""
    final_model = os.path.join(args.output, "model")
    if lora is None:
        params = engine.iter_master_params()  # across ranks: gathered block by block, on every rank
        if ranks.main:
            export_model(params, final_model, model_cfg, tokenizer, export_dtype)
        else:
            for _ in params:
                pass
        return [f"model (Hugging Face layout): {final_model}"]
    adapter, masters = lora.export_adapter(engine, args.output, model_cfg, ranks.main)
    lines = [f"adapter (PEFT format; runners.infer --model {lora.base_name} --adapter {adapter}"
             f"{lora.infer_flags()}, or peft.PeftModel.from_pretrained): {adapter}"]
    if lora.merge and ranks.main:  # the base read again tensor by tensor, whatever its tier
        export_model(lora.merged_params(model_cfg, masters, export_dtype), final_model, model_cfg,
                     tokenizer, export_dtype)
        lines.append(f"merged model (Hugging Face layout): {final_model}")
    return lines


def export_model(params, path: str, model_cfg, tokenizer, export_dtype) -> None:
    """The model (ours, or (name, tensor) pairs in checkpoint order) in Hugging Face layout with
    the tokenizer's files, read back."""
    from offload.models import save_pretrained

    save_pretrained(params, path, config=model_cfg, dtype=export_dtype, extra_files=tokenizer.files())
    verify_export(path, model_cfg, bool(tokenizer.files()))


def _finish(args, engine, cfg, history, totals, wall: float, tokens_run: int, eval_loss0,
            path: str | None, metrics_path: str, ranks: Ranks, outputs: list[str]) -> int:
    """A completed run, its result exported: print the summary and the loss curve, close the
    engine and remove the swap files."""
    from runners.report import summary_table, write_loss_plot

    eval_final = next((h["eval_loss"] for h in reversed(history) if "eval_loss" in h), None)
    ranks.long_barrier()  # rank 0 exported, merged and fsynced alone (review 2 P3)
    memory = ranks.gather(engine.memory_report())
    print(summary_table(engine, totals, wall, tokens_run, eval_loss0, eval_final, memory))
    if engine.skipped_steps:
        print(f"skipped updates (inf/nan loss or gradients): {engine.skipped_steps}")
    if ranks.many:  # what checking that the ranks agree cost at start-up
        print(f"ranks: {ranks.world}, start-up agreement (flags; configuration, data and model) "
              f"{ranks.agree_s * 1e3:.1f} ms")
    png = write_loss_plot(history, os.path.join(args.output, "loss.png")) if ranks.main else None
    where = path or "not written at the end (--no-final-checkpoint)"
    print("\n".join(outputs) + f"\ncheckpoint: {where}\nmetrics: {metrics_path}"
          + (f"\nloss curve: {png}" if png else ""))
    engine.close()
    swap_dir = cfg.nvme_dir if not ranks.many or cfg.nvme_dir is None else \
        rank_dir(cfg.nvme_dir, ranks.rank)
    if swap_dir is not None and os.path.isdir(swap_dir):
        # the finished run's swap files duplicate the checkpoint (a --resume writes them anew
        # from it): free the space, deleting only the files the store created
        from nvme import SwapStore
        freed = SwapStore(swap_dir, verify="never", durable=False).destroy()
        held = "the checkpoint holds the state" if path else "the run is complete and exported"
        print(f"swap: removed {format_bytes(freed)} of swap files from {swap_dir} ({held})")
    return 0


def verify_export(path: str, model_cfg, with_tokenizer: bool) -> None:
    """Read the export back the way a loader will (config, every tensor's name, shape and dtype,
    the tokenizer files): an export that cannot be loaded is an error, not a quiet success."""
    from offload.models import CheckpointReader
    from offload.data.tokenizer import load_tokenizer

    try:
        with CheckpointReader(path) as reader:
            if reader.config.to_hf(dtype="x") != model_cfg.to_hf(dtype="x") or reader.unexpected:
                raise ValueError("its config or tensors differ from the model trained")
        if with_tokenizer and load_tokenizer(path) is None:
            raise ValueError("its tokenizer files are missing")
    except Exception as e:  # noqa: BLE001 - any failure to read it back is the finding
        fail(f"the exported model in {path} cannot be read back ({str(e)[:200]}); the training "
             f"checkpoint is complete: export again from it")


def _progress(args: argparse.Namespace, start: int):
    if args.no_progress:
        return None
    from tqdm import tqdm
    return tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ranks = Ranks.from_env()
    if not ranks.many:
        return run_main(lambda a: run(build_parser().parse_args(a)), argv)
    # one of several ranks: errors name the rank, and a lost peer is one line, not a traceback
    # from inside a collective
    def run_rank(a):
        args = build_parser().parse_args(a)
        try:
            return run(args)
        except Exception as e:  # noqa: BLE001 - classified below, re-raised when not ours
            if is_peer_lost(e):
                fail(f"{peer_lost(args.output)} ({str(e).splitlines()[0][:160]})")
            raise
        finally:
            ranks.close()
    return run_main(run_rank, argv, prefix=f"rank {ranks.rank}: ")


if __name__ == "__main__":
    sys.exit(main())
