"""Check config, data, model and environment before any expensive work (model load, compile, a tracking run),
and report EVERY problem found in one line: ``3 problems: ...; ...; ...`` (one problem keeps its own message and
exit code; several exit 2 when any of them is a usage error).

``load_config(overrides)`` is what the CLI calls: the config, with every bad override and value listed (and, when
the config has problems, whatever is also wrong with the data, model and environment). ``check(cfg)`` is what
``train()`` calls first: data files, columns and labels, model availability, tracking store (reachable, and
accepting the login: preflight.py), writable directories, and the checkpoint a ``resume`` asks for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlparse

from . import config, data, hardware, modeling, preflight, resume as resume_mod, spool, tracking
from .config import Config
from .errors import ConfigError, MaxoutError, combined
from .train.setup import resolve_micro_batch

STORE_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")


@dataclass
class Checked:
    """What the checks loaded anyway, for train() to use instead of loading it again."""

    dataset: Any
    tokenizer: Any
    resume: resume_mod.Plan


def load_config(overrides: Sequence[str], device: Optional[hardware.DeviceInfo] = None) -> Config:
    """``config.load`` that reports every bad override and value at once (plus data, model and environment
    problems when it can tell them)."""
    device = device or hardware.detect()
    problems: list[MaxoutError] = _environment()
    try:
        cfg: Optional[Config] = config.load(overrides, device, problems)
    except ConfigError:  # the composition itself failed: find every override that breaks it, keep the rest
        good = _composable(list(overrides), problems)
        cfg = _collect(problems, config.load, good, device, problems)
    if problems:
        if cfg is not None:
            _check_all(cfg, None, problems)
        raise combined(problems)
    return cfg


def check(cfg: Config, dataset: Any = None) -> Checked:
    problems: list[MaxoutError] = _environment()
    checked = _check_all(cfg, dataset, problems)
    if problems:
        raise combined(problems)
    return checked


def _composable(overrides: list[str], problems: list) -> list[str]:
    """The overrides that compose, each tried with the group choices (model=..., data=...) that compose."""
    groups = [o for o in overrides if "." not in o.split("=", 1)[0]]
    good: list[str] = []
    for override in groups + [o for o in overrides if o not in groups]:
        context = [g for g in good if g in groups]
        if _collect(problems, config.compose, context + [override]) is not None:
            good.append(override)
    return good


def _environment() -> list[MaxoutError]:
    """Problems with the environment that hold whatever the config says."""
    root = os.environ.get("MAXOUT_ROOT")
    if root and not Path(root).expanduser().is_dir():
        return [ConfigError(f"MAXOUT_ROOT={root!r} is not a directory; point it at the project root or unset it")]
    return []


def _check_all(cfg: Config, dataset: Any, problems: list) -> Checked:
    if dataset is None and _valid(cfg.data):
        paths = [p for p in (cfg.data.train_path, cfg.data.validation_path) if p]
        if all([_collect(problems, data.existing_file, p) for p in paths]):  # a list: report each missing file
            dataset = _collect(problems, data.load, cfg.data)
    tokenizer = None
    if _valid(cfg.model):
        if cfg.model.source == "config" or _collect(problems, modeling.weights_location, cfg.model):
            tokenizer = _collect(problems, modeling.load_tokenizer, cfg.model)
    if cfg.batch_size != "auto":  # auto: the batch finder probes once the run's device is known
        _collect(problems, resolve_micro_batch, cfg)
    if cfg.tracking.backend == "mlflow" and _valid(cfg.tracking):
        _tracking_store(cfg, problems)
        _writable(Path(cfg.tracking.spool_dir or spool.default_dir()), "tracking.spool_dir", problems)
    if cfg.checkpoint.enabled:
        _writable(resume_mod.checkpoint_root(cfg), "checkpoint.dir", problems)
    plan = None if problems else _collect(problems, resume_mod.plan, cfg, dataset)  # reads data and checkpoints
    return Checked(dataset, tokenizer, plan)


def _tracking_store(cfg: Config, problems: list) -> None:
    uri, _ = tracking.resolve_uri(cfg.tracking)
    source = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.uri"
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme not in STORE_SCHEMES and not (scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE")):
        problems.append(ConfigError(
            f"{source}={tracking.redact(uri)!r} is not a tracking store MLflow 3 can use (valid schemes: "
            f"{', '.join(STORE_SCHEMES)}); use e.g. sqlite:///mlruns/mlflow.db or http://host:5000"))
        return
    if scheme == "sqlite":
        _writable(Path(uri.split(":///", 1)[-1]).parent, f"the directory of {source}", problems)
    if _collect(problems, tracking.check_reachable, uri) is None or not _collect(
            problems, preflight.check_credentials, uri):
        return
    experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
    if experiment_id and not problems:
        _collect(problems, _experiment_exists, uri, experiment_id)


def _experiment_exists(uri: str, experiment_id: str) -> None:
    import mlflow
    from mlflow.exceptions import MlflowException

    # A SQLite store that does not exist yet holds no experiment (and asking would create it, noisily).
    exists = not uri.startswith("sqlite:") or Path(uri.split(":///", 1)[-1]).is_file()
    if exists:
        try:
            mlflow.MlflowClient(uri).get_experiment(experiment_id)
        except MlflowException:
            exists = False
    if not exists:
        raise ConfigError(f"MLFLOW_EXPERIMENT_ID={experiment_id!r} is not an experiment in "
                          f"{tracking.redact(uri)}; unset it, or set MLFLOW_EXPERIMENT_NAME instead")


def _writable(path: Path, key: str, problems: list) -> None:
    existing = path.expanduser()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is not a directory" if not existing.is_dir() else "is not writable"
        problems.append(ConfigError(f"{key}={str(path)!r} cannot hold files ({existing} {why}); "
                                    f"point {key} at a writable directory"))


def _valid(section: Any) -> bool:
    """Whether a config section is valid on its own (checks that build on it would only add noise)."""
    try:
        section.validate()
        return True
    except ConfigError:
        return False


def _collect(problems: list, func: Callable, *args: Any) -> Any:
    """``func(*args)``, or None with its MaxoutError appended to ``problems``. A check that returns nothing
    gives True, so that the caller can tell it passed."""
    try:
        result = func(*args)
    except MaxoutError as err:
        problems.append(err)
        return None
    return True if result is None else result
