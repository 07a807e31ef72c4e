"""The model families beyond BERT: decoders as classifiers (Gemma 3 causal and bidirectional, Qwen3, Llama-class),
ModernBERT. Tiny random configs train end to end into a real MLflow store and log a model that predicts through
the pyfunc and `maxout predict`; each real-checkpoint group loads offline from model.path (a tiny model of its
architecture saved there); attention direction, pad / eos and LoRA targets are checked on the built objects.
"""

from __future__ import annotations

import re

import mlflow
import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from maxout import cli, loading, modeling
from maxout.errors import ConfigError
from maxout.optimizations import lora
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY, load_pyfunc, runs_in

ROWS = pd.DataFrame({"post": ["I lie awake every night and cannot fall asleep.", "We painted the fence on Sunday."],
                     "criterion": ["Sleep disturbance", "Fatigue or loss of energy"]})
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=512)


def minilm_tokenizer():
    return modeling.load_tokenizer(loading.load(["hardware=cpu", "model=tiny"]).model)


def tokenizer_dir(tmp_path, pad: bool, eos: bool) -> str:
    """MiniLM's tokenizer saved without its pad token (Llama-style), with or without an eos token."""
    tokenizer = minilm_tokenizer()
    tokenizer.pad_token = "[PAD]" if pad else None
    tokenizer.eos_token = "[SEP]" if eos else None
    path = tmp_path / f"tokenizer-pad{int(pad)}-eos{int(eos)}"
    tokenizer.save_pretrained(path)
    return str(path)


def train_and_log(store: dict, *overrides: str):
    assert cli.main(["train", *TINY, *store["overrides"], *overrides, "--no-progress"]) == 0
    (run,) = runs_in(store["uri"])
    assert run.info.status == "FINISHED"
    return run


def predicts(store: dict, run, tmp_path) -> pd.DataFrame:
    """The logged model through the pyfunc and through `maxout predict`: the same probabilities."""
    mlflow.set_tracking_uri(store["uri"])
    uri = run.data.tags["maxout.model_uri"]
    out = load_pyfunc(uri).predict(ROWS)
    assert list(out.columns) == ["label", "prob_0", "prob_1"] and len(out) == 2
    assert (out[["prob_0", "prob_1"]].sum(axis=1) - 1).abs().max() < 1e-5
    source, target = tmp_path / "in.csv", tmp_path / "out.csv"
    ROWS.to_csv(source, index=False)
    assert cli.main(["predict", "--model", uri, "--input", str(source), "--output", str(target),
                     "--tracking-uri", store["uri"], "--no-progress"]) == 0
    cli_out = pd.read_csv(target)
    assert (cli_out[["prob_0", "prob_1"]] - out[["prob_0", "prob_1"]]).abs().max().max() < 1e-5
    return out


def logged_predictor(store: dict, run):
    """The Predictor inside the logged pyfunc (the transformers model, or it with maxout's pooling)."""
    mlflow.set_tracking_uri(store["uri"])
    return load_pyfunc(run.data.tags["maxout.model_uri"]).unwrap_python_model().predictor


@pytest.mark.slow
def test_gemma_causal_with_last_pooling_trains_logs_and_predicts(mlflow_store, tmp_path):
    run = train_and_log(mlflow_store, "model=tiny_gemma", "model.adapter=lora")
    params = run.data.params
    assert params["cfg.model.attention"] == "causal" and params["derived.pooling"] == "last"
    assert params["opt.adapter.effective"] == "lora" and "q_proj" in params["derived.lora_target_modules"]
    predictor = logged_predictor(mlflow_store, run)
    assert predictor.meta.pooling == "last" and predictor.model.config.use_bidirectional_attention is False
    predicts(mlflow_store, run, tmp_path)


@pytest.mark.slow
def test_gemma_bidirectional_with_mean_pooling_trains_logs_and_predicts(mlflow_store, tmp_path):
    run = train_and_log(mlflow_store, "model=tiny_gemma", "model.attention=bidirectional", "model.pooling=mean")
    assert run.data.params["derived.pooling"] == "mean"
    predictor = logged_predictor(mlflow_store, run)
    assert predictor.model.pooling == "mean"  # the logged model pools as it was trained
    config = predictor.model.config
    assert config.use_bidirectional_attention is True and config.to_dict()["sliding_window"] == 32  # as configured
    predicts(mlflow_store, run, tmp_path)


