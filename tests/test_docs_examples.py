"""Every code block of the docs and the README (tests/docs_blocks.py says how they are found and marked): the ones
that can run here run, in this process (`maxout` commands through cli.main, Python blocks with exec); the ones
marked `check` have their maxout, mlflow run and make commands checked against the parser, the config, MLproject
and the Makefile (Python: compiled); `usage` lines name options that exist. The runs are tiny: one training step of
the random two-layer model at most."""

from __future__ import annotations

import pytest

from maxout import cli

from . import docs_blocks
from .docs_blocks import SHELLS, Block

BLOCKS = docs_blocks.blocks()
CODE = [b for b in BLOCKS if b.mode != "text"]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.id for b in blocks]


def test_the_docs_have_code_to_run_and_code_to_check():
    modes = {mode: [b for b in CODE if b.mode == mode] for mode in ("run", "check", "usage")}
    assert len(modes["run"]) >= 4 and len(modes["check"]) >= 20
    assert all(b.reason for b in modes["check"]), [b.id for b in modes["check"] if not b.reason]  # say why not run


RUN = [b for b in CODE if b.mode == "run"]


@pytest.mark.parametrize("block", RUN, ids=_ids(RUN))
def test_a_runnable_block_runs(block, capsys, one_torch_thread):
    if block.lang == "python":
        exec(compile(block.source, block.id, "exec"), {"__name__": "docs_example"})
        return
    for words in docs_blocks.commands(block.source):
        argv = docs_blocks.maxout_argv(words)
        assert argv is not None, f"{block.id}: only maxout commands run here; mark the block check: {words}"
        code = cli.main(argv)
        assert code == 0, f"{block.id}: maxout {' '.join(argv)} exited {code}: {capsys.readouterr().err[-2000:]}"


CHECK = [b for b in CODE if b.mode == "check"]


@pytest.mark.parametrize("block", CHECK, ids=_ids(CHECK))
def test_a_block_that_cannot_run_here_is_checked(block):
    if block.lang == "python":
        compile(block.source, block.id, "exec")
        return
    assert block.lang in SHELLS
    problems, _ = docs_blocks.check_shell(block)
    assert problems == []


USAGE = [b for b in CODE if b.mode == "usage"]


@pytest.mark.parametrize("block", USAGE, ids=_ids(USAGE))
def test_a_usage_block_names_options_that_exist(block):
    assert docs_blocks.check_usage(block) == []


def _block(source: str, mode: str = "check") -> Block:
    return Block(docs_blocks.ROOT / "README.md", 1, "bash", mode, "made up", source)


@pytest.mark.parametrize("source, finds", [
    ("maxout train --no-such-flag model=tiny", "unrecognized arguments: --no-such-flag"),
    ("maxout train model=tiny train.no_such_key=1", "train.no_such_key"),
    ("maxout train data.padding=sideways", "data.padding"),
    ("maxout hpo hpo.n_trials=zero", "hpo.n_trials"),
    ("HF_TOKEN=x torchrun --nproc-per-node=2 -m maxout train hardware.precision=fp8", "hardware.precision"),
    ("maxout benchmark --grid 'precision=fp64'", "fp64"),
    ('mlflow run . -P hardware=cpu -P overrides="model=nosuch"', "nosuch"),
    ("mlflow run . -P gpus=1", "-P gpus is not a parameter"),
    ("mlflow run . -e nosuch", "no entry point 'nosuch'"),
    ('make audit ARGS="--budget-s lots"', "--budget-s"),
    ("make no-such-target", "no target 'no-such-target'"),
])
def test_the_checks_find_a_wrong_flag_key_value_parameter_and_target(source, finds):
    problems, _ = docs_blocks.check_shell(_block(source))
    assert len(problems) == 1 and finds in problems[0], problems


def test_the_usage_check_finds_an_option_that_does_not_exist():
    assert docs_blocks.check_usage(_block("maxout audit [overrides] [--budget-s 600] [--no-such]", "usage")) == [
        "maxout audit: no option --no-such"]
    assert docs_blocks.check_usage(_block("make no-such-target", "usage")) == [
        "make: no target 'no-such-target' in the Makefile"]


def test_shell_commands_split_as_a_shell_splits_them():
    source = ("export A=1 B=2   # comment\n"
              "maxout predict --model models:/m/3 --input x.csv > out.csv\n"
              "maxout train model=tiny \\\n  train.lr=1e-4 &\n"
              "curl -d '{\"a\":\n 1}' http://h\n")
    assert docs_blocks.commands(source) == [
        ["export", "A=1", "B=2"], ["maxout", "predict", "--model", "models:/m/3", "--input", "x.csv"],
        ["maxout", "train", "model=tiny", "train.lr=1e-4"], ["curl", "-d", '{"a":\n 1}', "http://h"]]
    with pytest.raises(ValueError):
        docs_blocks.commands("echo 'never closed\n")
