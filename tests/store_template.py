"""A new MLflow SQLite store in milliseconds instead of seconds: a copy of one migrated once per process.

MLflow creates a store by running every Alembic migration of its schema (about 60 of them: 2-3 s on these cores),
and the suite creates a store in most of its tests. The copy is what that creation leaves, less the Default
experiment: MLflow creates that one itself when a store without it is opened, with the artifact root of whoever
opens it (a client's ./mlruns, a server's --default-artifact-root), exactly as on a new file. Tests whose point is
a store that does not exist yet (a refused command creates nothing; commands that race to create one) do not use it.
"""

from __future__ import annotations

import atexit
import shutil
import sqlite3
import tempfile
from pathlib import Path

_template: Path | None = None


def template() -> Path:
    """The migrated, experiment-less SQLite file (built on first use in this process)."""
    global _template
    if _template is None:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        folder = Path(tempfile.mkdtemp(prefix="maxout-store-template-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # one per process: not left in /tmp
        path = folder / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{path}", str(folder / "mlruns"))  # migrates, adds Default
        store.engine.dispose()
        with sqlite3.connect(path) as db:
            db.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            db.execute("DELETE FROM experiments WHERE experiment_id = 0")
        _template = path
    return _template


def new_store(path: Path) -> str:
    """A new, empty store at ``path`` (its folder created); returns its URI."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template(), path)
    return f"sqlite:///{path}"
