"""From Hydra overrides to a typed, validated Config, with every bad override and value listed at once.

``load(overrides)`` composes ``maxout/conf`` (plus every ``projects/<task>/conf``) with Hydra, resolves
``hardware=auto`` against the detected device, merges the result onto config.py's dataclasses and checks every
value. Hydra's and OmegaConf's errors become one-line ConfigErrors that name the bad key or value and what is
valid. When the composition itself fails, each override is tried on its own, so that every override that breaks
it is named, not just the first: ``3 problems: ...; ...; ...`` (a single problem keeps its own message and exit
code; several exit 2 when any of them is a usage error).

The CLI, HPO (once per study and once per trial) and the benchmark load configs through here; the trainer takes a
Config and never composes one.

Inputs. May import: errors, paths, config, hardware.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from .config import Config
from .errors import ConfigError, HardwareError, MaxoutError, collect, combined
from .paths import CONF_DIR, CPU_BF16_FORCED, CPU_BF16_VAR, group_options, project_root, search_path

if TYPE_CHECKING:
    from . import hardware


def load(overrides: Sequence[str] = (), device: Optional[hardware.DeviceInfo] = None,
         problems: Optional[list] = None) -> Optional[Config]:
    """The typed config for ``overrides`` on ``device`` (detected when None).

    Every bad override and value is found, not just the first. Without a ``problems`` list they are raised as one
    error (asking for a GPU profile on a machine without a visible CUDA device is one of them). With a list, they
    are appended to it and the config is returned as far as it could be built: invalid, or None when no
    composition succeeded (the CLI then adds the data, model and environment problems it can still tell).
    """
    from . import hardware  # lazy: torch (seconds); precheck() must answer without it

    device = device or hardware.detect()
    found: list[MaxoutError] = _environment()
    try:
        cfg: Optional[Config] = _load(list(overrides), device, found)
    except ConfigError:  # the composition itself failed: find every override that breaks it, keep the rest
        good = _composable(list(overrides), found)
        cfg = collect(found, _load, good, device, found)
    if problems is not None:
        problems.extend(found)
        return cfg
    if found:
        raise combined(found)
    return cfg


def precheck(overrides: Sequence[str]) -> list[MaxoutError]:
    """The problems ``overrides`` (and the environment) have on any device, found without importing torch: the
    config composed as given (``hardware=auto``'s file holds no settings, so the schema's defaults stand in for the
    profile it will pick), typed and checked. The CLI refuses a typo here, in about a second, before it imports
    torch, transformers and mlflow (ten); what needs the device (the picked profile, a GPU profile on a CPU) is
    load()'s."""
    problems: list[MaxoutError] = _environment()
    _as_composed(list(overrides), problems)
    return problems


def load_without_device(overrides: Sequence[str] = ()) -> Config:
    """The typed config as composed, ``hardware=auto`` not resolved (the schema's defaults stand in for the profile
    it would pick, as in precheck()), without importing torch: for a command that reads only sections no device
    changes. A Slurm job's stop trap (`maxout tracking end-slurm-job`, tracking only) runs within slurmd's KillWait,
    on a node that may be loaded: 1 s less of start-up there (torch, for the device a full load() detects)."""
    problems = _environment()
    cfg = _as_composed(list(overrides), problems)
    if problems:
        raise combined(problems)
    return cfg


def _as_composed(overrides: list[str], problems: list) -> Optional[Config]:
    """The config composed as given and typed, no device involved; problems go to ``problems`` (None: no
    composition succeeded)."""
    try:
        return to_typed(compose(overrides), problems)
    except ConfigError:  # the composition itself failed: name every override that breaks it, as load() does
        good = _composable(overrides, problems)
        return collect(problems, lambda: to_typed(compose(good), problems))


