"""The input-file fuzzer: training, validation, test and prediction files in the shapes users' files come in.

A table is drawn (texts with unicode, digits, booleans, quotes, delimiters and very long cells; label sets of 1, 2,
3 or 1,000 classes; labels as integers, strings or booleans), then written as CSV or TSV (delimiter, quoting,
CRLF, header or not, ragged rows), JSONL (nested objects where text is expected) or Parquet (columns of the wrong
type), in UTF-8, UTF-8 with a BOM, UTF-16 or latin-1. The property: the file loads and every row is accounted for
(the texts and labels read are the ones written, and a row left out is counted), or it is refused with one line
that names the file (and the row, where one row is to blame). Never a traceback. A sampled share of the training
files that load trains the tiny model for two steps.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, strategies as st

from maxout import data, loading
from maxout.config import DataConfig
from maxout.errors import MaxoutError

from .fuzzing import fuzz_settings, out_of_time

TRAIN_EVERY = 8  # loaded training files that also train two steps, by a hash of the drawn table

# Cells where text is expected: unicode, digits that a CSV reader could take for numbers, booleans, quotes and
# delimiters, and very long cells.
TEXT = st.one_of(
    st.text(min_size=1, max_size=20),
    st.sampled_from(["007", "1.50", "1e5", "-0", "True", "false", "NaN", "null", "None", "N/A", "#N/A", "\"quoted\"",
                     "a,b", "a\tb", "a;b", "line\nbreak", "' '", "ünïcödé 😀", "٣", "\u200b"]),
    st.integers(1, 200_000).map(lambda n: "x" * n),
)


@dataclass
class Table:
    texts: list  # Python values as written (str, or a number / bool / dict for the "wrong type" shapes)
    labels: list  # Python values: int, str or bool
    label_column: str = "label"


@st.composite
def tables(draw) -> Table:
    classes = draw(st.sampled_from([1, 2, 2, 3, 1000]))
    style = draw(st.sampled_from(["int", "str", "bool"] if classes <= 2 else ["int", "str"]))
    names = [i for i in range(classes)] if style == "int" else [f"c{i}" for i in range(classes)] \
        if style == "str" else [False, True]
    rows = classes + draw(st.integers(0, 4)) if classes == 1000 else draw(st.integers(0, 12))
    pool = draw(st.lists(TEXT, min_size=1, max_size=6))
    # the pool's cells once each (a very long cell among them), then short distinct texts: 1,000 very long rows
    # would cost gigabytes in Hypothesis' own bookkeeping and prove nothing more
    texts = [pool[i] if i < len(pool) else f"{pool[i % len(pool)][:40]} {i}" for i in range(rows)]
    if draw(st.booleans()) and rows:  # a cell of another type where text is expected
        texts[draw(st.integers(0, rows - 1))] = draw(st.sampled_from([42, 1.5, True, None, {"nested": {"a": 1}},
                                                                     ["a", "b"], ""]))
    return Table(texts, [names[i % classes] for i in range(rows)])


@dataclass
class Written:
    path: Path
    kind: str  # csv | tsv | jsonl | parquet
    encoding: str
    header: bool = True
    ragged: Optional[int] = None  # 0-based data row that got one cell too many
    shape: str = "typed"  # parquet: typed | text_as_int | label_as_float | text_as_list

    def expected(self, table: Table) -> Counter:
        """(text, label key) of each row as the file holds it: a CSV holds text only; JSONL and Parquet keep types."""
        as_text = self.kind in ("csv", "tsv") or self.shape in ("typed", "label_as_float") and self.kind == "parquet"
        texts = [_csv_value(t) for t in table.texts] if as_text else table.texts  # JSONL keeps each value's type
        labels = [float(x) if not isinstance(x, str) else math.nan for x in table.labels] \
            if self.shape == "label_as_float" else table.labels
        # a cell that is not text (JSONL: a number or mapping) is refused or dropped, never read: a key of its own
        keys = [t if isinstance(t, str) else ("not text", repr(t)) for t in texts]
        return Counter((t, _label_key(lab)) for t, lab in zip(keys, labels))


def _csv_value(value: Any) -> str:
    return "" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)


@st.composite
def written(draw, table: Table, folder: Path, stem: str) -> Written:
    kind = draw(st.sampled_from(["csv", "tsv", "jsonl", "parquet"]))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "latin-1"]))
    path = folder / f"{stem}.{kind}"
    if kind == "parquet":
        shape = draw(st.sampled_from(["typed", "text_as_int", "label_as_float", "text_as_list"]))
        path.write_bytes(_parquet(table, shape))
        return Written(path, kind, "binary", shape=shape)
    if kind == "jsonl":
        lines = [json.dumps({"text": t, "label": lab}, ensure_ascii=draw(st.booleans()))
                 for t, lab in zip(table.texts, table.labels)]
        content, out = "\n".join(lines) + ("\n" if lines else ""), Written(path, kind, encoding)
    else:
        delimiter = "\t" if kind == "tsv" else draw(st.sampled_from([",", ",", ";"]))
        quoting = draw(st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL, csv.QUOTE_NONNUMERIC]))
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter=delimiter, quoting=quoting,
                            lineterminator=draw(st.sampled_from(["\n", "\r\n"])))
        header = draw(st.booleans()) or not table.texts  # a header-only file always has its header
        if header:
            writer.writerow(["text", "label"])
        ragged = draw(st.integers(0, len(table.texts) - 1)) if table.texts and draw(st.booleans()) else None
        for i, (t, lab) in enumerate(zip(table.texts, table.labels)):
            writer.writerow([_csv_value(t), _csv_value(lab)] + (["extra"] if i == ragged else []))
        content, out = buffer.getvalue(), Written(path, kind, encoding, header, ragged)
    try:
        path.write_bytes(content.encode(encoding))
    except UnicodeEncodeError:  # latin-1 cannot hold this text: the file is UTF-8 after all
        path.write_bytes(content.encode("utf-8"))
        out.encoding = "utf-8"
    return out


def _parquet(table: Table, shape: str) -> bytes:
    texts: Any = [_csv_value(t) for t in table.texts]
    labels: Any = table.labels
    if shape == "text_as_int":
        texts = pa.array([len(t) for t in texts], pa.int64())
    elif shape == "text_as_list":
        texts = pa.array([[t] for t in texts], pa.list_(pa.string()))
    if shape == "label_as_float":
        labels = pa.array([float(x) if not isinstance(x, str) else math.nan for x in labels], pa.float64())
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": texts, "label": labels}), buffer)
    return buffer.getvalue()


def _label_key(value: Any) -> str:
    return data._label_key(value)


# Refusals about the whole file, not a row of it: its format, columns, rows or label set.
WHOLE_FILE = ("cannot tell the format", "is empty", "has no rows", "is not a column", "has the column",
              "single label", "no row left")


def check_refusal(err: MaxoutError, *files: Written) -> None:
    """One line naming the file, and the row (or line) where one is to blame."""
    line = str(err)
    assert "\n" not in line
    assert any(f.path.name in line for f in files), (line, [f.path.name for f in files])
    assert re.search(r"\b(rows?|line)\b", line) or any(w in line for w in WHOLE_FILE), line


def check_loaded(dataset: data.Dataset, table: Table, file: Written, role: str) -> None:
    """Every row written is in the dataset or counted as dropped, with the text and label as written."""
    split = {"train": [dataset.train, dataset.validation], "validation": [dataset.validation],
             "test": [dataset.test]}[role]
    read = [(t, dataset.label_names[lab]) for part in split for t, lab in zip(part.texts, part.labels)]
    dropped = dataset.dropped.get(role, 0)
    assert len(read) + dropped == len(table.texts), (len(read), dropped, len(table.texts))
    unexpected = Counter(read) - file.expected(table)
    assert not unexpected, unexpected.most_common(3)


def clean_train(table: Table, folder: Path) -> Path:
    """A training file that loads, with the drawn table's labels (and a second one if it has a single label)."""
    labels = list(dict.fromkeys(table.labels)) or [0]
    extra = 1 if isinstance(labels[0], (int, bool)) and not isinstance(labels[0], str) else "other"
    labels = labels if len(labels) > 1 else labels + [extra]
    path = folder / "clean_train.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}", "label": lab}) + "\n"
                            for i, lab in enumerate(labels * 2)))
    return path


