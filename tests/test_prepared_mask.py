"""Prepared attention masks (optimizations/prepared_mask.py): an eager forward is handed the masks transformers would
build, decided from the batch's host copy, so the model's outputs are the same and transformers no longer reads the
padding mask on the host (``padding_mask.all()``: one sync a forward on a GPU).

The host reads are counted with metrics.HostSyncs on CPU, where the same aten ops run as on a GPU: transformers'
checks are ``aten::_local_scalar_dense`` on the mask, whatever its device.
"""

from __future__ import annotations

import pytest
import torch

from maxout import loading, metrics
from maxout.optimizations import prepared_mask
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY
from .test_packing import DECODER, build, inputs, padded_batch

# test_packing's models (real tiny configs) of each model type prepared masks cover
ENCODERS = {"tiny": "bert", "roberta": "roberta", "xlm-roberta": "xlm-roberta", "electra": "electra"}
DECODERS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "tiny_qwen3": "qwen3", "gemma": "gemma"}
# and the decoders' other layouts: Mistral sliding over rows longer than its window (one tensor), Qwen 3 with
# sliding layers beside full ones (a mask per layer type)
SLIDING = {"mistral": dict(DECODER, model_type="mistral", sliding_window=8),
           "tiny_qwen3": dict(DECODER, model_type="qwen3", use_sliding_window=True, sliding_window=8,
                              max_window_layers=1)}


def test_the_models_tested_are_every_model_type_covered():
    assert sorted(ENCODERS.values()) == sorted(prepared_mask.ENCODERS)
    assert sorted(DECODERS.values()) == sorted(prepared_mask.DECODERS)
    assert prepared_mask.SLIDING_ENCODERS == ("modernbert",)  # tiny_modernbert, pooled only


def outputs_and_reads(model, batch_inputs):
    with torch.no_grad(), metrics.HostSyncs() as counted:
        out = model(**batch_inputs)
    return out, counted


def check(name: str, pooled: bool, reads: bool = True, attn: str = "sdpa", **architecture):
    """The outputs with and without prepared masks, padded and unpadded, and the host reads of each forward; the
    model's own head, or per-sample pooling (``pooled``: the native pooling test_packing builds). ``reads``: whether
    transformers' own forward reads a padded batch's mask (not where a window shorter than the rows makes it build
    the mask anyway)."""
    classifier, rows, tokenizer = build(name, attn, **architecture)
    model_type = classifier.model.config.model_type
    assert prepared_mask.supported(model_type, attn, "dynamic", "last" if pooled else None) == (True, "")
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    preparer = prepared_mask.apply(classifier.model, pooled=pooled)
    model = classifier if pooled else classifier.model
    ragged = padded_batch(rows, tokenizer)  # rows of different lengths: padding
    even = padded_batch([rows[1]] * 3, tokenizer)  # three rows of one length: none
    for batch, has_padding in ((ragged, True), (even, False)):
        assert prepared_mask.padded(batch) is has_padding
        expected, plain = outputs_and_reads(model, inputs(batch))
        prepared = preparer(inputs(batch), prepared_mask.padded(batch))
        got, counted = outputs_and_reads(model, prepared)
        assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)
        if has_padding:
            assert (plain.counts["aten::_local_scalar_dense"] >= 1) is reads  # transformers' own check reads it
            assert counted.total == 0, counted.counts
            mask = prepared["attention_mask"]  # pooling's 2D mask, or the one the model's own head passes on
            assert preparer.key in prepared and (isinstance(mask, torch.Tensor) and mask.dim() == 2) is pooled
        elif model_type in prepared_mask.DECODERS:  # a decoder's unpadded batch as it was (prepared_mask.py says why)
            assert prepared.keys() == inputs(batch).keys() and prepared["attention_mask"].dim() == 2
            assert counted.total == plain.total
        else:  # an encoder's without a mask: no read
            assert "attention_mask" not in prepared and counted.total == 0, counted.counts
    return classifier.model, preparer


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_an_encoders_prepared_mask_gives_the_same_outputs_without_a_host_read(name, pooled):
    _, preparer = check(name, pooled)
    assert list(preparer.builders) == ["full_attention"] and preparer.single and not preparer.causal


def test_modernberts_prepared_masks_are_its_global_and_sliding_ones():
    _, preparer = check("tiny_modernbert", pooled=True)
    assert list(preparer.builders) == ["full_attention", "sliding_attention"] and not preparer.single


