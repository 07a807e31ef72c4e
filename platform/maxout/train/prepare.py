"""The input checks that run before any run exists: data files, columns and labels, model availability, the
model's config and its size on this machine (footprint.py), data.max_length against the model's position
embeddings, the micro-batch, the tracking store (preflight.py), writable directories, and the checkpoint a
``resume`` asks for.

Every problem found is reported at once, in one line: ``3 problems: ...; ...; ...`` (one problem keeps its own
message and exit code; several exit 2 when any of them is a usage error). ``check(cfg)`` is what ``train()``
calls first, and what HPO calls once per study; ``add_problems(cfg, problems)`` adds what it finds to a list that
already holds the config's own problems (the CLI's way to list everything wrong with a command at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .. import data, hardware, modeling
from ..config import PER_CLASS_METRIC, Config
from ..errors import ConfigError, MaxoutError, collect, combined
from ..metrics import label_key
from ..paths import check_writable
from ..serving import pooling
from . import footprint, resume as resume_mod
from .setup import pad_multiple, resolve_micro_batch


@dataclass
class Checked:
    """What the checks loaded anyway, for train() to use instead of loading it again."""

    dataset: Any
    tokenizer: Any
    resume: Optional[resume_mod.Plan]


def check(cfg: Config, dataset: Any = None, tokenizer: Any = None) -> Checked:
    """Every input problem of ``cfg`` at once, as one error; ``dataset`` and ``tokenizer`` replace loading
    ``cfg.data`` and the model's tokenizer (a warm start passes both)."""
    problems: list[MaxoutError] = []
    checked = add_problems(cfg, problems, dataset, tokenizer)
    if problems:
        raise combined(problems)
    return checked


def add_problems(cfg: Config, problems: list, dataset: Any = None, tokenizer: Any = None) -> Checked:
    """Append every input problem of ``cfg`` to ``problems`` (a section that is itself invalid is not looked
    into: checks that build on it would only add noise)."""
    if dataset is None and _valid(cfg.data):
        paths = [p for p in (cfg.data.train_path, cfg.data.validation_path, cfg.data.test_path) if p]
        if all([collect(problems, data.existing_file, p) for p in paths]):  # a list: report each missing file
            dataset = collect(problems, data.load, cfg.data)
    if dataset is not None and _valid(cfg.train):
        collect(problems, check_selection_metric, cfg, dataset.label_names)
    device = hardware.detect()  # what the model and the processes must fit in
    if tokenizer is None and _valid(cfg.model):
        if cfg.model.source == "config" or collect(problems, modeling.weights_location, cfg.model):
            tokenizer = collect(problems, modeling.load_tokenizer, cfg.model)
    if tokenizer is not None and _valid(cfg.model):
        # The model's config and its size on this machine first (meta device, nothing allocated): the checks
        # after it build on a config that the library took and that fits.
        before = len(problems)
        if collect(problems, footprint.check, cfg, tokenizer, device):
            if _valid(cfg.data):  # against the model's position embeddings (its config, no weights)
                collect(problems, modeling.check_max_length, cfg.model, cfg.data.max_length,
                        pad_multiple(cfg, device))
            collect(problems, check_model, cfg, tokenizer)
        if len(problems) == before:  # a forward pass only of a model that passed every check above
            collect(problems, footprint.smoke, cfg, tokenizer)
    if _valid(cfg.hardware):
        collect(problems, check_machine, cfg, device)
    # auto: the batch finder probes once the run's device is known; an invalid batch size (all, inf) is already
    # among the config's problems, and int() of it would be a traceback
    if cfg.batch_size != "auto" and _valid(cfg.train) and _valid(cfg.hardware):
        collect(problems, resolve_micro_batch, cfg)
    if cfg.tracking.backend == "mlflow" and _valid(cfg.tracking):
        from ..tracking import preflight  # lazy: mlflow takes 1.5 s to import, and tracking=none never needs it

        problems.extend(preflight.store_problems(cfg.tracking, ready=not problems))
    if cfg.checkpoint.enabled:
        collect(problems, check_writable, resume_mod.checkpoint_root(cfg), "checkpoint.dir")
    plan = None if problems else collect(problems, resume_mod.plan, cfg, dataset)  # reads data and checkpoints
    return Checked(dataset, tokenizer, plan)


def check_selection_metric(cfg: Config, label_names: list[str]) -> None:
    """A per-class train.select_best must name a label of the data (config.py checked its form)."""
    found = PER_CLASS_METRIC.match(cfg.train.select_best)
    if not found:
        return
    keys = [label_key(name) for name in label_names]
    if found.group(2) not in keys:
        valid = ", ".join(f"eval/{found.group(1)}/{k}" for k in keys)
        raise ConfigError(f"train.select_best={cfg.train.select_best!r} names label {found.group(2)!r}, which "
                          f"evaluation never logs: the labels are {list(map(str, label_names))} (valid: {valid})")


def check_machine(cfg: Config, device: hardware.DeviceInfo) -> None:
    """Process counts the machine can hold. DataLoader workers are processes, started together at the first batch;
    maxout's tables are in memory, so a worker is CPU-bound and more of them than cores loads no faster
    (hardware.num_workers=2147483648 would fork until the machine refuses)."""
    workers = cfg.hardware.num_workers
    if isinstance(workers, int) and workers > device.cpu_count:
        raise ConfigError(f"hardware.num_workers={workers} is more worker processes than this machine's "
                          f"{device.cpu_count} cores, which cannot load faster (the tables are in memory); use at "
                          f"most {device.cpu_count}, or auto (cores - 2)")


def check_model(cfg: Config, tokenizer: Any) -> None:
    """The model's config takes the asked attention direction and pooling (config only: no weights are loaded)."""
    config = modeling.build_config(cfg.model, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)
    pooling.check(modeling.model_class(config), config.model_type, cfg.model.pooling)


def _valid(section: Any) -> bool:
    """Whether a config section is valid on its own."""
    try:
        section.validate()
        return True
    except ConfigError:
        return False
