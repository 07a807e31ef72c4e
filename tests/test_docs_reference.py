"""The reference pages written from the code (docs/hooks/gen_reference.py): each holds what the code has, found here
by a second, plainer route where there is one, and every config key has a comment to show."""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from maxout import config as config_module
from maxout.cli import build_parser
from maxout.optimizations import NAMES

from .docs_support import generator

GEN = generator()


def _walk_keys(cls: type = config_module.Config, prefix: str = "") -> list[str]:
    """Every leaf key of the config, by the dataclasses' own fields (a section: a field holding a dataclass)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if is_dataclass(a)] or [hints[f.name]]
        if is_dataclass(inner[0]):
            keys += _walk_keys(inner[0], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_config_key_has_a_comment():
    """The check that keeps the config reference whole: a new key without a comment fails here, naming it."""
    keys = GEN.config_keys()
    assert [k.key for k in keys if not k.comment.strip()] == []
    assert set(_walk_keys()) <= {k.key for k in keys}


def test_the_comment_check_finds_a_key_without_one():
    source = '''
class Made:
    commented: int = 1  # beside it
    # Above it, a new sentence.
    above: int = 2
    bare: int = 3
    tail: str = ""  # beside, and
    # going on in lower case
    last: int = 4
'''
    namespace: dict = {}
    exec("from dataclasses import dataclass\n@dataclass" + source, namespace)
    found = GEN.field_comments(namespace["Made"], source)
    assert found == {"commented": "beside it", "above": "Above it, a new sentence.",
                     "tail": "beside, and going on in lower case"}
    assert "bare" not in found and "last" not in found


def test_config_page_lists_every_key_with_type_default_and_valid_values():
    page = GEN.config_page()
    for key in _walk_keys():
        assert f"| `{key}` |" in page, key
    rows = {k.key: k for k in GEN.config_keys()}
    assert rows["hardware.precision"].valid == "bf16, fp16, fp32"
    assert rows["data.padding"].valid == "dynamic, max_length, packed" and rows["data.padding"].default == "dynamic"
    assert rows["train.lr"].type == "float" and rows["train.lr"].default == "5.0e-05"
    assert rows["data.validation_path"].type == "str or null" and rows["data.validation_path"].default == "null"
    # A comment that runs over two lines is read whole; a block above a field is that field's, not the one before.
    assert rows["model.architecture"].comment.endswith("{model_type: gemma3_text, hidden_size: 32, ...}")
    assert rows["checkpoint.async_save"].comment.startswith("sharded only")
    assert not rows["checkpoint.sharded"].comment.endswith("manifest are written")


def test_cli_page_has_every_command_and_option():
    page = GEN.cli_page()
    for command in GEN.commands(build_parser()):
        assert f"## `{command.name}`" in page
        for action in command.parser._actions:
            for option in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                assert f"`{option}`" in page, (command.name, option)
    for expected in ("## `maxout`\n", "`--version`", "maxout registry promote", "maxout tracking replay", "maxout audit", "--nproc-per-node",
                     "--on-missing"):
        assert expected in page
    names = [c.name for c in GEN.commands(build_parser())]
    assert "maxout train" in names and "maxout registry cleanup-locks" in names
    assert len(names) == len(set(names)) and all(isinstance(c.parser, argparse.ArgumentParser)
                                                 for c in GEN.commands(build_parser()))


def test_hardware_page_has_every_profile_and_value():
    page = GEN.hardware_page()
    folder = Path(config_module.__file__).parent / "conf" / "hardware"
    header = next(line for line in page.splitlines() if line.startswith("| key |"))
    for path in folder.glob("*.yaml"):
        assert f"`{path.stem}`" in header
    h100 = yaml.safe_load((folder / "h100.yaml").read_text())
    columns = [c.strip(" `") for c in header.split("|")[1:-1]]
    compile_row = [c.strip() for c in next(line for line in page.splitlines()
                                           if line.startswith("| `compile` |")).split("|")[1:-1]]
    assert compile_row[columns.index("h100")] == str(h100["compile"]).lower()


def test_optimizations_page_has_every_decision_with_its_module_and_reasons():
    found = {d.name: d for d in GEN.decisions()}
    assert list(found) == list(NAMES)
    assert all(d.modules for d in found.values()), [d.name for d in found.values() if not d.modules]
    assert "no CUDA device" in found["tf32"].reasons
    assert "no CUDA device: pinned memory only speeds host-to-GPU copies" in found["pin_memory"].reasons
    assert found["pin_memory"].reasons == ["no CUDA device: pinned memory only speeds host-to-GPU copies"]
    assert any("one process: nothing to synchronise" in r for r in found["data_parallel"].reasons)
    page = GEN.optimizations_page()
    for name in NAMES:
        assert f"## {name}\n" in page and f"`opt.{name}.reason`" in page


def test_logged_page_has_the_params_and_metrics_a_run_writes():
    found = GEN.logged_names()
    params, metrics = found["params"], found["metrics"]
    for name in ("derived.accumulation_steps", "derived.data_fingerprint", "derived.rows_dropped_<split>",
                 "device.compute_capability", "dist.world_size", "batch_finder.micro_batch", "opt.tf32.reason",
                 "cfg.train.lr"):
        assert name in params, name
    for name in ("train/loss", "eval/macro_f1", "perf/mfu", "time/compile_s", "hpo/compute_saved"):
        assert name in metrics, name
    assert not [n for n in params if n.endswith(".json")]  # artifact files are no params
    page = GEN.logged_page()
    assert "| `train/loss` |" in page


@pytest.mark.parametrize("uri", sorted(GEN.PAGES))
def test_each_generated_page_says_it_is_generated(uri):
    assert GEN.PAGES[uri]().startswith(GEN.GENERATED_NOTE)
