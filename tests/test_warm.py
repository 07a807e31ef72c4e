"""train.warm.WarmStart: what runs sharing one (HPO trials, an audit's runs, a grid's cells, a batch finder and its
run) get from its caches, and that a cached table is never served for another tokenizer's."""

from __future__ import annotations

import gc
import weakref

from maxout import data as data_mod, loading, modeling
from maxout.train.warm import WarmStart

TABLE = data_mod.Table(["a short post", "a somewhat longer post about a criterion"], ["criterion a", "criterion b"],
                       [0, 1])


def _tokenizer():
    return modeling.load_tokenizer(loading.load(["model=tiny"]).model)


def test_a_table_is_tokenized_once_per_tokenizer_and_length_and_equals_data_encode(tokenized_rows):
    warm, tokenizer = WarmStart(), _tokenizer()
    first = warm.encode(tokenizer, TABLE, 64)
    again = warm.encode(tokenizer, TABLE, 64)
    assert again is first and warm.hits == 1 and tokenized_rows[len(TABLE)] == 1
    assert first.input_ids == data_mod.encode(tokenizer, TABLE, 64).input_ids
    shorter = warm.encode(tokenizer, TABLE, 4)  # another length truncates otherwise: tokenized again
    assert warm.hits == 1 and max(len(ids) for ids in shorter.input_ids) == 4


def test_the_tokenizer_a_caller_loaded_is_kept_and_reused():
    warm, loaded = WarmStart(), _tokenizer()
    model = loading.load(["model=tiny"]).model
    assert warm.tokenizer(model, loaded=loaded) is loaded
    assert warm.tokenizer(model) is loaded  # not loaded again


def test_a_cached_table_holds_its_tokenizer_so_a_new_one_cannot_take_its_id():
    # The cache is keyed by id(tokenizer): were a caller's tokenizer freed while its tables stayed cached, a new
    # tokenizer at the same address would be served the old one's token ids.
    warm, tokenizer = WarmStart(), _tokenizer()
    alive = weakref.ref(tokenizer)
    warm.encode(tokenizer, TABLE, 64)
    del tokenizer
    gc.collect()
    assert alive() is not None