def _load(overrides: list[str], device: hardware.DeviceInfo, problems: list) -> Config:
    """Compose, resolve ``hardware=auto``, type; invalid values and the hardware mismatch go to ``problems``."""
    from . import hardware  # lazy: torch, see load()

    # Which profile is selected? auto.yaml holds no settings, so hardware.* value overrides are left out of
    # this probe; they apply on top of the picked profile in the real composition below. A profile named on the
    # command line other than auto needs no probe: nothing is picked then, and a composition is ~66 ms.
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("hardware=")]
    if named:
        auto = named[-1] == "auto"
    else:
        probe = compose([o for o in overrides if not o.lstrip("+~").startswith("hardware.")])
        auto = probe.hardware.get("name") == "auto"
    why = ""
    if auto:
        picked, why = hardware.pick_profile(device, hardware.load_profiles())
        overrides = [o for o in overrides if not o.startswith("hardware=")] + [f"hardware={picked}"]
    raw = compose(overrides)
    if why:
        raw.hardware.description = f"{raw.hardware.get('description', '')} [auto: {why}]".strip()
    cfg = to_typed(raw, problems)
    try:
        hardware.check_profile(cfg.hardware, device)
    except HardwareError as err:
        problems.append(err)
    return cfg


def _composable(overrides: list[str], problems: list) -> list[str]:
    """The overrides that compose, each tried with the group choices (model=..., data=...) that compose."""
    groups = [o for o in overrides if "." not in o.split("=", 1)[0]]
    good: list[str] = []
    for override in groups + [o for o in overrides if o not in groups]:
        context = [g for g in good if g in groups]
        if collect(problems, compose, context + [override]) is not None:
            good.append(override)
    return good


def _environment() -> list[MaxoutError]:
    """Problems with the environment that hold whatever the config says."""
    found: list[MaxoutError] = []
    root = os.environ.get("MAXOUT_ROOT")
    if root and not Path(root).expanduser().is_dir():
        found.append(ConfigError(f"MAXOUT_ROOT={root!r} is not a directory; point it at the project root or unset it"))
    bf16 = os.environ.get(CPU_BF16_VAR, "")
    if bf16 and bf16 not in CPU_BF16_FORCED:
        found.append(ConfigError(f"{CPU_BF16_VAR}={bf16!r} is not valid (valid: 0 = no native bf16, "
                                 f"1 = bf16 as if native, or unset to detect it)"))
    return found


# ------------------------------------------------------------------------------------------ composition


# Compositions this process made, by their overrides, the config files' state and the environment (the files
# interpolate ${oc.env:...}): a CLI command composes the same overrides in its precheck and again in load(), and
# a composition is ~66 ms of Hydra's own work (each YAML file parsed again); a copy is ~2 ms.
_COMPOSED: dict[tuple, Any] = {}


def _files_stamp(dirs: Sequence[Path]) -> tuple:
    """Every config file under ``dirs`` with its modification time and size: a file written since is a new key."""
    stamp = []
    for top in dirs:
        for folder, _, names in os.walk(top):
            for name in names:
                if name.endswith((".yaml", ".yml")):
                    st = os.stat(os.path.join(folder, name))
                    stamp.append((folder, name, st.st_mtime_ns, st.st_size))
    return tuple(sorted(stamp))


