"""The config fuzzer: overrides drawn from the whole grammar of an override, with the keys read from the code and
the libraries themselves, never kept by hand:

- typed keys: walked from config.py's dataclasses (dataclasses.fields and the type hints), so a new field is
  fuzzed the day it is added; set to a value of the right type, the wrong type, out of range, non-finite, empty,
  huge or unicode;
- config groups: every group of config.yaml's defaults list (hardware=, model=, ..., the optional hpo=) set to
  one of its options, or to a bool, number, list, dict, null, empty string, unknown name, sweep or interpolation,
  with ``+`` and ``~`` too;
- free-form keys: the dicts passed to another library. ``model.architecture.*`` keys are the fields of
  transformers' own config class for each tiny model's model_type (so a new transformers field is fuzzed
  without a list), added with ``+key=`` where the YAML lacks them, deleted with ``~key``; peft's adapter
  settings with an adapter switched on; the other dict-typed keys (tracking.tags, hpo.search_space);
- sizes: every int-typed key and architecture field at the edges of int32 and int64, up to 2**63.

Each example runs ``maxout train`` in this process on the tiny CPU config, with training replaced by the pre-run
checks (train/prepare.py) and what ``--cfg`` prints. The property: the command either accepts the config, or exits
non-zero with exactly one line ``maxout: error: ...`` that names a key it was given; never a traceback. A sampled
share of the small accepted configs then trains for two steps, with any run it tracks closed (never left RUNNING).

Most of an example's time is the refusal path (each override composed on its own to name every bad one) and the
pre-run checks; a two-step training run costs about 2 s. ``make test`` draws (profile ``ci``, fixed seed): 14 typed,
8 group, 10 free-form and 6 size examples, plus the @examples; ``make fuzz`` FUZZ_SCALE times as many per round.
"""

from __future__ import annotations

import math
import typing
import zlib
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence
from unittest import mock

import pytest
from hypothesis import example, given, strategies as st
from transformers import CONFIG_MAPPING

from maxout import config as config_module, loading, paths
from maxout.config import Config
from maxout.errors import Diverged, MaxoutError

from .fuzzing import fuzz_settings, one_error_line, out_of_time, run_cli

# The tiny CPU config every example starts from (conftest.TINY, minus the run's length: TRAIN_FIXED holds it), and
# where its checks look for checkpoints. Short on purpose: a refusal composes each override on its own.
BASE = {"hardware": "cpu", "model": "tiny", "tracking": "none"}
# Accepted configs that also train: one in TRAIN_EVERY (by a hash of the overrides, so the share holds while
# Hypothesis shrinks). Training is then held to two steps, one process and no compilation: the fuzzed value of
# these keys was checked by the CLI and prepare, and a real run of them is the slow tests' business. What it writes
# goes under tmp, and any run a fuzzed tracking setting turns on to a store there, where the test looks for RUNNING
# runs.
TRAIN_EVERY = 6
# fp32: bf16 autocast is emulated on CPUs without native bf16, and took 4 s of a 5 s two-step run here.
TRAIN_FIXED = {"train.max_steps": "2", "train.epochs": "1", "hardware.compile": "false",
               "hardware.num_workers": "0", "train.eval_interval": "0", "train.eval_every_epochs": "1.0",
               "hardware.precision": "fp32", "checkpoint.dir": "{tmp}/ckpt", "tracking.spool_dir": "{tmp}/spool",
               "batch_finder.cache_path": "{tmp}/batch_finder.json", "tracking.uri": "sqlite:///{tmp}/mlflow.db",
               "tracking.artifact_location": "file://{tmp}/artifacts"}
# Accepted models bigger than this are checked through prepare (meta device, a one-layer forward) but not
# trained: num_hidden_layers=100000 fits this machine, and building it would take minutes.
TRAIN_MAX_PARAMS = 30_000_000


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
# Sizes at the edges of int32 and int64, and anywhere up to 2**63: they pass an int field's type check, so their
# bounds must come from the model and the machine.
EDGES = [2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, -(2**31), -(2**63), 99999999999]
SIZES = (st.sampled_from(EDGES) | st.integers(-(2**63), 2**63)).map(str)
WRONG = st.sampled_from(["fast", "true", "1.5", "[1, 2]", "{a: 1}", "0x10", "-0", "1_000", "${train.lr}",
                         "${oc.env:HOME}", "${nope}", "💥"])


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def right_type(key: Key) -> st.SearchStrategy[str]:
    hint = key.hint
    if hint is bool:
        return st.sampled_from(["true", "false"])
    if hint is int:
        return st.integers(-3, 3000).map(str) | SIZES
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


