"""The Tracker interface every room logs through, the null tracker, and the run's life cycle.

``start(cfg)`` gives an MLflow run (mlflow_run.py) or, with ``tracking.backend=none``, a NullTracker that keeps
what it is given in memory. ``closing(tracker)`` ends the run FINISHED, FAILED (with the error as a tag) or KILLED
(Ctrl-C, SIGTERM), so no run is left RUNNING.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Protocol, Sequence

from ..config import TrackingConfig
from ..errors import Terminated
from .datasets import DataInput
from .redact import redact

# The Slurm job a run belongs to (train.run sets it from SLURM_JOB_ID); `maxout tracking end-slurm-job` finds a
# cancelled job's runs by it. Here, beside the interface, so that command imports neither torch nor the trainer.
SLURM_JOB_TAG = "maxout.slurm_job_id"


class Tracker(Protocol):
    """What every room that logs sees: the trainer, HPO, the benchmark. ``run_id`` is None when nothing is stored."""

    run_id: Optional[str]

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: Optional[int] = None,
                    model_id: Optional[str] = None, dataset: Optional[DataInput] = None) -> None:
        """``model_id``: the values are the scores of that logged model (``dataset``: measured on that input).
        A value the run already holds as its latest point of that key is sent again as that same point (MLflow
        keeps it once in the run's history) with the model's id, so the model gets its scores and the run's
        history is unchanged."""
    def log_inputs(self, inputs: Sequence[DataInput]) -> None:
        """The datasets the run reads, each under its role (training, validation, test)."""
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_dict(self, data: Any, artifact_file: str) -> None: ...
    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None: ...
    def log_model(self, model_dir: str, input_example: Any = None, name: Optional[str] = None) -> Optional[str]:
        """The logged model's URI (``models:/<model id>``); ``name``: its name in the experiment's Models tab (a
        run name is made valid by datasets.model_name)."""
    def flush(self) -> None: ...
    def close(self, status: str = "FINISHED", reason: str = "") -> None: ...
    def release(self) -> None:
        """Deliver what was logged and leave the run RUNNING, for another process to end (start(detached=True))."""


class NullTracker:
    """Logs nothing anywhere; keeps what it was given so tests and benchmarks can read it back."""

    run_id: Optional[str] = None

    def __init__(self) -> None:
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self.inputs: list[DataInput] = []
        self.model_metrics: dict[str, dict[str, tuple[float, Optional[str]]]] = {}  # model -> key -> value, dataset
        self.status: Optional[str] = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.params.update({k: redact(v) for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: Optional[int] = None,
                    model_id: Optional[str] = None, dataset: Optional[DataInput] = None) -> None:
        for key, value in metrics.items():
            if value is None:
                continue
            if model_id is not None:  # a score of a model: the run's history is unchanged (see Tracker)
                self.model_metrics.setdefault(model_id, {})[key] = (float(value), dataset and dataset.name)
                if self.last(key) == float(value):
                    continue
            self.metrics.setdefault(key, []).append((step or 0, float(value)))

    def log_inputs(self, inputs: Sequence[DataInput]) -> None:
        self.inputs.extend(inputs)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.tags.update({k: redact(v) for k, v in tags.items()})

    def log_dict(self, data: Any, artifact_file: str) -> None:
        pass

    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        pass

    def log_model(self, model_dir: str, input_example: Any = None, name: Optional[str] = None) -> Optional[str]:
        return None

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED", reason: str = "") -> None:
        self.status = status

    def release(self) -> None:
        pass

    def last(self, key: str) -> Optional[float]:
        return self.metrics[key][-1][1] if key in self.metrics else None


def start(cfg: TrackingConfig, run_name: Optional[str] = None, tags: Optional[Mapping[str, Any]] = None,
          nested: bool = False, system_metrics: Optional[bool] = None, run_id: Optional[str] = None,
          parent_run_id: Optional[str] = None, under: Optional[str] = None, detached: bool = False) -> Tracker:
    """A new run, or with ``run_id`` the continuation of that run (resume). The store was checked before a top-level
    run starts (train/prepare.py runs preflight.store_problems); a nested run's parent passed the same checks.
    ``nested``: a child of the active run. ``parent_run_id``: a child of that run, which need not be the active one
    (``maxout audit`` keeps several children open and files each measurement under its own). ``under``: a child of
    that run, which another process owns (an HPO worker's trial under its supervisor's parent run), made this
    process's active run, so that its own children (k-fold runs) nest under it. ``detached``: a top-level run that
    is never this process's active run, which it may leave RUNNING (release()) for another process to end."""
    if cfg.backend == "none":
        return NullTracker()
    from .mlflow_run import MLflowTracker  # lazy: mlflow takes 1.5 s to import, and tracking=none never needs it

    if parent_run_id:
        return MLflowTracker.start_child(cfg, parent_run_id, run_name=run_name, tags=tags)
    if detached:
        return MLflowTracker.start_detached(cfg, run_name=run_name, tags=tags)
    return MLflowTracker.start(cfg, run_name=run_name, tags=tags, nested=nested, system_metrics=system_metrics,
                               run_id=run_id, under=under)


def fail_if_running(cfg: TrackingConfig, run_id: str, reason: str) -> None:
    """End ``run_id`` FAILED with ``reason`` if it is still RUNNING (its process was killed) and can no longer be
    continued: nothing else would ever end it."""
    if cfg.backend == "none":
        return
    from .mlflow_run import fail_if_running as fail  # lazy: mlflow takes 1.5 s to import (see start)

    fail(cfg, run_id, reason)


@contextlib.contextmanager
def closing(tracker: Tracker) -> Iterator[Tracker]:
    """End the run as FINISHED, FAILED (exception, with its message as a tag) or KILLED (Ctrl-C, SIGTERM)."""
    try:
        yield tracker
    except (KeyboardInterrupt, Terminated) as err:
        tracker.close("KILLED", reason=f"{type(err).__name__}: interrupted")
        raise
    except BaseException as err:
        tracker.close("FAILED", reason=f"{type(err).__name__}: {err}"[:2000])
        raise
    else:
        tracker.close("FINISHED")


def model_id(model_uri: Optional[str]) -> Optional[str]:
    """The logged model's id in an MLflow 3 model URI (``models:/<model id>``); None for another kind of URI."""
    if not model_uri or not model_uri.startswith("models:/"):
        return None
    rest = model_uri[len("models:/"):]
    return rest if rest and "/" not in rest and "@" not in rest else None
