"""MFU's numerator: training FLOPs per real token, against hand counts (BERT-base; small Qwen3 and Gemma 3
classifiers with grouped-query attention, a head width that is not the hidden size, causal and sliding-window
attention) and against torch's own FLOP counter over a real forward and backward pass (full fine-tuning, frozen
encoder, LoRA)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForSequenceClassification, BertConfig, Gemma3TextConfig, Qwen3Config

from maxout import metrics
from maxout.optimizations import freeze, lora


def build(config):
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")


def bert(layers=12, d=768, ff=3072, heads=12, labels=2):
    return BertConfig(vocab_size=30522, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=ff, num_labels=labels)


def test_bert_base_full_fine_tuning_is_6n_plus_the_attention_term():
    L, d, ff, S = 12, 768, 3072, 100.0
    per_token = L * (4 * d * d + 2 * d * ff)  # q, k, v, o and the two feed-forward matrices: 84.9M
    per_sequence = d * d + d * 2  # pooler and classifier: they see the [CLS] row only
    expected = 6 * per_token + 6 * per_sequence / S + 12 * L * d * S
    count = metrics.count_flops(build(bert()), bert(), S)
    assert per_token == 84_934_656
    assert count.total == pytest.approx(expected, rel=1e-12)
    assert count.forward == pytest.approx(2 * per_token + 2 * per_sequence / S)
    assert metrics.flops_per_token(build(bert()), bert(), S) == pytest.approx(expected, rel=1e-12)


def test_attention_modules_without_is_causal_are_counted_from_the_config():
    """transformers 4's BERT attention has no `is_causal`: the layers come from the config instead."""
    config = bert(layers=2, d=64, ff=128, heads=4)
    model = build(config)
    expected = metrics.count_flops(model, config, 30.0)
    for module in model.modules():
        if hasattr(module, "is_causal"):
            del module.is_causal
    assert metrics.count_flops(model, config, 30.0) == expected and expected.attention == 12 * 2 * 64 * 30.0


def test_bert_base_with_a_frozen_encoder_runs_no_backward_through_it():
    L, d, ff, S = 12, 768, 3072, 100.0
    model = build(bert())
    freeze.apply(model)
    count = metrics.count_flops(model, bert(), S)
    classifier = d * 2
    assert count.forward == pytest.approx(2 * L * (4 * d * d + 2 * d * ff) + 2 * (d * d + classifier) / S)
    assert count.weight_grads == pytest.approx(2 * classifier / S)  # only the head's weights train
    assert count.input_grads == 0  # nothing trainable below any layer: no backward through activations
    assert count.attention == pytest.approx(4 * L * d * S)  # forward only


def qwen3(layers=2):
    return Qwen3Config(vocab_size=1000, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=128, num_labels=3, pad_token_id=0)


def test_a_qwen3_classifier_counts_gqa_projections_as_weights_and_causal_attention_at_half():
    d, A, kv, ff, L, labels, S = 64, 4 * 32, 2 * 32, 128, 2, 3, 40.0
    # q: d x A, k and v: d x kv each (grouped-query attention: 2 key/value heads for 4 query heads), o: A x d,
    # gate and up: d x ff, down: ff x d; the score head runs on every token (transformers then picks the last)
    per_layer = d * A + 2 * d * kv + A * d + 3 * d * ff
    expected = 6 * (L * per_layer + d * labels) + L * 4 * A * (S / 2) * 3
    assert A != d  # the attention width is heads x head_dim, not the hidden size
    assert metrics.count_flops(build(qwen3()), qwen3(), S).total == pytest.approx(expected, rel=1e-12)


def test_a_gemma3_classifier_caps_keys_at_its_sliding_window():
    config = Gemma3TextConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, intermediate_size=64, num_labels=2, pad_token_id=0,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    d, A, kv, ff, S, w = 32, 64, 16, 64, 10.0, 4
    per_layer = d * A + 2 * d * kv + A * d + 3 * d * ff
    # causal: a query at position i sees min(i, w) keys; over S positions that averages w - w^2 / (2S)
    sliding, full = w - w * w / (2 * S), S / 2
    expected = 6 * (2 * per_layer + d * 2) + 4 * A * (sliding + full) * 3
    assert metrics.count_flops(build(config), config, S).total == pytest.approx(expected, rel=1e-12)


def measured_per_token(model, config, seq_len: int) -> float:
    """FLOPs torch's own counter sees in one real forward and backward over one row, per token."""
    torch.manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (1, seq_len))
    model.eval()  # no dropout: same computation as the probe
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([1])).loss.backward()
    return counter.get_total_flops() / seq_len


