"""Batched inference on raw text with a saved model folder: label plus every class probability.

The folder is what the trainer logs inside the MLflow model: a transformers ``save_pretrained`` model, its
tokenizer, and ``maxout.json`` naming the text columns the model was trained on and, when it was trained with
per-sample pooling (pooling.py), the pooling, so it predicts exactly as it was trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from .pooling import PooledClassifier

META_FILE = "maxout.json"


class InputError(ValueError):
    """The input table does not fit the model (missing text columns, empty)."""


@dataclass
class ModelMeta:
    text_column: str
    text_pair_column: Optional[str]
    label_names: list
    max_length: int
    pooling: Optional[str] = None  # last / mean / first: pooling.PooledClassifier; None: the model's own head

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

    @torch.no_grad()
    def predict(self, frame: pd.DataFrame, batch_size: int = 64, progress: bool = False) -> pd.DataFrame:
        self.check(frame)
        texts = frame[self.meta.text_column].astype(str).tolist()
        pairs = frame[self.meta.text_pair_column].astype(str).tolist() if self.meta.text_pair_column else None
        # Sort by length so each batch pads little; results are put back in input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]) + (len(pairs[i]) if pairs else 0))
        probs = torch.empty((len(texts), len(self.meta.label_names)))
        for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="predict", unit="batch"):
            idx = order[start:start + batch_size]
            enc = self.tokenizer([texts[i] for i in idx], [pairs[i] for i in idx] if pairs else None,
                                 truncation=True, max_length=self.meta.max_length, padding=True,
                                 return_tensors="pt").to(self.device)
            probs[idx] = torch.softmax(self.model(**enc).logits.float(), dim=-1).cpu()
        out = pd.DataFrame(probs.numpy(), columns=[f"prob_{n}" for n in self.meta.label_names])
        out.insert(0, "label", [self.meta.label_names[i] for i in probs.argmax(-1).tolist()])
        return out
