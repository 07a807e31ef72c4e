"""Reading CSV / JSONL / Parquet, every data error the user can make, collation and length bucketing."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from maxout import data
from maxout.config import DataConfig
from maxout.errors import DataError
from maxout.optimizations import bucketing

ROWS = [{"post": f"post number {i} " + "word " * (i % 7), "criterion": "crit", "label": i % 2} for i in range(20)]


def cfg(path, **kw) -> DataConfig:
    base = dict(name="t", train_path=str(path), text_column="post", text_pair_column="criterion", label_column="label")
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_each_format_loads_and_splits_stratified(tmp_path, fmt):
    frame = pd.DataFrame(ROWS)
    path = tmp_path / f"train.{fmt}"
    {"csv": lambda: frame.to_csv(path, index=False), "jsonl": lambda: frame.to_json(path, orient="records", lines=True),
     "parquet": lambda: frame.to_parquet(path)}[fmt]()
    ds = data.load(cfg(path, validation_split=0.2))
    assert (len(ds.train), len(ds.validation)) == (16, 4)
    assert ds.label_names == ["0", "1"] and sorted(set(ds.validation.labels)) == [0, 1]
    assert ds.train.pairs is not None and len(ds.fingerprint) == 16


def test_demo_project_loads_with_its_own_validation_file():
    from maxout import loading

    ds = data.load(loading.to_typed(loading.compose(["hardware=cpu"])).data)
    assert len(ds.train) == 800 and len(ds.validation) == 200 and ds.num_labels == 2


def write_csv(tmp_path, text: str, name="train.csv"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("setup,pattern", [
    (lambda p: cfg(p / "nope.csv"), r"data file not found: .*nope.csv"),
    (lambda p: cfg(write_csv(p, "post,criterion,label\n")), r"has no rows: the training set must not be empty"),
    (lambda p: cfg(write_csv(p, "")), r"is empty: it needs a header row"),
    (lambda p: cfg(write_csv(p, "body,criterion,label\na,b,1\nc,d,0\n")),
     r"data.text_column='post' is not a column of .*\(columns: body, criterion, label\)"),
    (lambda p: cfg(write_csv(p, "post,criterion,y\na,b,1\n")), r"data.label_column='label' is not a column"),
    (lambda p: cfg(write_csv(p, "post,label\na,1\nb,0\n")), r"data.text_pair_column='criterion' is not a column"),
    (lambda p: cfg(write_csv(p, "post,criterion,label\na,b,1\nc,d,7\n"), labels=[0, 1]),
     r"label '7' in .* is not in the label set \['0', '1'\]"),
    (lambda p: cfg(write_csv(p, "post,criterion,label\na,b,1\nc,d,1\n")), r"single label \['1'\]"),
    (lambda p: cfg(write_csv(p, "post,criterion,label\na,b,1\nc,d,0\n"),
                   validation_path=str(write_csv(p, "post,criterion,label\na,b,2\n", "val.csv"))),
     r"label '2' in .*val.csv is not in the label set"),
    (lambda p: cfg(p / "x.bin"), r"data file not found"),
])
def test_bad_data_is_one_clear_error(tmp_path, setup, pattern):
    with pytest.raises(DataError, match=pattern) as err:
        data.load(setup(tmp_path))
    assert "\n" not in str(err.value)


def test_non_utf8_file_names_the_byte_and_the_fix(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("post,criterion,label\ncaf\xe9,b,1\nx,y,0\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"not valid UTF-8 \(byte 0xe9 at offset \d+, line \d+\); re-save it as UTF-8"):
        data.load(cfg(path))


def test_unknown_extension_asks_for_data_format(tmp_path):
    path = write_csv(tmp_path, "post,criterion,label\n", name="train.txt")
    with pytest.raises(DataError, match="set data.format to one of csv, jsonl, parquet"):
        data.load(cfg(path))


def test_labels_match_across_formats_as_strings(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"post": "a", "criterion": "c", "label": x}) for x in ["1", 0, 1.0, "0"]))
    ds = data.load(cfg(path, labels=[0, 1], validation_path=str(path)))
    assert ds.train.labels == [1, 0, 1, 0]


def test_csv_texts_stay_text(tmp_path):
    """Found by test_fuzz_data.py: a CSV post "007" was read as the number 7 and trained as "7"."""
    path = tmp_path / "t.csv"
    path.write_text("post,criterion,label\n007,1.50,0\nTrue,x,1\n")
    ds = data.load(cfg(path, validation_split=0.5))
    assert sorted(ds.train.texts + ds.validation.texts) == ["007", "True"]
    assert sorted(ds.train.pairs + ds.validation.pairs) == ["1.50", "x"]


def test_a_bom_is_skipped_and_a_utf16_file_is_named_as_such(tmp_path):
    """Found by test_fuzz_data.py: a JSONL file with a UTF-8 BOM was refused ("Expected object or value", no line), and
    a UTF-16 file's refusal named no line."""
    path = tmp_path / "t.jsonl"
    path.write_bytes("".join(json.dumps(r) + "\n" for r in ROWS).encode("utf-8-sig"))
    assert len(data.read_table(str(path))) == len(ROWS)
    path = tmp_path / "t.csv"
    path.write_bytes("post,criterion,label\na,b,0\n".encode("utf-16"))
    with pytest.raises(DataError, match=r"not valid UTF-8 \(byte 0xff at offset 0, line 1; it looks like UTF-16\)"):
        data.read_table(str(path))


