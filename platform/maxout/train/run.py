"""``train(cfg)``: one fine-tuning run, tracked. The CLI, HPO and benchmarks all call this.

Everything that can be wrong with the input (data files, columns, labels, model availability, tracking store,
the checkpoint to resume) is checked by prepare.py before the tracking run starts, so bad input never leaves a
run behind; after it starts, any failure ends the run as FAILED (or KILLED on Ctrl-C / SIGTERM) with the
reason as a tag. Checkpoints are saved as it trains (checkpointing.py); ``resume=auto`` continues the same MLflow
run from the last one (resume.py).

The model it keeps is the best evaluation's (selection.py, ``train.select_best``); its final ``eval/*`` metrics,
confusion matrix and classification report describe that model, and so does ``test/*`` when ``data.test_path`` is
set: the test split is scored once, at the end, and never chooses anything.

Under torchrun every process calls ``train`` (distributed.py): rank 0 opens the one MLflow run of the job and logs
params, metrics (evaluation and throughput over all ranks) and the model; the other ranks train their share with a
NullTracker. A failure on any rank ends the run FAILED naming that rank.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Mapping, Optional, Sequence

import pandas as pd

from .. import data as data_mod
from .. import hardware, metrics as m
from ..config import Config, to_dict
from ..errors import MaxoutError, Terminated, raise_if_stop_requested
from ..optimizations import accumulation, bucketing, lora
from ..serving import inference
from ..tracking.params import config_params, device_params, run_name
from ..tracking.tracker import SLURM_JOB_TAG, NullTracker, Tracker, closing, start
from . import batch_finder, distributed, lineage, prepare, reports, resume, sharded
from .callbacks import Callback
from .distributed import World
from .evaluate import Evaluation, evaluate
from .loop import fit
from .selection import ModelSelection, Selected
from .setup import Setup, build, split_loader
from .warm import WarmStart


@dataclass
class TrainResult:
    metrics: dict
    run_id: Optional[str]
    model_uri: Optional[str]
    setup: Setup
    params: dict = field(default_factory=dict)


def run_params(cfg: Config, setup: Setup) -> dict[str, str]:
    """The naming scheme (docs/reference/what-a-run-logs.md): opt.* decisions, cfg.* config, device.*, derived.*."""
    params: dict[str, str] = {}
    for decision in setup.decisions:
        params.update(decision.params())
    params.update(config_params(cfg))
    params.update(device_params(setup.device))
    params.update({f"derived.{k}": str(v) for k, v in setup.derived.items()})
    params.update(setup.world.params(setup.micro_batch, setup.accum_steps,
                                     bucketing.token_imbalance(setup.sampler, setup.accum_steps)))
    return params


def library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("torch", "transformers", "peft", "mlflow", "optuna", "hydra-core", "tokenizers", "numpy",
                 "nvidia-ml-py", "maxout"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def startup_banner(setup: Setup) -> str:
    """Derived numbers printed at start-up, so nobody has to work them out from the config."""
    d = setup.derived
    changed = [f"{x.name}: {x.requested} -> {x.effective} ({x.reason})" for x in setup.decisions if x.changed]
    lines = [f"maxout: {setup.cfg.model.name} on {setup.device.name} [{setup.cfg.hardware.name}], "
             f"precision {setup.decision('precision').effective}, compile {setup.decision('compile').effective}",
             f"  micro-batch {d['micro_batch']} x accumulation {d['accumulation_steps']}"
             + (f" x {setup.world.size} processes" if setup.world.size > 1 else "") + " = effective batch "
             f"{d['effective_batch']}; {d['steps_per_epoch']} steps/epoch, {d['total_steps']} steps; "
             f"{d['params_trainable']:,} of {d['params_total']:,} params trainable"]
    lines += [f"  {c}" for c in changed]
    if setup.dataset.dropped:
        lines.append("  data.on_missing=drop: left out " + ", ".join(
            f"{n} {split} rows" for split, n in setup.dataset.dropped.items()) + " with an empty text or label cell")
    return "\n".join(lines)


def majority_baseline(labels: list[int]) -> float:
    return max(labels.count(c) for c in set(labels)) / len(labels)


def log_model(setup: Setup, tracker: Tracker, results: Optional[Mapping[str, float]] = None,
              step: Optional[int] = None) -> Optional[str]:
    """Log the selected model (named after the run) and, from ``results``, its final eval/test scores on it."""
    model = sharded.full_model(setup)  # FSDP: gathered from every rank; None on the ranks that do not log
    if model is None:
        return None
    cfg = setup.cfg
    meta = inference.ModelMeta(cfg.data.text_column, cfg.data.text_pair_column, setup.dataset.label_names,
                               cfg.data.max_length, setup.derived.get("pooling"), base_model(cfg),
                               setup.derived.get("model_commit"))
    with tempfile.TemporaryDirectory(prefix="maxout-model-") as tmp:
        inference.save(lora.merged(model), setup.tokenizer, meta, tmp)
        model_uri = tracker.log_model(tmp, input_example(setup, meta))
    lineage.log_scores(tracker, model_uri, results or {}, lineage.data_inputs(cfg, setup.dataset), step)
    return model_uri


def input_example(setup: Setup, meta: inference.ModelMeta) -> Optional[pd.DataFrame]:
    """The logged model's input example (tracking.input_example): made up from the model's columns by default, so
    no training data travels with the model; two real validation rows only when asked for."""
    choice = setup.cfg.tracking.input_example
    if choice == "none":
        return None
    if choice == "synthetic":
        return inference.synthetic_example(meta)
    val = setup.dataset.validation
    example = pd.DataFrame({meta.text_column: val.texts[:2]})
    if val.pairs is not None:
        example[meta.text_pair_column] = val.pairs[:2]
    return example


def base_model(cfg: Config) -> Optional[str]:
    """What the logged model was fine-tuned from: a Hub id or a folder (None: random weights)."""
    mc = cfg.model
    if mc.source == "config":
        return None
    if mc.source == "package":
        return mc.name_or_path or None
    return mc.path or mc.name_or_path


def selection_metrics(selected: Selected, selection: ModelSelection, steps_per_epoch: int,
                      total_steps: int) -> dict[str, float]:
    """best/step, best/epoch, best/<metric> (when a metric selects), and what early stopping saved."""
    out = {"best/step": float(selected.step), "best/epoch": selected.epoch,
           "train/epochs_saved": (total_steps - selection.last_step) / steps_per_epoch,
           "train/steps_saved": float(total_steps - selection.last_step)}
    if selection.select:
        out[f"best/{selection.metric}"] = selection.value
    return out


def score_test_split(setup: Setup, warm: Optional[WarmStart]) -> Optional[Evaluation]:
    """The test split, scored once by the selected model (its loader is built only now)."""
    if setup.dataset.test is None:
        return None
    loader = split_loader(setup, setup.dataset.test, warm.encode if warm else data_mod.encode)
    return evaluate(setup, loader, split="test")


def evaluate_now(setup: Setup, selection: ModelSelection) -> Selected:
    """A run resumed after its last step from a checkpoint without a selection record: its model, scored now."""
    now = evaluate(setup)
    selection.last_step = setup.total_steps
    return Selected(setup.total_steps, setup.total_steps / setup.steps_per_epoch, now.metrics, now.confusion)


def log_outcome(setup: Setup, tracker: Tracker, results: dict, selection: ModelSelection, selected: Selected,
                warm: Optional[WarmStart]) -> None:
    """The end of a run: the final metrics (at the last step), why it stopped, the selected evaluation's confusion
    matrix and report, and the test split scored by the selected model (into ``results`` too)."""
    last = selection.last_step
    # fit logged the last evaluation at the last step already: once is enough in the history. When an earlier
    # evaluation was better, its values are logged again at the last step: the latest eval/* are the model's.
    again = selected.step != last
    if again:  # MLflow keeps, per step, the value of the latest millisecond (on a tie, the largest value)
        time.sleep(0.002)
    tracker.log_metrics({k: v for k, v in results.items() if again or not k.startswith("eval/")}, step=last)
    tracker.set_tags({"maxout.stop_reason": selection.stop_reason or f"completed: {last} of {setup.total_steps} "
                                                                      f"steps"})
    results["eval/majority_baseline"] = majority_baseline(setup.dataset.validation.labels)
    tracker.log_metrics({"eval/majority_baseline": results["eval/majority_baseline"]}, step=last)
    labels = setup.dataset.label_names
    reports.log(tracker, "eval", selected.evaluation(), labels, selected.step)
    tested = score_test_split(setup, warm)
    if tested is not None:
        results.update(tested.metrics)
        tracker.log_metrics(tested.metrics, step=last)
        reports.log(tracker, "test", tested, labels, selected.step)


def train(cfg: Config, tracker: Optional[Tracker] = None, callbacks: Sequence[Callback] = (), progress: bool = True,
          device: Optional[hardware.DeviceInfo] = None, verbose: bool = True,
          dataset: Optional[data_mod.Dataset] = None, warm: Optional[WarmStart] = None) -> TrainResult:
    """Fine-tune per ``cfg``. With ``tracker=None`` a run is started and closed here; a tracker passed in (HPO's
    nested child run) is logged to but left open for its owner to close. ``dataset`` replaces loading
    ``cfg.data`` (k-fold passes each fold's split); ``warm`` keeps the tokenizer and tokenized tables between
    runs of one process (HPO trials). Under torchrun each process calls this (see the module docstring); the
    progress bar and the start-up lines are rank 0's."""
    device = device or hardware.detect()
    with distributed.session(cfg.distributed, device) as world:
        return _train(cfg, world, tracker, callbacks, progress and world.is_main, device, verbose and world.is_main,
                      dataset, warm)


def _train(cfg: Config, world: World, tracker: Optional[Tracker], callbacks: Sequence[Callback], progress: bool,
           device: hardware.DeviceInfo, verbose: bool, dataset: Optional[data_mod.Dataset],
           warm: Optional[WarmStart]) -> TrainResult:
    tokenizer = warm.tokenizer(cfg.model) if warm else None
    checked = prepare.check(cfg, dataset, tokenizer)  # every input problem at once, before a run exists
    dataset, tokenizer = checked.dataset, checked.tokenizer
    resuming = resume.agreed(world, checked.resume, dataset)  # rank 0's choice of run and checkpoint, on every rank
    # One tokenization of each table per run: a batch finder's longest row and its probe's set-up reuse it
    encode = warm.encode if warm else WarmStart().encode
    micro_batch, finder_params = batch_finder.resolve(cfg, device, dataset, tokenizer, verbose=verbose, encode=encode)
    if world.size > 1:  # each rank searched its own device: the smallest answer fits them all
        micro_batch = world.agree_min(micro_batch)
        finder_params = {**finder_params, "batch_finder.micro_batch": str(micro_batch)} if finder_params else {}
    resuming.check_batch(micro_batch, accumulation.plan(cfg.train.target_effective_batch, micro_batch, world.size)[0],
                         world.size)
    owned = tracker is None
    if owned and world.is_main:
        tracker = start(cfg.tracking, run_name=run_name(cfg),
                        tags={"maxout.command": "train", "maxout.hardware_profile": cfg.hardware.name,
                              "maxout.model": cfg.model.name, "maxout.data": cfg.data.name,
                              "maxout.run_key": resuming.run_key, **slurm_tags()},
                        run_id=resuming.run_id)
        distributed.announce_run(tracker.run_id, cfg.tracking)  # for the --nproc-per-node launcher
    elif owned:
        tracker = NullTracker()  # one run per job: only rank 0 logs
    guard = closing(tracker) if owned else _no_close(tracker)
    with guard, distributed.reporting_failures(world):
        run_id = world.broadcast(tracker.run_id)  # the job's run, on every rank
        resuming.run_id = run_id or resuming.run_id
        setup = build(cfg, device, dataset, tokenizer, micro_batch=micro_batch, world=world, encode=encode)
        setup.oom.attach(tracker)  # out-of-memory recoveries are logged as they happen
        if verbose:
            print(startup_banner(setup), file=sys.stderr)
        params = {**run_params(cfg, setup), **finder_params}
        tracker.log_params(params)
        tracker.log_inputs(lineage.data_inputs(cfg, dataset))  # the splits it trains and is scored on
        tracker.log_dict(to_dict(cfg), "config.yaml")
        tracker.log_dict({**device.to_dict(), "profile": cfg.hardware.name,
                          "profile_description": cfg.hardware.description}, "hardware.json")
        tracker.log_dict(library_versions(), "versions.json")
        selection = ModelSelection(setup.model, cfg.train, resuming.directory(tracker.run_id))
        tracker.set_tags({"maxout.best_state": selection.describe()})
        state = resuming.restore(setup)
        if state is not None:
            selection.restore(resuming.payload)
            tracker.set_tags({"maxout.resumed_from_step": state.step})
            if verbose:
                print(f"maxout: resuming from step {state.step} of {resuming.checkpoint}", file=sys.stderr)
        saving = resuming.checkpointer(setup, tracker, {"selection": selection.checkpoint})
        try:
            results = fit(setup, tracker, [selection, *callbacks, *saving], progress, state)
            selected = selection.finish()  # the model holds the selected evaluation's weights from here on
        finally:
            selection.close()
        results = world.combine(results)  # throughput summed over the ranks, peak memory the max
        selected = selected or evaluate_now(setup, selection)
        results.update({**selected.metrics, **setup.timings,
                        **selection_metrics(selected, selection, setup.steps_per_epoch, setup.total_steps)})
        mean_len = results["train/real_tokens"] / max(results["train/samples"], 1)
        flops = m.flops_per_token(setup.flop_probe or setup.model, setup.model_config, mean_len)
        peak = hardware.peak_flops(device, setup.decision("precision").effective, setup.decision("tf32").effective)
        tokens_per_device = results.get("perf/steady_tokens_per_s", results["perf/tokens_per_s"]) / world.size
        results["perf/mfu"] = m.mfu(flops, tokens_per_device, peak)  # per device: the peak is one device's
        results["perf/flops_per_token"] = flops
        try:  # the reports' artifacts, then the model: uploads that may find the server away
            raise_if_stop_requested()  # a stop whose exception got dropped (errors.py): before, and after, logging
            log_outcome(setup, tracker, results, selection, selected, warm)
            model_uri = log_model(setup, tracker, results, selection.last_step) if cfg.tracking.log_model else None
            raise_if_stop_requested()
        except MaxoutError as err:  # the server stayed away: say where the weights are and how to finish the run
            raise resuming.model_not_stored(err, setup.total_steps) if owned else err
    if world.is_main:
        resuming.finished()
    return TrainResult({k: v for k, v in results.items() if v is not None}, run_id, model_uri, setup, params)


class _no_close:
    """For a tracker owned by the caller: tag the failure reason, leave closing to the owner."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker

    def __enter__(self) -> Tracker:
        return self.tracker

    def __exit__(self, kind: object, err: Optional[BaseException], tb: object) -> None:
        if err is not None and not isinstance(err, (KeyboardInterrupt, Terminated)):
            self.tracker.set_tags({"maxout.error": f"{type(err).__name__}: {err}"[:2000]})


def slurm_tags() -> dict:
    """The Slurm job a run belongs to, when a Slurm job runs it: `maxout tracking end-slurm-job` finds the runs of a
    cancelled job by it (srun SIGKILLs the ranks on scancel, maybe before rank 0 ends its run)."""
    job = os.environ.get("SLURM_JOB_ID")
    return {SLURM_JOB_TAG: job} if job else {}

