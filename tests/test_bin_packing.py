"""Packing into bins (data.packing_attention=bins, optimizations/bin_packing.py), on real tiny models built from
configs (CPU): the logits and loss of a binned batch equal those of each sample run alone, on every packable
architecture and both attention implementations a CPU runs; its gradients equal the padded batch's; the sampler
places every row once into bins that the collator rebuilds exactly; out-of-memory recovery splits whole bins; a run
trains on them. Tolerances as in test_packing.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from maxout import loading, metrics
from maxout.optimizations import bin_packing, bucketing, packing

from .test_packing import FP32_TOL, MODELS, assert_same_gradients, build, inputs, packed_batch, padded_batch


def binned_batch(rows, model, tokenizer, width=None):
    width = width or max(len(r["input_ids"]) for r in rows)
    start = packing.position_start(model.config.model_type, model.config.pad_token_id)
    return bin_packing.BinnedCollator(width, tokenizer.pad_token_id, start)(rows)


def bin_order(rows, width):
    """The rows' order in a binned batch: bin by bin, in their order within each bin."""
    where, offsets = bin_packing.first_fit([len(r["input_ids"]) for r in rows], width)
    return sorted(range(len(rows)), key=lambda i: (where[i], offsets[i]))


def demo_lengths(seed: int = 0, count: int = 2000) -> list[int]:
    """Row lengths like the demo mix's at <= 128 tokens (mean ~60, a long tail to 128)."""
    rng = random.Random(seed)
    return [max(8, min(128, int(rng.gauss(60, 25)))) for _ in range(count)]


@pytest.mark.parametrize("name,attn", [(n, a) for n in sorted(MODELS) for a in ("sdpa", "eager")
                                       if (n, a) != ("gemma2", "sdpa")])
def test_binned_logits_and_loss_equal_each_sample_run_alone(name, attn):
    classifier, rows, tokenizer = build(name, attn)
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    width = max(len(r["input_ids"]) for r in rows)
    batch = binned_batch(rows, classifier.model, tokenizer, width)
    model_inputs = inputs(batch)  # collated on the host, before the count
    assert batch["input_ids"].shape[0] < len(rows)  # bins hold several samples: the masks keep them apart
    with torch.no_grad():
        with metrics.HostSyncs() as syncs:
            binned = classifier(**model_inputs)
        alone = [classifier(**inputs(padded_batch([row], tokenizer))) for row in rows]
    assert syncs.counts == {}  # every bin's masks come from the layout: nothing is read on the host
    order = bin_order(rows, width)
    logits = torch.cat([alone[i].logits for i in order])
    assert (binned.logits - logits).abs().max() < FP32_TOL
    assert binned.loss == pytest.approx(torch.stack([out.loss for out in alone]).mean().item(), abs=FP32_TOL)


@pytest.mark.parametrize("name", ["tiny", "tiny_qwen3", "tiny_modernbert"])
def test_binned_gradients_equal_the_padded_batch_gradients(name):
    classifier, rows, tokenizer = build(name)
    twin = copy.deepcopy(classifier)
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 2
    classifier(**inputs(binned_batch(rows, classifier.model, tokenizer))).loss.backward()
    twin(**inputs(padded_batch(rows, tokenizer))).loss.backward()
    assert_same_gradients(classifier, twin)


def test_the_collator_numbers_samples_bin_by_bin_with_restarting_positions():
    rows = [{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1], "labels": 1},
            {"input_ids": [8, 9, 10, 11], "token_type_ids": [0, 1, 1, 1], "labels": 0},
            {"input_ids": [12, 13], "token_type_ids": [0, 1], "labels": 2}]
    batch = bin_packing.BinnedCollator(width=5, pad_token_id=0, position_ids_start=2)(rows)
    # first-fit: [5, 6, 7] opens bin 0, [8..11] does not fit there and opens bin 1, [12, 13] fills bin 0
    assert batch["input_ids"].tolist() == [[5, 6, 7, 12, 13], [8, 9, 10, 11, 0]]
    assert batch["position_ids"].tolist() == [[2, 3, 4, 2, 3], [2, 3, 4, 5, 2]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 1, 1, 0]]
    assert batch["labels"].tolist() == [1, 2, 0]  # samples numbered bin by bin
    layout = batch["packing"]
    assert layout.seq_idx.tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, 3]] and layout.samples == 3  # padding: 3
    assert layout.starts.tolist() == [0, 2, 3]
    assert (batch["num_real_tokens"], batch["num_tokens"]) == (9, 10)