def compose(overrides: Sequence[str] = ()) -> Any:
    """Compose the raw Hydra config (a DictConfig) and translate Hydra's errors into one-line ConfigErrors."""
    _register_schema()
    overrides = list(overrides)
    for override in overrides:
        check_group_choice(override)
    dirs = search_path()
    extra = [f"file://{p}" for p in dirs]
    if extra:
        overrides.append(f"hydra.searchpath=[{','.join(extra)}]")
    key = (tuple(overrides), _files_stamp([CONF_DIR, *dirs]), hash(frozenset(os.environ.items())))
    if key in _COMPOSED:
        return copy.deepcopy(_COMPOSED[key])
    raw = None
    try:
        with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR), job_name="maxout"):
            raw = hydra_compose(config_name="config", overrides=overrides)
        OmegaConf.resolve(raw)  # an interpolation that points nowhere (${nope}) fails here, by key, not later
        if len(_COMPOSED) >= 32:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        _COMPOSED[key] = copy.deepcopy(raw)
        return raw
    except MissingConfigException as err:
        found = re.search(r"Could not find '([^/']+)/([^']+)'", str(err))
        if found:
            group, name = found.groups()
            where = "" if dirs else (f"; no projects/<task>/conf under {project_root()}, where project options "
                                     f"live: run maxout from the project's root or set MAXOUT_ROOT to it")
            raise ConfigError(f"unknown {group} {name!r} (valid {group} options: "
                              f"{', '.join(group_options(group))}){where}") from None
        raise ConfigError(str(err).splitlines()[0]) from None
    except AssertionError:  # OmegaConf asserts, not raises, when an override sets a key inside a null section
        culprit = _inside_null_section(overrides)
        if culprit is None:
            raise
        key, section = culprit
        raise ConfigError(f"{key}: the {section} section is null unless one of its options is selected; add "
                          f"{section}=NAME before it (valid {section} options: "
                          f"{', '.join(group_options(section))})") from None
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).splitlines()[0]
        if isinstance(err, InterpolationResolutionError):  # OmegaConf.resolve's error names no key: find it
            key = raw is not None and _unresolvable(raw) or "an override"
            raise ConfigError(f"{key}: {first}; fix the ${{...}} interpolation or quote the value") from None
        key = re.search(r"Could not override '([^']+)'", first)
        free = key and _free_form(key.group(1))
        if free:  # a dict the schema leaves open (model.architecture, tracking.tags): Hydra adds a key only with +
            raise ConfigError(f"{key.group(1)} is not in {free} yet; {free} is a free-form dict, so add a new key "
                              f"with +{key.group(1)}=VALUE") from None
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
    except (ValueError, TypeError, KeyError, IndexError) as err:
        # OmegaConf.update's own errors, which Hydra lets through: int('lr') for hardware.match.lr=x (a list's items
        # go by index). load() and precheck() compose each override alone to find the one to name.
        keys = [o for o in overrides[:len(overrides) - bool(extra)] if "." in o.lstrip("+~").split("=", 1)[0]]
        raise ConfigError(f"bad override {' '.join(keys) or 'in the overrides'} ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}); a list's items are set by index (key.0=value), a "
                          f"dict's by name (key.name=value)") from None


@functools.lru_cache(maxsize=None)
def config_groups() -> dict[str, bool]:
    """The config groups of config.yaml's defaults list, each with whether it is optional (hpo, experiment, debug):
    read from the file, so a group added there is checked without a list kept here."""
    groups = {}
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if hasattr(entry, "keys"):
            for key in entry.keys():
                words = str(key).split()
                groups[words[-1]] = "optional" in words[:-1]
    return groups


def check_group_choice(override: str) -> None:
    """A group choice (``model=tiny``, ``~hpo``) must name one option of its group. Hydra itself ends a bool, number
    or null there in a ValueError traceback, merges every option of a list, and skips an unknown name of an
    optional group (``hpo=nope``) without a word, so the choice is checked here, with the parser Hydra uses, before
    Hydra sees it. Bad syntax is left to compose's own error."""
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException:
        return
    group = parsed.key_or_group
    optional = config_groups().get(group)
    if optional is None:  # a key (train.lr=...), not a group
        return
    value = parsed.value()
    options = group_options(group)
    valid = f"valid {group} options: {', '.join(options) or 'none exist'}"
    drop = f"; ~{group} drops the optional group" if optional else ""
    if parsed.is_delete():  # ~hpo, or ~hpo=NAME naming the option to drop
        if value is None or (isinstance(value, str) and value):
            return
        raise ConfigError(f"{override}: a deletion takes the group alone (~{group}) or its selected option's name, "
                          f"not {value!r} ({valid})")
    if parsed.is_add():  # Hydra: "Multiple values for hardware", and no word of the fix
        raise ConfigError(f"{override}: {group} is in config.yaml's defaults list already, so + would add a second "
                          f"{group} option; pick one with {override[1:]} ({valid})")
    if parsed.is_sweep_override():
        why = f"a sweep of several options; one command takes one {group} option (maxout hpo searches values)"
    elif isinstance(value, str) and value in options:
        return
    elif isinstance(value, str):
        if value.strip():
            raise ConfigError(f"unknown {group} {value!r} ({valid}{drop})")
        why = "an empty name"
    elif value is None:
        why = f"null, which is no option{drop}" if optional else "null, which is no option; pick one"
        drop = ""
    elif isinstance(value, list):
        why = f"a list; a command takes one {group} option"
    else:
        kind = {bool: "a bool", int: "an integer", float: "a number", dict: "a dict"}.get(type(value), "a value")
        why = f"{kind}, not an option's name"
    raise ConfigError(f"{override}: {why} ({valid}{drop})")


