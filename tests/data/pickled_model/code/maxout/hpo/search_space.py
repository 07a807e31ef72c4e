"""The search space: a typed spec per hyper-parameter, checked against the real config before any trial runs.

In YAML (``hpo.search_space``) the keys nest like the config itself, so Hydra overrides reach them
(``hpo.search_space.train.lr.high=1e-3``); a leaf is a mapping with a ``type``:

    train:
      lr: {type: float, low: 1.0e-5, high: 3.0e-4, log: true}
      target_effective_batch: {type: categorical, choices: [16, 32]}

Each sampled value becomes a Hydra override on top of the user's (``train.lr=0.0001``), so a trial's config is
composed exactly like ``maxout train`` would compose it.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import Config
from ..errors import ConfigError

TYPES = ("float", "int", "categorical")
SPEC_KEYS = {"type", "low", "high", "log", "step", "choices"}
# Keys a trial must not change: the study's own settings, where runs go, and what the tables are (they are read
# and split once per study, before the first trial).
NOT_TUNABLE = ("hpo", "tracking", "data.train_path", "data.validation_path", "data.test_path",
               "data.validation_split", "data.split_seed", "data.format", "data.text_column", "data.text_pair_column",
               "data.label_column", "data.labels")


@dataclass(frozen=True)
class ParamSpec:
    key: str  # the dotted config key, also the Optuna parameter name
    type: str
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: tuple = ()

    def suggest(self, trial: Any) -> Any:
        if self.type == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.type == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.key, list(self.choices))

    def candidates(self) -> list[Any]:
        """Values that stand for the whole range when checking it against the config: bounds or choices."""
        return [self.low, self.high] if self.type != "categorical" else list(self.choices)


def _fail(where: str, message: str) -> None:
    raise ConfigError(f"hpo.search_space.{where}: {message}")


def _number(value: Any, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)


def _leaf(key: str, spec: dict) -> ParamSpec:
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        _fail(key, f"unknown field {unknown[0]!r} (valid: {', '.join(sorted(SPEC_KEYS))})")
    kind = spec.get("type")
    if kind not in TYPES:
        _fail(key, f"type={kind!r} is invalid (valid: {', '.join(TYPES)})")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, (list, tuple)) or not choices:
            _fail(key, "categorical needs a non-empty list of choices, e.g. choices: [16, 32]")
        bad = [c for c in choices if c is not None and not isinstance(c, (bool, int, float, str))]
        if bad:
            _fail(key, f"choice {bad[0]!r} is not a number, string, boolean or null")
        return ParamSpec(key, kind, choices=tuple(choices))
    integer = kind == "int"
    low, high, log, step = spec.get("low"), spec.get("high"), bool(spec.get("log", False)), spec.get("step")
    for name, value in (("low", low), ("high", high)):
        if not _number(value, integer):
            _fail(key, f"{name}={value!r} is invalid: {kind} needs numeric low and high"
                       + (" (integers)" if integer else ""))
    if low > high:
        _fail(key, f"inverted range: low={low} > high={high}")
    if low == high:
        _fail(key, f"empty range: low == high == {low} (to fix a value, set it as a plain override instead)")
    if log and low <= 0:
        _fail(key, f"log=true needs low > 0, got low={low}")
    if step is not None:
        if log:
            _fail(key, "step and log=true cannot be combined")
        if not _number(step, integer) or step <= 0:
            _fail(key, f"step={step!r} must be a positive {'integer' if integer else 'number'}")
        if step > high - low:
            _fail(key, f"empty range: step={step} is larger than high - low = {high - low}")
    return ParamSpec(key, kind, low, high, log, step)


def parse(tree: Any, prefix: str = "") -> list[ParamSpec]:
    """The nested ``hpo.search_space`` mapping as a flat list of specs (each checked for its own shape)."""
    if not isinstance(tree, dict):
        _fail(prefix or "(root)", f"expected a mapping of config keys, got {tree!r}")
    specs: list[ParamSpec] = []
    for name, value in tree.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, dict) and "type" in value:
            specs.append(_leaf(key, value))
        elif isinstance(value, dict):  # a section; empty once its last key was removed (~hpo.search_space.x.y)
            specs.extend(parse(value, key))
        else:
            _fail(key, f"expected a distribution like {{type: float, low: 1e-5, high: 1e-3}}, got {value!r}")
    return specs


def _resolve(cfg: Any, key: str) -> tuple[Any, str]:
    """(the dataclass or dict holding ``key``'s last part, that part), or a one-line error naming valid keys."""
    parts = key.split(".")
    fixed = next((k for k in NOT_TUNABLE if key == k or key.startswith(k + ".")), None)
    if fixed:
        raise ConfigError(f"hyper-parameter {key!r} in hpo.search_space cannot be tuned: {fixed} is fixed for "
                          f"the whole study")
    node: Any = cfg
    for depth, part in enumerate(parts):
        names = [f.name for f in fields(node)] if is_dataclass(node) else list(node) if isinstance(node, dict) else []
        where = f"under {'.'.join(parts[:depth])!r}" if depth else "at the top level"
        if part not in names:
            raise ConfigError(f"unknown hyper-parameter {key!r} in hpo.search_space: {part!r} is not a config key "
                              f"{where} (valid: {', '.join(map(str, names))})")
        if depth == len(parts) - 1:
            return node, part
        node = getattr(node, part) if is_dataclass(node) else node[part]
    raise AssertionError("unreachable")


def _is_integer_field(holder: Any, name: str) -> bool:
    if not is_dataclass(holder):
        return False
    hint = typing.get_type_hints(type(holder)).get(name)
    return hint is int or set(typing.get_args(hint)) == {int, type(None)}


def check(specs: list[ParamSpec], cfg: Config) -> None:
    """Every key is a real config key of the right type, and every bound or choice passes the config's own
    validation (so a trial never fails on a value the search space allowed)."""
    for spec in specs:
        holder, name = _resolve(cfg, spec.key)
        if spec.type == "float" and _is_integer_field(holder, name):
            _fail(spec.key, f"{spec.key} is an integer: use type: int (or categorical)")
        for value in spec.candidates():
            node = OmegaConf.structured(cfg)
            try:
                OmegaConf.update(node, spec.key, value, merge=False)
                OmegaConf.to_object(node).validate()
            except ConfigError as err:
                _fail(spec.key, f"value {value!r} is invalid: {err}")
            except OmegaConfBaseException as err:
                _fail(spec.key, f"value {value!r} is invalid: {str(err).splitlines()[0]}")


def load(tree: Any, cfg: Config) -> list[ParamSpec]:
    specs = parse(tree)
    check(specs, cfg)
    return specs


def apply(cfg: Config, values: dict[str, Any]) -> Config:
    """``cfg`` with ``values`` set (dotted keys): the same typed, validated config as composing it again with
    ``overrides(values)`` appended, without Hydra's ~0.9 s per composition (a trial's warm start)."""
    node = OmegaConf.structured(cfg)
    for key, value in values.items():
        OmegaConf.update(node, key, value, merge=False)
    return OmegaConf.to_object(node).validate()


def suggest(trial: Any, specs: list[ParamSpec]) -> dict[str, Any]:
    return {spec.key: spec.suggest(trial) for spec in specs}


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"  # always a string, never re-parsed


def overrides(values: dict[str, Any]) -> list[str]:
    """Sampled values as Hydra overrides (appended after the user's, so they win)."""
    return [f"{key}={_hydra_value(value)}" for key, value in values.items()]


def describe(specs: list[ParamSpec]) -> dict[str, str]:
    """One readable line per hyper-parameter, for the parent run's params."""
    out: dict[str, str] = {}
    for s in specs:
        if s.type == "categorical":
            out[s.key] = f"categorical{list(s.choices)}"
        else:
            out[s.key] = f"{s.type}[{s.low}, {s.high}]" + (" log" if s.log else "") + (f" step {s.step}" if s.step
                                                                                      else "")
    return out