def test_collator_pads_dynamically_and_counts_tokens_on_the_host():
    collate = data.Collator(pad_id=0)
    rows = [{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [5], "labels": 0}]
    batch = collate(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (batch["num_real_tokens"], batch["num_tokens"]) == (4, 6)
    assert data.Collator(0, multiple_of=8)(rows)["input_ids"].shape == (2, 8)
    assert data.Collator(0, pad_to=16)(rows)["num_tokens"] == 32


def test_bucketing_raises_padding_efficiency_and_keeps_every_row():
    import random

    from transformers.trainer_pt_utils import get_length_grouped_indices

    rng = random.Random(0)
    lengths = [max(8, int(rng.expovariate(1 / 60))) for _ in range(810)]
    bucketed = bucketing.apply(lengths, 16, seed=1, enabled=True)
    shuffled = bucketing.apply(lengths, 16, seed=1, enabled=False)
    batches = bucketed.batches()
    assert sorted(i for b in batches for i in b) == list(range(810))  # every row once, per epoch
    assert len(batches) == len(bucketed) == 51 and sorted(map(len, batches))[0] == 810 % 16
    assert max(lengths[i] for i in batches[0]) == max(lengths)  # the longest batch first: OOM shows at step 1
    eff_b = bucketing.padding_efficiency(lengths, 16, bucketed.indices())
    eff_r = bucketing.padding_efficiency(lengths, 16, shuffled.indices())
    hf = bucketing.padding_efficiency(lengths, 16, list(get_length_grouped_indices(lengths, 16)))
    # Heavy-tailed lengths: random batches waste ~70% of the tokens; bucketing recovers most of it, and more
    # than transformers' group_by_length (12 batches per megabatch for 810 rows).
    assert eff_r < 0.35 and eff_b > 2.4 * eff_r and eff_b > hf, (eff_b, hf, eff_r)


def test_on_the_demo_data_bucketing_pads_under_five_percent():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from maxout import loading, modeling

    cfg = loading.to_typed(loading.compose(["hardware=cpu"]))
    lengths = data.encode(modeling.load_tokenizer(cfg.model), data.load(cfg.data).train, 256).lengths
    ours = bucketing.padding_efficiency(lengths, 16, bucketing.apply(lengths, 16, 7).indices())
    hf = bucketing.padding_efficiency(lengths, 16, list(get_length_grouped_indices(lengths, 16)))
    assert ours > 0.95 and hf < 0.9, (ours, hf)


def test_smaller_buckets_trade_padding_for_randomness():
    lengths = list(range(8, 808))
    small, large = (bucketing.padding_efficiency(lengths, 16, bucketing.apply(lengths, 16, 1, True, k).indices())
                    for k in (2, 50))
    assert small < large


def test_epoch_order_depends_only_on_seed_and_epoch():
    a, b = bucketing.apply(list(range(100)), 8, seed=3), bucketing.apply(list(range(100)), 8, seed=3)
    a.set_epoch(2), b.set_epoch(2)
    assert a.indices() == b.indices()
    b.set_epoch(3)
    assert a.indices() != b.indices()