@pytest.mark.slow
def test_qwen3_with_dora_and_an_eos_only_tokenizer_trains_logs_and_predicts(mlflow_store, tmp_path):
    run = train_and_log(mlflow_store, "model=tiny_qwen3", "model.adapter=dora",
                        f"model.tokenizer={tokenizer_dir(tmp_path, pad=False, eos=True)}")
    params = run.data.params
    assert params["opt.adapter.effective"] == "dora"
    assert set(params["derived.lora_target_modules"].split(" ")[0].split(",")) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    predictor = logged_predictor(mlflow_store, run)  # the eos ([SEP]) pads, and the config says so
    assert predictor.model.config.pad_token_id == 102 and predictor.tokenizer.pad_token == "[SEP]"
    predicts(mlflow_store, run, tmp_path)


@pytest.mark.slow
def test_modernbert_trains_logs_and_predicts(mlflow_store, tmp_path):
    run = train_and_log(mlflow_store, "model=tiny_modernbert")
    assert "derived.pooling" not in run.data.params  # its own head
    assert logged_predictor(mlflow_store, run).model.config.model_type == "modernbert"
    predicts(mlflow_store, run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model,adapter", [("tiny_gemma", "dora"), ("tiny_qwen3", "lora"),
                                           ("tiny_modernbert", "lora"), ("tiny_modernbert", "dora")])
def test_each_tiny_model_trains_with_lora_and_dora(model, adapter, cpu_device):
    cfg = loading.load([*TINY, f"model={model}", f"model.adapter={adapter}", "checkpoint.enabled=false",
                        "hardware.gradient_checkpointing=true"], device=cpu_device)
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert tracker.params["opt.adapter.effective"] == adapter
    assert tracker.params["opt.gradient_checkpointing.effective"] == "true"
    assert 0 < int(tracker.params["derived.params_trainable"]) < int(tracker.params["derived.params_total"])
    assert result.metrics["train/final_loss"] == result.metrics["train/final_loss"]  # not NaN


# Each real-checkpoint group, from a model.path holding a tiny model of its architecture (no weights here).
GROUPS = {
    "gemma3_270m": dict(SMALL, model_type="gemma3_text", num_key_value_heads=1, head_dim=16,
                        query_pre_attn_scalar=16, sliding_window=32),
    "gemma3_1b": dict(SMALL, model_type="gemma3_text", num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16),
    "gemma2_2b": dict(SMALL, model_type="gemma2", num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16),
    "qwen3_0_6b": dict(SMALL, model_type="qwen3", num_key_value_heads=1, head_dim=16),
    "llama3_2_1b": dict(SMALL, model_type="llama", num_key_value_heads=1),
    "modernbert_base": dict(SMALL, model_type="modernbert", bos_token_id=101, eos_token_id=102, cls_token_id=101,
                            sep_token_id=102),
    "modernbert_large": dict(SMALL, model_type="modernbert", bos_token_id=101, eos_token_id=102, cls_token_id=101,
                             sep_token_id=102),
}


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_model_group_trains_offline_from_model_path(group, tmp_path, cpu_device):
    fields = dict(GROUPS[group])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=30522, pad_token_id=0, **fields)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    tokenizer = minilm_tokenizer()
    if group == "llama3_2_1b":  # Llama's tokenizer has no pad token: the eos pads
        tokenizer.pad_token, tokenizer.eos_token = None, "[SEP]"
    tokenizer.save_pretrained(tmp_path)
    cfg = loading.load([*TINY, f"model={group}", f"model.path={tmp_path}", "checkpoint.enabled=false",
                        "train.max_steps=2", "hardware.attn_implementation=sdpa"], device=cpu_device)
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert result.metrics["train/samples"] == 32 and result.setup.model_config.model_type == config.model_type
    if group == "gemma2_2b":  # Gemma 2 has no SDPA path: the attention decision falls back and says why
        assert tracker.params["opt.attention.effective"] == "eager"
        assert "no SDPA attention" in tracker.params["opt.attention.reason"]
    if group == "llama3_2_1b":
        assert result.setup.model_config.pad_token_id == 102 and result.setup.tokenizer.pad_token == "[SEP]"


