"""``hpo.parent=shared``: the invocations of one study that start on their own (the tasks of a Slurm job array, the
pods of a Kubernetes Job with ``parallelism: N``) nest their trials under one parent run, as the workers of
``--workers N`` do under their supervisor's.

There is no supervisor to own the parent, and the invocations may start minutes apart, in any order, on any node;
some may be requeued. So the parent belongs to the study: its id is kept in the study's storage (a system attribute),
and every decision about it is taken under a lock of the study, taken from the storage itself:

- joining (:func:`join`): the first invocation to find no parent, or one that is no longer RUNNING, creates it (a
  run of no process: ``start(detached=True)``, released RUNNING) and records it; the others find it and join.
- leaving (:func:`leave`): an invocation whose trials are done ends the parent (the study's summary, FINISHED) only
  when no trial of the study is RUNNING any more, that is when it is the last to leave. One that leaves while
  others still train leaves it to them. A killed invocation never ends it: the others, or its requeued self, do.

The lock: PostgreSQL's ``pg_advisory_lock`` on a session of its own (freed by the server if the holder dies), or an
``flock`` on a file beside a journal or SQLite file (freed by the kernel). The storages the study can be shared on
across machines are those: PostgreSQL, or a journal on a file system every node mounts.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from optuna.trial import TrialState

from ..errors import ConfigError
from ..tracking.redact import redact
from . import storage as storage_mod

PARENT_ATTR = "maxout:shared_parent_run_id"
LOCK_SUFFIX = ".maxout-parent.lock"


def check(where: str) -> None:
    """The storage can hold a shared parent (before any run starts)."""
    if storage_mod.is_url(where) and not where.startswith(("postgresql", "sqlite:///")):
        raise ConfigError(f"hpo.parent=shared needs the study on PostgreSQL, SQLite or a journal file, not "
                          f"{redact(where)} (its lock is taken from the storage)")


@contextlib.contextmanager
def study_lock(where: str, study_name: str) -> Iterator[None]:
    """Mutual exclusion between the invocations of one study, on every machine that reaches its storage."""
    if where.startswith("postgresql"):
        with storage_mod.advisory_lock(where, study_name, namespace="maxout.hpo-parent"):
            yield
        return
    path = Path(where[len("sqlite:///"):] if where.startswith("sqlite:///") else where).expanduser()
    with open(path.with_name(path.name + LOCK_SUFFIX), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or by the kernel if this process dies
        yield


def _running(client: Any, run_id: Optional[str]) -> bool:
    if not run_id:
        return False
    try:
        return client.get_run(run_id).info.status == "RUNNING"
    except Exception:  # deleted, or a store that changed since: a new parent
        return False


def join(study: Any, where: str, client: Any, create: Callable[[], str]) -> tuple[str, bool]:
    """The study's shared parent run id, and whether this invocation created it (``create``: a new parent run,
    left RUNNING, its id returned)."""
    storage, study_id = study._storage, study._study_id
    with study_lock(where, study.study_name):
        parent = storage.get_study_system_attrs(study_id).get(PARENT_ATTR)
        if _running(client, parent):
            return parent, False
        parent = create()
        storage.set_study_system_attr(study_id, PARENT_ATTR, parent)
        return parent, True


def leave(study: Any, where: str, client: Any, parent: str, finish: Callable[[str], None]) -> bool:
    """End the shared parent through ``finish`` if this invocation is the last of the study to leave: no trial
    RUNNING, the parent still RUNNING. Returns whether it did."""
    with study_lock(where, study.study_name):
        if study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) or not _running(client, parent):
            return False
        finish(parent)
        return True
