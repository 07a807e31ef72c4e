"""The MLflow model the trainer logs: a custom pyfunc that takes raw text and returns every class probability.

``mlflow.pyfunc.load_model(uri).predict(DataFrame)`` and ``mlflow models serve`` both go through
:class:`TextClassifier`; the maxout package travels inside the model (``code_paths``), so a consumer needs
torch, transformers and pandas, not maxout.

The model is logged from code (``model_code.py``, MLflow 3's "models from code"): no pickled object. Its signature
is what the saved model declares in ``maxout.json`` (text columns, label names) and its params, so logging neither
loads the weights again nor predicts. Models logged before (``python_model.pkl``, a pickle that names
``maxout.serving.pyfunc.TextClassifier``) load through the same class, which therefore stays here, under that name.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional

import mlflow
import pandas as pd
from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

from .. import cells
from .inference import InputError, MissingText, ModelMeta, Predictor, read_meta

log = logging.getLogger("maxout")

PACKAGE_DIR = Path(__file__).parents[1]  # the whole maxout package travels inside the model (code_paths)
MODEL_CODE = Path(__file__).with_name("model_code.py")  # the file MLflow logs and runs as the model
PARAMS = {"batch_size": 64, "on_missing": "error"}  # a request's params and their defaults (see predict)


class TextClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        self.predictor = Predictor.from_dir(context.artifacts["model"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: Optional[dict] = None) -> pd.DataFrame:
        """``params``: ``batch_size`` (64) and ``on_missing`` (error | skip | empty: rows without text)."""
        if not isinstance(model_input, pd.DataFrame):
            model_input = pd.DataFrame(model_input)
        params = {**PARAMS, **(params or {})}
        batch_size, on_missing = int(params["batch_size"]), str(params["on_missing"])
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


def signature(meta: ModelMeta) -> ModelSignature:
    """What the model takes and gives, from what it declares: its text columns in, ``label`` and one float32
    probability per class out (``Predictor.predict``), and the request params. The same signature MLflow inferred
    from a prediction before, without loading the model for it."""
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, column) for column in meta.input_columns()]),
        outputs=Schema([ColSpec(DataType.string, "label")]
                       + [ColSpec(DataType.float, column) for column in meta.output_columns()[1:]]),
        params=ParamSchema([ParamSpec("batch_size", DataType.long, PARAMS["batch_size"]),
                            ParamSpec("on_missing", DataType.string, PARAMS["on_missing"])]))


def _requirement(dist: str) -> Optional[str]:
    try:
        return f"{dist}=={version(dist).split('+')[0]}"  # drop local tags like +cpu: not installable elsewhere
    except PackageNotFoundError:
        return None


def requirements() -> list[str]:
    return [r for r in map(_requirement, ("mlflow", "torch", "transformers", "tokenizers", "pandas",
                                          "safetensors")) if r]


class _PyfuncFlavor:
    """``mlflow.pyfunc`` as ``Model.log`` drives it, minus one step: with an input example, ``Model.log`` loads the
    saved model and predicts on the example to check that it serves ("serving input validation"), unless told
    ``validate_serving_input=False``, which ``mlflow.pyfunc.log_model`` cannot pass on. For a large model that load
    is minutes and gigabytes at the end of every run; MLflow's own transformers flavor turns it off for that reason.
    The example is still checked against the signature (pyfunc.save_model does that without loading anything)."""

    __name__ = "mlflow.pyfunc"

    @staticmethod
    def save_model(path: str, mlflow_model: Model, validate_serving_input: bool = False, **kwargs: Any) -> Any:
        return mlflow.pyfunc.save_model(path=path, mlflow_model=mlflow_model, **kwargs)


def log_model(model_dir: str, example: Optional[pd.DataFrame] = None, name: str = "model") -> Any:
    """Log ``model_dir`` (see inference.save) as the active run's pyfunc model ``name`` (a valid MLflow model name:
    tracking.datasets.model_name); returns MLflow's ModelInfo.
    ``example``: the input example stored with it (``inference.synthetic_example``, or real rows; None: none). The
    signature comes from the model's declared columns and classes, so nothing is loaded or predicted here."""
    meta = read_meta(model_dir)
    # The base weights, in the MLmodel file too: a registry pull names the exact Hub commit it was tuned from.
    base = {f"maxout.{key}": getattr(meta, key) for key in ("base_model", "base_commit") if getattr(meta, key)}
    return Model.log(
        artifact_path=None, name=name, flavor=_PyfuncFlavor, flavor_name="pyfunc.ModelFromCode",
        validate_serving_input=False, python_model=str(MODEL_CODE), artifacts={"model": str(model_dir)},
        code_paths=[str(PACKAGE_DIR)], signature=signature(meta), input_example=example,
        pip_requirements=requirements(), metadata=base or None)