# ------------------------------------------------------------------------------------- attention, pad, LoRA


def hidden_of_first_token(cfg, ids: torch.Tensor) -> torch.Tensor:
    tokenizer = minilm_tokenizer()
    config = modeling.build_config(cfg, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = modeling.load_model(cfg, config, "sdpa").eval()
    with torch.no_grad():
        return model.base_model(input_ids=ids).last_hidden_state[0, 0]


@pytest.mark.parametrize("attention,sees_later_tokens", [("causal", False), ("bidirectional", True)])
def test_gemma_attention_direction_decides_whether_the_first_token_sees_the_last(attention, sees_later_tokens):
    cfg = loading.load(["hardware=cpu", "model=tiny_gemma", f"model.attention={attention}"]).model
    ids = torch.randint(1000, 2000, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, -1] += 1
    differs = (hidden_of_first_token(cfg, ids) - hidden_of_first_token(cfg, changed)).abs().max() > 1e-6
    assert bool(differs) is sees_later_tokens


@pytest.mark.parametrize("model,attention,message", [
    ("tiny_qwen3", "bidirectional", "model.attention=bidirectional: Qwen3Config (qwen3) has no switch for "
                                    "bidirectional attention"),
    ("tiny", "causal", "model.attention=causal: bert is an encoder"),
])
def test_an_attention_direction_the_model_cannot_take_is_a_one_line_error(model, attention, message):
    cfg = loading.load(["hardware=cpu", f"model={model}", f"model.attention={attention}"]).model
    with pytest.raises(ConfigError, match=re.escape(message)):
        modeling.build_config(cfg, ["0", "1"], 30522, 0)


def test_gemma2_s_switch_is_refused_because_transformers_does_not_apply_it():
    cfg = loading.load(["hardware=cpu", "model=tiny_qwen3", "model.attention=bidirectional"]).model
    cfg.architecture = dict(SMALL, model_type="gemma2", num_key_value_heads=1, head_dim=16)
    with pytest.raises(ConfigError, match=r"Gemma2Config \(gemma2\) has no switch .* \(model types that have one: "
                                          r"gemma3_text\)"):
        modeling.build_config(cfg, ["0", "1"], 30522, 0)


def test_a_tokenizer_without_pad_pads_with_eos_and_one_without_either_is_an_error(tmp_path):
    cfg = loading.load(["hardware=cpu", "model=tiny_qwen3"]).model
    cfg.tokenizer = tokenizer_dir(tmp_path, pad=False, eos=True)
    tokenizer = modeling.load_tokenizer(cfg)
    assert (tokenizer.pad_token, tokenizer.pad_token_id, tokenizer.padding_side) == ("[SEP]", 102, "right")
    config = modeling.build_config(cfg, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)
    assert config.pad_token_id == 102 and config.use_cache is False
    cfg.tokenizer = tokenizer_dir(tmp_path, pad=False, eos=False)
    with pytest.raises(ConfigError, match="has neither a pad token nor an eos token"):
        modeling.load_tokenizer(cfg)


@pytest.mark.parametrize("model_type,fields,expected", [
    ("bert", SMALL, {"query", "key", "value", "dense"}),
    ("gemma3_text", dict(SMALL, num_key_value_heads=1, head_dim=16),
     {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ("modernbert", SMALL, {"Wqkv", "Wo", "Wi", "dense"}),
])
def test_lora_targets_are_found_from_the_models_own_linear_layers(model_type, fields, expected):
    config = AutoConfig.for_model(model_type, vocab_size=100, pad_token_id=0, num_labels=2, **fields)
    model = AutoModelForSequenceClassification.from_config(config)
    targets = lora.target_modules(model, "all-linear")
    assert {t.rsplit(".", 1)[-1] for t in targets} == expected
    assert not any(t.split(".")[0] in ("score", "classifier") for t in targets)  # the head trains whole
    attention_only = lora.target_modules(model, "attention")
    assert attention_only and set(attention_only) < set(targets)
    assert all("attn" in t.lower() or "attention" in t.lower() for t in attention_only)
