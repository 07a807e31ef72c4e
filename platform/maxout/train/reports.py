"""What a run logs about its selected model's predictions, per split (``eval``: validation, ``test``):

- ``<split>/confusion_matrix.json``: the counts with the label names (rows: true label, columns: predicted)
- ``<split>/confusion_matrix.png``: the same as a heat map
- ``<split>/classification_report.txt``: per-class precision, recall, F1 and support, in scikit-learn's format
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MaxoutError
from ..metrics import accuracy, per_class_scores
from ..tracking.tracker import Tracker
from .evaluate import Evaluation


def classification_report(confusion: list[list[int]], label_names: list[str], digits: int = 4) -> str:
    """scikit-learn's ``classification_report`` text (every label, ``zero_division=0``), from the counts (rows: true
    label, columns: predicted). Written here, in scikit-learn's own format strings, because importing
    sklearn.metrics costs 0.7 CPU-s at the end of every run and every HPO worker; tests/test_reports.py holds the two
    texts equal (where no row is right, scikit-learn prints the supports as floats; here they stay counts)."""
    scores = per_class_scores(confusion)
    precision, recall, f1, support = (np.asarray(column) for column in zip(*scores))
    total = int(support.sum())
    width = max(*(len(str(n)) for n in label_names), len("weighted avg"), digits)
    row = "{:>{width}s} " + " {:>9.{digits}f}" * 3 + " {:>9}\n"
    text = ("{:>{width}s} " + " {:>9}" * 4).format("", "precision", "recall", "f1-score", "support", width=width)
    text += "\n\n" + "".join(row.format(str(name), *per_class, width=width, digits=digits)
                             for name, per_class in zip(label_names, scores))
    # accuracy is the micro average: every label is in the report
    text += "\n" + ("{:>{width}s} " + " {:>9.{digits}}" * 2 + " {:>9.{digits}f} {:>9}\n").format(
        "accuracy", "", "", accuracy(confusion), total, width=width, digits=digits)
    text += row.format("macro avg", *(np.average(x) for x in (precision, recall, f1)), total, width=width,
                       digits=digits)
    weighted = [np.average(x, weights=support) if total else 0.0 for x in (precision, recall, f1)]
    return text + row.format("weighted avg", *weighted, total, width=width, digits=digits)


def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend (workers have no display)."""
    import matplotlib  # lazy: 0.6 s to import, and only the end of a run (or of a study) draws

    matplotlib.use("Agg")  # chosen before pyplot is imported
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    return plt


# Classes up to which the heat map names each label and writes each cell's count. Beyond, a plain heat map of that
# size: 1,000 classes drew a million texts on a 450-inch figure (minutes, and gigabytes that ended in the OOM killer);
# the counts are in confusion_matrix.json, the per-class scores in classification_report.txt.
ANNOTATED_CLASSES = 30


def confusion_png(confusion: list[list[int]], label_names: list[str], title: str, path: Path) -> None:
    plt = pyplot()
    counts = np.asarray(confusion)
    annotated = len(label_names) <= ANNOTATED_CLASSES
    side = 2.2 + 0.45 * min(len(label_names), ANNOTATED_CLASSES)
    fig, ax = plt.subplots(figsize=(side + 1, side))
    image = ax.imshow(counts, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ticks = range(len(label_names)) if annotated else []
    ax.set_xticks(ticks, [str(n) for n in label_names] if annotated else [],
                  rotation=45 if len(label_names) > 4 else 0)
    ax.set_yticks(ticks, [str(n) for n in label_names] if annotated else [])
    ax.set_xlabel("predicted" if annotated else f"predicted ({len(label_names)} classes, in label order)")
    ax.set_ylabel("true")
    ax.set_title(title)
    middle = counts.max() / 2 if counts.size else 0
    for (r, c), n in np.ndenumerate(counts if annotated else []):
        ax.text(c, r, str(n), ha="center", va="center", color="white" if n > middle else "black")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def log(tracker: Tracker, split: str, evaluation: Evaluation, label_names: list[str], step: int) -> None:
    """The three artifacts of ``split`` under ``<split>/``. They summarise what the run's metrics already hold, so a
    server that stays away costs the report (one warning), not the run; the model's upload decides that."""
    if tracker.run_id is None:  # nothing is stored (tracking=none, ranks other than 0): drawing them is wasted time
        return
    try:
        _log(tracker, split, evaluation, label_names, step)
    except MaxoutError as err:
        logging.getLogger("maxout").warning("maxout: the %s report (confusion matrix, classification report) was not "
                                            "stored: %s; its figures are in the run's metrics", split, err)


def _log(tracker: Tracker, split: str, evaluation: Evaluation, label_names: list[str], step: int) -> None:
    names = [str(n) for n in label_names]
    total = int(sum(map(sum, evaluation.confusion)))
    tracker.log_dict({"split": split, "step": step, "labels": names, "rows": "true label",
                      "columns": "predicted label", "total": total, "matrix": evaluation.confusion},
                     f"{split}/confusion_matrix.json")
    with tempfile.TemporaryDirectory(prefix="maxout-report-") as tmp:
        png, report = Path(tmp) / "confusion_matrix.png", Path(tmp) / "classification_report.txt"
        accuracy = evaluation.metrics.get(f"{split}/accuracy", float("nan"))
        confusion_png(evaluation.confusion, names, f"{split}: {total} rows, accuracy {accuracy:.3f} (step {step})",
                      png)
        report.write_text(classification_report(evaluation.confusion, names))
        tracker.log_artifact(str(png), split)
        tracker.log_artifact(str(report), split)
