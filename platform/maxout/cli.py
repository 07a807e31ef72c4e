"""``maxout <command> [hydra overrides]``: thin wiring from the command line to library functions.

Errors a user can fix print as ONE line (``maxout: error: ...``) with exit code 2 for usage/config errors and 1
for runtime ones; anything else is a bug and keeps its traceback.

Each command imports the rooms it runs inside its function, not at the top: ``maxout --help`` and a mistyped
command must answer at once, without loading torch, transformers, mlflow or hydra (seconds). The top imports only
what building the parser needs.

Top floor. May import: anything. Nothing imports it (``__main__`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

from . import __version__
from .errors import (USAGE, ConfigError, MaxoutError, Terminated, combined, exit_without_collecting, forget_stop_request,
                     stop_requested)
from .insight.grid import AXES


DESCRIPTION = ("Fine-tune transformer encoders with every GPU speed-up as a config flag, measured and tracked in "
               "MLflow. Each command takes Hydra overrides, e.g. `maxout train hardware=cpu model=tiny`.")
# The examples the help shows. tests/test_cli.py runs each one, so a help text cannot teach a command that fails.
OVERRIDES_EXAMPLE = "hardware=cpu model=tiny train.epochs=1"
OVERRIDES_STRING_EXAMPLE = "train.lr=3e-5 train.seed=1"
GRID_EXAMPLES = ("precision=fp32,bf16 compile=off,on", "padding=dynamic,bucketed,packed")
LEVERS_EXAMPLE = "precision,bucketing"
CONFIG_GROUPS = ("hardware", "model", "data", "train", "tracking", "hpo")


def split_overrides(positional: Sequence[str], overrides: Optional[str]) -> list[str]:
    """Positional overrides as given, plus ``--overrides "a=1 b=2"`` split like a shell would (MLproject's
    free-form parameter arrives as one token). A string that is one shell-quoted token, ``'a=1 b=2'`` or ``''``, is
    unwrapped once more: MLflow's Kubernetes backend quotes each token of MLproject's command and hands the list to
    the container without a shell, so the quotes arrive with the value (no override is a whole quoted string)."""
    try:
        tokens = shlex.split(overrides) if overrides else []
        if len(tokens) == 1 and tokens[0] != overrides and shlex.quote(tokens[0]) == overrides:
            tokens = shlex.split(tokens[0])
        return list(positional) + tokens
    except ValueError as err:
        raise ConfigError(f"--overrides {overrides!r} cannot be split ({err}); balance its quotes") from None


_MAIN_PID = os.getpid()  # the process whose _main installed the handlers below (set again there)


def _on_sigterm(signum: int, frame: object) -> None:
    if os.getpid() != _MAIN_PID:  # a forked DataLoader worker inherits this handler: the main process shuts it down
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not interrupt closing the run
    raise stop_requested(signum)  # kept, too: raised again at the next safe point if this one gets dropped


def _on_sigint(signum: int, frame: object) -> None:
    if os.getpid() != _MAIN_PID:  # a forked DataLoader worker: Python's own behaviour
        signal.default_int_handler(signum, frame)
    raise stop_requested(signum)  # Ctrl-C, as Python's own handler, kept like SIGTERM


def precheck(overrides: list[str]) -> None:
    """A typo is refused in a second, before torch, transformers and mlflow are imported."""
    from . import loading  # lazy: hydra (start-up)

    early = loading.precheck(overrides)
    if early:
        raise combined(early)


def load_config(args: argparse.Namespace, device: Any = None) -> Any:
    """The command's config, with every problem listed at once: each bad override and value, and, when there are
    any, also whatever is wrong with the data, model and environment (so one attempt shows the user everything)."""
    from . import loading  # lazy: hydra (start-up); torch only once load() detects the device

    overrides = split_overrides(args.overrides, args.overrides_string)
    precheck(overrides)
    problems: list[MaxoutError] = []
    cfg = loading.load(overrides, device, problems)
    if problems:
        if cfg is not None:
            from .train import prepare  # lazy: the training stack (start-up), only when there is more to report

            prepare.add_problems(cfg, problems)
        raise combined(problems)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    from .train.distributed import env_world_size  # lazy: torch (start-up), after the config's quick checks

    if args.nproc_per_node > 1 and env_world_size() > 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node}: this process was started by a launcher already "
                          f"(WORLD_SIZE={env_world_size()}); drop --nproc-per-node")
    if args.cfg:
        from omegaconf import OmegaConf  # lazy: loaded already by load_config; named here, not at the top (start-up)

        from .config import to_dict  # lazy: see above

        print(OmegaConf.to_yaml(to_dict(cfg)))
        return 0
    if args.nproc_per_node > 1:
        from .train import launch  # lazy: torch's launcher (start-up)

        child = [*args.overrides, *(["--overrides", args.overrides_string] if args.overrides_string else []),
                 *(["--no-progress"] if args.no_progress else [])]
        return launch.launch(cfg, args.nproc_per_node, child)
    from .train import train  # lazy: torch, transformers (start-up)

    if cfg.registry.name:  # registration is opt-in; its prerequisites are checked before training
        from .registry import promotion  # lazy: mlflow, which tracking=none runs never import (start-up)

        promotion.check_train(cfg)
    result = train(cfg, progress=not args.no_progress)
    if not result.setup.world.is_main:
        return 0  # one job, one report: rank 0's
    summary = {k: result.metrics.get(k) for k in ("eval/accuracy", "eval/macro_f1", "perf/samples_per_s",
                                                   "perf/steady_samples_per_s", "time/wall_s")}
    print("maxout: done " + " ".join(f"{k}={v:.4g}" for k, v in summary.items() if v is not None))
    if result.run_id:
        print(f"maxout: MLflow run {result.run_id}; {_where_to_browse(cfg, result.run_id)}")
    if cfg.registry.name:
        print(f"maxout: {promotion.register_train_result(cfg, result).summary()}")
    return 0


def _tracking_uri(args: argparse.Namespace) -> str:
    from .config import TrackingConfig  # lazy: omegaconf (start-up)
    from .tracking.store import resolve_uri  # lazy: requests (start-up)

    return args.tracking_uri or resolve_uri(TrackingConfig())[0]


def cmd_predict(args: argparse.Namespace) -> int:
    from .registry.predict import predict_file  # lazy: mlflow, torch (start-up)

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size={args.batch_size} must be >= 1")
    out = predict_file(args.model, args.input, _tracking_uri(args), args.output, args.batch_size,
                       progress=not args.no_progress, on_missing=args.on_missing)
    if args.output:
        print(f"maxout: wrote {len(out)} predictions to {args.output}", file=sys.stderr)
    return 0


def cmd_registry(args: argparse.Namespace) -> int:
    from .registry import client as registry, promotion  # lazy: mlflow (start-up)

    client = registry.connect(_tracking_uri(args))
    if args.action == "list":
        table = list(registry.rows(client, args.name))
        if table:
            widths = {k: max(len(k), *(len(r[k]) for r in table)) for k in table[0]}
            print("  ".join(k.ljust(w) for k, w in widths.items()).rstrip())
            for row in table:
                print("  ".join(row[k].ljust(w) for k, w in widths.items()).rstrip())
        return 0
    if args.action == "register":
        from .config import Config, RegistryConfig, TrackingConfig  # lazy: omegaconf (start-up)

        cfg = Config(registry=RegistryConfig(name=args.name, metric=args.metric, direction=args.direction),
                     tracking=TrackingConfig(uri=_tracking_uri(args)))
        cfg.registry.validate()
        print(f"maxout: {promotion.register_run(cfg, args.run_id, client).summary()}")
        return 0
    if args.action == "cleanup-locks":
        from .registry.lock import cleanup_legacy_locks  # lazy: mlflow (start-up)

        removed = cleanup_legacy_locks(client)
        print(f"maxout: deleted {len(removed)} old promotion lock model(s)" + (f": {', '.join(removed)}" if removed
                                                                                else ""))
        return 0
    if args.action == "promote":
        outcome = promotion.promote(client, args.name, args.version)
    else:
        outcome = promotion.rollback(client, args.name)
    print(f"maxout: {args.name}@{registry.CHAMPION} -> v{outcome.champion_version} ({outcome.reason})")
    return 0


def cmd_hpo(args: argparse.Namespace) -> int:
    overrides = split_overrides(args.overrides, args.overrides_string)
    if not any(o.lstrip("+").startswith("hpo=") for o in overrides):
        overrides.insert(0, "hpo=default")
    if args.workers is not None:
        overrides.append(f"hpo.workers={args.workers}")
    precheck(overrides)  # before the study's imports: a typo took 6.7 s to refuse here, 0.3 s in maxout train
    from .train.distributed import env_world_size  # lazy: torch (start-up); the study loads it anyway

    if env_world_size() > 1:
        raise ConfigError("maxout hpo runs one trial per process and cannot run under torchrun: on a node of N "
                          "GPUs run maxout hpo --workers N (one worker per GPU, one study; docs/tutorials/torchrun.md, "
                          "\"HPO on a multi-GPU node\")")
    from .hpo.study import run  # lazy: optuna, torch, mlflow (start-up)

    result = run(overrides, progress=not args.no_progress)
    if result.worker:  # one of a supervisor's workers: the supervisor reports the study
        return 0
    counts = " ".join(f"{k.split('/')[1]}={int(v)}" for k, v in result.counts.items() if k.startswith("hpo/trials"))
    print(f"maxout: study {result.study_name!r}: {counts}, compute saved by pruning "
          f"{result.counts.get('hpo/compute_saved', 0.0):.0%}")
    if result.best is not None:
        print(f"maxout: best trial {result.best.number}: {result.best.metric}={result.best.value:.4g} "
              + " ".join(f"{k}={v}" for k, v in result.best.params.items()))
    if result.parent_run_id:
        print(f"maxout: MLflow parent run {result.parent_run_id}; browse it with `make ui`, then "
              f"{_ui_url(_used_uri(), None, result.parent_run_id)}")
    print(f"maxout: dashboard: optuna-dashboard {result.storage}")
    return 0


def _config_on_this_device(args: argparse.Namespace) -> tuple:
    """(config, device) for commands that look at this machine: every bad override listed at once, as in train."""
    from . import hardware  # lazy: torch (start-up)

    device = hardware.detect()
    return load_config(args, device), device


def cmd_check_hardware(args: argparse.Namespace) -> int:
    precheck(split_overrides(args.overrides, args.overrides_string))  # before the imports below: seconds
    from rich.console import Console  # lazy: only the tables need it (start-up)

    from .insight import hardware_report  # lazy: torch, the batch finder (start-up)

    cfg, device = _config_on_this_device(args)
    rep = hardware_report.report(cfg, device, search=not args.no_search)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
        return 0
    console = Console()
    for table in hardware_report.render(rep):
        console.print(table)
    return 0


def cmd_find_batch_size(args: argparse.Namespace) -> int:
    precheck(split_overrides(args.overrides, args.overrides_string))  # before the imports below: seconds
    from . import data, modeling  # lazy: pandas, transformers (start-up)
    from .train import batch_finder  # lazy: torch (start-up)

    cfg, device = _config_on_this_device(args)
    result = batch_finder.find(cfg, device, data.load(cfg.data), modeling.load_tokenizer(cfg.model))
    print(json.dumps(result.params(), indent=2) if args.json else f"maxout: {result.summary()}")
    return 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    overrides = split_overrides(args.overrides, args.overrides_string)
    precheck(overrides)  # before the imports below: seconds
    from .insight import benchmark  # lazy: torch, mlflow (start-up)

    report = benchmark.run(overrides, grid_spec=args.grid,
                           steps=args.steps, repeats=args.repeats, out_dir=args.out, progress=not args.no_progress)
    print(report.markdown())
    print(f"maxout: table, CSV and charts in {report.files['markdown'].parent}"
          + (f"; MLflow parent run {report.parent_run_id}: browse it with `make ui`, then "
             f"{_ui_url(_used_uri(), None, report.parent_run_id)}" if report.parent_run_id else ""))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    overrides = split_overrides(args.overrides, args.overrides_string)
    precheck(overrides)  # before the imports below: seconds
    from rich.console import Console  # lazy: only the tables need it (start-up)

    from .insight import audit, audit_report, levers  # lazy: torch, mlflow (start-up)

    audit.check_budget(args.budget_s, args.steps)  # before the config: nothing is loaded for a budget that is no use
    only = levers.parse_levers(args.levers)
    cfg, device = _config_on_this_device(args)  # every bad override at once, as maxout train lists them
    result = audit.audit(cfg, args.budget_s, args.out, steps=args.steps, only=only, device=device,
                         overrides=overrides, progress=not args.no_progress)
    url = _ui_url(_used_uri(), result.experiment_id) if result.parent_run_id else None
    if args.json:
        print(json.dumps(result.report, indent=2, default=str))
    else:
        console = Console()
        for table in audit_report.render(result.report, url):
            console.print(table)
    print(f"maxout: audit.md, audit.json and charts in {result.files['markdown'].parent}"
          + (f"; MLflow run {result.parent_run_id}: browse it with `make ui`, then {url}" if url else ""),
          file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_tracking_url(args: argparse.Namespace) -> int:
    from .config import TrackingConfig  # lazy: omegaconf (start-up)
    from .tracking.store import resolve_uri, ui_url  # lazy: requests (start-up)

    uri = args.tracking_uri or resolve_uri(TrackingConfig())[0]  # the flag wins over MLFLOW_TRACKING_URI
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        print(ui_url(uri))  # no store yet: no experiment to open, and nothing to create just to say so
        return 0
    print(_ui_url(uri, None, args.run, args.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "maxout"))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Write the cluster's files for this job: Slurm's sbatch script, or Kubernetes' manifests. The overrides pass
    the same quick checks `maxout train` runs first, so a typo is refused here, not on the cluster."""
    from . import loading  # lazy: hydra (start-up)

    overrides = split_overrides(args.overrides, args.overrides_string)
    # slurm-hpo's tasks run `maxout hpo`, which selects hpo=default unless an hpo=... is given: checked the same way
    selects_hpo = args.target == "slurm-hpo" and not any(o.lstrip("+").startswith("hpo=") for o in overrides)
    early = loading.precheck((["hpo=default"] if selects_hpo else []) + overrides)
    if early:
        raise combined(early)
    out = Path(args.out)
    if args.target in ("slurm", "slurm-hpo"):
        from .launch import slurm  # lazy: only this command writes scripts

        job = slurm.SlurmJob(name=args.name, overrides=tuple(overrides), nodes=args.nodes,
                             gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node, time=args.time,
                             partition=args.partition or "", python=args.python)
        out.write_text(slurm.training_script(job) if args.target == "slurm" else
                       slurm.hpo_array_script(job, args.hpo_workers))
        print(f"maxout: wrote {out}; submit it with: sbatch {out}")
        return 0
    from .launch import kubernetes  # lazy: only this command writes manifests

    cluster_job = kubernetes.ClusterJob(name=args.name, image=args.image, overrides=tuple(overrides),
                                        namespace=args.namespace, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                        cpu=str(args.cpus_per_node), hpo_workers=args.hpo_workers)
    files = kubernetes.write(cluster_job, out, kube_context=args.kube_context, repository_uri=args.repository_uri)
    print(f"maxout: wrote {', '.join(str(f) for f in files)}")
    return 0


