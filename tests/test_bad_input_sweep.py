"""The bad-input sweep: every case is a real command line (plus environment) that a user could type. Each must give
ONE line on stderr naming the bad value and the fix, exit 2 for usage errors (1 for a missing file or server), and
leave no MLflow run behind: loading.py and train/prepare.py find them all before a run, a model load or a compile.
The README's troubleshooting section lists these cases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest

from maxout import cli

from .conftest import runs_in
from .services import free_port

TRAIN = ["train", "model=tiny", "train.max_steps=1"]
PAIR_DATA = ["data=files", "data.text_column=post", "data.text_pair_column=criterion"]


def write(tmp_path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def train_file(name: str, content: str) -> Callable:
    return lambda tmp: f"data.train_path={write(tmp, name, content)}"


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
    "resume_typo": Case(["resume=latest"], 2, ["resume='latest' is invalid: use resume=auto or an MLflow run id"]),
    "keep_no_checkpoints": Case(["checkpoint.keep_last=0"], 2, ["checkpoint.keep_last=0 must be >= 1"]),
    "unknown_adapter": Case(["model.adapter=qlora"], 2, ["model.adapter='qlora' (valid: none, lora, dora)"]),
    "validation_split_above_one": Case(["data.validation_split=1.5"], 2,
                                       ["data.validation_split=1.5 must be in (0, 1)"]),
    "pretrained_without_a_path": Case(["model.source=pretrained", "model.name_or_path="], 2,
                                      ["has source=pretrained but neither", "set model.path=DIR"]),
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
                                                          "CUDA_VISIBLE_DEVICES=i maxout hpo"],
                               env={"WORLD_SIZE": "2", "RANK": "0"}, train=False),
    # --- data files (runtime errors: exit 1; several problems are listed together)
    "both_data_files_missing": Case([*PAIR_DATA, "data.train_path=nope/train.csv",
                                     "data.validation_path=nope/validation.csv"], 1,
                                    ["2 problems: data file not found: nope/train.csv",
                                     "data file not found: nope/validation.csv", "check data.train_path"]),
    "unknown_extension": Case([*PAIR_DATA, train_file("train.txt", "post,criterion,label\na,b,0\n")], 1,
                              ["cannot tell the format of", "train.txt", "set data.format to one of csv, jsonl"]),
    "single_label": Case([*PAIR_DATA, train_file("t.csv", "post,criterion,label\na,b,0\nc,d,0\ne,f,0\n")], 1,
                         ["data has a single label ['0']", "check data.label_column='label'"]),
    "malformed_jsonl": Case([*PAIR_DATA, train_file("t.jsonl", '{"post": "a", "criterion": "b", "label": 0}\n{oops\n')],
                            1, ["cannot read", "t.jsonl as jsonl"]),
    "missing_pair_column": Case([*PAIR_DATA, train_file("t.csv", "post,label\na,0\nb,1\n")], 1,
                                ["data.text_pair_column='criterion' is not a column of", "(columns: post, label)"]),
    # --- model paths
    "model_path_missing": Case(["model=bert_base", "model.path=/nonexistent/bert"], 1,
                               ["model.path='/nonexistent/bert' is not a directory",
                                "point it at a save_pretrained folder"]),
    "model_path_without_config": Case(["model=bert_base", lambda tmp: f"model.path={tmp}"], 1,
                                      ["has no config.json", "point it at a save_pretrained folder"]),
    "tokenizer_path_missing": Case(["model.tokenizer=/nonexistent/tokenizer"], 1,
                                   ["cannot load the tokenizer for model 'tiny' from /nonexistent/tokenizer",
                                    "set model.tokenizer to a tokenizer directory or 'package'"]),
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
}


def run(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exit_:  # argparse
        return int(exit_.code)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, mlflow_store, capsys, monkeypatch):
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