def key_of(override: str) -> str:
    """``+model.architecture.x=1`` -> ``model.architecture.x``; ``~hpo`` -> ``hpo``."""
    return override.lstrip("+~").split("=", 1)[0]


def argv(fuzzed: list[str], tmp: str, fixed: Optional[dict] = None, context: Sequence[str] = ()) -> list[str]:
    """BASE, then ``context`` (what a case sets up, e.g. model=tiny_gemma), the fuzzed overrides, then ``fixed``."""
    fuzzed = [*context, *fuzzed]
    given_keys = {key_of(o) for o in fuzzed}
    base = {**BASE, "checkpoint.dir": f"{tmp}/ckpt"}
    fixed = {k: v.format(tmp=tmp) for k, v in (fixed or {}).items()}
    kept = [f"{k}={v}" for k, v in base.items() if k not in given_keys and k not in fixed]
    fuzzed = [o for o in fuzzed if key_of(o) not in fixed]
    return [*kept, *fuzzed, *(f"{k}={v}" for k, v in fixed.items())]


LEAVES = {k.dotted: k for k in KEYS}


def names_a_key(line: str, fuzzed: list[str]) -> bool:
    """The line names a fuzzed key; for a key below a field that is not a free-form dict (``+hardware.pad_widths.a=x``
    on an Any field), naming that field, whose value the key changed, is naming it."""
    for override in fuzzed:
        parts = key_of(override).split(".")
        fields_above = [".".join(parts[:i]) for i in range(1, len(parts))]
        names = [key_of(override)] + [f for f in fields_above if f in LEAVES and LEAVES[f].hint is not dict]
        if any(name in line for name in names):
            return True
    return False


def check_refusal(line: str, fuzzed: list[str]) -> None:
    assert names_a_key(line, fuzzed), (line, fuzzed)


class Prepared(BaseException):
    """Raised in place of training by check_property's stand-in for ``train()``: the CLI took the config and the
    pre-run checks passed. A BaseException, so that no handler on the way mistakes it for a refusal."""

    def __init__(self, cfg: Config, checked: Any):
        super().__init__()
        self.cfg, self.checked = cfg, checked


def prepare_only(cfg: Config, **_: Any) -> None:
    """What ``maxout train`` runs before training (prepare.check), and what ``--cfg`` would print; no run."""
    from omegaconf import OmegaConf

    from maxout.config import to_dict
    from maxout.train import prepare  # lazy: the training stack, after the cheap part of the property

    assert OmegaConf.to_yaml(to_dict(cfg)).strip()
    raise Prepared(cfg, prepare.check(cfg))


def check_property(fuzzed: list[str], tmp: str, context: Sequence[str] = ()) -> None:
    """Accepted (and, for one in TRAIN_EVERY, trained for two steps), or refused in one line naming a fuzzed key
    (``context`` is set too, but naming only it is not enough).

    ``maxout train`` runs in this process with ``train()`` replaced by its pre-run checks (prepare_only): a
    refusal, from the overrides or from the checks, is what a user would see, and an accepted config costs no
    second composition."""
    if out_of_time():
        return
    import maxout.train

    try:
        with mock.patch.object(maxout.train, "train", prepare_only):
            code, out, err = run_cli(["train", *argv(fuzzed, tmp, context=context)])
    except Prepared as done:
        cfg, checked = done.cfg, done.checked
    else:
        assert code != 0, (out, err)
        check_refusal(one_error_line(err), fuzzed)
        return
    if zlib.crc32(" ".join([*context, *fuzzed]).encode()) % TRAIN_EVERY:
        return
    from maxout.train import footprint  # lazy: see prepare_only

    size = footprint.estimate(cfg.model, checked.tokenizer)
    if size is None or size.params > TRAIN_MAX_PARAMS:
        return
    cfg = loading.load(argv(fuzzed, tmp, TRAIN_FIXED, context))
    try:
        result = maxout.train.train(cfg, progress=False, verbose=False)
    except Diverged:  # lr=1e9 and friends: a one-line refusal at the step it began (test_divergence.py)
        return
    finally:
        assert not running_runs(tmp), "a run was left RUNNING"
    assert math.isfinite(result.metrics["eval/loss"]), result.metrics


def running_runs(tmp: str) -> list:
    """The runs still RUNNING in the tmp store (where argv points tracking), if a fuzzed setting turned it on."""
    store = Path(tmp) / "mlflow.db"
    if not store.is_file():
        return []
    import mlflow  # lazy: only where a run was tracked

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    return [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.status == "RUNNING"]