@pytest.mark.parametrize("variant", ["full", "frozen", "lora"])
def test_the_count_equals_what_autograd_computes(variant):
    config = bert(layers=2, d=64, ff=128, heads=4)
    model = build(config)
    if variant == "frozen":
        freeze.apply(model)
    if variant == "lora":
        model = lora.apply(model, "lora", 8, 16, 0.0, "all-linear")
    seq_len = 24
    expected = measured_per_token(model, config, seq_len)
    model.zero_grad(set_to_none=True)
    assert metrics.flops_per_token(model, config, seq_len) == pytest.approx(expected, rel=1e-9)


def test_the_probe_leaves_the_model_as_it_found_it():
    model = build(bert(layers=1, d=32, ff=64, heads=2))
    model.train()
    state = torch.get_rng_state()
    metrics.flops_per_token(model, model.config, 16.0)
    assert model.training and torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class FakeNvml:
    """NVML's calls the sampler makes, on a device that is always 73% busy; counts nvmlInit / nvmlShutdown."""

    def __init__(self):
        self.inits = self.shutdowns = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Utilization", (), {"gpu": 73, "memory": 10})()


def test_gpu_utilization_of_a_window_shorter_than_the_sampling_interval_is_still_read():
    """A short training window (a few fast steps) ended before the thread's first sample: the run logged no GPU
    utilization at all. The reading at stop() covers NVML's last sample period, the window's end."""
    nvml = FakeNvml()
    sampler = metrics.UtilizationSampler(interval_s=60.0, nvml=nvml).start()
    assert sampler.stop() == {"gpu/utilization_mean": 73.0, "gpu/utilization_max": 73.0}
    assert (nvml.inits, nvml.shutdowns) == (1, 1)  # NVML's reference count is given back


def test_gpu_utilization_is_absent_without_nvml():
    class NoNvml(FakeNvml):
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert metrics.UtilizationSampler(nvml=NoNvml()).start().stop() == {}


class FakeEvent:
    """A timing event on a fake clock that advances 1 ms per record()."""

    clock = 0.0

    def record(self):
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def elapsed_time(self, other):
        return other.at - self.at


def test_gpu_figures_cover_the_steady_window_only():
    """NVML starts when warm-up ends (compile and CUDA-graph recording are not steady work), pauses around an
    evaluation, and CUDA-event busy time counts the steady steps only (issue 37: NVML logged 7.4% next to 24% MFU,
    sampled from before step 1 to after the last evaluation)."""
    nvml = FakeNvml()
    window = metrics.SteadyWindow(metrics.UtilizationSampler(interval_s=60.0, nvml=nvml), metrics.DeviceBusy(FakeEvent))
    meter = metrics.Throughput("cpu", warmup_steps=2, window=window)
    meter.start()

    def step():
        meter.begin_step()
        meter.add(4, 40, 64)
        meter.step()

    step()
    assert nvml.inits == 0 and not window.busy.active  # warm-up: nothing sampled
    step()  # the last warm-up step opens the window
    assert nvml.inits == 1 and window.busy.active
    step(), step()
    meter.pause()  # an evaluation
    meter.begin_step(), meter.step()  # not timed while paused
    meter.resume()
    step()
    summary = meter.summary()
    figures = window.stop(summary["time/steady_window_s"])
    assert window.busy.steps == 3 and figures["gpu/busy_s"] == pytest.approx(0.003)  # 1 ms per steady step
    assert figures["gpu/busy_share"] == pytest.approx(0.003 / summary["time/steady_window_s"])
    assert figures["gpu/utilization_mean"] == 73.0 and (nvml.inits, nvml.shutdowns) == (1, 1)


def test_a_paused_sampler_takes_no_closing_reading():
    nvml = FakeNvml()
    sampler = metrics.UtilizationSampler(interval_s=60.0, nvml=nvml).start()
    sampler.pause()
    assert sampler.stop() == {} and nvml.shutdowns == 1


def test_no_steady_window_no_gpu_figures():
    """A run shorter than its warm-up never opens the window: no utilization, no busy time (and NVML untouched)."""
    nvml = FakeNvml()
    window = metrics.SteadyWindow(metrics.UtilizationSampler(nvml=nvml), metrics.DeviceBusy(FakeEvent))
    meter = metrics.Throughput("cpu", warmup_steps=3, window=window)
    meter.start()
    meter.begin_step(), meter.step()
    assert window.stop(meter.summary().get("time/steady_window_s")) == {} and nvml.inits == 0
