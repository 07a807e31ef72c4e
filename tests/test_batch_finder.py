"""The batch finder: exact search within the probe bound, the plan that keeps the effective batch, the real probe
against a CPU memory budget (then a whole epoch at the longest length under that budget), the cache, the params a
run logs, and the errors that say what to change."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from maxout import cli, data, loading, modeling
from maxout.train import batch_finder
from maxout.errors import ConfigError, HardwareError
from maxout.optimizations import accumulation, precision as precision_opt
from maxout.train.tensor_memory import GIB, TensorMemory, training_state
from maxout.tracking.tracker import NullTracker
from maxout.train import train
from maxout.train.loop import fit
from maxout.train.setup import build

from .conftest import TINY


def synthetic_memory(true_max: int, per_row: float = 3.0, fixed: float = 100.0):
    """fits(rows): a linear memory model (fixed state + per-row activations) whose largest fitting batch is
    exactly ``true_max``."""
    budget = fixed + per_row * true_max + per_row / 2
    return lambda rows: fixed + per_row * rows <= budget


@pytest.mark.parametrize("upper", [1, 2, 40, 285, 1024])
def test_search_finds_the_true_maximum_within_the_probe_bound(upper):
    bound = math.ceil(math.log2(upper)) + 2
    for true_max in sorted({1, 2, 3, upper // 3, upper // 2, upper - 1, upper, upper + 5} - {0}):
        found = batch_finder.search(synthetic_memory(true_max), upper)
        assert found.max_batch == min(true_max, upper), (true_max, found)
        assert len(found.probes) <= bound, (true_max, found.probes)
        assert all(ok == (rows <= true_max) for rows, ok in found.probes)  # every probe reports the truth


def test_search_exhaustively_over_a_small_range():
    for true_max in range(0, 66):
        found = batch_finder.search(synthetic_memory(true_max), 64)
        assert found.max_batch == min(true_max, 64)
        assert len(found.probes) <= math.ceil(math.log2(64)) + 2


@pytest.mark.parametrize("safe,target,micro,effective", [
    (100, 64, 64, 64),  # everything fits: no accumulation
    (33, 64, 32, 64),  # a divisor of the target: exact
    (7, 16, 4, 16),  # 4 x 4 beats 6 x 3 = 18
    (10, 17, 9, 18),  # a prime target: the balanced split (9 x 2), rounded up with a reason
    (1, 32, 1, 32),
])
def test_micro_batch_keeps_the_effective_batch(safe, target, micro, effective):
    chosen = batch_finder.micro_batch_for(safe, target)
    steps, decision = accumulation.plan(target, chosen)
    assert (chosen, chosen * steps) == (micro, effective)
    assert chosen <= safe and decision.effective == effective


@pytest.fixture(scope="module")
def demo():
    cfg = loading.load(["hardware=cpu", "model=tiny"])
    return data.load(cfg.data), modeling.load_tokenizer(cfg.model)


def load(*overrides, tmp_path):
    return loading.load([*TINY, f"batch_finder.cache_path={tmp_path / 'cache.json'}", *overrides])


def test_find_with_a_synthetic_probe_applies_the_margin_and_keeps_the_target(demo, cpu_device, tmp_path):
    cfg = load("train.target_effective_batch=64", tmp_path=tmp_path)
    result = batch_finder.find(cfg, cpu_device, *demo, probe=synthetic_memory(37))
    assert (result.max_batch, result.safe_batch, result.micro_batch) == (37, 33, 32)
    assert result.upper == math.ceil(64 / 0.9) and not result.cache_hit
    params = result.params()
    assert params["batch_finder.max_batch"] == "37" and params["batch_finder.micro_batch"] == "32"
    assert params["batch_finder.probes"].startswith("1:ok 72:oom")


def test_real_probe_finds_the_budget_limit_then_an_epoch_at_the_longest_length_stays_within_it(
        demo, cpu_device, tmp_path):
    # padding=max_length: every batch of the epoch is as long as the longest row the finder probed with.
    overrides = ["data.padding=max_length", "data.max_length=48", "train.target_effective_batch=256",
                 "model.dropout=0.0", "hardware.precision=fp32"]
    dataset, tokenizer = demo
    demo = (replace(dataset, train=dataset.train.subset(list(range(240)))), tokenizer)  # a short epoch
    cfg = load(*overrides, tmp_path=tmp_path)
    probe = batch_finder.StepProbe.build(cfg, cpu_device, *demo, target=256, budget_bytes=None)
    one, many = probe.peak_bytes(1), probe.peak_bytes(65)
    budget = one + (many - one) * 0.75  # a true limit near 48 rows: inside the range, so the search must bisect
    probe.close()
    cfg = load(*overrides, f"batch_finder.memory_budget_gb={budget / GIB}", tmp_path=tmp_path)
    result = batch_finder.find(cfg, cpu_device, *demo)
    assert 1 < result.max_batch < result.upper and len(result.probes) <= math.ceil(math.log2(result.upper)) + 2
    # The true maximum: the found batch fits the budget and one more row does not.
    check = batch_finder.StepProbe.build(cfg, cpu_device, *demo, target=256, budget_bytes=budget)
    assert check(result.max_batch) and not check(result.max_batch + 1)
    check.close()
    assert result.micro_batch == batch_finder.micro_batch_for(math.floor(result.max_batch * 0.9), 256)

    # A whole epoch at that micro-batch under the same budget: no out-of-memory, no recovery needed.
    cfg = load(*overrides, "train.max_steps=-1", "train.epochs=1", tmp_path=tmp_path)
    setup = build(cfg, cpu_device, *demo, micro_batch=result.micro_batch)
    assert next(iter(setup.train_loader))["input_ids"].shape[1] == result.sequence_length == 48
    with TensorMemory(budget, baseline=training_state(setup.model, setup.optimizer)) as memory:
        metrics = fit(setup, NullTracker(), progress=False)
    assert setup.oom.events == [] and memory.peak <= budget
    assert metrics["train/samples"] == len(demo[0].train)


def test_train_with_batch_size_auto_logs_the_search_and_reuses_the_cache(demo, cpu_device, tmp_path, monkeypatch,
                                                                           tokenized_rows):
    cfg = load("train.batch_size=auto", "train.target_effective_batch=32", "batch_finder.memory_budget_gb=4",
               tmp_path=tmp_path)
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False, dataset=demo[0])
    # The finder's longest row, its probe's set-up and the run share one tokenization (they made three before)
    assert tokenized_rows[len(demo[0].train)] == 1
    p = tracker.params
    assert p["batch_finder.cache_hit"] == "false" and p["batch_finder.probes"] == "1:ok 36:ok"
    assert p["batch_finder.micro_batch"] == p["derived.micro_batch"] == "32"
    assert p["derived.effective_batch"] == "32" and result.metrics["train/samples"] == 3 * 32
    assert "cpu budget 4.0 GiB" in p["batch_finder.key"] and "model tiny" in p["batch_finder.key"]

    def no_probe(*args, **kwargs):
        raise AssertionError("a cached result must not probe again")

    monkeypatch.setattr(batch_finder.StepProbe, "build", no_probe)
    again = batch_finder.find(cfg, cpu_device, *demo)
    assert again.cache_hit and again.micro_batch == 32 and again.probes == [(1, True), (36, True)]
    # Another precision is another key: it would have to search. The key holds the precision the run really uses,
    # so "another" is the one this CPU did not resolve to: fp32 where bf16 is native; where it is not (every
    # request resolves to fp32 there), bf16 on the same CPU with native bf16.
    other_cfg, other_device = cfg, replace(cpu_device, bf16=True)
    if precision_opt.resolve(cfg.hardware.precision, cpu_device).effective != "fp32":
        other_device = cpu_device
        other_cfg = load("train.batch_size=auto", "train.target_effective_batch=32",
                         "batch_finder.memory_budget_gb=4", "hardware.precision=fp32", tmp_path=tmp_path)
    length, budget = again.sequence_length, 4 * GIB
    assert (batch_finder.cache_key(other_cfg, other_device, length, budget)
            != batch_finder.cache_key(cfg, cpu_device, length, budget))
    with pytest.raises(AssertionError, match="must not probe"):
        batch_finder.find(other_cfg, other_device, *demo)


def test_a_budget_below_one_sample_says_how_much_one_needs(no_mlflow_store, capsys, tmp_path):
    mlflow_store = no_mlflow_store
    code = cli.main(["train", *TINY, *mlflow_store["overrides"], "train.batch_size=auto",
                     "batch_finder.memory_budget_gb=0.001", f"batch_finder.cache_path={tmp_path / 'c.json'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert "batch_finder.memory_budget_gb=0.001 is below what one sample needs" in err
    assert "raise batch_finder.memory_budget_gb to at least" in err
    assert not (mlflow_store["dir"] / "mlflow.db").exists()  # it failed before a run started


def test_a_model_that_cannot_fit_one_sample_says_what_to_change(demo, cpu_device, tmp_path):
    cfg = load("train.batch_size=auto", tmp_path=tmp_path)
    with pytest.raises(HardwareError, match="does not fit even one sample per micro-batch: lower data.max_length, "
                                            "set hardware.gradient_checkpointing=true"):
        batch_finder.find(cfg, cpu_device, *demo, probe=lambda rows: False)


def test_batch_size_auto_needs_a_target_effective_batch(demo, cpu_device, tmp_path):
    cfg = load("train.batch_size=auto", "train.target_effective_batch=null", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match="needs train.target_effective_batch"):
        batch_finder.find(cfg, cpu_device, *demo)


@pytest.mark.parametrize("override,message", [
    ("batch_finder.memory_budget_gb=-1", "batch_finder.memory_budget_gb=-1.0 must be > 0"),
    ("batch_finder.max_batch=0", "batch_finder.max_batch=0 must be >= 1"),
])
def test_bad_finder_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        loading.load(["hardware=cpu", override])


def test_tensor_memory_counts_live_storages_and_fails_past_its_limit():
    kept = torch.zeros(256)  # exists before: only counted as baseline
    with TensorMemory(baseline=[kept]) as memory:
        a = torch.empty(1024)  # 4 KiB
        view = a[:10]  # a view allocates nothing
        b = a * 2  # 4 KiB more
        a.add_(1)  # in place: nothing
        del a, view, b
    assert memory.baseline == 1024 and memory.peak == 1024 + 8192 and memory.current == 1024
    with pytest.raises(torch.OutOfMemoryError, match="CPU memory budget exceeded"):
        with TensorMemory(limit_bytes=4096):
            torch.empty(2048)


@pytest.mark.gpu
def test_gpu_probe_finds_the_device_limit_under_a_memory_fraction(demo, tmp_path):
    from maxout import hardware

    device = hardware.detect()
    cfg = loading.load(["hardware=auto", "model=tiny", "tracking=none", "train.target_effective_batch=512",
                        "hardware.compile=false", f"batch_finder.cache_path={tmp_path / 'c.json'}"], device=device)
    probe = batch_finder.StepProbe.build(cfg, device, *demo, target=512, budget_bytes=None)
    one, many = probe.peak_bytes(1), probe.peak_bytes(64)
    probe.close()
    total = torch.cuda.get_device_properties(0).total_memory
    # Room for roughly 128 rows (the caching allocator's overhead makes the exact limit device-specific).
    torch.cuda.set_per_process_memory_fraction(min(1.0, (one + (many - one) * 2) / total))
    try:
        result = batch_finder.find(cfg, device, *demo)
        assert not result.capped and result.max_batch >= 16
        assert any(not ok and rows > result.max_batch for rows, ok in result.probes)  # a real OOM bounded it
        assert len(result.probes) <= math.ceil(math.log2(result.upper)) + 2
        check = batch_finder.StepProbe.build(cfg, device, *demo, target=512, budget_bytes=None)
        assert check(result.safe_batch)  # the margin leaves room on a fresh model
        check.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_model_that_cannot_fit_one_sample_is_a_clear_error(demo, tmp_path):
    from maxout import hardware

    device = hardware.detect()
    cfg = loading.load(["hardware=auto", "model=tiny", "tracking=none", "batch_finder.cache=false"], device=device)
    torch.cuda.set_per_process_memory_fraction(1e-6)
    try:
        with pytest.raises(HardwareError, match="does not fit even one sample per micro-batch on"):
            batch_finder.find(cfg, device, *demo)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
