"""What the study's parent run gets at the end of an invocation: counts, the compute pruning saved, the best
trial, a trials table, Optuna's plots (matplotlib, Agg) and maxout's own plot of every trial's intermediate values
with the pruned trials marked where they stopped. It describes the whole study in the storage, so with several
workers each parent shows the study as that worker left it."""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

from ..errors import first_line
from ..tracking.tracker import Tracker
from ..train.reports import pyplot

PLOTS = ("optimization_history", "param_importances")  # Optuna's; intermediate_values is drawn below


@dataclass
class BestTrial:
    """The study's best complete trial: what the registry hook needs."""

    number: int
    value: float
    metric: str
    direction: str
    params: dict = field(default_factory=dict)
    run_id: Optional[str] = None  # its MLflow child run
    model_uri: Optional[str] = None  # None with k-fold, hpo.log_models=none, or tracking=none


def counts(trials: list) -> dict[str, float]:
    """Trial counts and the compute saved by pruning: trial-epochs run vs. what the same trials would have run
    without pruning (each its planned epochs, times the folds)."""
    n = {s: sum(t.state == s for t in trials) for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    run = sum(t.user_attrs.get("epochs_run", 0) for t in finished)
    planned = sum(t.user_attrs.get("epochs_planned", 0) for t in finished)
    evaluations = sum(t.user_attrs.get("evaluations", 0) for t in finished)
    return {"hpo/trials_total": float(sum(n.values())), "hpo/trials_complete": float(n[TrialState.COMPLETE]),
            "hpo/trials_pruned": float(n[TrialState.PRUNED]), "hpo/trials_failed": float(n[TrialState.FAIL]),
            "hpo/trial_epochs_run": float(run), "hpo/trial_epochs_without_pruning": float(planned),
            "hpo/compute_saved": 1.0 - run / planned if planned else 0.0,
            "hpo/trial_evaluations": float(evaluations)}


def best_trial(study: Any, metric: str, direction: str) -> Optional[BestTrial]:
    try:
        best = study.best_trial
    except ValueError:  # no complete trial
        return None
    return BestTrial(best.number, float(best.value), metric, direction, dict(best.params),
                     best.user_attrs.get("mlflow_run_id"), best.user_attrs.get("model_uri"))


def intermediate_values(trials: list, unit: str, direction: str, path: Path) -> bool:
    """Each trial's reported values against its reports (x: reports of ``unit``): complete trials as lines, the
    best one highlighted, pruned ones dashed and grey with a cross where they stopped. False: nothing to draw."""
    plt = pyplot()
    drawn = [t for t in trials if t.intermediate_values and t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    if not drawn:
        return False
    complete = [t for t in drawn if t.state == TrialState.COMPLETE]
    pick = max if direction == "maximize" else min
    best = pick(complete, key=lambda t: t.value).number if complete else None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t in sorted(drawn, key=lambda t: (t.state == TrialState.COMPLETE, t.number == best)):
        steps = sorted(t.intermediate_values)
        values = [t.intermediate_values[k] for k in steps]
        if t.state == TrialState.PRUNED:
            ax.plot(steps, values, "--", color="0.65", linewidth=0.9)
            ax.plot(steps[-1], values[-1], "x", color="tab:red", markersize=6)
        elif t.number == best:
            ax.plot(steps, values, "-", color="tab:blue", linewidth=2.2, label=f"best: trial {t.number}")
        else:
            ax.plot(steps, values, "-", color="tab:green", linewidth=1, alpha=0.7)
    ax.plot([], [], "-", color="tab:green", label=f"complete ({len(complete)})")
    ax.plot([], [], "--x", color="0.65", markeredgecolor="tab:red", label=f"pruned ({len(drawn) - len(complete)}), "
                                                                             f"x: where it stopped")
    ax.set_xlabel(f"report (one every {unit})")
    ax.set_ylabel("intermediate value")
    ax.set_title(f"Intermediate values of {len(drawn)} trials")
    ax.legend(loc="best", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plots(study: Any, out: Path, unit: str = "report") -> dict[str, str]:
    """Write the plots that can be drawn; returns {plot: why it was skipped} for the others."""
    from optuna.visualization import matplotlib as vis  # lazy: imports matplotlib (0.6 s); only this report draws

    plt = pyplot()
    skipped: dict[str, str] = {}
    trials = study.get_trials(deepcopy=False)
    if not intermediate_values(trials, unit, study.direction.name.lower(), out / "intermediate_values.png"):
        skipped["intermediate_values"] = "no trial reported an intermediate value"
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # "no completed trials" warnings: skipped.json says it
    for name in PLOTS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the matplotlib backend is marked experimental
                axes = getattr(vis, f"plot_{name}")(study)
            figure = getattr(axes, "figure", None) or axes.flat[0].figure
            figure.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
            plt.close(figure)
        except Exception as err:  # too few trials for importances, no intermediate values, ...
            skipped[name] = first_line(err)[:300]
    optuna.logging.set_verbosity(verbosity)
    return skipped


def log(parent: Tracker, study: Any, metric: str, direction: str,
        unit: str = "report") -> tuple[Optional[BestTrial], dict[str, float]]:
    """Everything above onto the parent run; returns the best trial (None while no trial completed) and the
    counts."""
    trials = study.get_trials(deepcopy=False)
    summary = counts(trials)
    parent.log_metrics(summary)
    best = best_trial(study, metric, direction)
    if best is not None:
        parent.log_metrics({"hpo/best_value": best.value})
        parent.log_params({f"best.{key}": value for key, value in best.params.items()})
        parent.set_tags({"maxout.hpo.best_trial": best.number, "maxout.hpo.best_run_id": best.run_id or ""})
        parent.log_dict(asdict(best), "best.json")
    with tempfile.TemporaryDirectory(prefix="maxout-hpo-") as tmp:
        out = Path(tmp)
        if trials:
            table = study.trials_dataframe(attrs=("number", "state", "value", "params", "user_attrs",
                                                  "datetime_start", "datetime_complete", "duration"))
            table.to_csv(out / "trials.csv", index=False)
            parent.log_artifact(str(out / "trials.csv"))
            skipped = plots(study, out, unit)
            for name in (*PLOTS, "intermediate_values"):
                if (out / f"{name}.png").exists():
                    parent.log_artifact(str(out / f"{name}.png"), "plots")
            if skipped:
                parent.log_dict(skipped, "plots/skipped.json")
    parent.flush()
    return best, summary