@pytest.mark.parametrize("name", [*sorted(ENCODERS), "tiny_modernbert"])
def test_an_eager_encoders_prepared_mask_gives_the_same_outputs_without_its_host_read(name):
    """Eager attention (the CPU profile's) builds an encoder's additive mask after the same padding check as SDPA's:
    transformers' own forward reads the mask on the host (once, ModernBERT twice: a sync each on a GPU); the
    prepared one reads nothing and gives the same logits and loss."""
    _, preparer = check(name, pooled=name == "tiny_modernbert", attn="eager")
    assert isinstance(preparer.norm, torch.nn.LayerNorm)


def test_an_eager_mask_takes_the_dtype_of_a_low_precision_layernorms_embeddings():
    """Under autocast with low_precision_layernorm, an eager encoder's embeddings and so its additive mask are bf16;
    a mask built in the weights' fp32 would promote every layer's attention scores to fp32 (twice their bytes; the
    logits come out equal here either way, so the dtype is what is asserted)."""
    from maxout.optimizations import low_precision_layernorm

    classifier, rows, tokenizer = build("tiny", "eager")
    low_precision_layernorm.apply(classifier.model)
    preparer = prepared_mask.apply(classifier.model)
    batch = padded_batch(rows, tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, plain = outputs_and_reads(classifier.model, inputs(batch))
        prepared = preparer(inputs(batch), prepared_mask.padded(batch))
        got, counted = outputs_and_reads(classifier.model, prepared)
    assert prepared["attention_mask"].dtype == torch.bfloat16 and preparer.mask_dtype(torch.device("cpu")) is \
        torch.float32  # outside autocast: the weights'
    assert torch.equal(got.logits, expected.logits)
    assert plain.total >= 1 and counted.total == 0


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_decoders_prepared_masks_give_the_same_outputs_without_the_masks_host_reads(name, pooled):
    _, preparer = check(name, pooled)
    # one mask for every layer: causal, or sliding where Mistral's config has a window (4096 by default); one tensor,
    # or a mapping by layer type where the config lists the types (Qwen)
    kind = "sliding_attention" if name == "mistral" else "full_attention"
    assert preparer.causal and (list(preparer.builders), preparer.single) == (
        [kind], not name.endswith(("qwen2", "qwen3")))


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_a_sliding_decoders_prepared_masks_are_the_ones_its_layers_take(name):
    _, preparer = check(name, pooled=True, reads=name != "mistral", architecture=SLIDING[name])
    if name == "mistral":
        assert list(preparer.builders) == ["sliding_attention"] and preparer.single
    else:
        assert list(preparer.builders) == ["full_attention", "sliding_attention"] and not preparer.single


def test_what_prepared_masks_leave_alone_says_why():
    assert prepared_mask.supported("bert", "sdpa", "packed", None) == (
        False, "packed batches carry no padding mask: nothing to prepare")
    assert prepared_mask.supported("bert", "eager", "dynamic", None) == (True, "")
    for model_type in prepared_mask.DECODERS:
        assert prepared_mask.supported(model_type, "eager", "dynamic", "last") == (
            False, "eager attention builds a decoder's causal mask without reading it on the host")
    assert "unpads each batch" in prepared_mask.supported("bert", "flash_attention_2", "dynamic", None)[1]
    for model_type in ("gemma3_text", "gemma2", "deberta-v2"):
        ok, why = prepared_mask.supported(model_type, "sdpa", "dynamic", "last")
        assert not ok and repr(model_type) in why and "builds or reads its masks its own way" in why
    ok, why = prepared_mask.supported("modernbert", "sdpa", "dynamic", None)
    assert not ok and "own head may pool by the 2D mask" in why


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
    assert prepared_mask.MaskPreparer(None, torch.float32, {})(unknown, None) is unknown  # transformers decides


def test_a_pooled_decoder_trains_alike_with_and_without_prepared_masks(cpu_device, one_torch_thread):
    """Through the trainer: tiny_qwen3's group pools each row's last token, so its masks go to the backbone. The
    masks only (unmasked_causal off: it changes the kernel, so the sums' rounding; tests/test_unmasked_causal.py)."""
    configs = [loading.load([*TINY, "model=tiny_qwen3", "hardware.attn_implementation=sdpa",
                             "hardware.unmasked_causal=false", f"hardware.prepared_mask={on}"], device=cpu_device)
               for on in ("true", "false")]
    results = [train(cfg, tracker=NullTracker(), progress=False, device=cpu_device, verbose=False) for cfg in configs]
    assert results[0].setup.mask_preparer.key == "backbone_mask" and results[1].setup.mask_preparer is None
    assert results[0].metrics["train/final_loss"] == results[1].metrics["train/final_loss"]
    assert results[0].metrics["eval/loss"] == results[1].metrics["eval/loss"]
