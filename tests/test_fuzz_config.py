"""The config fuzzer: overrides drawn from the typed config dataclasses themselves (config.py, walked with
dataclasses.fields and the type hints, so a new field is fuzzed the day it is added).

Each example sets one, two or three keys to a value of the right type, the wrong type, out of range, non-finite,
empty, huge or unicode, and runs ``maxout train --cfg`` on the tiny CPU config. The property: the command either
accepts the config, or exits non-zero with exactly one line ``maxout: error: ...`` that names a key it was given;
never a traceback. An accepted config then goes through the pre-run checks (train/prepare.py) under the same
property, and a sampled share of them trains for two steps.
"""

from __future__ import annotations

import math
import typing
import zlib
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, Optional

import pytest
from hypothesis import example, given, strategies as st

from maxout import config as config_module, loading
from maxout.config import Config
from maxout.errors import Diverged, MaxoutError

from .fuzzing import fuzz_settings, one_error_line, out_of_time, run_cli

# The tiny CPU run every example starts from (conftest.TINY, minus the log cadence), writing only under tmp.
BASE = {"hardware": "cpu", "model": "tiny", "tracking": "none", "train.epochs": "1", "train.max_steps": "2"}
# Accepted configs that also train: one in TRAIN_EVERY (by a hash of the overrides, so the share holds while
# Hypothesis shrinks). Training is then held to two steps, one process and no compilation: the fuzzed value of
# these keys was checked by --cfg and prepare, and a real run of them is the slow tests' business.
TRAIN_EVERY = 6
TRAIN_FIXED = {"train.max_steps": "2", "train.epochs": "1", "hardware.compile": "false",
               "hardware.num_workers": "0", "train.eval_interval": "0", "train.eval_every_epochs": "1.0"}


@dataclass(frozen=True)
class Key:
    dotted: str
    hint: Any  # the field's type hint, Optional unwrapped
    optional: bool
    default: Any


def _unwrap(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Any), True
    return hint, False


def config_keys(cls: type = Config, prefix: str = "") -> list[Key]:
    """Every leaf key of the config, with its type: read from the dataclasses, never kept by hand."""
    found = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        hint, optional = _unwrap(hints[f.name])
        if is_dataclass(hint):
            found += config_keys(hint, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        found.append(Key(prefix + f.name, hint, optional, default))
    return found


KEYS = config_keys()
# The words config.py accepts somewhere (SCHEDULES, PRECISIONS, ...): a value valid for one key is a good wrong
# value for another.
WORDS = sorted({w for v in vars(config_module).values() if isinstance(v, tuple)
                for w in v if isinstance(w, str)} | {"auto", "eval/f1/1"})

# Values as a user would type them on the command line: Hydra's grammar parses them (null, true, 1e-3, [a, b],
# {k: v}, 'quoted').
NON_FINITE = st.sampled_from(["inf", "-inf", "nan", "+inf", "NaN"])
HUGE = st.sampled_from(["1" + "0" * 30, "-" + "9" * 25, "1e308", "1e-320", "x" * 5000, "é" * 300])
EMPTY = st.sampled_from(["", "''", "[]", "{}", "null", "' '"])
UNICODE = st.text(min_size=1, max_size=12)
WRONG = st.sampled_from(["fast", "true", "1.5", "[1, 2]", "{a: 1}", "0x10", "-0", "1_000", "${train.lr}",
                         "${oc.env:HOME}", "${nope}", "💥"])


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def right_type(key: Key) -> st.SearchStrategy[str]:
    hint = key.hint
    if hint is bool:
        return st.sampled_from(["true", "false"])
    if hint is int:
        return st.integers(-3, 3000).map(str)
    if hint is float:
        return st.floats(-10, 10, allow_nan=False).map(repr) | st.floats(0, 1).map(repr)
    if hint is str:
        return st.sampled_from(WORDS) | UNICODE.map(_quoted)
    if hint in (list, dict):
        return st.sampled_from(["[]", "[0, 1]", "[a, b, c]"] if hint is list else ["{}", "{a: 1}", "{x: [1, 2]}"])
    return st.sampled_from(WORDS) | st.integers(-3, 100).map(str)


def values(key: Key) -> st.SearchStrategy[str]:
    """Right type, wrong type, out of range, non-finite, empty, huge, unicode (raw as typed, or quoted)."""
    default = "null" if key.default is None else str(key.default).lower() if isinstance(key.default, bool) \
        else str(key.default)
    return st.one_of(right_type(key), st.just(default), WRONG, NON_FINITE, HUGE, EMPTY, UNICODE,
                     UNICODE.map(_quoted), st.sampled_from(WORDS))


@st.composite
def overrides(draw) -> list[str]:
    chosen = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique_by=lambda k: k.dotted))
    return [f"{k.dotted}={draw(values(k))}" for k in chosen]


