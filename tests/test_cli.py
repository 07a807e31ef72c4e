"""Bad input on the command line: one line on stderr naming the bad value and what is valid, a non-zero exit,
and no MLflow run left behind (these all fail before a run starts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from maxout import cli
from maxout.errors import ConfigError

from . import warm_maxout
from .conftest import HEAVY_IMPORTS_PROBE, ROOT, runs_in

TINY_LOCAL = ["model=tiny", "train.max_steps=1"]


def bad_file(tmp_path, name, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return f"data.train_path={path}"


FILES = ["data=files", "data.text_column=post", "data.text_pair_column=criterion"]
CASES = {
    "unknown_hardware": (["hardware=tpu9"], 2, r"unknown hardware 'tpu9' (valid hardware options: a100, auto, cpu"),
    "unknown_model": (["model=gpt9"], 2, "unknown model 'gpt9' (valid model options: bert_base,"),
    "unknown_key": (["train.learning_rate=1"], 2, "unknown config key 'train.learning_rate'"),
    "missing_data_file": (["data.train_path=nope/train.csv"], 1, "data file not found: nope/train.csv"),
    "missing_text_column": (FILES + [lambda p: bad_file(p, "t.csv", b"body,criterion,label\na,b,0\nc,d,1\n")], 1,
                            "data.text_column='post' is not a column of"),
    "missing_label_column": (FILES + [lambda p: bad_file(p, "t.csv", b"post,criterion,y\na,b,0\n")], 1,
                             "data.label_column='label' is not a column of"),
    "empty_dataset": (FILES + [lambda p: bad_file(p, "t.csv", b"post,criterion,label\n")], 1,
                      "the training set must not be empty"),
    "label_outside_set": (FILES + ["data.labels=[0,1]", lambda p: bad_file(p, "t.csv", b"post,criterion,label\na,b,0\nc,d,5\n")],
                          1, "label '5' in"),
    "non_utf8": (FILES + [lambda p: bad_file(p, "t.csv", "post,criterion,label\ncaf\xe9,b,0\nx,y,1\n".encode("latin-1"))],
                 1, "is not valid UTF-8"),
    "batch_size_zero": (["train.batch_size=0"], 2, "train.batch_size=0 is invalid: use a positive integer or 'auto'"),
    "batch_size_negative": (["hardware.batch_size=-8"], 2, "hardware.batch_size=-8 is invalid"),
    "gpu_profile_without_gpu": (["hardware=rtx4090"], 1,
                                "hardware profile 'rtx4090' needs a CUDA GPU (hardware.requires_cuda=true) but none"),
    "missing_offline_model": (["model=bert_base", "model.name_or_path=nobody/no-such-model"], 1,
                              "is not available offline"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_nonzero_and_leaves_no_run(name, tmp_path, mlflow_store, capsys):
    overrides, code, message = CASES[name]
    overrides = [o(tmp_path) if callable(o) else o for o in overrides]
    assert cli.main(["train", *TINY_LOCAL, *mlflow_store["overrides"], *overrides]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("maxout: error: ") and "\n" not in err, err
    assert message in err, err
    assert all(r.info.status != "RUNNING" for r in runs_in(mlflow_store["uri"]))
    assert runs_in(mlflow_store["uri"]) == []


def test_python_dash_m_exits_with_the_code_and_one_line():
    """A fresh `python -m maxout`; and the same command forked warm (tests/warm_maxout.py, which the end-to-end
    tests use where a process's start-up is not their point) says and returns exactly what it does."""
    proc = subprocess.run([sys.executable, "-m", "maxout", "train", "hardware=nope"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown hardware 'nope'" in proc.stderr
    warm = warm_maxout.run(["train", "hardware=nope"], timeout=600)
    assert (warm.returncode, warm.stdout, warm.stderr) == (proc.returncode, proc.stdout, proc.stderr)
    assert warm_maxout.popen(["train", "hardware=nope"], stderr=warm_maxout.PIPE).wait(600) == 2


def test_a_forked_command_starts_its_own_python_dash_m_commands_forked_from_the_same_server(tmp_path):
    """tests/warm_maxout.py's ROUTED: the GPU report's runner, forked warm, starts its section forked from the same
    server (its parent is the server, not the runner), in a process group of its own as from a fresh runner; the
    section records what it records from a fresh runner."""
    fakes = ["--sections", "works", "--registry", "tests.gpu_report_fakes:SECTIONS", "--cuda", "no"]
    fresh = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_report", "--out", str(tmp_path / "fresh"), *fakes],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert fresh.wait(600) == 0
    warm = warm_maxout.run(["--out", str(tmp_path / "warm"), *fakes], program="benchmarks.gpu_report", timeout=600)
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-2000:]
    (on_fresh,), (on_warm,) = (json.loads((tmp_path / name / "report.json").read_text())["sections"]
                               for name in ("fresh", "warm"))
    assert on_fresh["status"] == on_warm["status"] == "ok"
    assert on_fresh["results"].pop("parent") == fresh.pid
    assert on_warm["results"].pop("parent") == warm_maxout._server().proc.pid
    assert on_fresh["results"] == on_warm["results"] == {"value": 42, "previous": [], "own_group": True}


def test_only_what_a_fresh_start_would_make_the_same_is_forked_from_the_server(tmp_path, monkeypatch):
    """tests/warm_maxout.py's _routed: ``python [-u] -m maxout|benchmarks.gpu_report`` with Popen's usual options,
    the server's import-time settings, and a session of its own, a process group of its own, or a group of the
    server's session (the caller's, or the one given); nothing else."""
    route = warm_maxout._Server(None, tmp_path)  # as the server sees itself: this process's settings and group
    monkeypatch.setattr(warm_maxout, "_ROUTE", route)
    python, own = sys.executable, {"start_new_session": True}
    routed = warm_maxout._routed
    assert routed([python, "-u", "-m", "maxout", "train", "x=1"], (), own) == ("maxout", ["train", "x=1"], True,
                                                                              None)
    assert routed((python, "-m", "benchmarks.gpu_report", "--child", "hpo"), (),
                  {"process_group": 0, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
                   "cwd": ROOT}) == ("benchmarks.gpu_report", ["--child", "hpo"], False, 0)
    assert routed([python, "-m", "maxout", "hpo"], (), {}) == ("maxout", ["hpo"], False, None)  # the server's group
    for args, positional, kwargs in (
            ([python, "-c", "import maxout"], (), own),  # not a module run
            ([python, "-m", "mlflow", "server"], (), own),  # not one of ROUTED
            (["python3", "-m", "maxout", "train"], (), own),  # another interpreter
            ([python, "-X", "importtime", "-m", "maxout"], (), own),  # an interpreter option
            ([python, "-m"], (), own),
            (f"{python} -m maxout train", (), {**own, "shell": True}),
            ([python, "-m", "maxout", "train"], (-1,), own),  # bufsize and more, by position
            ([python, "-m", "maxout", "train"], (), {**own, "preexec_fn": os.getpid}),
            ([python, "-m", "maxout", "train"], (), {**own, "close_fds": False}),  # it would inherit every fd
            ([python, "-m", "maxout", "train"], (), {**own, "env": {**os.environ, "HF_HOME": str(tmp_path)}})):
        assert routed(args, positional, kwargs) is None, (args, positional, kwargs)
    route.group = -1  # a caller in another group of the server's session: the child joins the caller's group
    assert routed([python, "-m", "maxout", "hpo"], (), {}) == ("maxout", ["hpo"], False, os.getpgid(0))
    route.session = -1  # ... of another session: a child forked from the server could not join it
    assert routed([python, "-m", "maxout", "hpo"], (), {}) is None
    assert routed([python, "-m", "maxout", "hpo"], (), {"process_group": os.getpgid(0)}) is None
    assert routed([python, "-m", "maxout", "hpo"], (), own) == ("maxout", ["hpo"], False, None)
    assert routed([python, "-m", "maxout", "hpo"], (), {"process_group": 0}) == ("maxout", ["hpo"], False, 0)


def test_a_forked_command_starts_in_the_process_group_it_is_given(tmp_path):
    """tests/warm_maxout.py's process_group, as Popen's: 0 makes the child a group of its own; a group of the server's
    session makes it a member of that group, which one killpg ends whole (the GPU report's runner starts each
    section so, and the hpo section its study's supervisor in the section's group)."""
    from .store_template import new_store

    uri = new_store(tmp_path / "mlflow.db")
    holders = []
    try:
        for name, group in (("a", 0), ("b", None)):  # tests/lock_holder.py: holds a lock until its stdin closes
            holders.append(warm_maxout.popen([uri, name], program="tests.lock_holder", stdin=warm_maxout.PIPE,
                                             stdout=warm_maxout.PIPE,
                                             process_group=holders[0].pid if group is None else group))
            assert holders[-1].stdout.readline().startswith("held"), name
        leader, member = holders
        assert os.getpgid(leader.pid) == os.getpgid(member.pid) == leader.pid != os.getpgid(0)
        assert os.getsid(member.pid) == os.getsid(warm_maxout._server().proc.pid)
        os.killpg(leader.pid, signal.SIGKILL)
        assert [p.wait(60) for p in holders] == [-signal.SIGKILL] * 2
    finally:
        for p in holders:
            if p.poll() is None:
                p.kill()


def test_the_warm_server_takes_the_tests_environment_whoever_starts_it(monkeypatch):
    """A module fixture's first warm command runs before the per-test environment (conftest's _isolate) is set: a
    server it started once imported without HF_HUB_OFFLINE=1, and every maxout command of a later test in that
    process was refused (test_faults beside test_registry_e2e's served champion, 2026-11-29). A server of this test's
    own, started outside the tests' environment, still runs a test's command."""
    monkeypatch.setattr(warm_maxout, "_SERVER", None)  # the process's own server comes back after the test
    with monkeypatch.context() as outside:
        outside.delenv("HF_HUB_OFFLINE")  # as a module fixture sees the environment
        server = warm_maxout._server()
    try:
        done = warm_maxout.run(["train", "hardware=nope"], timeout=600)  # the test's environment: HF_HUB_OFFLINE=1
        assert done.returncode == 2 and "unknown hardware 'nope'" in done.stderr, done.stderr[-2000:]
    finally:
        warm_maxout._stop(server)


def test_cfg_prints_the_resolved_config(capsys):
    assert cli.main(["train", "model=tiny", "hardware.precision=fp32", "--cfg"]) == 0
    out = capsys.readouterr().out
    assert "precision: fp32" in out and "name: tiny" in out


# Each command's options, put before, between and after its positional arguments (issue 19, case 5a).
ANYWHERE = {
    "train": (["train", "--no-progress", "model=tiny", "--overrides", "train.epochs=1", "train.lr=1e-4", "--cfg"],
              {"no_progress": True, "cfg": True, "overrides": ["model=tiny", "train.lr=1e-4"],
               "overrides_string": "train.epochs=1"}),
    "hpo": (["hpo", "--no-progress", "model=tiny", "hpo.n_trials=2"],
            {"no_progress": True, "overrides": ["model=tiny", "hpo.n_trials=2"]}),
    "check-hardware": (["check-hardware", "--json", "model=tiny", "--no-search", "hardware=cpu"],
                       {"json": True, "no_search": True, "overrides": ["model=tiny", "hardware=cpu"]}),
    "find-batch-size": (["find-batch-size", "--json", "model=tiny"], {"json": True, "overrides": ["model=tiny"]}),
    "benchmark": (["benchmark", "--steps", "2", "model=tiny", "--grid", "precision=fp32", "hardware=cpu"],
                  {"steps": 2, "grid": "precision=fp32", "overrides": ["model=tiny", "hardware=cpu"]}),
    "predict": (["predict", "--no-progress", "--input", "in.csv", "--model", "models:/m/1", "--batch-size", "8"],
                {"no_progress": True, "input": "in.csv", "model": "models:/m/1", "batch_size": 8}),
    "registry list": (["registry", "list", "--tracking-uri", "sqlite:///r.db", "nli"],
                      {"tracking_uri": "sqlite:///r.db", "name": "nli"}),
    "registry promote": (["registry", "promote", "nli", "--tracking-uri", "sqlite:///r.db", "3"],
                         {"tracking_uri": "sqlite:///r.db", "name": "nli", "version": 3}),
    "registry register": (["registry", "register", "--metric", "eval/loss", "nli", "abc", "--direction", "minimize"],
                          {"metric": "eval/loss", "direction": "minimize", "name": "nli", "run_id": "abc"}),
    "registry rollback": (["registry", "rollback", "--tracking-uri", "sqlite:///r.db", "nli"],
                          {"tracking_uri": "sqlite:///r.db", "name": "nli"}),
    "registry cleanup-locks": (["registry", "cleanup-locks", "--tracking-uri", "sqlite:///r.db"],
                               {"tracking_uri": "sqlite:///r.db", "action": "cleanup-locks"}),
    "tracking replay": (["tracking", "replay", "a.jsonl", "--tracking-uri", "sqlite:///r.db", "b.jsonl"],
                        {"tracking_uri": "sqlite:///r.db", "spool": ["a.jsonl", "b.jsonl"]}),
}


@pytest.mark.parametrize("command", sorted(ANYWHERE))
def test_every_command_takes_its_options_anywhere_among_its_arguments(command):
    argv, expected = ANYWHERE[command]
    args = cli.build_parser().parse_args(argv)
    assert {k: getattr(args, k) for k in expected} == expected


def test_an_option_between_the_overrides_runs_the_command(capsys):
    assert cli.main(["train", "model=tiny", "--cfg", "hardware.precision=fp32"]) == 0
    out = capsys.readouterr().out
    assert "precision: fp32" in out and "name: tiny" in out


def test_a_mistyped_option_still_fails_wherever_it_stands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--no-progres", "model=tiny"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unrecognized arguments: --no-progres" in err and "\n" not in err


def test_every_help_example_runs(capsys):
    """The help teaches these; each one runs as shown (the overrides on `train --cfg`, which composes and checks the
    whole config; the grid and lever lists through the parsers the commands use)."""
    import shlex

    import yaml

    from maxout.insight import grid, levers

    code = cli.main(["train", "--cfg", *cli.OVERRIDES_EXAMPLE.split(), "--overrides", cli.OVERRIDES_STRING_EXAMPLE])
    out, err = capsys.readouterr()
    assert code == 0, err
    train = yaml.safe_load(out)["train"]
    assert (train["lr"], train["seed"], train["epochs"]) == (3e-5, 1, 1)
    for spec in cli.GRID_EXAMPLES:
        assert set(grid.parse_grid(spec)) == {part.split("=")[0] for part in shlex.split(spec)}
    assert list(levers.parse_levers(cli.LEVERS_EXAMPLE)) == cli.LEVERS_EXAMPLE.split(",")


def test_version_and_the_config_groups_in_help(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"maxout {__import__('maxout').__version__}"
    for command in ("train", "hpo", "audit", "benchmark", "check-hardware", "find-batch-size"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert "  hardware=a100|auto|cpu|" in out and "|tiny|" in out and "  data=files|nli_demo" in out, command


@pytest.mark.parametrize("overrides, message", [
    (["data.padding=sideways"], "data.padding='sideways' (valid: dynamic, max_length, packed)"),
    (["train.lr=-1", "train.epochs=0"], "2 problems: train.epochs=0 must be >= 1; train.lr=-1.0 must be > 0"),
    (["train.learning_rate=1"], "unknown config key 'train.learning_rate'"),
])
def test_a_bad_override_is_refused_before_torch_transformers_or_mlflow_is_imported(overrides, message):
    """The refusal's speed is measured in benchmarks/cli_refusal.py; here, what makes it fast: nothing heavy loads."""
    done = subprocess.run([sys.executable, "-c", HEAVY_IMPORTS_PROBE, "train", *overrides], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_every_command_that_composes_a_config_refuses_a_typo_before_its_heavy_imports():
    """hpo, audit, benchmark, check-hardware and find-batch-size imported their stacks before reading the overrides:
    6-8 s to refuse a typo, against maxout train's 0.3 s. One process runs them all: the first to import torch,
    transformers or mlflow would show in the list the probe prints after each."""
    commands = ["hpo", "audit", "benchmark", "check-hardware", "find-batch-size", "train"]
    probe = ("import contextlib, io, sys; from maxout import cli\n"
             "for command in sys.argv[1:]:\n"
             "    err = io.StringIO()\n"
             "    with contextlib.redirect_stderr(err):\n"
             "        code = cli.main([command, 'hardware=cpu', 'train.learning_rate=1'])\n"
             "    heavy = sorted(m for m in ('torch', 'transformers', 'mlflow', 'optuna') if m in sys.modules)\n"
             "    print(command, code, err.getvalue().count('unknown config key'), heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe, *commands], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"{command} 2 1 []" for command in commands], done.stdout


@pytest.mark.parametrize("given, expected", [
    ("train.epochs=1 train.lr=1e-4", ["train.epochs=1", "train.lr=1e-4"]),  # bash (docker backend) unquoted it
    ("'train.epochs=1 train.lr=1e-4'", ["train.epochs=1", "train.lr=1e-4"]),  # MLflow's Kubernetes backend, no shell
    ("''", []), ("", []), ("model=tiny", ["model=tiny"]),
    ("data.name='a b' model=tiny", ["data.name=a b", "model=tiny"])])
def test_overrides_string_split_like_a_shell_and_unwrapped_once_when_it_arrives_quoted(given, expected):
    assert cli.split_overrides(["hardware=cpu"], given) == ["hardware=cpu", *expected]


def test_overrides_string_with_unbalanced_quotes_is_a_one_line_error():
    with pytest.raises(ConfigError, match="cannot be split"):
        cli.split_overrides([], "'train.epochs=1")


def test_outside_a_project_the_missing_default_is_told_once_with_where_project_options_live(tmp_path, monkeypatch,
                                                                                           capsys):
    """config.yaml's default data=nli_demo lives in projects/nli_demo/conf: from another folder every check that
    composes the config meets the same missing option, and the user is told it once, with the way out."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MAXOUT_ROOT", raising=False)
    assert cli.main(["train", "hardware=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count("unknown data 'nli_demo'") == 1 and "problems" not in err, err
    assert f"no projects/<task>/conf under {tmp_path.resolve()}" in err and "set MAXOUT_ROOT" in err


def test_the_stop_handlers_know_the_process_running_the_command_even_one_forked_after_the_import(tmp_path):
    """SIGTERM/SIGINT in a forked DataLoader worker are left to the main process, told apart by pid: the pid of the
    process whose command installed the handlers, not of the one that imported maxout (tests/job_race.py forks
    its commands from one pre-imported process)."""
    import contextlib
    import io
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs a command, says what the handlers will take for the main process, and leaves
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = cli.main(["tracking", "url", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"])
            os.write(write, f"{code} {cli._MAIN_PID == os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    said = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert said == "0 True"
