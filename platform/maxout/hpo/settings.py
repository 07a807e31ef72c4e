"""The typed ``hpo`` config section (the ``hpo/`` Hydra group; ``null`` unless ``maxout hpo`` selects one).

Only plain checks live here (ranges, names); the search space is checked against the real config schema by
search_space.py, and the storage and study by storage.py / study.py, all before the parent run starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError, one_of

# What evaluate() returns at each evaluation: the values a trial can report and be pruned on.
EVAL_METRICS = ("eval/macro_f1", "eval/accuracy", "eval/loss")
DIRECTIONS = ("maximize", "minimize")
SAMPLERS = ("tpe", "random")
PRUNERS = ("hyperband", "none")
LOG_MODELS = ("best", "all", "none")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class SamplerConfig:
    name: str = "tpe"  # tpe (Optuna 5: multivariate, constant liar for parallel workers) | random
    seed: Optional[int] = None  # None: a different sequence per worker (what parallel workers want)
    n_startup_trials: int = 10  # TPE samples at random until this many trials finished

    def validate(self) -> None:
        _check(self.name in SAMPLERS, f"hpo.sampler.name={one_of(self.name, SAMPLERS)}")
        _check(self.n_startup_trials >= 0, f"hpo.sampler.n_startup_trials={self.n_startup_trials} must be >= 0")


@dataclass
class PrunerConfig:
    """HyperbandPruner wrapped in PatientPruner. The resource is epochs (k_folds=1) or folds (k_folds>1)."""

    name: str = "hyperband"  # hyperband | none (never prune: the baseline that pruning saves compute against)
    min_resource: int = 1
    max_resource: Optional[int] = None  # None: train.epochs, or k_folds in k-fold mode
    reduction_factor: int = 3
    bootstrap_count: int = 0  # trials that must finish a rung before any is promoted past it
    patience: Optional[int] = 0  # PatientPruner: steps without improvement before Hyperband is asked; None: off
    min_delta: float = 0.0  # PatientPruner: an improvement smaller than this does not count

    def validate(self) -> None:
        _check(self.name in PRUNERS, f"hpo.pruner.name={one_of(self.name, PRUNERS)}")
        _check(self.min_resource >= 1, f"hpo.pruner.min_resource={self.min_resource} must be >= 1")
        _check(self.max_resource is None or self.max_resource >= self.min_resource,
               f"hpo.pruner.max_resource={self.max_resource} must be >= hpo.pruner.min_resource={self.min_resource}")
        _check(self.reduction_factor >= 2, f"hpo.pruner.reduction_factor={self.reduction_factor} must be >= 2")
        _check(self.bootstrap_count >= 0, f"hpo.pruner.bootstrap_count={self.bootstrap_count} must be >= 0")
        _check(self.patience is None or self.patience >= 0,
               f"hpo.pruner.patience={self.patience} must be >= 0 (or null: no PatientPruner)")
        _check(self.min_delta >= 0, f"hpo.pruner.min_delta={self.min_delta} must be >= 0")


@dataclass
class HpoConfig:
    study_name: str = "maxout"  # workers started with the same name (and storage) join one study
    storage: Optional[str] = None  # None: a journal file beside the local MLflow store; or an RDB URL (PostgreSQL)
    n_trials: Optional[int] = 20  # finished (complete + pruned) trials the STUDY stops at, over all workers
    timeout_s: Optional[float] = None  # this worker stops starting trials after this long
    metric: str = "eval/macro_f1"
    direction: str = "maximize"
    k_folds: int = 1  # 1: the configured train/validation split; > 1: stratified k-fold over the training table
    fold_seed: int = 13
    log_models: str = "best"  # best: only a trial that beats the study's best so far logs its model | all | none
    heartbeat_interval_s: int = 60  # RDB storages: a worker's running trial sends a heartbeat this often
    grace_period_s: int = 120  # ... and a trial whose heartbeat is older than this is failed and retried
    max_retry: Optional[int] = 3  # retries of a trial whose worker died (None: unbounded)
    compile_cache_dir: Optional[str] = None  # TorchInductor's on-disk cache; None: beside the local MLflow store
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    search_space: dict = field(default_factory=dict)  # config key -> {type: float|int|categorical, ...}

    def validate(self) -> None:
        _check(bool(self.study_name.strip()), "hpo.study_name is empty: name the study")
        _check(self.n_trials is not None or self.timeout_s is not None,
               "hpo.n_trials and hpo.timeout_s are both null: set at least one, e.g. hpo.n_trials=20")
        _check(self.n_trials is None or self.n_trials >= 1, f"hpo.n_trials={self.n_trials} must be >= 1")
        _check(self.timeout_s is None or self.timeout_s > 0, f"hpo.timeout_s={self.timeout_s} must be > 0")
        _check(self.metric in EVAL_METRICS, f"hpo.metric={one_of(self.metric, EVAL_METRICS)}")
        _check(self.direction in DIRECTIONS, f"hpo.direction={one_of(self.direction, DIRECTIONS)}")
        _check(self.k_folds >= 1, f"hpo.k_folds={self.k_folds} must be >= 1 (1: the plain train/validation split)")
        _check(self.log_models in LOG_MODELS, f"hpo.log_models={one_of(self.log_models, LOG_MODELS)}")
        _check(self.heartbeat_interval_s >= 1, f"hpo.heartbeat_interval_s={self.heartbeat_interval_s} must be >= 1")
        _check(self.grace_period_s > self.heartbeat_interval_s,
               f"hpo.grace_period_s={self.grace_period_s} must be > hpo.heartbeat_interval_s="
               f"{self.heartbeat_interval_s} (else live trials look dead)")
        _check(self.max_retry is None or self.max_retry >= 0, f"hpo.max_retry={self.max_retry} must be >= 0")
        _check(bool(self.search_space), "hpo.search_space is empty: name at least one hyper-parameter")
        self.sampler.validate()
        self.pruner.validate()