@given(draw=st.data(), table=tables(), role=st.sampled_from(["train", "validation", "test"]),
       on_missing=st.sampled_from(["error", "drop"]))
@fuzz_settings(ci=80)
def test_any_input_file_loads_every_row_or_is_refused_naming_it(draw, table, role, on_missing, tmp_path_factory):
    if out_of_time():
        return
    folder = tmp_path_factory.mktemp("files")
    file = draw.draw(written(table, folder, role))
    paths = {"train_path": str(file.path)} if role == "train" else \
        {"train_path": str(clean_train(table, folder)), f"{role}_path": str(file.path)}
    cfg = DataConfig(**paths, on_missing=on_missing, labels=None)
    try:
        dataset = data.load(cfg)
    except MaxoutError as err:
        check_refusal(err, file)
        return
    check_loaded(dataset, table, file, role)
    if role == "train" and zlib.crc32(repr(table).encode()) % TRAIN_EVERY == 0:
        train_two_steps(cfg, tmp_path_factory.mktemp("run"))


def train_two_steps(cfg: DataConfig, tmp: Path) -> None:
    from maxout.train import train  # lazy: the training stack, only for the sampled share

    overrides = ["hardware=cpu", "model=tiny", "tracking=none", "train.max_steps=2", "train.epochs=1",
                 "data=files", f"data.train_path={cfg.train_path}", "data.text_column=text",
                 "data.text_pair_column=null", f"data.on_missing={cfg.on_missing}", f"checkpoint.dir={tmp}/ckpt",
                 "data.max_length=64"]
    result = train(loading.load(overrides), progress=False, verbose=False)
    assert math.isfinite(result.metrics["eval/loss"])


