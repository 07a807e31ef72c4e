"""What a run trained and was scored on, as MLflow dataset inputs (tracking/datasets.py): one per split, logged at
the start of every run that trains (``maxout train``, each HPO trial and fold, the audit's runs), and the logged
model's scores, each tied to the split it was measured on.

A split's digest is the data's fingerprint (data.Dataset.digest), so the same table gives the same MLflow dataset
in every run, and a registered version's ``maxout.data_fingerprint`` tag matches the digest of its run's inputs.
"""

from __future__ import annotations

from typing import Mapping, Optional

from ..config import Config
from ..data import SPLITS, Dataset, text_columns
from ..tracking.datasets import CONTEXTS, DataInput, scored_on
from ..tracking.tracker import Tracker, model_id


def data_inputs(cfg: Config, dataset: Dataset) -> list[DataInput]:
    """The splits ``dataset`` holds, each named ``<data.name>-<split>`` and sourced from its file."""
    configured = {"train": cfg.data.train_path, "validation": cfg.data.validation_path or cfg.data.train_path,
                  "test": cfg.data.test_path or ""}
    columns = tuple(text_columns(cfg.data) + [cfg.data.label_column])
    inputs = []
    for split in SPLITS:
        table = dataset.split(split)
        if table is None:
            continue
        origin = dataset.origins.get(split)
        profile = {"rows_of_file": origin.rows} if origin is not None and origin.rows else {}
        inputs.append(DataInput(f"{cfg.data.name}-{split}", dataset.digest(split), CONTEXTS[split],
                                origin.path if origin is not None else configured[split], len(table), columns,
                                {**profile, "labels": ", ".join(dataset.label_names)[:500]}))
    return inputs


def log_scores(tracker: Tracker, model_uri: Optional[str], results: Mapping[str, float], inputs: list[DataInput],
               step: Optional[int] = None) -> None:
    """The final ``eval/*`` (validation) and ``test/*`` metrics in ``results`` as the scores of the logged model at
    ``model_uri``: MLflow's Models tab and search_logged_models show them, with the dataset of each."""
    model = model_id(model_uri)
    if model is None:
        return
    by_split = {i.context: i for i in inputs}
    for split in ("validation", "test"):
        scores = {k: v for k, v in results.items() if scored_on(k) == split and v is not None}
        if scores:
            tracker.log_metrics(scores, step=step, model_id=model, dataset=by_split.get(CONTEXTS[split]))
