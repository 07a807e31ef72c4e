"""maxout's sbatch scripts (maxout.launch.slurm) on a real two-node Slurm cluster started on this machine
(tests/slurm_cluster.py: munged, slurmctld, and one slurmd in each of two network namespaces, each node its own
address on a private bridge). The tests submit with `sbatch` and cancel with `scancel`, as a user does.

Each job trains the tiny model on CPU with gloo, one torchrun agent per node (one rank each), on an embedded MLflow
store and checkpoints in a temporary folder: the file system is shared by both nodes, as a cluster's is.
GLOO_SOCKET_IFNAME names the nodes' interface: the machine's host name, which gloo would otherwise bind to, is not
an address inside the nodes' namespaces (on a real cluster, the interface of its fast network).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from maxout.errors import ConfigError
from maxout.launch import slurm

from . import slurm_cluster
from .conftest import HEAVY_IMPORTS_PROBE, ROOT, runs_in, two_invocations_shared_one_study

pytestmark = pytest.mark.slow
JOB_ENV = {"GLOO_SOCKET_IFNAME": "eth0", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def cluster():
    why = slurm_cluster.available()
    if why:
        pytest.fail(f"a Slurm cluster cannot start here: {why}")
    with slurm_cluster.cluster() as c:
        print(f"\nslurm: two-node cluster up in {c.setup_s:.1f} s", file=sys.stderr)
        yield c


def tiny_job(directory: Path, mlflow_store: dict, name: str, epochs: int) -> tuple[slurm.SlurmJob, Path]:
    rows = pd.read_csv(ROOT / "projects/nli_demo/data/train.csv")
    rows.iloc[:32].to_csv(directory / "train.csv", index=False)
    rows.iloc[32:48].to_csv(directory / "validation.csv", index=False)
    overrides = ("hardware=cpu", "model=tiny", f"train.epochs={epochs}", "train.batch_size=4",
                 "train.target_effective_batch=8", f"data.train_path={directory / 'train.csv'}",
                 f"data.validation_path={directory / 'validation.csv'}", "checkpoint.every_n_steps=1",
                 f"checkpoint.dir={directory / 'ckpt'}", "distributed.timeout_s=60", "tracking.log_model=false",
                 *mlflow_store["overrides"])
    job = slurm.SlurmJob(name=name, overrides=overrides, nodes=2, gpus_per_node=0, cpus_per_node=1, time="10:00",
                         python=sys.executable, output=str(directory / "%x-%j.out"))
    script = directory / f"{name}.sbatch"
    script.write_text(slurm.training_script(job))
    return job, script


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise TimeoutError(what)


def checkpoints(directory: Path) -> list[Path]:
    return list((directory / "ckpt").rglob("step-*.pt"))


def output(directory: Path, name: str, job_id: str) -> str:
    return (directory / f"{name}-{job_id}.out").read_text()


def test_training_job_runs_one_agent_per_node_and_a_requeued_job_resumes_its_run(cluster, tmp_path, mlflow_store):
    """sbatch the training script; once it has a checkpoint, `scontrol requeue` it (what pre-emption does): Slurm
    stops it and starts it again, resume=auto continues the same run from its checkpoint, and the job finishes as
    ONE MLflow run, FINISHED, whose two ranks ran on the two nodes."""
    # 4 epochs: 16 steps with a checkpoint after each (~10 s of training here); the requeue comes right after the
    # first checkpoint, long before the last step, and the second start trains the rest
    job, script = tiny_job(tmp_path, mlflow_store, "mx-train", epochs=4)
    job_id = cluster.sbatch(script, f"--chdir={ROOT}", env=JOB_ENV)
    wait_for(lambda: checkpoints(tmp_path), 300, f"no checkpoint\n{cluster.logs()}")
    cluster.run("scontrol", "requeue", job_id)
    # Slurm holds a requeued job back (Reason=BeginTime, about two minutes here): let it start at once
    assert cluster.wait(job_id, 150, states=("PENDING",)) == "PENDING"
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    assert cluster.wait(job_id, 240) == "COMPLETED", output(tmp_path, "mx-train", job_id)[-3000:]
    text = output(tmp_path, "mx-train", job_id)
    # two starts of the job, each with one torchrun agent on each node, meeting on the first node
    assert "(restart 0) on n[1-2]" in text and "(restart 1) on n[1-2]" in text
    addrs = cluster.node_addrs
    for node, rank in (("n1", 0), ("n2", 1)):
        assert text.count(f"agent on {node} ({addrs[node]}), node rank {rank}") == 2, text[-3000:]
    assert text.count(f"rendezvous {addrs['n1']}:29500") == 2
    (run,) = runs_in(mlflow_store["uri"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["dist.world_size"], params["dist.nodes"], params["dist.local_world_size"]) == ("2", "2", "1")
    assert int(run.data.tags["maxout.resumed_from_step"]) >= 1  # the second start continued the first's run
    assert text.count("maxout: resuming from step") == 1
    assert text.count("maxout: done") == 1 and not checkpoints(tmp_path)  # a finished run keeps no checkpoint
    assert run.data.tags["maxout.slurm_job_id"] == job_id


def test_scancel_ends_the_run_and_leaves_no_process_on_either_node(cluster, tmp_path, mlflow_store):
    job, script = tiny_job(tmp_path, mlflow_store, "mx-cancel", epochs=50)
    job_id = cluster.sbatch(script, f"--chdir={ROOT}", env=JOB_ENV)
    wait_for(lambda: checkpoints(tmp_path), 300, f"no checkpoint\n{cluster.logs()}")
    (running,) = runs_in(mlflow_store["uri"])
    assert running.info.status == "RUNNING"
    cluster.run("scancel", job_id)
    assert cluster.wait(job_id, 150) == "CANCELLED"

    def only_slurmd() -> bool:
        return all(cluster.processes_in(node) == [pid] for node, pid in cluster.slurmd_pids.items())

    wait_for(only_slurmd, 60, "processes left: " + repr({n: cluster.processes_in(n) for n in cluster.node_addrs}))
    (run,) = runs_in(mlflow_store["uri"])
    # KILLED, by rank 0 or by the script's trap; or FAILED when srun's SIGKILL took rank 1 before it told rank 0
    # its outcome: rank 0, stopping too, then ends the run naming rank 1 as lost (train/distributed.py)
    assert run.info.run_id == running.info.run_id and run.info.status in ("KILLED", "FAILED")
    if run.info.status == "FAILED":
        assert "rank 1 lost" in run.data.tags["maxout.status_reason"] and "SIGTERM" in run.data.tags[
            "maxout.status_reason"]
    assert run.data.tags["maxout.slurm_job_id"] == job_id
    # the script's trap ran once srun was gone (it ends the run if rank 0 was SIGKILLed before it could)
    assert f"maxout: Slurm job {job_id}: ended" in output(tmp_path, "mx-cancel", job_id)
    assert checkpoints(tmp_path)  # kept: a new submission with resume=auto continues it


def test_an_hpo_job_array_on_one_postgresql_study_nests_every_trial_under_one_parent_run(cluster, tmp_path,
                                                                                         mlflow_store):
    """`maxout launch slurm-hpo`'s script, sbatch'ed: an array of two tasks, one worker on each node, on one study in
    a PostgreSQL server the nodes reach over their bridge (MAXOUT_HPO_STORAGE from the environment sbatch runs in).
    hpo.parent=shared: one parent run, FINISHED with the study's summary, every trial nested under it."""
    import optuna

    from maxout import cli
    from maxout.hpo import shared_parent

    from .services import create_database, postgres

    rows = pd.read_csv(ROOT / "projects/nli_demo/data/train.csv")
    rows.iloc[:32].to_csv(tmp_path / "train.csv", index=False)
    rows.iloc[32:48].to_csv(tmp_path / "validation.csv", index=False)
    script = tmp_path / "hpo.sbatch"
    assert cli.main(["launch", "slurm-hpo", "hardware=cpu", "model=tiny", "hpo=default", "train.epochs=1",
                     "train.batch_size=4", f"data.train_path={tmp_path / 'train.csv'}",
                     f"data.validation_path={tmp_path / 'validation.csv'}", "hpo.study_name=array", "hpo.n_trials=4",
                     "hpo.pruner.name=none", "hpo.log_models=none", *mlflow_store["overrides"], "--name", "mx-hpo",
                     "--hpo-workers", "2", "--gpus-per-node", "0", "--cpus-per-node", "2", "--time", "10:00",
                     "--python", sys.executable, "--out", str(script)]) == 0
    text = script.read_text()
    assert "#SBATCH --array=0-1" in text and "hpo.parent=shared" in text and "postgresql" not in text
    script.write_text(text.replace("--output=%x-%A_%a.out", f"--output={tmp_path}/%x-%A_%a.out"))  # each task's log
    with postgres(listen=(cluster.controller_addr,)) as server:
        optuna_url = create_database(server, "optuna").replace("127.0.0.1", cluster.controller_addr)
        job_id = cluster.sbatch(script, f"--chdir={ROOT}", env={**JOB_ENV, "MAXOUT_HPO_STORAGE": optuna_url})
        assert cluster.wait_array(job_id, 300) == []
        states = [cluster.state(f"{job_id}_{task}") for task in (0, 1)]
        outputs = {task: (tmp_path / f"mx-hpo-{job_id}_{task}.out").read_text() for task in (0, 1)}
        assert states == ["COMPLETED", "COMPLETED"], (states, outputs, cluster.logs())
        study = optuna.load_study(study_name="array", storage=optuna_url)
        (parent,) = [r for r in runs_in(mlflow_store["uri"]) if r.data.tags.get("maxout.command") == "hpo"]
        assert study._storage.get_study_system_attrs(study._study_id)[shared_parent.PARENT_ATTR] == parent.info.run_id
        two_invocations_shared_one_study(study, list(outputs.values()), parent.info.run_id)  # one task each
    nodes = {task: next(word for word in out.split() if word in ("n1", "n2")) for task, out in outputs.items()}
    assert sorted(nodes.values()) == ["n1", "n2"], outputs  # one worker on each node
    assert parent.info.status == "FINISHED" and parent.data.metrics["hpo/trials_complete"] >= 4
    runs = runs_in(mlflow_store["uri"])
    trials = [r for r in runs if "maxout.hpo.trial_number" in r.data.tags]
    assert len(trials) >= 4 and {r.data.tags["mlflow.parentRunId"] for r in trials} == {parent.info.run_id}
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_training_script_is_what_torchrun_and_maxout_accept():
    """The script's srun line as bash expands it on a node (the program printing its argv instead of exec'ing
    it), through torchrun's and maxout's parsers and the pre-run checks."""
    import shlex
    import subprocess

    from torch.distributed.run import get_args_parser

    from maxout import cli, loading

    job = slurm.SlurmJob(overrides=("model=tiny", "hardware=cpu", "train.lr=3e-5", "data.name='a b'"), nodes=4,
                         gpus_per_node=8)
    script = slurm.training_script(job)
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script and "#SBATCH --requeue" in script
    program = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))[-2]
    assert program.count("exec ") == 1
    env = {"PATH": os.environ["PATH"], "SLURM_NNODES": "4", "MAXOUT_RDZV_ENDPOINT": "10.0.0.1:29500",
           "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "gpu01", "head_node": "gpu01", "SLURM_NODEID": "0"}
    printed = subprocess.run(["bash", "-c", "node_addr() { echo 10.0.0.2; }; "
                              + program.replace("exec ", "printf '%s\\0' ")], env=env, capture_output=True,
                             text=True, check=True).stdout
    argv = printed.split("\n", 1)[1].split("\0")[:-1]  # after the agent's own echo line
    assert argv[:3] == [job.python, "-m", "torch.distributed.run"]
    launch = get_args_parser().parse_args(argv[3:])
    assert (launch.nnodes, launch.nproc_per_node, launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_id,
            launch.local_addr, launch.rdzv_conf) == ("4", "8", "c10d", "10.0.0.1:29500", "7", "10.0.0.2", "is_host=1")
    assert launch.module and launch.training_script == "maxout"
    args = cli.build_parser().parse_args(launch.training_script_args)
    assert args.command == "train" and args.overrides == [*job.overrides, "resume=auto"]
    assert [str(p) for p in loading.precheck(args.overrides)] == []


def test_end_slurm_job_ends_only_that_jobs_running_runs(mlflow_store, capsys):
    """What the script's trap runs: the RUNNING runs tagged with the job end KILLED; another job's run and a
    finished run of the job are left as they are. In a process of its own, as the trap starts it: it runs within
    slurmd's KillWait, so it reads its config without torch (a second of start-up, more on a loaded node)."""
    import subprocess

    import mlflow

    from maxout import cli

    client = mlflow.MlflowClient(tracking_uri=mlflow_store["uri"])
    experiment = client.create_experiment("maxout")
    ids = {}
    for name, job, finished in (("cancelled", "17", False), ("other", "18", False), ("done", "17", True)):
        ids[name] = client.create_run(experiment, tags={"maxout.slurm_job_id": job}).info.run_id
        if finished:
            client.set_terminated(ids[name], "FINISHED")
    done = subprocess.run([sys.executable, "-c", HEAVY_IMPORTS_PROBE, "tracking", "end-slurm-job", "17",
                           *mlflow_store["overrides"]], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    said, imported = done.stdout.splitlines()
    assert said.endswith(f"ended 1 running run(s) as KILLED: {ids['cancelled']}") and imported == "['mlflow']"
    status = {name: client.get_run(run_id).info.status for name, run_id in ids.items()}
    assert status == {"cancelled": "KILLED", "other": "RUNNING", "done": "FINISHED"}
    assert cli.main(["tracking", "end-slurm-job", "$SLURM_JOB_ID"]) == 2
    assert "job id '$SLURM_JOB_ID' is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [({"nodes": 0}, "nodes=0 is invalid"), ({"name": "a b"}, "name='a b'"),
                                          ({"time": "1 day"}, "time='1 day' is invalid"),
                                          ({"overrides": ("resume=abc",)}, "sets resume=auto itself")])
def test_bad_settings_are_refused_naming_the_value(bad, message):
    with pytest.raises(ConfigError, match=message):
        slurm.SlurmJob(**bad)


def test_maxout_launch_slurm_writes_the_script_and_refuses_a_bad_override(tmp_path, capsys):
    from maxout import cli

    out = tmp_path / "train.sbatch"
    assert cli.main(["launch", "slurm", "model=tiny", "--out", str(out), "--nodes", "4", "--gpus-per-node", "8",
                     "--partition", "gpu", "--python", "/opt/venv/bin/python"]) == 0
    script = out.read_text()
    assert script == slurm.training_script(slurm.SlurmJob(overrides=("model=tiny",), nodes=4, gpus_per_node=8,
                                                          partition="gpu", python="/opt/venv/bin/python"))
    assert f"sbatch {out}" in capsys.readouterr().out
    assert cli.main(["launch", "slurm", "model=tiny", "train.lr=fast", "--out", str(tmp_path / "bad")]) == 2
    assert "train.lr" in capsys.readouterr().err and not (tmp_path / "bad").exists()
