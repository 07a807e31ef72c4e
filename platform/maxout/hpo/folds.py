"""Stratified k-fold over the training table: one ``data.Dataset`` per fold, for ``train(dataset=...)``.

The configured validation table is left out of the folds (it stays unseen by the search).
"""

from __future__ import annotations

from collections import Counter

from ..data import Dataset, Origin
from ..errors import ConfigError


def kfold(dataset: Dataset, k: int, seed: int) -> list[Dataset]:
    labels = dataset.train.labels
    rarest, count = min(Counter(labels).items(), key=lambda item: item[1])
    if count < k:
        raise ConfigError(f"hpo.k_folds={k} is too many for this data: label {dataset.label_names[rarest]!r} has "
                          f"only {count} training rows (each fold needs one); use hpo.k_folds <= {count}")
    from sklearn.model_selection import StratifiedKFold  # lazy: 0.7 s to import; only k-fold studies need it

    splits = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(labels, labels)
    train = dataset.origins.get("train") or Origin("")
    return [Dataset(dataset.train.subset(list(fit)), dataset.train.subset(list(held_out)), dataset.label_names,
                    f"{dataset.fingerprint}-fold{i}of{k}",
                    origins={"train": Origin(train.path, _fold(train.rows, f"fold {i} of {k}: the rest", seed)),
                             "validation": Origin(train.path, _fold(train.rows, f"fold {i} of {k}: held out", seed))})
            for i, (fit, held_out) in enumerate(splits, 1)]


def _fold(rows: str, part: str, seed: int) -> str:
    """Which rows of the training file a fold's split holds (its lineage: data.Dataset.digest)."""
    return f"{rows}; " * bool(rows) + f"stratified {part} (seed {seed})"
