"""The run's classification report, written without importing sklearn.metrics (0.7 CPU-s at every run's end), is
scikit-learn's own text for the same counts."""

from __future__ import annotations

import re

import numpy as np
import pytest
from sklearn.metrics import classification_report as sklearn_report

from maxout.train import reports


def sklearn_text(confusion: np.ndarray, names: list[str]) -> str:
    k = len(confusion)
    cells = np.repeat(np.arange(k * k), confusion.ravel())  # one (true, predicted) pair per counted row
    return sklearn_report(cells // k, cells % k, labels=list(range(k)), target_names=names, digits=4,
                          zero_division=0)


def confusions():
    rng = np.random.default_rng(0)
    yield "binary", np.array([[40, 10], [7, 43]]), ["0", "1"]
    yield "a class never predicted", np.array([[50, 0], [30, 0]]), ["negative", "positive"]
    yield "a class absent from the truth", np.array([[0, 0, 0], [3, 9, 1], [2, 0, 12]]), ["a", "b", "c"]
    yield "every row one class, all predicted wrong", np.array([[0, 6], [0, 0]]), ["0", "1"]
    yield "a long label", np.array([[5, 1], [2, 8]]), ["no evidence of the criterion at all", "evidence"]
    for k in (3, 7, 40):
        yield f"{k} random classes", rng.integers(0, 30, size=(k, k)) * (rng.random((k, k)) < 0.6), [
            f"class {i}" for i in range(k)]


@pytest.mark.parametrize("case", list(confusions()), ids=lambda case: case[0])
def test_the_report_is_sklearns_text_for_the_same_counts(case):
    _, confusion, names = case
    expected = sklearn_text(confusion, names)
    if not np.trace(confusion):  # no row right: scikit-learn prints the supports as floats (6.0), maxout as counts
        expected = re.sub(r" +(\d+)\.0\n", lambda m: f" {m.group(1):>9}\n", expected)
    assert reports.classification_report(confusion.tolist(), names) == expected
