"""The MLflow model the trainer logs: a custom pyfunc that takes raw text and returns every class probability.

``mlflow.pyfunc.load_model(uri).predict(DataFrame)`` and ``mlflow models serve`` both go through
:class:`TextClassifier`; the maxout package travels inside the model (``code_paths``), so a consumer needs
torch, transformers and pandas, not maxout.
"""

from __future__ import annotations

import json
import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional

import mlflow
import pandas as pd
from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException
from mlflow.models import infer_signature

from .. import cells
from .inference import META_FILE, InputError, MissingText, Predictor

log = logging.getLogger("maxout")

PACKAGE_DIR = Path(__file__).parents[1]  # the whole maxout package travels inside the model (code_paths)


class TextClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        self.predictor = Predictor.from_dir(context.artifacts["model"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: Optional[dict] = None) -> pd.DataFrame:
        """``params``: ``batch_size`` (64) and ``on_missing`` (error | skip | empty: rows without text)."""
        if not isinstance(model_input, pd.DataFrame):
            model_input = pd.DataFrame(model_input)
        params = params or {}
        batch_size, on_missing = int(params.get("batch_size", 64)), str(params.get("on_missing", "error"))
        try:
            out = self.predictor.predict(model_input, batch_size=batch_size, on_missing=on_missing)
        except MissingText as err:  # a 400 from `mlflow models serve` that names the rows and the way out
            raise MlflowException(err.advice('params {{"on_missing": "{}"}}'),
                                  error_code=INVALID_PARAMETER_VALUE) from None
        except InputError as err:  # a 400 from `mlflow models serve`, not a 500
            raise MlflowException(str(err), error_code=INVALID_PARAMETER_VALUE) from None
        if out.attrs["rows_without_text"]:
            log.warning("maxout: on_missing=%s: %d rows without text (%s)", on_missing,
                        len(out.attrs["rows_without_text"]), cells.rows(out.attrs["rows_without_text"]))
        return out


def _requirement(dist: str) -> Optional[str]:
    try:
        return f"{dist}=={version(dist).split('+')[0]}"  # drop local tags like +cpu: not installable elsewhere
    except PackageNotFoundError:
        return None


def requirements() -> list[str]:
    return [r for r in map(_requirement, ("mlflow", "torch", "transformers", "tokenizers", "pandas",
                                          "safetensors")) if r]


def log_model(model_dir: str, example: Optional[pd.DataFrame] = None, name: str = "model") -> Any:
    """Log ``model_dir`` (see inference.save) as the run's pyfunc model named ``name`` (a valid MLflow model name:
    tracking.datasets.model_name); returns MLflow's ModelInfo."""
    signature = None
    if example is not None:
        predictor = Predictor.from_dir(model_dir, device="cpu")
        signature = infer_signature(example, predictor.predict(example),
                                    params={"batch_size": 64, "on_missing": "error"})
    meta = json.loads((Path(model_dir) / META_FILE).read_text())
    # The base weights, in the MLmodel file too: a registry pull names the exact Hub commit it was tuned from.
    base = {f"maxout.{key}": meta[key] for key in ("base_model", "base_commit") if meta.get(key)}
    return mlflow.pyfunc.log_model(
        name=name, python_model=TextClassifier(), artifacts={"model": str(model_dir)},
        code_paths=[str(PACKAGE_DIR)], signature=signature, input_example=example, pip_requirements=requirements(),
        metadata=base or None)