def cmd_tracking_end_slurm_job(args: argparse.Namespace) -> int:
    """What a Slurm job's script runs when Slurm stops it (scancel, requeue): srun answers SIGTERM by SIGKILLing the
    ranks, maybe before rank 0 ended its run, so the job's RUNNING runs end KILLED here."""
    if not args.job_id.isdigit():
        raise ConfigError(f"job id {args.job_id!r} is invalid: use a Slurm job id (digits, e.g. $SLURM_JOB_ID)")
    from . import loading  # lazy: hydra (start-up)
    from .tracking.mlflow_run import end_running  # lazy: mlflow (start-up)
    from .tracking.tracker import SLURM_JOB_TAG  # lazy: with the command (start-up)

    cfg = loading.load_without_device(split_overrides(args.overrides, args.overrides_string))  # tracking only
    ended = end_running(cfg.tracking, SLURM_JOB_TAG, args.job_id, "KILLED", f"Slurm job {args.job_id} stopped")
    print(f"maxout: Slurm job {args.job_id}: ended {len(ended)} running run(s) as KILLED"
          + (f": {', '.join(ended)}" if ended else ""))
    return 0


def cmd_tracking_replay(args: argparse.Namespace) -> int:
    from .tracking import spool  # lazy: mlflow (start-up)

    paths = [Path(p) for p in args.spool] or sorted(spool.default_dir().glob("*.jsonl"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise MaxoutError(f"spool file not found: {', '.join(missing)}; pass files from {spool.default_dir()}",
                          exit_code=USAGE)
    for path in paths:
        print(f"maxout: replayed {spool.replay(path, args.tracking_uri)} records from {path}")
    if not paths:
        print(f"maxout: nothing to replay in {spool.default_dir()}")
    return 0


def _where_to_browse(cfg: Any, run_id: str) -> str:
    from .tracking import container  # lazy: a run has loaded these already (start-up of the rest)
    from .tracking.store import is_http, resolve_uri

    uri = resolve_uri(cfg.tracking)[0]
    page = _ui_url(uri, None, run_id)
    if is_http(uri):
        return f"browse it at {page}"
    if container.is_mounted_store(uri):
        # The URI here is mlflow run's mount of your store in its container: name the file as the host sees it.
        host = container.host_store_uri(uri)
        if host is None:
            return f"browse it in the MLflow UI on the store that MLFLOW_TRACKING_URI names on your host ({page})"
        uri = host
    return f"browse it with `make ui`, then {page} (tracking URI: {uri})"


def _ui_url(uri: str, experiment_id: Optional[str], run_id: Optional[str] = None,
            experiment_name: str = "maxout") -> str:
    """The MLflow UI page of a run, or of an experiment's runs table, in the model-training view."""
    import mlflow  # lazy: a run has loaded it already; `maxout --help` must not (start-up)

    from .tracking.store import ui_url  # lazy: requests (start-up)

    client = mlflow.MlflowClient(uri)
    if run_id and not experiment_id:
        experiment_id = client.get_run(run_id).info.experiment_id
    if experiment_id is None:
        experiment = client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else None
    return ui_url(uri, experiment_id, run_id)


def _used_uri() -> str:
    """The store the command's runs went to (the MLflow tracker set it)."""
    import mlflow  # lazy: loaded by the command's runs already (start-up)

    return mlflow.get_tracking_uri()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (the number of processes)")
    return value


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help=f"Hydra overrides, e.g. {OVERRIDES_EXAMPLE}")
    p.add_argument("--overrides", dest="overrides_string", default=None, metavar="STRING",
                   help=f'more overrides as one string, split like a shell: --overrides "{OVERRIDES_STRING_EXAMPLE}"')
    p.epilog = config_groups_help()
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's one line per group


def config_groups_help() -> str:
    """Each config group's options (the YAML files of the package and of every project), for a command's --help."""
    from .paths import group_options  # lazy: read when a parser that takes overrides is built, not on import

    rows = [f"  {group}={'|'.join(group_options(group))}" for group in CONFIG_GROUPS]
    return ("config groups (GROUP=NAME picks one; GROUP.KEY=VALUE sets a key; `maxout train --cfg` prints them "
            "all):\n" + "\n".join(rows))


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object):
        kwargs.setdefault("allow_abbrev", False)  # a mistyped --no-progres must fail, not start a training run
        super().__init__(*args, **kwargs)
        self._intermixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """A command's own parser (one without sub-commands) takes its options anywhere among its positional
        arguments: `maxout train --no-progress train.lr=1e-4` as well as `maxout train train.lr=1e-4 --no-progress`
        (plain argparse ends a `nargs="*"` positional at the first option and refuses what follows)."""
        if self._subparsers is not None or self._intermixing:  # intermixing itself calls this method twice
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def error(self, message: str) -> NoReturn:
        """One line, like every other maxout error (argparse prints the usage block first)."""
        self.exit(USAGE, f"maxout: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="maxout", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="fine-tune a model with the composed config")
    _add_overrides(p)
    p.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
    p.add_argument("--nproc-per-node", type=_positive_int, default=1, metavar="N",
                   help="data-parallel training on N processes of this node (one per GPU), launched through "
                        "torchrun (torch.distributed.run --standalone); default 1: this process alone")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    tracking_uri = argparse.ArgumentParser(add_help=False)
    tracking_uri.add_argument("--tracking-uri", default=None, metavar="URI",
                              help="the MLflow store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p = sub.add_parser("predict", parents=[tracking_uri], help="label a CSV / JSONL file with a registered model")
    p.add_argument("--model", required=True, metavar="URI", help="e.g. models:/NAME@champion, models:/NAME/3")
    p.add_argument("--input", required=True, metavar="FILE", help=".csv, .tsv, .jsonl or .parquet with the "
                                                                  "model's text column(s)")
    p.add_argument("--output", default=None, metavar="FILE", help=".csv, .tsv, .jsonl or .parquet (default: "
                                                                  "CSV on stdout)")
    p.add_argument("--batch-size", type=int, default=64, metavar="N")
    p.add_argument("--on-missing", choices=("error", "skip", "empty"), default="error",
                   help="rows whose text is empty, null or not a string: error (default: refuse, naming the rows), "
                        "skip (no prediction for them: empty label), empty (predict them as empty text)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("registry", help="list registered models; promote or roll back the champion")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = actions.add_parser("list", parents=[tracking_uri], help="registered models, or one model's versions")
    a.add_argument("name", nargs="?", default=None)
    a = actions.add_parser("register", parents=[tracking_uri],
                           help="register a finished run's model; champion if better (what registry.name does)")
    a.add_argument("name")
    a.add_argument("run_id", metavar="RUN_ID")
    a.add_argument("--metric", default="eval/macro_f1", help="compared with the champion's (default: eval/macro_f1)")
    a.add_argument("--direction", default="maximize", choices=("maximize", "minimize"))
    a = actions.add_parser("promote", parents=[tracking_uri], help="make VERSION the champion, by hand")
    a.add_argument("name")
    a.add_argument("version", type=int)
    a = actions.add_parser("rollback", parents=[tracking_uri], help="champion back to the previous champion")
    a.add_argument("name")
    actions.add_parser("cleanup-locks", parents=[tracking_uri],
                       help="delete the NAME.lock models in which older maxout releases kept the promotion lock")
    p.set_defaults(func=cmd_registry)

    p = sub.add_parser("hpo", help="hyper-parameter search: an Optuna study as nested MLflow runs (hpo=default)")
    _add_overrides(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar per trial")
    p.add_argument("--workers", default=None, metavar="N|auto",
                   help="worker processes of the study on this machine, sharing its device (= hpo.workers=N)")
    p.set_defaults(func=cmd_hpo)

    p = sub.add_parser("check-hardware", help="what this device offers, what hardware=auto picks, the batch to use")
    _add_overrides(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-search", action="store_true", help="recommend a batch from the cache only (no probes)")
    p.set_defaults(func=cmd_check_hardware)

    p = sub.add_parser("find-batch-size", help="the largest micro-batch that fits (what train.batch_size=auto uses)")
    _add_overrides(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON (the params a run logs)")
    p.set_defaults(func=cmd_find_batch_size)

    p = sub.add_parser("benchmark", help="ablation over a grid of optimizations, one MLflow child run per cell")
    _add_overrides(p)
    p.add_argument("--grid", default=None, metavar="SPEC",
                   help=f'axes and values, e.g. "{GRID_EXAMPLES[0]}" (default: every value of '
                        f'{", ".join(a for a, axis in AXES.items() if axis.in_default)}; also: '
                        f'{", ".join(a for a, axis in AXES.items() if not axis.in_default)}, e.g. '
                        f'"{GRID_EXAMPLES[1]}")')
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per cell (default: one epoch, which measures length bucketing fairly)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the grid; medians are reported")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the table, CSV and charts go (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true", help="no per-cell progress lines")
    p.set_defaults(func=cmd_benchmark)

    p = sub.add_parser("audit", help="are we maxed out? where the time goes, what each speed-up buys (measured), "
                                     "and the fastest config, within a time budget")
    _add_overrides(p)
    p.add_argument("--budget-s", type=float, default=600.0, metavar="S",
                   help="seconds to spend measuring (default 600; the levers that do not fit are listed as not "
                        "reached)")
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="steady-state optimizer steps per measured run (default 20)")
    p.add_argument("--levers", default=None, metavar="NAMES",
                   help=f"measure only these levers, e.g. {LEVERS_EXAMPLE} (the others are still listed)")
    p.add_argument("--out", default=None, metavar="DIR", help="where audit.md, audit.json and the charts go "
                                                              "(default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print audit.json instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("launch", help="write a cluster's files for the same job: an sbatch script (slurm: the "
                                      "training job; slurm-hpo: an HPO job array) or Kubernetes manifests (kubernetes)")
    p.add_argument("target", choices=("slurm", "slurm-hpo", "kubernetes"))
    _add_overrides(p)
    p.add_argument("--out", required=True, metavar="PATH",
                   help="slurm: the script's file; kubernetes: the folder for the manifests")
    p.add_argument("--name", default="maxout", help="the job's name (default: maxout)")
    p.add_argument("--nodes", type=_positive_int, default=2, metavar="N", help="nodes of the training job (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=1, metavar="G",
                   help="GPUs per node, one process each (default 1; 0: CPU, one process per node)")
    p.add_argument("--cpus-per-node", type=_positive_int, default=8, metavar="C", help="CPU cores per node (default 8)")
    p.add_argument("--time", default="24:00:00", help="slurm: the time limit (default 24:00:00)")
    p.add_argument("--partition", default=None, help="slurm: the partition (default: the cluster's)")
    p.add_argument("--python", default="python", help="slurm: the Python on the nodes that has maxout (a venv's)")
    p.add_argument("--image", default="maxout:latest", help="kubernetes: the image (make image, pushed)")
    p.add_argument("--namespace", default="default", help="kubernetes: the namespace (default: default)")
    p.add_argument("--hpo-workers", type=_positive_int, default=4, metavar="N",
                   help="HPO workers of one study, sharing one parent run: the tasks of slurm-hpo's array, the pods "
                        "of kubernetes' HPO job (default 4)")
    p.add_argument("--kube-context", default="my-cluster", help="kubernetes: kubectl's context, for mlflow run")
    p.add_argument("--repository-uri", default="registry.example.com/maxout",
                   help="kubernetes: where mlflow run pushes the image it builds")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("tracking", help="tracking utilities")
    tracking_sub = p.add_subparsers(dest="tracking_command", required=True, metavar="SUBCOMMAND")
    p = tracking_sub.add_parser("replay", help="send what a run spooled while its tracking server was away")
    p.add_argument("spool", nargs="*", help="spool files (default: every file in the spool folder, mlruns/spool/)")
    p.add_argument("--tracking-uri", default=None, help="where to send them (default: the URI the run used)")
    p.set_defaults(func=cmd_tracking_replay)
    p = tracking_sub.add_parser("url", parents=[tracking_uri],
                                help="the MLflow UI address of the experiment's runs table (or of --run), in the "
                                     "model-training view (make ui prints it)")
    p.add_argument("--experiment", default=None, metavar="NAME",
                   help="the experiment (default: MLFLOW_EXPERIMENT_NAME, else maxout)")
    p.add_argument("--run", default=None, metavar="RUN_ID", help="a run's page instead")
    p.set_defaults(func=cmd_tracking_url)
    p = tracking_sub.add_parser("end-slurm-job", help="end the RUNNING runs of a stopped Slurm job as KILLED (the "
                                                      "sbatch scripts of maxout.launch.slurm run it on scancel)")
    p.add_argument("job_id", metavar="JOB_ID", help="the Slurm job id ($SLURM_JOB_ID)")
    _add_overrides(p)
    p.set_defaults(func=cmd_tracking_end_slurm_job)
    return parser


def run(argv: Optional[Sequence[str]] = None) -> int:
    """The `maxout` process (`python -m maxout`, the console script): main(), then an exit that skips the
    interpreter's last garbage collection (errors.exit_without_collecting). In-process callers use main()."""
    exit_without_collecting()
    return main(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    code = _main(argv)
    distributed = sys.modules.get("maxout.train.distributed")
    if distributed is not None and distributed.ran_process_group():
        distributed.end_process(code)  # a rank of a multi-process job: see end_process (a torch bug at exit)
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 with its own one-line usage error
    forget_stop_request()
    global _MAIN_PID
    _MAIN_PID = os.getpid()  # not the importer's pid: a process forked after the import runs its own command
    signal.signal(signal.SIGTERM, _on_sigterm)
    previous_sigint = signal.signal(signal.SIGINT, _on_sigint)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except MaxoutError as err:
        rank = os.environ.get("RANK", "0")  # torchrun's: every process prints its own error, rank 0's unmarked
        print(f"maxout: error: {'' if rank == '0' else f'[rank {rank}] '}{err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("maxout: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        _end_orphan_run()
        print("maxout: terminated (SIGTERM)", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGINT, previous_sigint)  # called in-process (tests, notebooks): leave it as found
        forget_stop_request()  # ... and no stop request for what the caller runs next


def _end_orphan_run() -> None:
    """SIGTERM between starting a run and entering its guard (tracking.closing) would leave it RUNNING."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.end_run("KILLED")

