"""Where things are: the package's config directory, the project root, the config search path, the embedded
MLflow store, and the folder where maxout keeps its own local files.

Relative paths in a config (data files, checkpoint and cache folders) resolve against the project root:
``MAXOUT_ROOT``, else the working directory. The embedded store is MLflow's own default in that folder
(``mlflow.db`` and ``mlruns/``), so ``maxout train``, ``mlflow run .``, ``mlflow ui`` and ``make ui`` all use the same
store without being told where it is.

Ground floor. May import: errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .errors import ConfigError

CONF_DIR = Path(__file__).parent / "conf"
# MAXOUT_CPU_BF16=0|1 overrides the CPU's native-bf16 detection (hardware.cpu_bf16); loading checks its value.
CPU_BF16_VAR = "MAXOUT_CPU_BF16"
CPU_BF16_FORCED = {"0": False, "1": True}


def in_container() -> bool:
    """This process runs in a container (Docker, containerd, a Kubernetes pod). Here, not in hardware.py, so the
    tracking code that asks (tracking/container.py) does not import torch with it."""
    if Path("/.dockerenv").exists() or os.environ.get("container"):
        return True
    try:
        return any(k in Path("/proc/1/cgroup").read_text() for k in ("docker", "kubepods", "containerd"))
    except OSError:
        return False


def project_root() -> Path:
    """Where relative data paths and the embedded MLflow store live: MAXOUT_ROOT, else the working directory."""
    return Path(os.environ.get("MAXOUT_ROOT") or os.getcwd()).resolve()


def resolve_path(path: str) -> Path:
    """``path`` as given when absolute (``~`` expanded), else under the project root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else project_root() / p


def embedded_store() -> tuple[Path, Path]:
    """The embedded MLflow store: (its SQLite file, its artifact folder), MLflow's defaults in the project root."""
    root = project_root()
    return root / "mlflow.db", root / "mlruns"


def state_dir() -> Path:
    """Where maxout keeps its own local files: the tracking spool, the batch finder's cache, the HPO journal and
    compile cache. ``MAXOUT_STATE_DIR`` when set (the container image sets it to a volume that outlives the
    container), else ``<project root>/mlruns``, beside the embedded store's artifacts."""
    configured = os.environ.get("MAXOUT_STATE_DIR")
    return Path(configured).expanduser() if configured else project_root() / "mlruns"


def checkpoint_dir() -> Path:
    """Where checkpoints go unless ``checkpoint.dir`` says: ``<MAXOUT_STATE_DIR>/checkpoints`` when that is set,
    else ``<project root>/checkpoints``."""
    configured = os.environ.get("MAXOUT_STATE_DIR")
    return (Path(configured).expanduser() if configured else project_root()) / "checkpoints"


def search_path(root: Optional[Path] = None) -> list[Path]:
    """Config directories besides the package's: every ``projects/<task>/conf`` under the project root."""
    root = root or project_root()
    return sorted(p for p in (root / "projects").glob("*/conf") if p.is_dir())


def group_options(group: str, root: Optional[Path] = None) -> list[str]:
    """Names that ``group=NAME`` accepts, from the package and every project."""
    dirs = [CONF_DIR / group] + [d / group for d in search_path(root)]
    return sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})


def check_writable(path: Path, key: str) -> None:
    """A ConfigError naming the setting ``key`` unless ``path`` (a directory that may not exist yet) can hold files:
    its nearest existing ancestor must be a writable directory (the folders below it are created on first use)."""
    existing = path.expanduser()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    why = "is not a directory" if not existing.is_dir() else "is not writable"
    raise ConfigError(f"{key}={str(path)!r} cannot hold files ({existing} {why}); point {key} at a writable "
                      f"directory")
