"""The datasets a run logs as its inputs (MLflow's dataset inputs), as plain values: what the tracker needs to log
them, with no mlflow import (the MLflow tracker turns them into ``mlflow.data`` datasets).

A run logs each of its splits once, under its role (MLflow's input tag ``mlflow.data.context``): ``training``,
``validation``, ``test``. MLflow keeps one dataset per (name, digest) in an experiment, so every run that trained
on the same table (a train run, each HPO trial, the audit's runs) points at the same dataset, and a model's scores
name the dataset they were measured on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# data.Dataset's split names -> MLflow's input context for each
CONTEXTS = {"train": "training", "validation": "validation", "test": "test"}
# What a metric key's prefix says it was measured on: the final eval/* are the validation split's, test/* the test's.
SCORED_ON = {"eval/": "validation", "test/": "test"}
# Not a score of the model: what predicting the majority class would get.
NOT_SCORES = {"eval/majority_baseline"}


@dataclass(frozen=True)
class DataInput:
    """One split as an MLflow dataset input."""

    name: str  # "<data.name>-<split>", e.g. "sst2-train"
    digest: str  # data.Dataset.digest(split): the data's fingerprint (plus which rows, for part of a file)
    context: str  # training | validation | test
    source: str  # the file the rows come from, as configured ("" when unknown: a table passed in by code)
    rows: int
    columns: tuple[str, ...] = ()  # text column(s), then the label column
    profile: dict = field(default_factory=dict)  # what else the UI shows: which rows of the file, the label set


def scored_on(key: str) -> Optional[str]:
    """The split a final metric was measured on (None: not a model score, e.g. throughput)."""
    if key in NOT_SCORES:
        return None
    return next((split for prefix, split in SCORED_ON.items() if key.startswith(prefix)), None)


# MLflow refuses these in a logged model's name (mlflow.utils.validation._validate_logged_model_name).
_NOT_IN_MODEL_NAMES = re.compile(r"[^A-Za-z0-9_\-]+")


def model_name(run_name: Optional[str], limit: int = 200) -> str:
    """A logged model's name from its run's name, e.g. ``tiny-cpu precision=fp32`` -> ``tiny-cpu-precision-fp32``.
    MLflow refuses ``/ : . % " '`` in model names; every run of characters other than letters, digits, ``_`` and
    ``-`` becomes one ``-`` (spaces too: the name is also the model's folder), and a name left empty is ``model``."""
    name = _NOT_IN_MODEL_NAMES.sub("-", run_name or "").strip("-")[:limit].strip("-")
    return name or "model"
