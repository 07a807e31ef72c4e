"""Downstream inference: a registered model (``models:/NAME@champion``) on a CSV / JSONL / Parquet file.

The model is loaded through its pyfunc (``mlflow.pyfunc.load_model``), exactly what ``mlflow models serve`` runs,
and predicts with the wrapped :class:`maxout.serving.inference.Predictor` (batched, sorted by length, with a progress
bar). Output: ``label`` plus one ``prob_<label>`` column per class, one row per input row, in input order.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException

from .. import cells
from ..data import READERS, read_table
from ..errors import MaxoutError
from ..serving.inference import InputError, MissingText, Predictor
from .client import LOGGED_MODEL_URI, check_ready, connect, model_version

# models:/NAME@alias or models:/NAME/VERSION (models:/m-<id> names a logged model, not a registered one)
_REGISTERED = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")
WRITERS = {".csv": "csv", ".tsv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def registered_ref(model_uri: str) -> Optional[tuple[str, str]]:
    """(name, alias or version) of a registry URI; None for other URIs."""
    match = _REGISTERED.match(model_uri)
    return (match["name"], match["alias"] or match["version"]) if match else None


def load(model_uri: str, tracking_uri: str, dst_path: str) -> Predictor:
    """The Predictor inside a logged or registered maxout model; one-line errors for unknown names/aliases.
    ``dst_path``: an existing folder for the model's files, which the caller removes (without one, MLflow makes a
    new temporary folder that nothing removes)."""
    client = connect(tracking_uri)
    ref, logged = registered_ref(model_uri), LOGGED_MODEL_URI.match(model_uri)
    if ref:
        version = model_version(client, *ref)  # "no registered model 'X' (registered: ...)" and the like
        check_ready(client, getattr(version, "model_id", None), f"{model_uri} ({ref[0]} v{version.version})")
    elif logged:
        check_ready(client, logged[1], model_uri)  # never a model whose logging was cut off or failed
    try:
        model = mlflow.pyfunc.load_model(model_uri, dst_path=dst_path)
    except (MlflowException, OSError) as err:
        raise MaxoutError(f"cannot load model {model_uri!r}: {str(err).splitlines()[0][:300]}") from None
    predictor = getattr(model.unwrap_python_model(), "predictor", None)
    if not isinstance(predictor, Predictor):
        raise MaxoutError(f"model {model_uri!r} is not a maxout text classifier (no maxout pyfunc inside)")
    return predictor


def read_input(path: str) -> pd.DataFrame:
    if Path(path).is_dir():
        raise MaxoutError(f"--input {path} is a directory; give a file (.csv, .tsv, .jsonl or .parquet)")
    kind = READERS.get(Path(path).suffix.lower())
    if kind is None:
        raise MaxoutError(f"cannot tell the format of --input {path!r} from its extension (valid: "
                          f"{', '.join(sorted(READERS))})")
    if not Path(path).is_file():
        raise MaxoutError(f"input file not found: {path}")
    try:
        return read_table(str(Path(path).resolve()), kind, text=True)  # a CSV cell "42" is text, not a number
    except MaxoutError as err:
        raise MaxoutError(f"--input {path}: {err}") from None


def write_output(frame: pd.DataFrame, path: Optional[str]) -> None:
    """CSV on stdout without ``path``; else by the extension of ``path``."""
    if path is None:
        frame.to_csv(sys.stdout, index=False)
        return
    kind = WRITERS.get(Path(path).suffix.lower())
    if kind is None:
        raise MaxoutError(f"cannot tell the format of --output {path!r} from its extension (valid: "
                          f"{', '.join(sorted(WRITERS))})")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        frame.to_csv(path, index=False, sep="\t" if path.lower().endswith(".tsv") else ",")
    elif kind == "jsonl":
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    else:
        frame.to_parquet(path, index=False)


def predict_file(model_uri: str, input_path: str, tracking_uri: str, output_path: Optional[str] = None,
                 batch_size: int = 64, progress: bool = True, on_missing: str = "error") -> pd.DataFrame:
    """Predict every row of ``input_path`` with ``model_uri``; writes to ``output_path`` (stdout: None). Rows
    without text: ``on_missing`` (see serving/inference.py), counted on stderr."""
    frame = read_input(input_path)  # a missing or unreadable file fails before the model loads
    if frame.empty:
        raise MaxoutError(f"--input {input_path} has no rows to predict")
    # The model's files (weights, tokenizer, the pyfunc's code) are downloaded for this prediction only: MLflow's
    # own temporary folder stays behind, a copy of the model in /tmp per command. Removed once the rows are
    # predicted, not after loading: the pyfunc's code folder is on sys.path while it predicts.
    with tempfile.TemporaryDirectory(prefix="maxout-predict-") as model_files:
        predictor = load(model_uri, tracking_uri, dst_path=model_files)
        try:
            out = predictor.predict(frame, batch_size=batch_size, progress=progress, on_missing=on_missing)
        except MissingText as err:
            raise MaxoutError(f"--input {input_path}: {err.advice('--on-missing={}')}") from None
        except InputError as err:
            raise MaxoutError(f"--input {input_path}: {err}") from None
    without_text = out.attrs["rows_without_text"]
    if without_text:
        done = "not predicted (empty label)" if on_missing == "skip" else "predicted as empty text"
        print(f"maxout: --on-missing={on_missing}: {len(without_text)} of {len(out)} rows had no text and were "
              f"{done}: {cells.rows(without_text)}", file=sys.stderr)
    write_output(out, output_path)
    return out
