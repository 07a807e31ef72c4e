"""Load text-classification / NLI tables, validate them against the data config, tokenize once, and batch.

Tokenization happens once, up front, with the fast tokenizer; batches are padded per batch (dynamic padding),
and the collate function counts real and padded tokens on the host, so throughput and padding efficiency need no
device sync.

Inputs. May import: errors, paths, config, cells.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from . import cells
from .config import DataConfig
from .errors import DataError
from .paths import resolve_path

# Very long cells are text too: the csv module's default field limit (128 KiB) would refuse them.
csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
READERS = {".csv": "csv", ".tsv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet",
           ".pq": "parquet"}


def existing_file(path: str) -> Path:
    file = resolve_path(path)
    if file.is_dir():
        raise DataError(f"data path {path} is a directory (resolved to {file}), not a file; point data.train_path / "
                        f"data.validation_path at a .csv, .tsv, .jsonl or .parquet file")
    if not file.is_file():
        raise DataError(f"data file not found: {path} (resolved to {file}); check data.train_path / "
                        f"data.validation_path / data.test_path")
    return file


def read_table(path: str, fmt: str = "auto", text: bool = False, text_columns: Sequence[str] = ()) -> pd.DataFrame:
    """Read one CSV / JSONL / Parquet file as strings-or-numbers; UTF-8 strictly (a leading BOM is skipped). ``text``: every CSV cell stays a
    string (prediction input: a CSV has no types, so "42" is text, not a number); ``text_columns``: these CSV columns
    stay strings (training texts: "007" is not the number 7). A column name that appears twice is an error, never a
    silent rename."""
    file = existing_file(path)
    kind = READERS.get(file.suffix.lower()) if fmt == "auto" else fmt
    if kind is None:
        raise DataError(f"cannot tell the format of {path!r} from its extension; set data.format to one of "
                        f"csv, jsonl, parquet")
    try:
        _no_duplicate_columns(file, kind, path)
        if kind == "csv":
            return pd.read_csv(file, encoding="utf-8-sig", encoding_errors="strict", sep=_separator(file),
                               keep_default_na=False, dtype=str if text else dict.fromkeys(text_columns, str))
        if kind == "jsonl":
            return pd.read_json(file, lines=True, encoding="utf-8-sig", encoding_errors="strict", dtype=False)
        return pd.read_parquet(file)
    except UnicodeDecodeError as err:
        raise DataError(f"data file {path} is not valid UTF-8 ({_first_bad_byte(file, err)}); re-save it as "
                        f"UTF-8") from None
    except pd.errors.EmptyDataError:
        raise DataError(f"data file {path} is empty: it needs a header row and at least one example") from None
    except (ValueError, pd.errors.ParserError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"cannot read {path} as {kind}: {first}") from None


def _first_bad_byte(file: Path, err: UnicodeDecodeError) -> str:
    """Where the file stops being UTF-8, from the whole file (pandas decodes in chunks: its offset is the chunk's)."""
    raw = file.read_bytes()
    try:
        raw.decode("utf-8-sig")
        start, byte = err.start, err.object[err.start]
    except UnicodeDecodeError as whole:
        start, byte = whole.start, raw[whole.start]
    utf16 = "; it looks like UTF-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
    line = raw[:start].count(b"\n") + 1
    return f"byte {byte:#04x} at offset {start}, line {line}{utf16}"


def _separator(file: Path) -> str:
    return "\t" if file.suffix.lower() == ".tsv" else ","


def _no_duplicate_columns(file: Path, kind: str, path: str) -> None:
    """pandas renames a repeated CSV header (label, label.1) and keeps the last of repeated JSON keys: either way
    one of the two columns would be used without a word. Read the names as written and refuse repeats."""
    if kind == "csv":
        with open(file, newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f, delimiter=_separator(file))
            header = next(rows, [])
            _unique(header, path)
            _not_ragged(rows, header, path)
    elif kind == "jsonl":
        with open(file, encoding="utf-8-sig") as f:
            for line in f:
                try:  # a second parse of each line: json keeps the last of repeated keys, the hook sees them all
                    json.loads(line, object_pairs_hook=lambda pairs: _unique([k for k, _ in pairs], path) or {})
                except ValueError:  # not JSON (or blank): read_json says so, with its own message
                    continue
    else:
        import pyarrow.parquet as pq  # lazy: pandas' Parquet engine, loaded by read_parquet anyway

        _unique(pq.read_schema(file).names, path)


def _not_ragged(rows: Any, header: list, path: str) -> None:
    """Every CSV row has as many cells as the header. pandas takes a first row with one cell more for an index
    column (every column then shifts by one: the text column reads the labels) and fills a short row with NaN."""
    try:
        for number, row in enumerate(rows, start=1):
            if row and len(row) != len(header):  # a blank line is no row (pandas skips it too)
                raise DataError(f"data file {path} row {number} has {len(row)} cells but the header has "
                                f"{len(header)} ({', '.join(header)}); quote cells that hold the delimiter, and "
                                f"give every row one cell per column")
    except csv.Error as err:
        raise DataError(f"cannot read {path} as csv: {err}") from None


def _unique(names: list, path: str) -> None:
    counts = Counter(names)
    repeated = [n for n, count in counts.items() if count > 1]
    if repeated:
        raise DataError(f"data file {path} has the column {repeated[0]!r} {counts[repeated[0]]} times (columns: "
                        f"{', '.join(map(str, names))}); rename or remove the repeats: maxout will not pick one "
                        f"of them for you")


@dataclass
class Table:
    """One split: raw texts (and pairs) plus label ids."""

    texts: list[str]
    pairs: Optional[list[str]]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: list[int]) -> "Table":
        pick = lambda xs: [xs[i] for i in index]  # noqa: E731
        return Table(pick(self.texts), pick(self.pairs) if self.pairs is not None else None, pick(self.labels))


