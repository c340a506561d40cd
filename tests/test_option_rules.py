"""The rules about which options go together live in one table (offload.config.COMBINATION_RULES):
every combination of the options they mention is refused by OffloadConfig exactly when a rule
says so, with that rule's message, and the fine-tuning runner refuses the same combinations in
its own flags' spelling."""

from __future__ import annotations

import itertools

import pytest

from offload.config import COMBINATION_RULES, ConfigError, OffloadConfig, combination_error

GRID = dict(offload=("none", "cpu", "nvme"), offload_params=("none", "cpu", "nvme"),
            nvme_dir=(None, "/tmp/x"), activation_checkpointing=(False, True),
            offload_activations=(False, True), delayed_update=(False, True),
            speculative_step=(False, True), overlap_step=(True, False))


def _grid():
    for values in itertools.product(*GRID.values()):
        yield dict(zip(GRID, values))


def test_config_refuses_exactly_what_a_rule_says():
    refused = 0
    for options in _grid():
        broken = [r for r in COMBINATION_RULES if r.broken(_Namespace(options))]
        try:
            OffloadConfig(device="cpu", **options)
        except ConfigError as e:
            refused += 1
            assert broken, (options, str(e))
            assert str(e) == broken[0].message.format(**{f: f for f in OffloadConfig.field_names()})
        else:
            assert not broken, options
    assert 0 < refused < len(list(_grid()))
    # every rule is reachable from the grid
    for rule in COMBINATION_RULES:
        assert any(rule.broken(_Namespace(o)) for o in _grid()), rule.message


class _Namespace:
    def __init__(self, options: dict):
        self.__dict__.update(options)


def test_spelling_is_the_callers():
    options = _Namespace({**{k: v[0] for k, v in GRID.items()}, "offload_activations": True})
    assert combination_error(options) == ("offload_activations offloads the checkpointed block "
                                          "inputs: add activation_checkpointing")
    flagged = combination_error(options, spell=lambda f: "--" + f.replace("_", "-"))
    assert flagged == "--offload-activations offloads the checkpointed block inputs: add " \
                      "--activation-checkpointing"


@pytest.mark.parametrize("argv,message", [
    (["--offload-activations"], "--offload-activations offloads the checkpointed block inputs: "
                                "add --activation-checkpointing"),
    (["--delayed-update", "--offload", "none"], "--delayed-update overlaps the CPU optimizer step"),
    (["--delayed-update", "--offload-params", "cpu"], "--delayed-update needs the 16-bit weights"),
    (["--speculative-step", "--delayed-update", "--offload", "cpu"],
     "--speculative-step steps each block during backward of the same update"),
])
def test_runner_uses_the_same_rules(tmp_path, capsys, argv, message):
    from runners.finetune import main

    rc = main(argv + ["--output", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and err[-1].startswith("error: ") and message in err[-1], err