def argv(fuzzed: list[str], tmp: str, fixed: Optional[dict] = None) -> list[str]:
    given_keys = {o.split("=", 1)[0] for o in fuzzed}
    base = {**BASE, "checkpoint.dir": f"{tmp}/ckpt", "tracking.spool_dir": f"{tmp}/spool",
            "batch_finder.cache_path": f"{tmp}/batch_finder.json"}
    fixed = fixed or {}
    kept = [f"{k}={v}" for k, v in base.items() if k not in given_keys and k not in fixed]
    fuzzed = [o for o in fuzzed if o.split("=", 1)[0] not in fixed]
    return [*kept, *fuzzed, *(f"{k}={v}" for k, v in fixed.items())]


def names_a_key(line: str, fuzzed: list[str]) -> bool:
    keys = [o.split("=", 1)[0] for o in fuzzed]
    return any(k in line for k in keys)


def check_refusal(line: str, fuzzed: list[str]) -> None:
    assert names_a_key(line, fuzzed), (line, fuzzed)


@given(fuzzed=overrides())
@fuzz_settings(ci=25)
@example(fuzzed=["train.lr=1e-3"])  # an accepted config: the property's other half is exercised every run
@example(fuzzed=["hpo.study_name=all"])  # was OmegaConf's AssertionError: a key inside the null hpo section
@example(fuzzed=["hardware.name=${nope}"])  # was InterpolationKeyError, raised where the probe read the name
@example(fuzzed=["hardware.requires_cuda=true"])  # the refusal named the profile, not the key that was set
@example(fuzzed=["train.batch_size=all"])  # int('all'): the pre-run checks read the batch size of an invalid config
@example(fuzzed=["train.batch_size=inf"])  # ... and int(inf)
def test_any_override_is_accepted_or_refused_in_one_line_naming_the_key(fuzzed, tmp_path):
    if out_of_time():
        return
    code, out, err = run_cli(["train", *argv(fuzzed, str(tmp_path)), "--cfg"])
    if code != 0:
        check_refusal(one_error_line(err), fuzzed)
        return
    assert out.strip() and not err.strip(), err
    # The pre-run checks, which --cfg leaves to the run: data, model, tokenizer, micro-batch, directories.
    from maxout.train import prepare  # lazy: the training stack, after the cheap part of the property

    overrides_ = argv(fuzzed, str(tmp_path))
    cfg = loading.load(overrides_)
    try:
        prepare.check(cfg)
    except MaxoutError as refused:
        check_refusal(str(refused), fuzzed)
        return
    if zlib.crc32(" ".join(fuzzed).encode()) % TRAIN_EVERY:
        return
    from maxout.train import train  # lazy: see above

    cfg = loading.load(argv(fuzzed, str(tmp_path), TRAIN_FIXED))
    try:
        result = train(cfg, progress=False, verbose=False)
    except Diverged:  # lr=1e9 and friends: a one-line refusal at the step it began (test_divergence.py)
        return
    assert math.isfinite(result.metrics["eval/loss"]), result.metrics


def test_the_walk_finds_every_section():
    """The fuzzer draws from the dataclasses: every section's keys are there (none kept by hand)."""
    sections = {k.dotted.split(".")[0] for k in KEYS}
    assert sections >= {f.name for f in fields(Config)} - {"debug", "resume"} | {"hpo"}
    assert len(KEYS) > 120 and {"train.early_stopping.patience", "hpo.pruner.min_delta", "data.labels"} <= \
        {k.dotted for k in KEYS}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
