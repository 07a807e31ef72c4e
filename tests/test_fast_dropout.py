"""Fast dropout keeps dropout's meaning: keep probability, scaling, gradients, seeding, and where it applies."""

from __future__ import annotations

import pytest
import torch

from maxout.optimizations import fast_dropout

from .conftest import fake_cuda


def test_each_element_is_kept_with_probability_one_minus_p_and_scaled_like_torch():
    x = torch.full((1000, 1000), 3.0)
    for p in (0.1, 0.5):
        out = fast_dropout.dropout(x, p)
        kept = out != 0
        # 1e6 draws: the kept fraction's standard deviation is <= 0.0005, so 0.003 is six of them.
        assert kept.float().mean().item() == pytest.approx(1 - p, abs=0.003)
        reference = torch.nn.functional.dropout(x, p)  # torch's own: the kept values, bit for bit
        assert torch.equal(out[kept], torch.full_like(out[kept], reference.max().item()))
    rows = fast_dropout.dropout(x, 0.1) != 0  # no pattern along either axis (e.g. a repeated 64-bit word)
    assert rows.float().mean(1).std().item() < 0.02 and rows.float().mean(0).std().item() < 0.02


def test_the_mask_comes_from_torchs_seeded_generator():
    torch.manual_seed(7)
    a = fast_dropout.keep_mask(torch.Size([4, 33]), 0.3)
    b = fast_dropout.keep_mask(torch.Size([4, 33]), 0.3)
    torch.manual_seed(7)
    assert torch.equal(fast_dropout.keep_mask(torch.Size([4, 33]), 0.3), a) and not torch.equal(a, b)


def test_gradient_is_the_same_scaled_mask():
    x = torch.randn(64, 48, requires_grad=True)
    out = fast_dropout.dropout(x, 0.25)
    out.sum().backward()
    assert torch.equal(x.grad, (out.detach() != 0).float() / 0.75)


def test_bf16_keeps_its_dtype_and_edge_cases_match_torch():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    assert fast_dropout.dropout(x, 0.1).dtype == torch.bfloat16
    assert fast_dropout.dropout(x, 0.1, training=False) is x and fast_dropout.dropout(x, 0.0) is x
    assert torch.count_nonzero(fast_dropout.dropout(x, 1.0)) == 0
    y = x.clone()
    assert fast_dropout.dropout(y, 0.5, inplace=True) is y
    with pytest.raises(ValueError, match="between 0 and 1, but got 1.5"):
        fast_dropout.dropout(x, 1.5)


def test_the_mode_answers_every_dropout_in_a_bert_forward_and_nothing_in_eval(monkeypatch):
    """nn.Dropout modules and the eager attention's functional dropout both go through it; eval is unchanged."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32, attn_implementation="eager")
    model = BertForSequenceClassification(cfg)
    ids = torch.randint(0, 50, (3, 9))
    calls = []
    real = fast_dropout.dropout
    monkeypatch.setattr(fast_dropout, "dropout", lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    forward = fast_dropout.apply(model)
    forward(input_ids=ids)
    # embeddings + per layer (attention probabilities, attention output, feed-forward output) + classifier
    assert len(calls) == 1 + 3 * 2 + 1 and (3, 2, 9, 9) in calls
    model.eval()
    with torch.no_grad():
        assert torch.equal(forward(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_model_trains_with_it():
    """A few steps of the tiny model learn a separable toy task as well with fast dropout as without."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    ids = torch.randint(5, 50, (64, 12))
    ids[:32, 0], ids[32:, 0] = 1, 2
    labels = torch.tensor([0] * 32 + [1] * 32)
    losses = {}
    for on in (False, True):
        torch.manual_seed(1)
        model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=2, intermediate_size=64,
                                                         attn_implementation="eager"))
        forward = fast_dropout.apply(model) if on else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(40):
            loss = forward(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[on] = loss.item()
    assert losses[True] < 0.1 and losses[False] < 0.1, losses


def test_support_reasons(cpu_device):
    assert fast_dropout.supported(fake_cuda(), compiled=False, gradient_checkpointing=False)[1].startswith(
        "CUDA's dropout is already one fused kernel")
    assert fast_dropout.supported(cpu_device, False, False) == (True, "")
    assert "inductor" in fast_dropout.supported(cpu_device, True, False)[1]
    assert "recomputes dropout" in fast_dropout.supported(cpu_device, False, True)[1]