@given(fuzzed=overrides())
@fuzz_settings(ci=14)
@example(fuzzed=["train.lr=1e-3"])  # an accepted config: the property's other half is exercised every run
@example(fuzzed=["hpo.study_name=all"])  # was OmegaConf's AssertionError: a key inside the null hpo section
@example(fuzzed=["hardware.name=${nope}"])  # was InterpolationKeyError, raised where the probe read the name
@example(fuzzed=["hardware.requires_cuda=true"])  # the refusal named the profile, not the key that was set
@example(fuzzed=["train.batch_size=all"])  # int('all'): the pre-run checks read the batch size of an invalid config
@example(fuzzed=["train.batch_size=inf"])  # ... and int(inf)
def test_any_override_is_accepted_or_refused_in_one_line_naming_the_key(fuzzed, tmp_path):
    check_property(fuzzed, str(tmp_path))


# ------------------------------------------------------------------------------------------ config groups

GROUPS = loading.config_groups()  # read from config.yaml's defaults list: {group: optional}
NOT_A_NAME = st.sampled_from(["true", "false", "0", "1", "-1", "1.5", "1e308", "[]", "[cpu, tiny]", "null", "''", "",
                              "' '", "{a: 1}", "nope", "${nope}", "${model.name}", "cpu,tiny", "glob(*)", "💥"])


@st.composite
def group_choices(draw) -> list[str]:
    """One group choice, plain, with + or as a deletion (~group, ~group=name), to an option or to anything else;
    sometimes with a typed key of the same group beside it."""
    group = draw(st.sampled_from(sorted(GROUPS)))
    value = draw(st.sampled_from(paths.group_options(group) or ["none"]) | NOT_A_NAME | UNICODE.map(_quoted))
    op = draw(st.sampled_from(["", "", "+", "~"]))
    choice = (f"~{group}" if draw(st.booleans()) else f"~{group}={value}") if op == "~" else f"{op}{group}={value}"
    keys = [k for k in KEYS if k.dotted.startswith(group + ".")]
    if keys and draw(st.booleans()):
        key = draw(st.sampled_from(keys))
        return [choice, f"{key.dotted}={draw(values(key))}"]
    return [choice]


@given(fuzzed=group_choices())
@fuzz_settings(ci=8)
@example(fuzzed=["hpo=true"])  # was Hydra's ValueError: Config group override must be a string or a list. Got bool
@example(fuzzed=["hpo=nope"])  # was accepted without a word: Hydra skips an unknown option of an optional group
@example(fuzzed=["hardware=[cpu, gpu]"])  # was accepted: Hydra merged both profiles
@example(fuzzed=["hpo={a: 1}"])  # was AttributeError: 'NoneType' object has no attribute 'get'
@example(fuzzed=["~hpo", "hpo.study_name=all"])  # make fuzz: OmegaConf's AssertionError (~hpo read as a choice)
def test_any_group_choice_is_accepted_or_refused_in_one_line_naming_the_group(fuzzed, tmp_path):
    check_property(fuzzed, str(tmp_path))


# ------------------------------------------------------------------------------------------ free-form keys

def _yaml(group: str, name: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(paths.CONF_DIR / group / f"{name}.yaml"))


# The tiny models (source=config) and the fields of transformers' own config class for each one's model_type.
TINY_MODELS = {m: _yaml("model", m) for m in paths.group_options("model") if m.startswith("tiny")}
ARCHITECTURE_FIELDS = {m: [f for f in fields(CONFIG_MAPPING[y.get("architecture", {}).get("model_type", "bert")])
                           if f.init] for m, y in TINY_MODELS.items()}
ADAPTER_KEYS = [k for k in KEYS if k.dotted.startswith("model.lora_")]
FREE_FORM_KEYS = [k for k in KEYS if k.hint in (dict, list, Any) and not k.dotted.startswith("model.architecture")]


def field_values(hint: Any) -> st.SearchStrategy[str]:
    """Values for a transformers config field, from its annotation (a type or a string such as 'float | int')."""
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    right = []
    if "int" in text:
        right.append(st.integers(-2, 4096).map(str) | SIZES)
    if "float" in text:
        right.append(st.floats(-1, 2, allow_nan=False).map(repr))
    if "bool" in text:
        right.append(st.sampled_from(["true", "false"]))
    if "str" in text or "Literal" in text:
        right.append(st.sampled_from(["gelu", "relu", "silu", "sliding_attention", "full_attention", "eager",
                                      "float16", "bfloat16", "cls", "mean", "default", "none"]))
    if "list" in text or "dict" in text:
        right.append(st.sampled_from(["[]", "[1, 2]", "[full_attention, sliding_attention]", "{}", "{a: 1}"]))
    return st.one_of(*right, SIZES, WRONG, NON_FINITE, EMPTY, st.just("null"))