@dataclass(frozen=True)
class Origin:
    """Where one split's rows come from, for its lineage (the MLflow dataset a run logs as its input): the file as
    configured, and which of its rows ("" every row; else e.g. "a stratified split of data.validation_split=0.1, ...")."""

    path: str
    rows: str = ""


SPLITS = ("train", "validation", "test")
DIGEST_LIMIT = 36  # what MLflow stores of a dataset digest


@dataclass
class Dataset:
    train: Table
    validation: Table
    label_names: list[str]
    fingerprint: str  # content hash of the files + column choice, to tag models and cache results
    dropped: dict = field(default_factory=dict)  # data.on_missing=drop: {"train": n, "validation": n} rows left out
    test: Optional[Table] = None  # data.test_path: scored once with the selected model, never used to select it
    origins: dict = field(default_factory=dict)  # split -> Origin; a split missing here has no known file

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def split(self, name: str) -> Optional[Table]:
        return {"train": self.train, "validation": self.validation, "test": self.test}[name]

    def digest(self, split: str) -> str:
        """The identity of one split: the fingerprint of the data (every file, the column choice), plus a short
        hash of which rows when the split is only part of its file (a split-off validation set, a fold, the
        audit's first rows), so that two different tables never share a digest."""
        origin = self.origins.get(split)
        if origin is None or not origin.rows:
            return self.fingerprint
        part = hashlib.sha256(f"{split}|{origin.rows}".encode()).hexdigest()
        digest = f"{self.fingerprint}-{part[:8]}"
        return digest if len(digest) <= DIGEST_LIMIT else hashlib.sha256(digest.encode()).hexdigest()[:16]


def text_columns(cfg: DataConfig) -> list[str]:
    """The columns that hold text: the text column and, for pair tasks, the pair column."""
    return [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])