def _unresolvable(node: Any, prefix: str = "") -> Optional[str]:
    """The dotted key of the first value in ``node`` whose interpolation does not resolve."""
    listed = OmegaConf.is_list(node)
    for key in range(len(node)) if listed else node.keys():
        full = f"{prefix}[{key}]" if listed else f"{prefix}.{key}" if prefix else str(key)
        try:
            child = node[key]
        except InterpolationResolutionError:
            return full
        found = _unresolvable(child, full) if OmegaConf.is_config(child) else None
        if found:
            return found
    return None


def _inside_null_section(overrides: Sequence[str]) -> Optional[tuple[str, str]]:
    """(key, section) of the first override that sets a key inside a section the schema leaves null (``hpo``,
    unless an ``hpo=...`` choice selects it): ``hpo.study_name=x`` on ``maxout train``, or after ``~hpo`` (a
    deletion selects nothing)."""
    typed = typing.get_type_hints(Config)
    null = {f.name for f in fields(Config) if f.default is None and _dataclass_in(typed[f.name])}
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    chosen = {key for key, o in zip(keys, overrides) if "." not in key and not o.startswith("~")}
    return next(((k, k.split(".")[0]) for k in keys if "." in k and k.split(".")[0] in null - chosen), None)


def _register_schema() -> None:
    """The dataclasses are the schema (first in config.yaml's defaults list): every field can be overridden
    even where a YAML file leaves it at its default, and types are checked while composing. Stored once per
    process: building the structured node is ~10 ms, and Hydra deep-copies it for each composition anyway."""
    store = ConfigStore.instance()
    if "maxout_schema.yaml" not in store.repo:
        store.store(name="maxout_schema", node=Config)


@functools.lru_cache(maxsize=1)
def _schema() -> Any:
    """The dataclasses as one structured node, built once per process (~10 ms each time)."""
    return OmegaConf.structured(Config)


def _dataclass_in(hint: Any) -> Optional[type]:
    """The dataclass behind a field's type hint, also when Optional (the hpo section is null unless selected)."""
    return next((t for t in (hint, *typing.get_args(hint)) if is_dataclass(t)), None)


def _free_form(dotted: str) -> Optional[str]:
    """The free-form section above ``dotted`` (``model.architecture`` for ``model.architecture.x.y``): a field
    typed dict or Any, whose keys no dataclass declares; None when every part above it is a dataclass."""
    cls: Optional[type] = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = _dataclass_in(hints[part])
        if cls is None:
            return ".".join(parts[:i + 1])
    return None


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
    for f in fields(Config):  # `+section.key=...` force-adds past the schema; to_object would drop it silently
        section = raw.get(f.name)
        cls = _dataclass_in(typing.get_type_hints(Config)[f.name])
        extra = _unknown_key(f.name, section, cls) if cls and section is not None else None
        if extra:
            raise ConfigError(f"unknown config key '{extra}'; valid keys under '{extra.rsplit('.', 1)[0]}': "
                              f"{', '.join(_valid_keys(extra))}")
    try:
        merged = OmegaConf.merge(_schema(), raw)  # merge deep-copies its first argument: the cached node stays
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
