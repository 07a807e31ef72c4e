"""sbatch scripts for maxout's jobs on a Slurm cluster: Slurm allocates, starts and signals; torchrun runs the
processes of each node; maxout trains. Submit a script with ``sbatch``; cancel with ``scancel``.

``hpo_array_script``: an HPO job array, each task one ``maxout hpo`` worker on one study (PostgreSQL, or a journal
on a shared file system), every trial nested under one parent run (``hpo.parent=shared``).

``training_script``: one multi-node torchrun job. ``srun`` starts one torchrun agent per node (``--ntasks-per-node=1``);
the agents meet through c10d rendezvous on the first node of the allocation (its NodeAddr, from ``scontrol``), and
each starts ``procs_per_node`` ranks (one per GPU). The command always carries ``resume=auto``: a job that Slurm
requeues (pre-emption, a node failure, ``scontrol requeue``) continues its run from the newest checkpoint
(``checkpoint.dir`` must be on a file system every node shares). ``scancel`` sends SIGTERM to the job's steps:
the script ends the job's runs still RUNNING as KILLED (``maxout tracking end-slurm-job``: srun SIGKILLs the
ranks on SIGTERM, often before rank 0 could end its run), and the checkpoints are kept.

Why plain sbatch and not submitit: submitit pickles a Python function and runs it through its own launcher on the
nodes, which needs maxout importable where ``sbatch`` runs and hides the command a user would otherwise read and
edit; a script is Slurm's own format, runs from any login node, and keeps ``maxout train`` the one entry point.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass

from ..errors import ConfigError

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class SlurmJob:
    """One job as Slurm sees it. ``overrides``: Hydra overrides, as ``maxout train`` takes them."""

    name: str = "maxout"
    overrides: tuple[str, ...] = ()
    nodes: int = 2
    gpus_per_node: int = 1
    cpus_per_node: int = 8
    time: str = "24:00:00"
    partition: str = ""
    output: str = "%x-%j.out"  # sbatch's file name patterns: %x job name, %j job id
    python: str = "python"  # the interpreter on the nodes (a venv's, or the image's)
    rdzv_port: int = 29500
    extra_sbatch: tuple[str, ...] = ()  # more #SBATCH lines' options, e.g. --account=lab, --qos=high

    def __post_init__(self) -> None:
        if not JOB_NAME.match(self.name):
            raise ConfigError(f"name={self.name!r} is invalid: use letters, digits, '_', '.', '-' (at most 64)")
        if self.nodes < 1:
            raise ConfigError(f"nodes={self.nodes} is invalid: use 1 or more")
        if self.gpus_per_node < 0:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} is invalid: use 0 (CPU) or more")
        if self.cpus_per_node < 1:
            raise ConfigError(f"cpus_per_node={self.cpus_per_node} is invalid: use 1 or more")
        if not re.match(r"^(\d+-)?\d+(:\d+){0,2}$", self.time):
            raise ConfigError(f"time={self.time!r} is invalid: use Slurm's [days-]hours:minutes:seconds, e.g. 4:00:00")
        if not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"rdzv_port={self.rdzv_port} is invalid: use a port from 1 to 65535")
        for override in self.overrides:
            if override.split("=", 1)[0].lstrip("+~") in ("resume",):
                raise ConfigError(f"override {override!r}: the script sets resume=auto itself (a requeued job "
                                  f"continues its run); drop it")

    @property
    def procs_per_node(self) -> int:
        return max(1, self.gpus_per_node)


def _header(job: SlurmJob, *lines: str) -> list[str]:
    opts = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={job.cpus_per_node}", f"--time={job.time}", f"--output={job.output}",
            "--open-mode=append", *lines]
    if job.gpus_per_node:
        opts.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.partition:
        opts.append(f"--partition={job.partition}")
    return ["#!/bin/bash"] + [f"#SBATCH {o}" for o in (*opts, *job.extra_sbatch)]


def maxout_args(job: SlurmJob) -> list[str]:
    """``maxout train``'s arguments in the job: the overrides, then resume=auto."""
    return ["train", *job.overrides, "resume=auto", "--no-progress"]