def _columns(df: pd.DataFrame, cfg: DataConfig, path: str) -> None:
    wanted = [("data.text_column", cfg.text_column), ("data.label_column", cfg.label_column)]
    if cfg.text_pair_column:
        wanted.append(("data.text_pair_column", cfg.text_pair_column))
    for key, column in wanted:
        if column not in df.columns:
            raise DataError(f"{key}={column!r} is not a column of {path} (columns: {', '.join(map(str, df.columns))})")


def _without_empty_cells(df: pd.DataFrame, cfg: DataConfig, path: str) -> tuple[pd.DataFrame, int]:
    """The rows whose text, pair or label cell is empty (null, NaN, blank), whose text or pair cell is not a string
    (a number, list or mapping from JSON or Parquet: prediction refuses those too, cells.py) or whose label is not a
    single value (a list or mapping) are refused with one line naming the file, the columns, how many and which
    rows; with ``data.on_missing=drop`` they are left out and counted. (An empty label would otherwise become a
    class of its own, an empty text the string 'nan' or 'None', and a mapping its Python repr.)"""
    texts = text_columns(cfg)
    empty, other = {}, {}
    for c in dict.fromkeys(texts + [cfg.label_column]):
        empty[c] = cells.positions(df[c])
        other[c] = cells.positions(df[c], cells.not_text if c in texts else _not_a_label)
    bad = sorted(set().union(*empty.values(), *other.values()))
    if not bad:
        return df, 0
    if cfg.on_missing != "drop":
        typed = any(other.values())
        which = ", ".join(f"{c!r}: " + (f"{len(empty[c])}" if not typed else " and ".join(
            f"{n} {what}" for n, what in ((len(empty[c]), "empty"), (len(other[c]), "not text" if c in texts
                                                                      else "not a single value")) if n))
            for c in empty if empty[c] or other[c])
        raise DataError(f"data file {path} has {len(bad)} of {len(df)} rows with an empty{' or non-text' * typed} "
                        f"cell ({which}; {cells.rows(bad)}); fill them in{' as text' * typed}, or set "
                        f"data.on_missing=drop to train without those rows (the run logs how many it dropped)")
    kept = df.drop(index=df.index[bad])
    if kept.empty:
        raise DataError(f"data file {path} has no row left after data.on_missing=drop: every row has an empty or "
                        f"non-text {' / '.join(repr(c) for c in empty)} cell")
    return kept, len(bad)


def _not_a_label(value: Any) -> bool:
    """A label cell holding a list or mapping (JSON, Parquet): no class name."""
    return not cells.missing(value) and not pd.api.types.is_scalar(value)


def _table(df: pd.DataFrame, cfg: DataConfig, label_ids: dict[str, int], path: str) -> Table:
    labels = df[cfg.label_column].map(_label_key)
    unknown = sorted(set(labels) - set(label_ids))
    if unknown:
        rows = [i for i, label in enumerate(labels) if label not in label_ids]
        raise DataError(f"label {unknown[0]!r} in {path} is not in the label set {sorted(label_ids)} "
                        f"({cells.rows(rows)}); fix the data or set data.labels")
    texts = df[cfg.text_column].astype(str).tolist()
    pairs = df[cfg.text_pair_column].astype(str).tolist() if cfg.text_pair_column else None
    return Table(texts, pairs, [label_ids[x] for x in labels])


