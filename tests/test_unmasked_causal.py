"""Causal attention without a padding mask (optimizations/unmasked_causal.py): a Qwen2/Qwen3 batch, padded on the
right, hands its full-attention layers no mask, so SDPA runs causal (``is_causal``, grouped K/V heads as they are)
where transformers' own forward hands it a mask (a masked kernel, K/V expanded to every head). The logits, loss and
gradients are the same, and nothing is read on the host, padded batch or not.

What SDPA is handed is recorded at ``torch.nn.functional.scaled_dot_product_attention``, which transformers looks
up on every call.
"""

from __future__ import annotations

import pytest
import torch

from maxout import loading
from maxout.errors import ConfigError
from maxout.optimizations import prepared_mask, unmasked_causal
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY
from .test_packing import BF16_TOL, build, inputs, padded_batch
from .test_prepared_mask import SLIDING, outputs_and_reads

# test_packing's models of each model type covered, and Qwen 3 with a sliding layer beside a full one
MODELS = {"qwen2": "qwen2", "tiny_qwen3": "qwen3"}


@pytest.fixture
def sdpa_calls(monkeypatch):
    """What each SDPA call of a forward is handed: (mask or None, is_causal, enable_gqa, query heads, key heads)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((attn_mask, is_causal, enable_gqa, query.shape[1], key.shape[1]))
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    return calls


def prepared_pair(name: str, pooled: bool, **architecture):
    classifier, rows, tokenizer = build(name, "sdpa", **architecture)
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    assert unmasked_causal.supported(classifier.config.model_type, "sdpa", "dynamic", True) == (True, "")
    preparer = unmasked_causal.apply(prepared_mask.apply(classifier.model, pooled=pooled))
    return (classifier if pooled else classifier.model), preparer, rows, tokenizer


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("name,sliding", [*((n, False) for n in sorted(MODELS)), ("tiny_qwen3", True)])
def test_a_right_padded_qwen_batch_runs_causal_attention_without_a_mask_and_gives_the_same_outputs(
        name, sliding, pooled, sdpa_calls):
    model, preparer, rows, tokenizer = prepared_pair(name, pooled, **({"architecture": SLIDING[name]}
                                                                      if sliding else {}))
    kinds = model.config.layer_types
    assert preparer.serves_compiled and preparer.unmasked == {"full_attention"}
    ragged = padded_batch(rows, tokenizer)
    even = padded_batch([rows[1]] * 3, tokenizer)
    for batch, has_padding in ((ragged, True), (even, False)):
        expected, plain = outputs_and_reads(model, inputs(batch))
        theirs, sdpa_calls[:] = list(sdpa_calls), []
        prepared = preparer(inputs(batch), prepared_mask.padded(batch))
        got, counted = outputs_and_reads(model, prepared)
        torch.testing.assert_close(got.logits, expected.logits)
        torch.testing.assert_close(got.loss, expected.loss)
        assert counted.total == 0, counted.counts
        assert plain.total >= (0 if has_padding else 1)  # transformers' own forward reads an unpadded batch's mask
        masks = prepared[preparer.key]
        assert isinstance(masks, dict) and masks["full_attention"] is None
        for kind, (mask, is_causal, gqa, heads, kv_heads), (their_mask, _, their_gqa, _, their_kv) in zip(
                kinds, sdpa_calls, theirs):
            if kind == "full_attention":
                # causal, the grouped K/V heads handed as they are; transformers' own, padded: a mask, K/V
                # expanded to every query head (unpadded, after its read, the same as this)
                assert mask is None and is_causal and gqa and kv_heads < heads
                if has_padding:
                    assert their_mask is not None and not their_gqa and their_kv == heads
            else:  # a window is more than causal: its mask stays
                assert mask is not None and mask.dim() == 4 and not is_causal
        sdpa_calls.clear()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_its_gradients_are_the_masked_forwards(name):
    """The pads' own outputs change (they see the pads before them), but no loss reads them and no real token sees
    a pad: every parameter's gradient is the masked forward's."""
    model, preparer, rows, tokenizer = prepared_pair(name, pooled=True)
    batch = padded_batch(rows, tokenizer)
    grads = []
    for batch_inputs in (inputs(batch), preparer(inputs(batch), True)):
        model.zero_grad()
        model(**batch_inputs).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)


def test_what_it_leaves_alone_says_why():
    for model_type in ("llama", "mistral", "gemma", "gemma3_text", "bert"):
        ok, why = unmasked_causal.supported(model_type, "sdpa", "dynamic", True)
        assert not ok and repr(model_type) in why and "reads its position ids on the host" in why
    assert unmasked_causal.supported("qwen3", "eager", "dynamic", True) == (
        False, "attention 'eager': only SDPA's kernels take causal attention without a mask")
    assert unmasked_causal.supported("qwen2", "sdpa", "packed", True) == (
        False, "packed batches keep their samples apart with block masks")
    assert "prepared_mask is off" in unmasked_causal.supported("qwen3", "sdpa", "dynamic", False)[1]
    classifier, _, _ = build("llama", "sdpa")  # one mask for every layer, built inside its forward
    with pytest.raises(ConfigError, match="hardware.unmasked_causal=false"):
        unmasked_causal.apply(prepared_mask.apply(classifier.model))


def test_a_qwen3_run_trains_alike_with_and_without_it_eager_and_compiled(graphs, cpu_device, one_torch_thread):
    """Through the trainer (tiny_qwen3 pools each row's last token: the masks go to the backbone). Compiled, the model
    is handed the mapping too, every batch (one graph over the bucket plan's widths, guards skipped for inputs seen:
    the mapping is part of the signature). The losses agree to rounding: the kernels differ, the sums are the same."""
    def run(*overrides):
        cfg = loading.load([*TINY, "model=tiny_qwen3", "hardware.attn_implementation=sdpa", "data.bucketing=true",
                            "train.max_steps=8", *overrides], device=cpu_device)
        return train(cfg, tracker=NullTracker(), progress=False, device=cpu_device, verbose=False)

    on, off = run("hardware.unmasked_causal=true"), run("hardware.unmasked_causal=false")
    assert on.setup.decision("unmasked_causal").effective and on.setup.mask_preparer.unmasked
    assert not off.setup.decision("unmasked_causal").effective and not off.setup.mask_preparer.unmasked
    for key in ("train/final_loss", "eval/loss"):
        assert on.metrics[key] == pytest.approx(off.metrics[key], rel=1e-3)
    compiled = run("hardware.unmasked_causal=true", "hardware.compile=true", "train.epochs=2", "train.max_steps=-1")
    assert graphs.frame_count == 1 and compiled.metrics["compile/forwards_guards_skipped"] > 0
    batch = next(iter(compiled.setup.train_loader))
    handed = compiled.setup.model_inputs(batch, compiled=True)
    assert handed["backbone_mask"] == {"full_attention": None} and handed["attention_mask"].dim() == 2
    assert compiled.setup.decision("skip_guards").effective


@pytest.mark.gpu
def test_on_a_gpu_it_runs_on_the_flash_kernel_and_gives_the_masked_logits_in_bf16():
    """The kernel it is for: with only SDPA's flash backend allowed, the unmasked forward runs, and transformers'
    masked one finds no kernel; the logits agree to bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, preparer, rows, tokenizer = prepared_pair("tiny_qwen3", pooled=True)
    model = model.to("cuda")
    batch = {k: v.to("cuda") for k, v in inputs(padded_batch(rows, tokenizer)).items()}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        masked = model(**batch).logits.float()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            unmasked = model(**preparer(batch, True)).logits.float()
            with pytest.raises(RuntimeError):
                model(**batch)
    assert (unmasked - masked).abs().max() < BF16_TOL
