"""Prepared attention masks (optimizations/prepared_mask.py): an eager forward is handed the mask transformers would
build, decided from the batch's host copy, so the model's outputs are the same and transformers no longer reads the
padding mask on the host (``padding_mask.all()``: one sync a forward on a GPU).

The host reads are counted with metrics.HostSyncs on CPU, where the same aten ops run as on a GPU: transformers'
check is an ``aten::_local_scalar_dense`` on the mask, whatever its device.
"""

from __future__ import annotations

import pytest
import torch

from maxout import metrics
from maxout.optimizations import prepared_mask

from .test_packing import build, inputs, padded_batch

# test_packing's models (real tiny configs) of each model type prepared masks cover
ENCODERS = {"tiny": "bert", "roberta": "roberta", "xlm-roberta": "xlm-roberta", "electra": "electra"}


def test_the_encoders_tested_are_every_model_type_covered():
    assert sorted(ENCODERS.values()) == sorted(prepared_mask.MODEL_TYPES)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_a_prepared_mask_gives_the_same_outputs_without_a_host_read(name):
    classifier, rows, tokenizer = build(name, "sdpa")
    model = classifier.model  # the model's own head: prepared masks leave per-sample pooling alone
    assert model.config.model_type == ENCODERS[name]
    assert prepared_mask.supported(model.config.model_type, "sdpa", "dynamic", None) == (True, "")
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    preparer = prepared_mask.apply(model)
    ragged = padded_batch(rows, tokenizer)  # rows of different lengths: padding
    even = padded_batch([rows[1]] * 3, tokenizer)  # three rows of one length: none
    for batch, has_padding in ((ragged, True), (even, False)):
        assert prepared_mask.padded(batch) is has_padding
        with torch.no_grad():
            with metrics.HostSyncs() as plain:
                expected = model(**inputs(batch))
            prepared = preparer(inputs(batch), prepared_mask.padded(batch))
            with metrics.HostSyncs() as counted:
                got = model(**prepared)
        assert plain.counts["aten::_local_scalar_dense"] >= 1  # transformers' own check reads the mask
        assert counted.total == 0, counted.counts
        assert ("attention_mask" in prepared) is has_padding
        if has_padding:
            assert prepared["attention_mask"].shape == (len(rows), 1, *batch["input_ids"].shape[1:] * 2)
        assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)


def test_what_prepared_masks_leave_alone_says_why():
    assert prepared_mask.supported("bert", "sdpa", "packed", None) == (
        False, "packed batches carry no padding mask: nothing to prepare")
    assert "without reading it on the host" in prepared_mask.supported("bert", "eager", "dynamic", None)[1]
    assert "unpads each batch" in prepared_mask.supported("bert", "flash_attention_2", "dynamic", None)[1]
    for model_type in ("modernbert", "qwen3", "gemma3_text"):
        ok, why = prepared_mask.supported(model_type, "sdpa", "dynamic", None)
        assert not ok and repr(model_type) in why and "sliding-window or causal" in why
    assert prepared_mask.supported("bert", "sdpa", "dynamic", "mean") == (
        False, "per-sample pooling (model.pooling=mean) reads the batch's 2D mask")


def test_a_batch_without_the_collators_counts_is_read_from_its_host_mask_and_never_from_a_device():
    chunk = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 1],
                                                                                              [1, 1, 0, 0]])}
    with metrics.HostSyncs() as counted:
        assert prepared_mask.padded(chunk) is True  # an out-of-memory row chunk: no token counts
        assert prepared_mask.padded({**chunk, "attention_mask": chunk["attention_mask"][:1]}) is False
    assert counted.total == 0
    assert prepared_mask.padded({**chunk, "attention_mask": torch.ones(2, 4, device="meta")}) is None
    mask = torch.ones(2, 4, dtype=torch.long)
    unknown = {"input_ids": mask, "attention_mask": mask}
    assert prepared_mask.MaskPreparer(None, torch.float32)(unknown, None) is unknown  # transformers decides