def training_script(job: SlurmJob) -> str:
    """The sbatch script of one multi-node training job."""
    agent = " ".join([
        shlex.quote(job.python), "-m", "torch.distributed.run", '--nnodes="$SLURM_NNODES"',
        f"--nproc-per-node={job.procs_per_node}", "--rdzv-backend=c10d", '--rdzv-endpoint="$MAXOUT_RDZV_ENDPOINT"',
        '--rdzv-id="$SLURM_JOB_ID"', '--rdzv-conf="is_host=$is_host"', '--local-addr="$(node_addr "$SLURMD_NODENAME")"', "--max-restarts=0",
        "-m", "maxout", *(shlex.quote(a) for a in maxout_args(job))])
    return "\n".join([
        *_header(job, "--requeue"),
        "# Written by maxout (maxout.launch.slurm). Submit: sbatch THIS_FILE. One torchrun agent per node (srun),",
        "# c10d rendezvous on the first node; resume=auto: a requeued job continues its run from its checkpoint.",
        "# The tracking server, login and Hub token come from the environment sbatch runs in (MLFLOW_TRACKING_URI,",
        "# MLFLOW_TRACKING_USERNAME/_PASSWORD, HF_TOKEN): sbatch exports it to the job; nothing secret is written here.",
        "set -euo pipefail",
        "node_addr() { scontrol show node \"$1\" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2; }",
        "export -f node_addr",
        'export head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export MAXOUT_RDZV_ENDPOINT="$(node_addr "$head_node"):{job.rdzv_port}"',
        'echo "maxout: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, rendezvous '
        '$MAXOUT_RDZV_ENDPOINT"',
        # --kill-on-bad-exit: one agent failing ends the step on every node; exec: the agent gets srun's signals.
        # In the background, so that this shell's trap runs as soon as Slurm signals the job (below).
        "srun --kill-on-bad-exit=1 bash -c " + shlex.quote(
            'echo "maxout: agent on $SLURMD_NODENAME ($(node_addr "$SLURMD_NODENAME")), node rank $SLURM_NODEID"; '
            # the first node hosts the rendezvous store: said, not guessed from its host name (a node whose name
            # does not resolve to the address it is reached at would otherwise wait for a store nobody hosts)
            'is_host=0; [ "$SLURMD_NODENAME" = "$head_node" ] && is_host=1; '
            f"exec {agent}") + " &",
        "srun_pid=$!",
        "# scancel and requeue send SIGTERM to the ranks and to srun at once, and srun answers it by SIGKILLing the",
        "# ranks, maybe before rank 0 ended its run: once srun is gone, end the job's runs still RUNNING (KILLED).",
        "# The checkpoints stay: resume=auto continues the run (a requeued job does so by itself).",
        "end_runs() {",
        '    wait "$srun_pid" || true',
        "    " + " ".join([shlex.quote(job.python), "-m", "maxout", "tracking", "end-slurm-job", '"$SLURM_JOB_ID"',
                          *(shlex.quote(o) for o in job.overrides)]) + " || true",
        "    exit 143",
        "}",
        "trap end_runs TERM",
        'wait "$srun_pid"',
        ""])


def hpo_array_script(job: SlurmJob, tasks: int) -> str:
    """The sbatch script of an HPO job array: ``tasks`` tasks, each one worker of the study on one node's share
    (``gpus_per_node`` GPUs; 0: CPU). The study's storage comes from the environment sbatch runs in
    (MAXOUT_HPO_STORAGE, a PostgreSQL URL with its password: exported to the job, never written here). The tasks
    share one parent run (hpo.parent=shared): whichever starts first creates it, the last to leave ends it with the
    study's summary. A task that Slurm requeues or restarts joins it again; scancel ends the trials it ran KILLED."""
    if tasks < 1:
        raise ConfigError(f"tasks={tasks} is invalid: use 1 or more")
    worker = " ".join([shlex.quote(job.python), "-m", "maxout", "hpo", *(shlex.quote(o) for o in job.overrides),
                       "hpo.parent=shared", "--no-progress"])
    # one log per task (%A: the array's job id, %a: the task), unless the job names its own
    output = "%x-%A_%a.out" if job.output == SlurmJob.output else job.output
    header = _header(dataclasses.replace(job, nodes=1, output=output), f"--array=0-{tasks - 1}", "--requeue")
    return "\n".join([
        *header,
        "# Written by maxout (maxout.launch.slurm). Submit: sbatch THIS_FILE. Each array task is one worker of the",
        "# study; all of them nest their trials under one parent run (hpo.parent=shared). The study's storage",
        "# (MAXOUT_HPO_STORAGE), the tracking server and its login come from the environment sbatch runs in.",
        "set -euo pipefail",
        'echo "maxout: HPO worker, array task $SLURM_ARRAY_TASK_ID of job $SLURM_ARRAY_JOB_ID on $SLURMD_NODENAME"',
        # exec: maxout gets Slurm's SIGTERM itself (scancel, requeue), ends its trial KILLED and leaves the study
        f"exec {worker}",
        ""])
