"""Bad input of every kind ends in one line and a non-zero exit, never a traceback, a hang, a
huge allocation or a quiet default: text that is not Unicode, seeds and temperatures at the
edges of their ranges, damaged state files, a stranger's config.json, chat template and
tokenizer, and checkpoints whose parts do not belong together."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest
import torch
from safetensors.torch import save_file

from offload.data.formats import BatchOrder, DataError, load_documents
from offload.infer.generate import SamplingParams, filter_logits
from offload.models import CheckpointError, CheckpointReader
from offload.data.tokenizer import Tokenizer, TokenizerError
from runners import infer
from test_run_guards import FAST, finetune, run_cli


def test_text_that_is_not_unicode(tmp_path, capsys):
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "abc \\ud800 def"}\n')
    with pytest.raises(DataError, match=r"s.jsonl:2: character 4 is a lone surrogate"):
        load_documents(str(tmp_path / "s.jsonl"))
    (tmp_path / "b.txt").write_bytes(b"hello\n\xff\xfe world\n")
    with pytest.raises(DataError, match=r"b.txt:2: not UTF-8 text"):
        load_documents(str(tmp_path / "b.txt"))
    (tmp_path / "blank.txt").write_text("  \n\n")
    for argv, msg in ((["--prompt", "abc\udcff"], "prompt 1 is not valid UTF-8"),
                      (["--prompt-file", str(tmp_path / "blank.txt")], "holds no prompt")):
        rc, err = run_cli(infer.main, argv, capsys)
        assert rc == 2 and msg in err, err


def test_edge_seeds_and_temperatures():
    order = BatchOrder(10, 2**63 - 1)  # the largest --seed the runner accepts
    assert sorted(order.take(10).tolist()) == list(range(10))
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0 - 1e-6]])
    scaled = filter_logits(logits, SamplingParams(temperature=1e-45))
    probs = scaled.softmax(-1)
    assert bool(torch.isfinite(probs).all()) and probs.argmax().item() == 1


def test_damaged_state_files_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert finetune(["--output", out, *FAST, "--stop-after", "2"], capsys)[0] == 0
    ckpt = os.path.join(out, "checkpoint")
    trainer_path = os.path.join(ckpt, "trainer_state.json")
    engine_path = os.path.join(ckpt, "engine", "engine_state.json")
    trainer, engine = json.load(open(trainer_path)), json.load(open(engine_path))
    damages = [
        (trainer_path, {k: v for k, v in trainer.items() if k != "rng"}, "'rng' must be"),
        (engine_path, engine | {"loss_scale": 0}, "'loss_scale' is missing or not a valid number"),
        (engine_path, engine | {"micro_step": 1}, "micro_step 1 does not fit global_step 2"),
        (engine_path, b"[" * 100_000 + b"]" * 100_000, "unreadable"),
        (engine_path, b'{"format": "\xff"}', "unreadable"),
    ]
    for path, body, msg in damages:
        good = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(body if isinstance(body, bytes) else json.dumps(body).encode())
        rc, err = finetune(["--output", out, *FAST, "--resume", out], capsys)
        assert rc == 2 and msg in err and "Traceback" not in err, (msg, err)
        with open(path, "wb") as f:
            f.write(good)
    # a damaged byte in metrics.jsonl does not stop a resume
    with open(os.path.join(out, "metrics.jsonl"), "ab") as f:
        f.write(b'{"step": 1, "loss": "\xff"}\n')
    assert finetune(["--output", out, *FAST, "--resume", out], capsys)[0] == 0


def _checkpoint_dir(path, layers_in_config: int, layers_stored: int, extra: dict | None = None):
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": layers_in_config, "num_attention_heads": 4,
           "num_key_value_heads": 4, "vocab_size": 100, "max_position_embeddings": 128,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    from offload.models import build_model, preset
    from offload.models.config import ModelConfig
    model = build_model(ModelConfig.from_hf(cfg | {"num_hidden_layers": layers_stored}), "cpu",
                        torch.float32, source=0)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors | (extra or {}), os.path.join(path, "model.safetensors"))
    del preset


def test_a_strangers_checkpoint(tmp_path, capsys):
    big = tmp_path / "big"
    _checkpoint_dir(big, 10**7, 1)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="num_hidden_layers is 10000000, but the weights hold "
                                              "tensors of 1 layers"):
        CheckpointReader(str(big))
    assert time.perf_counter() - t0 < 5
    extra = tmp_path / "extra"
    _checkpoint_dir(extra, 2, 2, {"model.vision_tower.weight": torch.zeros(3)})
    rc, _ = run_cli(infer.main, ["--model", str(extra), "--prompt-ids", "1,2",
                                       "--max-new-tokens", "1"], capsys)
    # (the note went to stderr; finetune_like kept only the last line)
    assert rc == 0
    rc = infer.main(["--model", str(extra), "--prompt-ids", "1,2", "--max-new-tokens", "1"])
    assert rc == 0 and "1 stored tensor(s) are not used by LlamaForCausalLM" in capsys.readouterr().err


def test_a_strangers_chat_template(smollm2_hf, monkeypatch):
    from offload.data import template
    monkeypatch.setattr(template, "TEMPLATE_SECONDS", 1.0)  # the endless loop waits this out
    tok = Tokenizer.from_dir(smollm2_hf)
    hi = [{"role": "user", "content": "hi"}]
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for template, msg in (
            ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran past"),
            ("{{ 'x' * 100000000 }}", "builds a string or list"),
            ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "wrote more than"),
            ("{{ 10 ** 100000 }}", "power over 64"),
            # each of these allocated gigabytes, overflowed or recursed into a traceback
            ("{{ '%5000000000s' % 'x' }}", "width 5000000000"),
            ("{{ '%*s' % (5000000000, 'x') }}", "'\\*' width"),
            ("{{ '%5000000000s' | format('x') }}", "width 5000000000"),
            ("{{ '{:5000000000}'.format('x') }}", "format width"),
            ("{{ '{0:>{1}}'.format('x', 5000000000) }}", "width argument"),
            ("{{ range(300000000) | join }}", "cannot be rendered .*OverflowError"),
            ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
            ("{{ 'x' | center(5000000000) }}", "'center' filter"),
            ("{{ 'x' | indent(5000000000) }}", "'indent' filter"),
            ("{{ 'x'.ljust(5000000000) }}", "str.ljust"),
            ("{{ 'x'.zfill(5000000000) }}", "str.zfill"),
            ("{{ ('a' * 1000000) | replace('a', 'b' * 1000000) }}", "replace builds"),
            ("{{ ('a' * 1000000).replace('a', 'b' * 1000000) }}", "replace builds"),
            ("{{ [1] | batch(1000000000, 0) | list }}", "'batch' filter"),
            ("{{ [1, 2] | slice(1000000000) | list }}", "'slice' filter")):
        tok.chat_template = template
        t0 = time.perf_counter()
        with pytest.raises(TokenizerError, match=msg):
            tok.render_chat(hi)
        assert time.perf_counter() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < peak0 + (1 << 30), \
        "a hostile template allocated over 1 GiB before it was refused"


def test_tokenizer_panics_and_bad_text_are_tokenizer_errors(smollm2_hf):
    tok = Tokenizer.from_dir(smollm2_hf)
    with pytest.raises(TokenizerError, match="the tokenizer failed on this text"):
        tok.encode("abc \ud800")


def test_no_room_for_io_threads_is_one_line(monkeypatch):
    import threading

    from nvme import IOEngine, IOEngineError
    real, started = threading.Thread.start, []

    def start(self):
        if self.name.startswith("nvme-io-") and started:
            raise RuntimeError("can't start new thread")
        started.append(self)
        real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(IOEngineError, match=r"cannot start IO thread 2 of 4 .*ulimit"):
        IOEngine(threads=4)


def test_no_room_for_the_step_thread_is_found_at_set_up(monkeypatch, tmp_path):
    import threading

    import offload
    from offload.memory.tiers import BudgetError
    from test_engine import MLP, _cfg
    real = threading.Thread.start

    def start(self):
        if self.name.startswith("offload-step"):
            raise RuntimeError("can't start new thread")
        real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(BudgetError, match="cannot start the offload-step thread .*ulimit"):
        offload.initialize(MLP(), _cfg("cpu", tmp_path))