@st.composite
def free_form(draw) -> tuple[list[str], list[str]]:
    """model.architecture.FIELD (any field of the model_type's config class; + where the YAML lacks it, or plain,
    or ~), or an adapter setting with the adapter switched on, or another dict-typed key."""
    kind = draw(st.sampled_from(["architecture", "architecture", "architecture", "adapter", "dict"]))
    if kind == "adapter":
        key = draw(st.sampled_from(ADAPTER_KEYS))
        adapter = draw(st.sampled_from(["lora", "dora"]))
        return [f"model.adapter={adapter}"], [f"{key.dotted}={draw(values(key))}"]
    if kind == "dict":
        key = draw(st.sampled_from(FREE_FORM_KEYS))
        name = draw(st.sampled_from(["a", "lr", "train.lr", "x.y"]))
        group = ["hpo=default"] if key.dotted.startswith("hpo.") else []
        op = draw(st.sampled_from(["+", "", "~"]))
        return group, [f"{op}{key.dotted}.{name}" + ("" if op == "~" else f"={draw(values(key))}")]
    model = draw(st.sampled_from(sorted(TINY_MODELS)))
    chosen = draw(st.lists(st.sampled_from(ARCHITECTURE_FIELDS[model]), min_size=1, max_size=2,
                           unique_by=lambda f: f.name))
    present = TINY_MODELS[model].get("architecture", {})
    out = []
    for f in chosen:
        key = f"model.architecture.{f.name}"
        op = draw(st.sampled_from(["+" if f.name not in present else "", "+" if f.name not in present else "",
                                   "+", "", "~"]))
        out.append(f"~{key}" if op == "~" else f"{op}{key}={draw(field_values(f.type))}")
    return [f"model={model}"], out


@given(case=free_form())
@fuzz_settings(ci=10)
@example(case=([], ["model.architecture.intermediate_size=1e308"]))  # were huggingface_hub's
@example(case=([], ["model.architecture.num_attention_heads=abc"]))  # StrictDataclassFieldValidationError
@example(case=([], ["model.architecture.hidden_size=-1"]))  # was RuntimeError: negative dimension -1
@example(case=([], ["+model.architecture.type_vocab_size=0"]))  # failed in the first forward pass
@example(case=([], ["~model.architecture.num_attention_heads"]))  # BERT's default 12 heads do not divide 32
@example(case=(["model.adapter=lora"], ["model.lora_target_modules=[nope]"]))  # peft's ValueError
@example(case=([], ["hardware.match.lr='x'"]))  # was OmegaConf's ValueError: int('lr') on a list
@example(case=([], ["+hardware.pad_widths.a=all"]))  # a dict under an Any field: the refusal names the field
def test_any_free_form_key_is_accepted_or_refused_in_one_line_naming_the_key(case, tmp_path):
    context, fuzzed = case
    check_property(fuzzed, str(tmp_path), context)


# ------------------------------------------------------------------------------------------ sizes

INT_KEYS = [k for k in KEYS if k.hint is int or (k.hint is Any and isinstance(k.default, int))]


@st.composite
def sizes(draw) -> list[str]:
    """Sizes a machine cannot hold: any int key, or a tiny model's size field, up to 2**63."""
    if draw(st.booleans()):
        key = draw(st.sampled_from(INT_KEYS))
        return [f"{key.dotted}={draw(SIZES)}"]
    field = draw(st.sampled_from(["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "max_position_embeddings", "type_vocab_size"]))
    return [f"model.architecture.{field}={draw(SIZES)}" if field != "type_vocab_size"
            else f"+model.architecture.{field}={draw(SIZES)}"]


@given(fuzzed=sizes())
@fuzz_settings(ci=6)
@example(fuzzed=["data.pad_to_multiple_of=99999999999"])  # was DefaultCPUAllocator: can't allocate 12.8 TB
@example(fuzzed=["model.architecture.num_hidden_layers=2147483648"])  # built layers until the machine ran out
@example(fuzzed=["train.seed=4294967296"])  # numpy's seed range: was a ValueError at the run's start
@example(fuzzed=["hardware.num_workers=2147483648"])  # DataLoader workers are processes
def test_any_size_is_accepted_or_refused_in_one_line_naming_the_key(fuzzed, tmp_path):
    check_property(fuzzed, str(tmp_path))


def test_the_walk_finds_every_section():
    """The fuzzer draws from the dataclasses: every section's keys are there (none kept by hand)."""
    sections = {k.dotted.split(".")[0] for k in KEYS}
    assert sections >= {f.name for f in fields(Config)} - {"debug", "resume"} | {"hpo"}
    assert len(KEYS) > 120 and {"train.early_stopping.patience", "hpo.pruner.min_delta", "data.labels"} <= \
        {k.dotted for k in KEYS}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
