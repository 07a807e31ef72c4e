"""Where things are: the package's config directory, the project root, the config search path, and the local
folder beside the embedded MLflow store.

Relative paths in a config (data files, checkpoint and cache folders) resolve against the project root:
``MAXOUT_ROOT``, else the working directory.

Ground floor. May import: errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .errors import ConfigError

CONF_DIR = Path(__file__).parent / "conf"


def project_root() -> Path:
    """Where relative data paths and the embedded MLflow store live: MAXOUT_ROOT, else the working directory."""
    return Path(os.environ.get("MAXOUT_ROOT") or os.getcwd()).resolve()


def resolve_path(path: str) -> Path:
    """``path`` as given when absolute (``~`` expanded), else under the project root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else project_root() / p


def local_dir() -> Path:
    """``<project root>/mlruns``: the embedded MLflow store and what lives beside it by default (the tracking
    spool, the batch finder's cache, the HPO journal and compile cache)."""
    return project_root() / "mlruns"


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
