"""Warm start: what one process keeps between the runs it trains on the same data (HPO trials).

A trial's set-up used to load the tokenizer and tokenize both tables again, each time. A ``WarmStart`` passed to
``train(..., warm=...)`` keeps the tokenizer per tokenizer source and the tokenized tables per (tokenizer, table,
max_length), so only the first trial of a worker pays for them; the tables themselves are the study's, loaded and
checked once. (The compiled kernels are shared already: TorchInductor's on-disk cache, hpo.compile_cache_dir.)
"""

from __future__ import annotations

from typing import Any

from .. import data as data_mod, modeling
from ..config import ModelConfig


class WarmStart:
    def __init__(self) -> None:
        self._tokenizers: dict[tuple, Any] = {}
        self._encoded: dict[tuple, tuple[Any, data_mod.Table, data_mod.Encoded]] = {}
        self.hits = 0  # tokenized tables served from the cache

    def tokenizer(self, model: ModelConfig, loaded: Any = None) -> Any:
        """The tokenizer ``model`` loads (modeling.load_tokenizer), loaded once per source. ``loaded``: the one the
        caller has loaded for ``model`` already (its input check's), kept instead of loading it again."""
        key = (model.source, model.name_or_path, model.path, model.tokenizer)
        if key not in self._tokenizers:
            self._tokenizers[key] = loaded if loaded is not None else modeling.load_tokenizer(model)
        return self._tokenizers[key]

    def encode(self, tokenizer: Any, table: data_mod.Table, max_length: int) -> data_mod.Encoded:
        """data.encode, once per (tokenizer, table, max_length). The entry holds the tokenizer and the table, so
        their ids stay their own while cached (a caller's tokenizer need not be one this warm start loaded)."""
        key = (id(tokenizer), id(table), max_length)
        if key in self._encoded:
            self.hits += 1
        else:
            self._encoded[key] = (tokenizer, table, data_mod.encode(tokenizer, table, max_length))
        return self._encoded[key][2]