@given(table=tables(), draw=st.data())
@fuzz_settings(ci=40)
def test_any_prediction_file_is_predicted_or_refused_naming_the_rows(predictor, table, draw, tmp_path_factory):
    from maxout.registry.predict import read_input
    from maxout.serving.inference import InputError, MissingText

    if out_of_time():
        return
    file = draw.draw(written(table, tmp_path_factory.mktemp("predict"), "input"))
    try:
        frame = read_input(str(file.path))
        if frame.empty:
            return  # predict_file refuses it by name before any model loads
        out = predictor.predict(frame)
    except MaxoutError as err:
        check_refusal(err, file)
        return
    except MissingText as err:  # predict_file prefixes the file's name; the rows are named here
        assert "row" in str(err) and "\n" not in str(err)
        return
    except InputError as err:
        assert "\n" not in str(err)
        return
    assert len(out) == len(frame) == len(table.texts)
    assert Counter(frame["text"]) == Counter(t for t, _ in file.expected(table).elements())


@pytest.fixture(scope="module")
def predictor():
    """A tiny random model as maxout serves it (serving/inference.py), without MLflow: prediction's input rules."""
    from transformers import AutoModelForSequenceClassification

    from maxout import modeling
    from maxout.serving.inference import ModelMeta, Predictor

    cfg = loading.load(["hardware=cpu", "model=tiny", "tracking=none"]).model
    tokenizer = modeling.load_tokenizer(cfg)
    config = modeling.build_config(cfg, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)
    model = AutoModelForSequenceClassification.from_config(config)
    return Predictor(model, tokenizer, ModelMeta("text", None, ["0", "1"], 64), device="cpu")


def test_a_thousand_classes_draw_a_confusion_matrix_of_bounded_size(tmp_path):
    """Found by the fuzzer: a 1,000-class training file hung at the run's end (a million count labels on a 450-inch
    heat map, gigabytes until the OOM killer)."""
    from PIL import Image

    from maxout.train import reports

    k = 1000
    reports.confusion_png(np.eye(k, dtype=int).tolist(), [f"c{i}" for i in range(k)], "eval", tmp_path / "cm.png")
    assert max(Image.open(tmp_path / "cm.png").size) < 2500