def test_first_fit_places_each_row_where_a_plain_scan_of_the_bins_would():
    """bin_packing.Bins keeps the most room an open bin has to skip scans; a plain first-fit is the reference."""
    for seed, limit in ((0, None), (1, 5), (2, 40)):
        lengths = demo_lengths(seed, count=400)
        room, expected = [], []
        for n in lengths:
            b = next((k for k, r in enumerate(room) if r >= n), None)
            if b is None and (limit is None or len(room) < limit):
                b = len(room)
                room.append(128)
            expected.append((b, 128 - room[b]) if b is not None else (-1, -1))
            if b is not None:
                room[b] -= n
        where, offsets = bin_packing.first_fit(lengths, 128, limit)
        assert list(zip(where, offsets)) == expected


@pytest.mark.parametrize("micro_batch", [16, 256])
def test_bin_batches_hold_every_row_once_in_bins_the_collator_rebuilds(micro_batch):
    lengths = demo_lengths()
    budget = packing.token_budget("auto", micro_batch, lengths)
    sampler = bin_packing.BinSampler(lengths, budget, width=128, seed=3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert len(sampler) == len(batches) == sampler.batches_in_epoch(epoch)
        slots = 0
        for batch in batches:
            rows = [{"input_ids": [7] * lengths[i], "labels": 0} for i in batch]
            collated = bin_packing.BinnedCollator(128, 0)(rows)
            bins = collated["input_ids"].shape[0]
            assert collated["input_ids"].shape[1] == 128 and bins <= sampler.bins
            # the collator's first-fit over the sampler's order places the rows where the sampler did
            assert bin_packing.first_fit([lengths[i] for i in batch], 128, sampler.bins)[0] == \
                bin_packing.first_fit([lengths[i] for i in batch], 128)[0]
            assert collated["num_real_tokens"] == sum(lengths[i] for i in batch)
            slots += collated["num_tokens"]
        assert all(len(set(bin_packing.first_fit([lengths[i] for i in b], 128)[0])) == sampler.bins
                   for b in batches[:-1])  # one batch shape: every batch but the epoch's last fills its bins
        fill = sum(lengths) / slots
        assert fill > 0.9, fill  # first-fit leaves ~4-5% of the bins empty on this mix
    twin = bin_packing.BinSampler(lengths, budget, width=128, seed=3)
    assert twin.batches(1) == sampler.batches(1) != sampler.batches(0)  # a pure function of seed and epoch
    sampler.set_epoch(1, skip_batches=2)
    assert list(sampler) == sampler.batches(1)[2:]  # a resumed run skips what it consumed


def test_bins_fill_more_of_their_tokens_than_bucketed_batches_of_a_large_micro_batch():
    """The padding bins save: at 256 rows a step, length bucketing (the default, 50 batches a bucket) pads more
    than first-fit leaves free in the same tokens' worth of bins."""
    lengths = demo_lengths(count=6400)
    bucketed = bucketing.apply(lengths, 256, 0, True, 50, 0, 1)
    bucketed.set_epoch(0)
    bucketed_fill = sum(lengths) / sum(bucketed.tokens(b) for b in bucketed)
    sampler = bin_packing.BinSampler(lengths, packing.token_budget("auto", 256, lengths), 128, seed=0)
    bins_fill = sum(lengths) / sum(sampler.tokens(b) for b in sampler.batches(0))
    assert bins_fill > bucketed_fill, (bins_fill, bucketed_fill)


def test_data_parallel_ranks_take_disjoint_equal_shares_of_the_bin_batches():
    lengths = demo_lengths(seed=1, count=901)
    one = bin_packing.BinSampler(lengths, 1024, 128, seed=3)
    ranks = [bin_packing.BinSampler(lengths, 1024, 128, seed=3, rank=r, world_size=3) for r in range(3)]
    for sampler in (one, *ranks):
        sampler.set_epoch(0)
    every, shares = one.batches(), [list(r) for r in ranks]
    assert len({len(s) for s in shares}) == 1 and len(shares[0]) == len(every) // 3
    dealt = [b for step in zip(*shares) for b in step]
    assert dealt == every[:len(dealt)] and bucketing.token_imbalance(ranks[0]) < 1.1  # bins: the same work a step


def test_a_binned_batch_splits_into_chunks_of_whole_bins_whose_weighted_losses_add_up():
    classifier, rows, tokenizer = build("tiny")
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    batch = binned_batch(rows, classifier.model, tokenizer)
    chunks = bin_packing.split(batch, 2)
    assert len(chunks) > 1 and sum(share for _, share in chunks) == pytest.approx(1.0)
    assert torch.cat([c["labels"] for c, _ in chunks]).tolist() == batch["labels"].tolist()
    assert sum(c["num_real_tokens"] for c, _ in chunks) == batch["num_real_tokens"]
    with torch.no_grad():
        whole = classifier(**inputs(batch))
        parts = [(classifier(**inputs(chunk)), share) for chunk, share in chunks]
    assert torch.cat([out.logits for out, _ in parts]).sub(whole.logits).abs().max() < FP32_TOL
    assert sum(out.loss * share for out, share in parts).item() == pytest.approx(whole.loss.item(), abs=FP32_TOL)


def test_a_tiny_binned_run_trains_on_bins_of_one_shape(cpu_device):
    from maxout.tracking.tracker import NullTracker
    from maxout.train import train

    from .conftest import TINY

    cfg = loading.load([*TINY, "train.max_steps=4", "data.padding=packed", "data.packing_attention=bins",
                        "data.max_length=64", "data.max_tokens_per_batch=512", "checkpoint.enabled=false"],
                       device=cpu_device)
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert (tracker.params["opt.padding.effective"], tracker.params["opt.packing.effective"]) == ("packed", "bins")
    assert isinstance(result.setup.sampler, bin_packing.BinSampler) and result.setup.sampler.bins == 8
    shapes = {tuple(b["input_ids"].shape) for b in list(result.setup.train_loader)[:-1]}
    assert shapes == {(8, 64)}, shapes
    assert 0.8 < result.metrics["perf/padding_efficiency"] < 1.0  # the bins' free tails are the padding
    per_step = tracker.metrics["train/batch_samples"]
    assert sum(n for _, n in per_step) == result.metrics["train/samples"] and len(per_step) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny_modernbert", "tiny_qwen3"])
def test_on_a_gpu_binned_logits_equal_each_sample_alone_in_bf16(name):
    """SDPA's CUDA kernels with the bins' block-diagonal masks, against each row alone."""
    from .test_packing import BF16_TOL

    classifier, rows, tokenizer = build(name)
    classifier = classifier.to("cuda")
    width = max(len(r["input_ids"]) for r in rows)
    to_cuda = lambda batch: {k: v.to("cuda") for k, v in inputs(batch).items()}  # noqa: E731
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        binned = classifier(**to_cuda(binned_batch(rows, classifier.model, tokenizer, width))).logits.float()
        alone = [classifier(**to_cuda(padded_batch([r], tokenizer))).logits.float() for r in rows]
    assert (binned - torch.cat([alone[i] for i in bin_order(rows, width)])).abs().max() < BF16_TOL


@pytest.mark.parametrize("name,layout", [("tiny_gemma", "bins"), ("gemma_bidirectional", "packed"),
                                         ("tiny_modernbert", "bins"), ("tiny_qwen3", "packed")])
def test_a_packed_forward_traces_as_one_graph(name, layout):
    """Under compile the masks built from the layout (and the pooling) trace into the model's one graph: a break would
    split the step and keep CUDA graphs from recording it whole. The cases cover the mask builders: sliding and full
    causal layers, Gemma 3's bidirectional overlays with mean pooling, ModernBERT's two bidirectional kinds, one
    causal mask. (All 13 architectures x padded, packed and bins traced as one graph on 2026-12-03: ~90 s.)"""
    classifier, rows, tokenizer = build(name)
    for row in rows:
        row["labels"] = 0
    batch = packed_batch(rows, classifier.model) if layout == "packed" else binned_batch(rows, classifier.model,
                                                                                           tokenizer)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(classifier)(**inputs(batch))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
