"""The bad-input sweep: every case is a real command line (plus environment) that a user could type. Each must give
ONE line on stderr naming the bad value and the fix, exit 2 for usage errors (1 for a missing file or server), and
leave no MLflow run behind: loading.py and train/prepare.py find them all before a run, a model load or a compile.
docs/how-to/bad-input.md lists these cases.

Below them, what can only go wrong once a run has started (divergence, a signal while the model is logged) and
prediction on rows without text: never a FINISHED run with a wrong model, never a model that did not finish
logging picked by predict or the registry."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlflow
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from maxout import cli
from maxout.errors import MaxoutError
from maxout.registry import promotion

from .conftest import MLFLOW_VARS, ROOT, TINY, load_pyfunc, runs_in
from .services import free_port
from .store_template import new_store

TRAIN = ["train", "model=tiny", "train.max_steps=1"]
PAIR_DATA = ["data=files", "data.text_column=post", "data.text_pair_column=criterion"]


V_NULL_TEXT = '{"post": "a", "criterion": "b", "label": 0}\n{"post": null, "criterion": "d", "label": 1}\n'


def write(tmp_path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def train_file(name: str, content: str) -> Callable:
    return lambda tmp: f"data.train_path={write(tmp, name, content)}"


def held_out_file(name: str, content: str) -> Callable:
    """data.test_path (not named test_*: pytest would collect it)."""
    return lambda tmp: f"data.test_path={write(tmp, name, content)}"


def tokenizer_without_pad_or_eos(tmp_path) -> str:
    from maxout import loading, modeling

    tokenizer = modeling.load_tokenizer(loading.load(["hardware=cpu", "model=tiny"]).model)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return str(tmp_path / "tokenizer")


@dataclass
class Case:
    args: list  # after `maxout`; callables get tmp_path
    code: int
    expect: list  # substrings: the bad value and the fix
    env: dict = field(default_factory=dict)  # values may be callables of tmp_path
    train: bool = True  # a `maxout train` command (gets the temporary store and directories)


CASES = {
    # --- config values and overrides (usage errors: exit 2)
    "negative_lr": Case(["train.lr=-1"], 2, ["train.lr=-1.0 must be > 0"]),
    "three_problems_at_once": Case(["train.lr=-1", "train.epochs=0", "data.max_length=4"], 2,
                                   ["3 problems: ", "train.epochs=0 must be >= 1", "train.lr=-1.0 must be > 0",
                                    "data.max_length=4 must be in [8, 8192]"]),
    "schedule_typo": Case(["train.schedule=cosin"], 2, ["train.schedule='cosin' (valid: linear, cosine, constant)"]),
    "unknown_precision": Case(["hardware.precision=fp8"], 2, ["hardware.precision='fp8' (valid: bf16, fp16, fp32)"]),
    "lr_not_a_number": Case(["train.lr=fast"], 2, ["train.lr=fast", "'fast'", "could not be converted to Float"]),
    "unknown_data_option": Case(["data=nope"], 2, ["unknown data 'nope' (valid data options: files, nli_demo)"]),
    "unknown_key_and_bad_value": Case(["train.learning_rate=1", "train.epochs=0"], 2,
                                      ["2 problems: ", "unknown config key 'train.learning_rate'",
                                       "valid keys under 'train': epochs, max_steps, lr", "train.epochs=0"]),
    "override_without_value": Case(["train.lr"], 2, ["train.lr", "overrides look like key=value"]),
    "key_inside_an_unselected_section": Case(["hpo.study_name=all"], 2,  # found by test_fuzz_config.py
                                             ["hpo.study_name: the hpo section is null unless one of its options is "
                                              "selected; add hpo=NAME before it (valid hpo options: default)"]),
    "interpolation_to_nowhere": Case(["hardware.name=${nope}"], 2,  # found by test_fuzz_config.py
                                     ["hardware.name: Interpolation key 'nope' not found; fix the ${...} "
                                      "interpolation or quote the value"]),
    "resume_typo": Case(["resume=latest"], 2, ["resume='latest' is invalid: use resume=auto or an MLflow run id"]),
    "keep_no_checkpoints": Case(["checkpoint.keep_last=0"], 2, ["checkpoint.keep_last=0 must be >= 1"]),
    "async_save_of_one_file": Case(["checkpoint.async_save=true", "checkpoint.sharded=false"], 2,
                                   ["checkpoint.async_save=true needs checkpoint.sharded=true"]),
    "async_save_not_a_bool": Case(["checkpoint.async_save=later"], 2, ["checkpoint.async_save", "'later'"]),
    "negative_upload_retry": Case(["tracking.upload_retry_s=-1"], 2, ["tracking.upload_retry_s=-1.0 must be >= 0"]),
    "unknown_adapter": Case(["model.adapter=qlora"], 2, ["model.adapter='qlora' (valid: none, lora, dora)"]),
    "validation_split_above_one": Case(["data.validation_split=1.5"], 2,
                                       ["data.validation_split=1.5 must be in (0, 1)"]),
    "select_best_never_logged": Case(["train.select_best=eval/f2"], 2,
                                     ["train.select_best='eval/f2' is not a metric evaluation logs",
                                      "valid: eval/loss, eval/accuracy, eval/macro_f1, eval/<precision|recall|f1>/<label>"]),
    "select_best_label_not_in_data": Case(["train.select_best=eval/f1/2"], 2,
                                          ["train.select_best='eval/f1/2' names label '2', which evaluation never logs",
                                           "valid: eval/f1/0, eval/f1/1"]),
    "negative_patience": Case(["train.early_stopping.patience=-1"], 2,
                              ["train.early_stopping.patience=-1 must be >= 0", "0: no early stopping"]),
    "early_stopping_without_a_metric": Case(["train.early_stopping.patience=2", "train.select_best=last"], 2,
                                            ["train.early_stopping.patience=2 watches train.select_best's metric",
                                             "set train.select_best to a metric"]),
    "pretrained_without_a_path": Case(["model.source=pretrained", "model.name_or_path="], 2,
                                      ["has source=pretrained but neither", "set model.path=DIR"]),
    # non-finite numbers: OmegaConf reads inf and nan as floats; one walk over every numeric setting refuses them
    "infinite_lr": Case(["train.lr=inf"], 2, ["train.lr=inf is not a finite number", "(default: 5e-05)"]),
    "nan_lr": Case(["train.lr=nan"], 2, ["train.lr=nan is not a finite number"]),
    "non_finite_in_every_section": Case(["train.max_grad_norm=-inf", "data.validation_split=nan",
                                         "registry.lock_ttl_s=inf", "+model.architecture.hidden_dropout_prob=nan"],
                                        2, ["4 problems: ", "train.max_grad_norm=-inf is not a finite number",
                                            "data.validation_split=nan is not a finite number",
                                            "registry.lock_ttl_s=inf is not a finite number",
                                            "model.architecture.hidden_dropout_prob=nan is not a finite number"]),
    # data.max_length beyond the model's position embeddings: refused before the run (a clamp would train on
    # something else than the config says)
    "max_length_beyond_positions": Case(["data.max_length=2048"], 2,
                                        ["data.max_length=2048 is more than model 'tiny' can take: 512 tokens "
                                         "(model.architecture.max_position_embeddings=512); set data.max_length=512 or "
                                         "less"]),
    "max_length_beyond_a_smaller_table": Case(["model.architecture.max_position_embeddings=64", "data.max_length=65"],
                                              2, ["data.max_length=65 is more than model 'tiny' can take: 64"]),
    "distributed_strategy_typo": Case(["distributed.strategy=fsdpp", "distributed.timeout_s=0"], 2,
                                      ["2 problems: ", "distributed.strategy='fsdpp' (valid: auto, ddp, fsdp, none)",
                                       "distributed.timeout_s=0.0 must be > 0"]),
    # --- data parallelism: the launcher's arguments and torchrun's environment
    "nproc_per_node_zero": Case(["--nproc-per-node", "0"], 2,
                                ["argument --nproc-per-node: '0' is not a positive integer"]),
    "nproc_per_node_under_torchrun": Case(["--nproc-per-node", "2"], 2,
                                          ["--nproc-per-node 2: this process was started by a launcher already",
                                           "drop --nproc-per-node"], env={"WORLD_SIZE": "2", "RANK": "0"}),
    "nccl_without_a_gpu": Case(["distributed.backend=nccl"], 2,
                               ["distributed.backend=nccl needs CUDA devices and none is visible",
                                "use distributed.backend=gloo"],
                               env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),
    "no_strategy_under_torchrun": Case(["distributed.strategy=none"], 2,
                                       ["distributed.strategy=none with 2 processes", "use auto, ddp or fsdp"],
                                       env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}),
    "hpo_under_torchrun": Case(["hpo", "model=tiny"], 2, ["maxout hpo runs one trial per process",
                                                          "run maxout hpo --workers N"],
                               env={"WORLD_SIZE": "2", "RANK": "0"}, train=False),
    # --- data files (runtime errors: exit 1; several problems are listed together)
    "both_data_files_missing": Case([*PAIR_DATA, "data.train_path=nope/train.csv",
                                     "data.validation_path=nope/validation.csv"], 1,
                                    ["2 problems: data file not found: nope/train.csv",
                                     "data file not found: nope/validation.csv", "check data.train_path"]),
    "unknown_extension": Case([*PAIR_DATA, train_file("train.txt", "post,criterion,label\na,b,0\n")], 1,
                              ["cannot tell the format of", "train.txt", "set data.format to one of csv, jsonl"]),
    "single_label": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\na,b,0\nc,d,0\ne,f,0\n")], 1,
                         ["data has a single label ['0'] (", "t.csv): classification needs at least 2",
                          "check data.label_column='label'"]),  # the file: found by test_fuzz_data.py
    "malformed_jsonl": Case([*PAIR_DATA, train_file("t.jsonl", '{"post": "a", "criterion": "b", "label": 0}\n{oops\n')],
                            1, ["cannot read", "t.jsonl as jsonl"]),
    "test_labels_outside_the_training_set": Case(
        [held_out_file("test.csv", "post,criterion,label\na,b,0\nc,d,2\ne,f,maybe\n")], 1, ["test.csv: label(s) ['2', 'maybe'] (2 rows) are not in the training label set ['0', '1']",
            "drop those rows or list every label in data.labels"]),
    "missing_pair_column": Case([*PAIR_DATA, train_file("t.csv", "post,label\na,0\nb,1\n")], 1,
                                ["data.text_pair_column='criterion' is not a column of", "(columns: post, label)"]),
    # empty cells: a label '' would become a class of its own, an empty text the string 'nan' or 'None'
    "empty_label_cells": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\na,b,0\nc,d,\ne,f,1\ng,h,\n"
                                                                "i,j,1\n")], 1,
                              ["t.csv has 2 of 5 rows with an empty cell ('label': 2; rows 2 and 4)",
                               "set data.on_missing=drop"]),
    "null_labels_in_jsonl": Case([*PAIR_DATA, train_file("t.jsonl", "".join(
        f'{{"post": "p{i}", "criterion": "c", "label": {"null" if i % 3 == 0 else i % 2}}}\n' for i in range(9)))],
                                 1, ["t.jsonl has 3 of 9 rows with an empty cell ('label': 3; rows 1, 4 and 7)"]),
    "blank_text_cells": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\n  ,b,0\nc,,1\ne,f,1\ng,h,0\n")],
                             1, ["t.csv has 2 of 4 rows with an empty cell ('post': 1, 'criterion': 1; rows 1 and 2)"]),
    "empty_text_in_validation_file": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\na,b,0\nc,d,1\n"),
                                           lambda tmp: f"data.validation_path={write(tmp, 'v.jsonl', V_NULL_TEXT)}"],
                                          1, ["v.jsonl has 1 of 2 rows with an empty cell ('post': 1; row 2)"]),
    # found by test_fuzz_data.py: a number or mapping where text is expected was trained as its str() ("1",
    # "{'a': 1}"), though prediction refuses it
    "non_text_cells_in_jsonl": Case([*PAIR_DATA, train_file("t.jsonl", "".join(
        f'{{"post": {json.dumps(p)}, "criterion": "c", "label": {i % 2}}}\n'
        for i, p in enumerate(["a", 42, "b", {"a": 1}, "c", ""])))], 1,
                                    ["t.jsonl has 3 of 6 rows with an empty or non-text cell ('post': 1 empty and 2 "
                                     "not text; rows 2, 4 and 6); fill them in as text, or set data.on_missing=drop"]),
    # found by make fuzz: pandas took a first row with a cell too many for an index column, shifting every column
    "ragged_row_in_csv": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\na,b,0,extra\nc,d,1\n")], 1,
                              ["t.csv row 1 has 4 cells but the header has 3 (post, criterion, label)"]),
    "data_path_is_a_directory": Case([*PAIR_DATA, lambda tmp: f"data.train_path={tmp}"], 1,
                                     ["is a directory (resolved to", "not a file; point data.train_path"]),
    "validation_path_is_a_directory": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\na,b,0\nc,d,1\n"),
                                            lambda tmp: f"data.validation_path={tmp}"], 1, ["is a directory"]),
    "duplicate_columns": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label,label\na,b,0,1\nc,d,1,0\n")], 1,
                              ["t.csv has the column 'label' 2 times (columns: post, criterion, label, label)",
                               "rename or remove the repeats"]),
    "duplicate_text_column_in_tsv": Case([*PAIR_DATA, train_file("t.tsv", "post\tpost\tcriterion\tlabel\na\tx\tb\t0\n")],
                                         1, ["has the column 'post' 2 times"]),
    "duplicate_keys_in_jsonl": Case([*PAIR_DATA, train_file("t.jsonl", '{"post": "a", "criterion": "b", "label": 0}\n'
                                                                      '{"post": "a", "label": 1, "label": 0}\n')], 1,
                                    ["t.jsonl has the column 'label' 2 times"]),
    # --- model paths
    "model_path_missing": Case(["model=bert_base", "model.path=/nonexistent/bert"], 1,
                               ["model.path='/nonexistent/bert' is not a directory",
                                "point it at a save_pretrained folder"]),
    "model_path_without_config": Case(["model=bert_base", lambda tmp: f"model.path={tmp}"], 1,
                                      ["has no config.json", "point it at a save_pretrained folder"]),
    "decoder_bidirectional_without_a_switch": Case(["model=tiny_qwen3", "model.attention=bidirectional"], 2,
                                                   ["model.attention=bidirectional: Qwen3Config (qwen3) has no switch",
                                                    "use model.attention=causal or a Gemma 3 model"]),
    "tokenizer_without_pad_or_eos": Case([lambda tmp: f"model.tokenizer={tokenizer_without_pad_or_eos(tmp)}"], 2,
                                         ["has neither a pad token nor an eos token",
                                          "set model.tokenizer to a tokenizer that has one"]),
    "tokenizer_path_missing": Case(["model.tokenizer=/nonexistent/tokenizer"], 1,
                                   ["cannot load the tokenizer for model 'tiny' from /nonexistent/tokenizer",
                                    "set model.tokenizer to a tokenizer directory, 'bundled' or 'package'"]),
    # --- environment: tracking store, directories, resume target
    "tracking_server_down": Case([], 1, ["MLflow tracking server unreachable at http://127.0.0.1:",
                                         "start it (make platform-up) or use tracking=local"],
                                 env={"MLFLOW_TRACKING_URI": lambda tmp: f"http://127.0.0.1:{free_port()}"}),
    "tracking_uri_unsupported_scheme": Case([], 2, ["MLFLOW_TRACKING_URI='ftp://mlflow.example'",
                                                    "valid schemes: http, https, sqlite", "use e.g. sqlite:///"],
                                            env={"MLFLOW_TRACKING_URI": "ftp://mlflow.example"}),
    "tracking_uri_is_a_file_store": Case([], 2, ["MLFLOW_TRACKING_URI='./mlruns' is not a tracking store MLflow 3"],
                                         env={"MLFLOW_TRACKING_URI": "./mlruns"}),
    "unknown_experiment_id": Case([], 2, ["MLFLOW_EXPERIMENT_ID='424242' is not an experiment",
                                          "set MLFLOW_EXPERIMENT_NAME instead"],
                                  env={"MLFLOW_EXPERIMENT_ID": "424242"}),
    "maxout_root_missing": Case([], 2, ["MAXOUT_ROOT='/nonexistent/root' is not a directory",
                                        "point it at the project root or unset it"],
                                env={"MAXOUT_ROOT": "/nonexistent/root"}),
    "checkpoint_dir_is_a_file": Case([lambda tmp: f"checkpoint.dir={write(tmp, 'f', '')}/ckpt"], 2,
                                     ["checkpoint.dir=", "is not a directory", "point checkpoint.dir at a writable"]),
    "spool_dir_is_a_file": Case([lambda tmp: f"tracking.spool_dir={write(tmp, 'g', '')}"], 2,
                                ["tracking.spool_dir=", "point tracking.spool_dir at a writable directory"]),
    "resume_unknown_run": Case([f"resume={'0' * 32}"], 2, [f"resume={'0' * 32}: no checkpoint of that run",
                                                            "use resume=auto"]),
    # --- the command line itself (argparse and maxout's own arguments)
    "unknown_command": Case(["trian"], 2, ["invalid choice: 'trian' (choose from 'train'",
                                           "see `maxout --help`"], train=False),
    "misspelled_flag": Case([*TRAIN, "--no-progres"], 2, ["unrecognized arguments: --no-progres"], train=False),
    "unbalanced_quotes": Case(["--overrides", "train.lr='3e-5"], 2,
                              ["--overrides \"train.lr='3e-5\" cannot be split", "balance its quotes"]),
    "tracking_without_subcommand": Case(["tracking"], 2, ["required: SUBCOMMAND", "see `maxout tracking --help`"],
                                        train=False),
    "replay_missing_spool": Case(["tracking", "replay", "/nonexistent/run.jsonl"], 2,
                                 ["spool file not found: /nonexistent/run.jsonl", "pass files from"], train=False),
    "replay_not_a_spool": Case(["tracking", "replay", lambda tmp: write(tmp, "x.jsonl", '{"a": 1}\n')], 2,
                               ["is not a maxout spool file", "pass a file from"], train=False),
    "register_unknown_run": Case(["registry", "register", "nli", "0" * 32, "--tracking-uri",
                                  lambda tmp: f"sqlite:///{tmp / 'mlflow.db'}"], 1,
                                 [f"run '{'0' * 32}' is not in the tracking store", "give the id"], train=False),
}


def run(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exit_:  # argparse
        return int(exit_.code)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, no_mlflow_store, capsys, monkeypatch):
    mlflow_store = no_mlflow_store
    case = CASES[name]
    args = [a(tmp_path) if callable(a) else a for a in case.args]
    if case.train:
        args = [*TRAIN, *mlflow_store["overrides"], f"checkpoint.dir={tmp_path / 'ckpt'}",
                f"tracking.spool_dir={tmp_path / 'spool'}", *args, "--no-progress"]
    for key, value in case.env.items():
        monkeypatch.setenv(key, value(tmp_path) if callable(value) else value)
    code = run(args)
    err = capsys.readouterr().err.strip()
    assert err.startswith("maxout: error: ") and "\n" not in err, err
    assert code == case.code, err
    missing = [part for part in case.expect if part not in err]
    assert not missing, (missing, err)
    # Nothing started, so nothing is left RUNNING (a store never opened holds no run, and opening it costs seconds).
    assert not (mlflow_store["dir"] / "mlflow.db").exists() or runs_in(mlflow_store["uri"]) == []


# ------------------------------------------------------------------------------------------------------------
# After the run started: the run ends FAILED (KILLED on a signal) with the reason, and no model is logged or
# registered. These train the tiny model for a few steps.

def only_run(uri: str):
    runs = runs_in(uri)
    assert len(runs) == 1, [r.info.status for r in runs]
    return runs[0]


def logged_models(uri: str) -> list:
    client = mlflow.MlflowClient(tracking_uri=uri)
    return list(client.search_logged_models([e.experiment_id for e in client.search_experiments()]))


def registered(uri: str) -> list[str]:
    return [m.name for m in mlflow.MlflowClient(tracking_uri=uri).search_registered_models()]


def train_args(tmp_path, store, *extra: str) -> list[str]:
    return ["train", "model=tiny", "hardware=cpu", *store["overrides"], f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"tracking.spool_dir={tmp_path / 'spool'}", *extra, "--no-progress"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the start-up banner comes first
    assert err.startswith("maxout: error: "), err
    return err


# lr=1e9: Adam moves every weight by ~1e9 at step 1, so step 2's forward pass overflows (loss NaN). The watch
# records step 2 on the device and the run fails at the next point where the loop syncs anyway: wherever that
# is, the step named is the one where it began. With one step only, no training loss ever sees the bad weights:
# the evaluation loss does.
DIVERGING = ["train.lr=1e9", "registry.name=diverged"]


@pytest.mark.parametrize("extra, step, what", [
    (["train.max_steps=6", "train.log_every=1"], 2, "loss nan"),
    (["train.max_steps=6", "train.log_every=50", "train.max_grad_norm=0"], 2, "loss nan"),
    (["train.max_steps=6", "train.log_every=50", "checkpoint.every_n_steps=1", "hardware.precision=fp32"], 2,
     "loss nan"),
    (["train.max_steps=1"], 1, "the weights after it give an evaluation loss of nan"),
], ids=["found_at_the_next_log_step", "clipping_off_found_at_the_end", "fp32_found_before_a_checkpoint",
        "last_update_found_by_evaluation"])
def test_a_diverging_run_fails_at_the_step_it_began_and_logs_no_model(extra, step, what, tmp_path, mlflow_store,
                                                                      capsys):
    code = run(train_args(tmp_path, mlflow_store, *DIVERGING, *extra))
    err = one_line(capsys)
    assert code == 1, err
    assert f"training diverged at step {step}: {what}" in err and "lower train.lr (now 1e+09)" in err, err
    assert ("clip gradients (train.max_grad_norm=1.0)" in err) == ("train.max_grad_norm=0" in extra), err
    run_ = only_run(mlflow_store["uri"])
    assert run_.info.status == "FAILED" and run_.data.tags["maxout.diverged_at_step"] == str(step)
    assert f"training diverged at step {step}" in run_.data.tags["maxout.status_reason"]
    assert "maxout.model_uri" not in run_.data.tags and "eval/accuracy" not in run_.data.metrics  # never scored
    assert logged_models(mlflow_store["uri"]) == [] and registered(mlflow_store["uri"]) == []
    saved = sorted(p.name for p in (tmp_path / "ckpt").rglob("step-*.pt"))
    assert saved == (["step-00000001.pt"] if "checkpoint.every_n_steps=1" in extra else []), saved


def test_empty_rows_dropped_on_request_are_counted(tmp_path, mlflow_store, capsys):
    rows = "".join(f"p{i},c{i},{'' if i % 5 == 0 else i % 2}\n" for i in range(40))  # 8 empty labels
    train_path = write(tmp_path, "t.csv", "post,criterion,label\n" + rows + " ,c,1\n")  # and a blank post
    code = run(train_args(tmp_path, mlflow_store, *PAIR_DATA, f"data.train_path={train_path}",
                          "data.on_missing=drop", "train.max_steps=1"))
    assert code == 0, capsys.readouterr().err
    assert "data.on_missing=drop: left out 9 train rows" in capsys.readouterr().err
    params = only_run(mlflow_store["uri"]).data.params
    assert params["derived.rows_dropped_train"] == "9" and params["derived.labels"] == "0,1"
    assert int(params["derived.train_samples"]) + int(params["derived.validation_samples"]) == 32


def test_a_signal_while_the_model_is_logged_leaves_it_failed_never_pending(tmp_path, mlflow_store, capsys,
                                                                          monkeypatch):
    """SIGTERM arrives while the model's files are uploaded: MLflow marks a model FAILED on an Exception, but a
    signal is not one, and the model stayed PENDING. Now: FAILED, the run KILLED, nothing registered, and
    predict refuses the model."""
    upload = mlflow.MlflowClient.log_model_artifacts

    def interrupted(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Terminated in this thread, right here
        return upload(self, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_model_artifacts", interrupted)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = run(train_args(tmp_path, mlflow_store, "train.max_steps=2", "registry.name=interrupted"))
    finally:
        signal.signal(signal.SIGTERM, handler)  # cli.main installed its own, which ignores a second SIGTERM
    monkeypatch.undo()
    assert code == 143 and capsys.readouterr().err.strip().endswith("maxout: terminated (SIGTERM)")
    uri = mlflow_store["uri"]
    run_ = only_run(uri)
    assert run_.info.status == "KILLED" and "maxout.model_uri" not in run_.data.tags
    [model] = logged_models(uri)
    assert str(model.status) == "FAILED" and registered(uri) == []
    source = write(tmp_path, "in.csv", "post,criterion\na,b\n")
    code = run(["predict", "--model", f"models:/{model.model_id}", "--input", source, "--tracking-uri", uri,
                "--no-progress"])
    assert code == 1 and f"its logged model {model.model_id} is FAILED" in one_line(capsys)
    with pytest.raises(MaxoutError, match="is FAILED"):
        promotion.register(mlflow.MlflowClient(tracking_uri=uri), "by-hand", model.model_uri, run_.info.run_id)
    assert registered(uri) == []


# ------------------------------------------------------------------------------------------------------------
# Prediction on rows without text: one policy for `maxout predict --on-missing`, the pyfunc's `on_missing` param
# and `mlflow models serve` (test_registry_e2e.py serves it): error (default, names the rows), skip, empty.

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model trained once, registered as `blank@champion` in a SQLite store."""
    root = tmp_path_factory.mktemp("predict")
    uri = new_store(root / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:  # module fixtures run before conftest's per-test isolation
        mp.chdir(ROOT)
        for var in MLFLOW_VARS:
            mp.delenv(var, raising=False)
        code = cli.main(["train", *TINY, "tracking=local", f"tracking.uri={uri}", "tracking.system_metrics=false",
                         f"tracking.artifact_location={(root / 'art').as_uri()}", f"checkpoint.dir={root / 'ckpt'}",
                         f"tracking.spool_dir={root / 'spool'}", "registry.name=blank", "--no-progress"])
    assert code == 0
    return {"uri": uri, "champion": "models:/blank@champion"}


BLANKS = ('{"post": "I cannot sleep at night.", "criterion": "Sleep disturbance"}\n'
          '{"post": null, "criterion": "Sleep disturbance"}\n'
          '{"post": "We painted the fence.", "criterion": "   "}\n'
          '{"post": 42, "criterion": "Fatigue"}\n'
          '{"criterion": "Fatigue"}\n'
          '{"post": "Tired all day.", "criterion": "Fatigue"}\n')


def predict(model, tmp_path, content: str, *extra: str, name: str = "in.jsonl") -> tuple[int, str]:
    source, out = write(tmp_path, name, content), tmp_path / "out.csv"
    code = run(["predict", "--model", model["champion"], "--input", source, "--output", str(out),
                "--tracking-uri", model["uri"], "--no-progress", *extra])
    return code, str(out)


def test_predict_refuses_rows_without_text_naming_them(model, tmp_path, capsys):
    code, out = predict(model, tmp_path, BLANKS)
    err = one_line(capsys)
    assert code == 1 and not Path(out).exists()
    assert ("4 input rows have no text to predict from ('post': 2 empty or null and 1 not a string, 'criterion': "
            "1 empty or null; rows 2, 3, 4 and 5); fix them, or use --on-missing=skip") in err, err


def test_predict_skips_or_empties_rows_without_text_when_asked_and_counts_them(model, tmp_path, capsys):
    code, out = predict(model, tmp_path, BLANKS, "--on-missing=skip")
    assert code == 0
    assert "--on-missing=skip: 4 of 6 rows had no text and were not predicted (empty label): rows 2, 3, 4 and 5" \
        in capsys.readouterr().err
    skipped = pd.read_csv(out, dtype={"label": str})
    assert len(skipped) == 6 and skipped["label"].isna().tolist() == [False, True, True, True, True, False]
    assert skipped["prob_0"].isna().tolist() == skipped["label"].isna().tolist()
    code, out = predict(model, tmp_path, BLANKS, "--on-missing=empty")
    assert code == 0 and "4 of 6 rows had no text and were predicted as empty text" in capsys.readouterr().err
    emptied = pd.read_csv(out, dtype={"label": str})
    assert emptied["label"].notna().all() and (emptied[["prob_0", "prob_1"]].sum(axis=1) - 1).abs().max() < 1e-5
    kept = [0, 5]  # rows with text: the same answer under every policy
    assert (emptied.loc[kept, "prob_0"] - skipped.loc[kept, "prob_0"]).abs().max() < 1e-6


def test_predict_reads_csv_digits_as_text_and_refuses_a_directory(model, tmp_path, capsys):
    code, out = predict(model, tmp_path, "post,criterion\n42,7\n,Fatigue\n", name="in.csv")
    assert code == 1 and "1 input rows have no text to predict from ('post': 1 empty or null; row 2)" in \
        one_line(capsys)
    code = run(["predict", "--model", model["champion"], "--input", str(tmp_path), "--tracking-uri", model["uri"]])
    assert code == 1 and f"--input {tmp_path} is a directory; give a file" in one_line(capsys)


def test_the_pyfunc_applies_the_same_policy(model):
    mlflow.set_tracking_uri(model["uri"])
    pyfunc = load_pyfunc(model["champion"])
    frame = pd.DataFrame({"post": ["I cannot sleep.", None, ""], "criterion": ["Sleep", "Sleep", "Fatigue"]})
    with pytest.raises(MlflowException, match=r"2 input rows have no text to predict from \('post': 2 empty or "
                                              r"null; rows 2 and 3\); fix them, or use params \{\"on_missing\": "
                                              r"\"skip\"\}"):
        pyfunc.predict(frame)
    skipped = pyfunc.predict(frame, params={"on_missing": "skip"})
    assert skipped["label"].isna().tolist() == [False, True, True]
    assert pyfunc.predict(frame, params={"on_missing": "empty"})["label"].notna().all()
    with pytest.raises(MlflowException, match=r"on_missing='drop' \(valid: error, skip, empty\)"):
        pyfunc.predict(frame, params={"on_missing": "drop"})


def test_predict_never_uses_a_model_whose_logging_did_not_finish(model, tmp_path, capsys):
    """A SIGKILL mid-upload leaves a PENDING logged model (no handler runs): predict and registration refuse it."""
    client = mlflow.MlflowClient(tracking_uri=model["uri"])
    run_ = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    pending = client.create_logged_model(run_.info.experiment_id, name="model", source_run_id=run_.info.run_id)
    source = write(tmp_path, "in.csv", "post,criterion\na,b\n")
    code = run(["predict", "--model", f"models:/{pending.model_id}", "--input", source, "--tracking-uri",
                model["uri"], "--no-progress"])
    assert code == 1 and f"its logged model {pending.model_id} is PENDING (its logging has not finished" in \
        one_line(capsys)
    with pytest.raises(MaxoutError, match="is PENDING"):
        promotion.register(client, "blank", f"models:/{pending.model_id}", run_.info.run_id)
    assert [int(v.version) for v in client.search_model_versions("name='blank'")] == [1]