def _label_key(value: Any) -> str:
    """Labels compare as strings: 1, 1.0 and "1" are the same label whatever the file format made of them."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _fingerprint(paths: list[str], cfg: DataConfig) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(resolve_path(p).read_bytes())
    digest.update(f"{cfg.text_column}|{cfg.text_pair_column}|{cfg.label_column}|{cfg.labels}".encode())
    if cfg.on_missing == "drop":  # the same files give other tables when empty rows are dropped
        digest.update(b"|drop")
    return digest.hexdigest()[:16]


def load(cfg: DataConfig) -> Dataset:
    """Read and validate both splits. Every check here runs before any model is loaded."""
    train_df = read_table(cfg.train_path, cfg.format, text_columns=text_columns(cfg))
    if train_df.empty:
        raise DataError(f"data file {cfg.train_path} has no rows: the training set must not be empty")
    _columns(train_df, cfg, cfg.train_path)
    train_df, dropped = _without_empty_cells(train_df, cfg, cfg.train_path)
    dropped_rows = {"train": dropped}
    if cfg.labels is not None:
        label_names = [_label_key(x) for x in cfg.labels]
    else:
        label_names = sorted({_label_key(x) for x in train_df[cfg.label_column]})
    if len(label_names) < 2:
        where = "data.labels" if cfg.labels is not None else cfg.train_path
        raise DataError(f"data has a single label {label_names} ({where}): classification needs at least 2 "
                        f"(check data.label_column={cfg.label_column!r})")
    label_ids = {name: i for i, name in enumerate(label_names)}
    train = _table(train_df, cfg, label_ids, cfg.train_path)
    paths = [cfg.train_path]
    origins = {"train": Origin(cfg.train_path)}
    if cfg.validation_path:
        val_df = read_table(cfg.validation_path, cfg.format, text_columns=text_columns(cfg))
        if val_df.empty:
            raise DataError(f"data file {cfg.validation_path} has no rows: the validation set must not be empty")
        _columns(val_df, cfg, cfg.validation_path)
        val_df, dropped_rows["validation"] = _without_empty_cells(val_df, cfg, cfg.validation_path)
        validation = _table(val_df, cfg, label_ids, cfg.validation_path)
        paths.append(cfg.validation_path)
        origins["validation"] = Origin(cfg.validation_path)
    else:
        train, validation = stratified_split(train, cfg.validation_split, cfg.split_seed)
        split = f"a stratified split of data.validation_split={cfg.validation_split:g}, data.split_seed={cfg.split_seed}"
        origins["train"] = Origin(cfg.train_path, f"the rest after {split}")
        origins["validation"] = Origin(cfg.train_path, split)
    test = None
    if cfg.test_path:
        test = _test_table(cfg, label_ids, dropped_rows)
        paths.append(cfg.test_path)
        origins["test"] = Origin(cfg.test_path)
    return Dataset(train, validation, label_names, _fingerprint(paths, cfg),
                   dropped_rows if cfg.on_missing == "drop" else {}, test, origins)


def _test_table(cfg: DataConfig, label_ids: dict[str, int], dropped_rows: dict) -> Table:
    """The test split: the model only predicts the training label set, so any other label is an error."""
    df = read_table(cfg.test_path, cfg.format, text_columns=text_columns(cfg))
    if df.empty:
        raise DataError(f"data file {cfg.test_path} has no rows: the test set must not be empty (or unset "
                        f"data.test_path)")
    _columns(df, cfg, cfg.test_path)
    df, dropped_rows["test"] = _without_empty_cells(df, cfg, cfg.test_path)
    labels = df[cfg.label_column].map(_label_key)
    unknown = sorted(set(labels) - set(label_ids))
    if unknown:
        rows = int(labels.isin(unknown).sum())
        raise DataError(f"data.test_path={cfg.test_path}: label(s) {unknown[:5]} ({rows} rows) are not in the "
                        f"training label set {list(label_ids)}; the model cannot predict them: drop those rows or "
                        f"list every label in data.labels")
    return _table(df, cfg, label_ids, cfg.test_path)


def stratified_split(table: Table, fraction: float, seed: int) -> tuple[Table, Table]:
    from sklearn.model_selection import train_test_split  # lazy: 1.2 s to import, and only a split needs it

    index = list(range(len(table)))
    try:
        train_idx, val_idx = train_test_split(index, test_size=fraction, random_state=seed, stratify=table.labels)
    except ValueError:  # a class too rare to stratify: fall back to a plain shuffled split
        train_idx, val_idx = train_test_split(index, test_size=fraction, random_state=seed)
    if not train_idx or not val_idx:
        raise DataError(f"data has {len(table)} rows: too few to split off data.validation_split={fraction}")
    return table.subset(train_idx), table.subset(val_idx)


# ------------------------------------------------------------------------------------------ tokenization


class Encoded(torch.utils.data.Dataset):
    """Token ids per row (unpadded) and label ids; ``lengths`` drives length bucketing."""

    def __init__(self, input_ids: list[list[int]], token_type_ids: Optional[list[list[int]]], labels: list[int]):
        self.input_ids = input_ids
        self.token_type_ids = token_type_ids
        self.labels = labels
        self.lengths = [len(x) for x in input_ids]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = {"input_ids": self.input_ids[i], "labels": self.labels[i]}
        if self.token_type_ids is not None:
            row["token_type_ids"] = self.token_type_ids[i]
        return row


def encode(tokenizer: Any, table: Table, max_length: int) -> Encoded:
    # longest_first truncation keeps both segments when a long post meets a short criterion.
    enc = tokenizer(table.texts, table.pairs, truncation="longest_first" if table.pairs else True,
                    max_length=max_length, padding=False)
    return Encoded(enc["input_ids"], enc.get("token_type_ids"), table.labels)


class Collator:
    """Pad a list of rows into tensors and count tokens on the host (no device sync needed later).

    ``pad_to``: None pads to the longest row of the batch (dynamic padding); an int pads to exactly that length.
    ``multiple_of`` rounds the padded length up (8 keeps tensor-core shapes on CUDA). ``widths``: the only widths
    dynamic padding may take (ascending; hardware.pad_widths, so CUDA graphs record a few shapes): a batch pads
    to the first one that holds its longest row (a longer row, e.g. of another split, to its own rounded length).

    Vectorized: the rows' tokens are joined into one flat tensor and scattered through the padding mask in one
    op, instead of three tensor writes per row: the loop took 25-32 ms per 1024 demo rows on a 2-core CPU, this
    2.4-2.7 ms (benchmarks/collator_speed.py), so an epoch's first batch, collated while the device waits, no
    longer stalls it.
    """

    def __init__(self, pad_id: int, pad_to: Optional[int] = None, multiple_of: Optional[int] = None,
                 widths: Optional[Sequence[int]] = None):
        self.pad_id, self.pad_to, self.multiple_of = pad_id, pad_to, multiple_of
        self.widths = sorted(widths) if widths else None

    def width(self, longest: int) -> int:
        """The padded width of a batch whose longest row has ``longest`` tokens."""
        if self.widths and not self.pad_to and longest <= self.widths[-1]:
            return next(w for w in self.widths if w >= longest)
        width = self.pad_to or longest
        return -(-width // self.multiple_of) * self.multiple_of if self.multiple_of else width

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(r["input_ids"]) for r in rows]
        width = self.width(max(lengths))
        real = torch.arange(width) < torch.tensor(lengths)[:, None]  # (rows, width): True on each row's tokens
        count = sum(lengths)
        ids = _scatter(real, (r["input_ids"] for r in rows), self.pad_id, count)
        batch = {"input_ids": ids, "attention_mask": real.long(),
                 "labels": torch.tensor([r["labels"] for r in rows], dtype=torch.long),
                 "num_real_tokens": count, "num_tokens": len(rows) * width}
        if "token_type_ids" in rows[0]:
            batch["token_type_ids"] = _scatter(real, (r["token_type_ids"] for r in rows), 0, count)
        return batch


def _scatter(real: torch.Tensor, rows: Iterable[Sequence[int]], fill: int, count: int) -> torch.Tensor:
    """A (rows, width) long tensor holding each row's values left-aligned, ``fill`` after them; ``count``: the
    values in all rows."""
    out = torch.full(real.shape, fill, dtype=torch.long)
    # numpy reads the joined lists 3.5x faster than torch.tensor(list); the mask's True cells are row-major, as
    # the joined values are
    out[real] = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=count))
    return out


# What the loop hands the model (each has .to(device)); position_ids and packing come with packed batches only
# (optimizations/packing.py).
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "labels", "position_ids", "packing")
