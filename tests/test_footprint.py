"""train/footprint.py: a model's size counted without allocating it, and the refusals before anything is built."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from maxout import hardware, loading, modeling
from maxout.errors import ConfigError
from maxout.train import footprint


def model_config(*overrides: str):
    return loading.load(["hardware=cpu", "tracking=none", *overrides])


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma", "tiny_qwen3", "tiny_modernbert"])
def test_the_extrapolated_count_is_the_count_of_the_model_built(model):
    """Builds of 1 and 2 layers give the rest: the estimate for 6 layers is what 6 layers hold, to the byte."""
    cfg = model_config(f"model={model}", "model.architecture.num_hidden_layers=6")
    tokenizer = modeling.load_tokenizer(cfg.model)
    key, layers = footprint.many_layers(cfg.model, footprint.PROBE_LAYERS[-1])
    assert (key, layers) == ("num_hidden_layers", 6)
    if "layer_types" in cfg.model.architecture:  # per-layer lists follow the count
        cfg.model.architecture["layer_types"] = ["sliding_attention", "full_attention"] * 3
    estimate = footprint.estimate(cfg.model, tokenizer)
    config = modeling.build_config(cfg.model, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)
    with torch.device("meta"):
        built = AutoModelForSequenceClassification.from_config(config)
    params = list(built.parameters())
    assert estimate.params == sum(p.numel() for p in params)
    assert estimate.weight_bytes == sum(p.numel() * p.element_size() for p in params)
    assert estimate.training_bytes() == 4 * estimate.weight_bytes  # full fine-tune: + gradient + 2 moments


def test_an_adapter_trains_a_small_share():
    cfg = model_config("model=tiny", "model.adapter=lora")
    tokenizer = modeling.load_tokenizer(cfg.model)
    found = footprint.estimate(cfg.model, tokenizer)
    assert 0 < found.trainable_bytes < found.weight_bytes / 10


def test_layers_no_machine_holds_are_refused_in_a_second_naming_the_key():
    cfg = model_config("model=tiny", "model.architecture.num_hidden_layers=2147483648")
    tokenizer = modeling.load_tokenizer(cfg.model)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^model\.architecture\.num_hidden_layers=2147483648: model 'tiny' would "
                                          r"have 1\.8\de\+13 parameters"):
        footprint.check(cfg, tokenizer, hardware.detect())
    assert time.perf_counter() - started < 5


def test_a_model_over_the_gpu_memory_is_refused_and_one_under_it_is_not(cpu_device):
    """The budget is the device's memory: the GPU's on CUDA, the host's on a CPU."""
    cfg = model_config("model=tiny", "model.architecture.hidden_size=4096", "model.architecture.num_attention_heads=32",
                       "model.architecture.intermediate_size=16384", "model.architecture.num_hidden_layers=8")
    tokenizer = modeling.load_tokenizer(cfg.model)
    found = footprint.estimate(cfg.model, tokenizer)
    small = dataclasses.replace(cpu_device, kind="cuda", name="small GPU",
                                total_memory_gb=found.training_bytes() / 2**30 / 2)
    with pytest.raises(ConfigError, match=r"more than the .* GiB of this GPU \(small GPU\)"):
        footprint.check(cfg, tokenizer, small)
    big = dataclasses.replace(small, total_memory_gb=found.training_bytes() / 2**30 * 2)
    assert footprint.check(cfg, tokenizer, big) == found


@pytest.mark.parametrize("override, named", [
    ("+model.architecture.type_vocab_size=0", "model.architecture.type_vocab_size=0"),
    ("+model.architecture.initializer_range=-1.0", "model.architecture.initializer_range=-1.0"),
    ("+model.architecture.chunk_size_feed_forward=8", "model.architecture.chunk_size_feed_forward=8"),
])
def test_what_fails_only_in_a_forward_pass_is_found_by_the_one_layer_copy(override, named):
    cfg = model_config("model=tiny", override)
    tokenizer = modeling.load_tokenizer(cfg.model)
    footprint.check(cfg, tokenizer, hardware.detect())  # the meta build takes them
    with pytest.raises(ConfigError, match=rf"^{named.replace('.', r'[.]')}: transformers .*\(a first forward pass"):
        footprint.smoke(cfg, tokenizer)


def test_a_default_the_library_speaks_of_is_named():
    """~num_attention_heads leaves BERT's 12, which does not divide the tiny model's 32: both are named."""
    cfg = model_config("model=tiny", "~model.architecture.num_attention_heads")
    tokenizer = modeling.load_tokenizer(cfg.model)
    with pytest.raises(ConfigError, match=r"model\.architecture\.hidden_size=32, "
                                          r"model\.architecture\.num_attention_heads=12 \(the default\)"):
        footprint.check(cfg, tokenizer, hardware.detect())
