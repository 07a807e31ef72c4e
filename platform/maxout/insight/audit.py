"""``maxout audit``: the measured answer to "are we maxed out?" for the user's own config on this device.

Within a time budget it measures the config as it stands (the same overrides as ``maxout train``):

1. Where the time goes: samples/s and tokens/s, MFU next to the device's peak, padding efficiency, GPU utilization
   (NVML, sampled inside the training window), peak memory and the headroom left, all from uninstrumented runs of
   the config; the data-wait and optimizer shares and the host syncs per step from an instrumented probe
   (breakdown.py).
2. What each lever would buy (levers.py): every speed-up the device supports that the config leaves off, measured
   as short training runs paired with runs of the current config, in both orders: current, lever, lever, current,
   then the next lever, and current again (so each lever has one pair with the current config before it and one
   after it, and a machine that slows down meanwhile hits both sides alike). Speed-up = the median of the two
   paired ratios of steady-state samples/s; memory ratio and compile seconds likewise. Levers the device cannot
   use are listed with the trainer's own reason; levers with a known cost are measured and marked.
3. The verdict: the levers that helped (above MIN_GAIN, no cost, and compile only where it pays back within a run
   of this config) are combined and measured again the same way; the fastest configuration measured gives the
   current config's share and the Hydra overrides to use; compile's seconds and speed-up give the step at which
   it pays back, and so whether it pays for trials of this length.

Budget: each lever is started only when its estimated cost (three runs, timed from the runs so far, plus compile)
fits what is left after a reserve for the best combination and the report; the levers that did not fit are
listed as not reached. An estimate can be wrong (a compile on a busy machine takes minutes longer than any
prior), so every run after the first of the current config also runs under a timer set to the end of the budget
(SIGALRM, in the main thread): when it rings the run is stopped (KILLED), the lever it belonged to is listed as
not reached, and measuring ends there. A budget below MIN_BUDGET_S is refused before anything runs.

MLflow: one parent run (tag ``maxout.audit``) holding the report (``audit/audit.md``, ``audit.json``, charts) and the
markdown as its description (the run page shows it); a child run per measured lever, one for the current config
and one for the best combination, each with its training runs as children (tagged with their position in the
sequence and their role, so the pairs can be read back).
"""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from .. import errors, hardware, loading, modeling
from ..config import Config
from ..data import Dataset, Origin
from ..errors import ConfigError, Terminated, first_line
from ..hardware import DeviceInfo
from ..optimizations import accumulation, named
from ..tracking.params import NOTE, device_params, note, run_name, show
from ..tracking.tracker import Tracker, closing, start
from ..train import batch_finder, prepare
from ..train.setup import plan_decisions, planned_steps
from ..train.tensor_memory import GIB
from ..train.warm import WarmStart
from . import audit_report, benchmark, breakdown, levers
from .levers import CANNOT_USE, MEASURE, Assessment

MIN_BUDGET_S = 60.0  # the current config and one lever: four short runs plus set-up, on a small model
DEFAULT_BUDGET_S = 600.0
DEFAULT_STEPS = 20  # steady-state optimizer steps per run (after train.warmup_steps_excluded)
REPORT_RESERVE_S = 10.0  # the report, its charts and artifacts
COMPILE_PRIOR_S = 60.0  # a compile not measured yet is budgeted at this (inductor, MiniLM, 2-core CPU: 33-74 s)
MIN_GAIN = 1.02  # a lever joins the best combination only above this speed-up: below it is run-to-run noise
THROUGHPUT = "perf/steady_samples_per_s"
VALIDATION_ROWS = 64  # each run still evaluates once at its end: on a few rows, it costs little of the budget
MEASURED, NOT_REACHED, FAILED = "measured", "not reached", "failed"


class BudgetSpent(Terminated):
    """The audit's budget ran out in the middle of a run. Raised at the training loop's next safe point once its
    timer rang; a Terminated, so the run is closed as KILLED, and a BaseException, so no library takes it for an
    error of its own and carries on."""


@contextlib.contextmanager
def budget_timer(seconds: float) -> Iterator[None]:
    """Stop the run in this thread once ``seconds`` have passed (right away when none are left): BudgetSpent at the
    training loop's next safe point, the end of the step (or evaluation) in which the time ran out. Not raised by
    the timer's signal handler itself: raised wherever the signal lands, inside torch, it broke torch's state (a
    torch function mode half pushed, then every compile in the process recompiled; a checkpoint's zip record half
    written), errors.py. Signals reach only the main thread: elsewhere the estimates alone keep the budget."""
    if seconds <= 0:
        raise BudgetSpent()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum: int, frame: Any) -> None:
        errors.request_stop(BudgetSpent)

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        errors.withdraw_stop_request(BudgetSpent)  # rang after the last safe point, or raised: either way, over


def check_budget(budget_s: float, steps: int) -> None:
    """The audit's own bad input: a budget too small to measure anything, or no steady steps."""
    if not budget_s >= MIN_BUDGET_S:
        raise ConfigError(f"--budget-s={budget_s:g} is too small to measure anything: the current config and one "
                          f"lever need four short training runs; use --budget-s >= {MIN_BUDGET_S:g} (default "
                          f"{DEFAULT_BUDGET_S:g})")
    if steps < 1:
        raise ConfigError(f"--steps={steps} must be >= 1 (steady-state optimizer steps per run)")


def run_audit(overrides: Sequence[str] = (), budget_s: float = DEFAULT_BUDGET_S, out_dir: Optional[str] = None,
              **options: Any) -> dict:
    """The audit of the config that ``overrides`` compose (as ``maxout train`` would), as audit.json's dict. Bad
    input raises a one-line ConfigError before anything runs. ``options``: those of ``audit()``."""
    check_budget(budget_s, options.get("steps", DEFAULT_STEPS))
    device = options.pop("device", None) or hardware.detect()
    cfg = loading.load(list(overrides), device=device)
    return audit(cfg, budget_s, out_dir, device=device, overrides=overrides, **options).report


@dataclass
class Run:
    """One training run of the audit."""

    name: str
    role: str  # current | lever | best
    position: int  # its place in the sequence (pairs are neighbours)
    run_id: Optional[str]
    metrics: dict
    wall_s: float
    params: dict

    @property
    def throughput(self) -> float:
        return self.metrics[THROUGHPUT]

    @property
    def memory_gb(self) -> Optional[float]:
        return self.metrics.get("mem/peak_allocated_gb") or self.metrics.get("mem/peak_tensor_gb")


@dataclass
class Audit:
    report: dict
    files: dict
    parent_run_id: Optional[str]
    experiment_id: Optional[str]


def measuring(cfg: Config, steps: int) -> Config:
    """The config of each measured run: ``steps`` steady steps after the warm-up, no evaluation in between, no
    model, checkpoint or resume (the rest as the user set it)."""
    return levers.with_overrides(cfg, [f"train.max_steps={cfg.train.warmup_steps_excluded + steps}",
                                       "train.epochs=1000", "train.eval_interval=0", "tracking.log_model=false",
                                       "checkpoint.enabled=false", "resume=null"])


def audit(cfg: Config, budget_s: float = DEFAULT_BUDGET_S, out_dir: Optional[str] = None, steps: int = DEFAULT_STEPS,
          only: Optional[Sequence[str]] = None, device: Optional[DeviceInfo] = None, overrides: Sequence[str] = (),
          progress: bool = True) -> Audit:
    """Audit ``cfg`` (a loaded, valid config) within ``budget_s`` seconds; ``only``: measure these levers alone."""
    check_budget(budget_s, steps)
    auditor = _Auditor(cfg, device or hardware.detect(), steps, only, budget_s, list(overrides), progress)
    return auditor.run(out_dir)


def plan_levers(cfg: Config, device: Optional[DeviceInfo] = None, only: Optional[Sequence[str]] = None
                ) -> list[Assessment]:
    """What the audit would do with each lever for ``cfg`` on ``device``, measuring nothing."""
    return _Auditor(cfg, device or hardware.detect(), DEFAULT_STEPS, only).assess()


class _Auditor:
    def __init__(self, cfg: Config, device: DeviceInfo, steps: int, only: Optional[Sequence[str]],
                 budget_s: float = DEFAULT_BUDGET_S, overrides: Sequence[str] = (), progress: bool = False):
        self.started = time.monotonic()
        self.user_cfg, self.budget_s, self.steps, self.only = cfg, budget_s, steps, only
        self.device, self.overrides, self.progress = device, list(overrides), progress
        self.cfg = measuring(cfg, steps)
        checked = prepare.check(self.cfg)  # data, model, tracking store: before any run exists
        full: Dataset = checked.dataset
        # Every run, and the breakdown's probe, trains on the same tables with the same tokenizer: only the first
        # tokenizes them, so set-up leaves the budget to the levers (55k demo rows: 13.4 s a run on one core)
        self.warm = WarmStart()
        self.tokenizer = self.warm.tokenizer(self.cfg.model, loaded=checked.tokenizer)
        kept = min(len(full.validation), VALIDATION_ROWS)
        origins, validation = dict(full.origins), full.origins.get("validation")
        if validation is not None and kept < len(full.validation):
            origins["validation"] = Origin(validation.path, f"{validation.rows}; " * bool(validation.rows)
                                           + f"the first {kept} rows")
        # The same train split as the runs it is about (same MLflow dataset); the validation split is its first rows.
        self.dataset = Dataset(full.train, full.validation.subset(list(range(kept))), full.label_names,
                               full.fingerprint, origins=origins)
        self.micro_batch, _ = batch_finder.resolve(self.cfg, device, full, self.tokenizer, verbose=False,
                                                   encode=self.warm.encode)
        self.accumulation = accumulation.plan(cfg.train.target_effective_batch, self.micro_batch)[0]
        model_config = modeling.build_config(cfg.model, full.label_names, len(self.tokenizer))
        self.model_class = modeling.model_class(model_config)
        self.current_decisions = plan_decisions(self.cfg, device, self.model_class)
        self.run_steps = planned_steps(math.ceil(len(full.train) / self.micro_batch), self.accumulation,
                                       cfg.train)[1]  # a run of the user's config, for compile's payback
        self.found: dict[str, int] = {}
        self.currents: list[Run] = []
        self.runs: list[Run] = []
        self.parent: Optional[Tracker] = None
        self.current_child: Optional[Tracker] = None
        self.spent = False  # the budget ran out mid-run: nothing more is measured

    # -------------------------------------------------------------------------------------------- clock

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, message: str) -> None:
        if self.progress:
            print(f"maxout: audit [{self.elapsed():.0f} s of {self.budget_s:g} s] {message}", file=sys.stderr)

    def run_estimate(self) -> float:
        """Seconds for one run without compiling, from the runs so far (set-up included)."""
        plain = [r.wall_s - r.metrics.get("time/compile_s", 0.0) for r in self.runs]
        return statistics.median(plain) if plain else 0.0

    def compile_estimate(self) -> float:
        compiled = [r.metrics["time/compile_s"] for r in self.runs if r.metrics.get("time/compile_s", 0) > 1]
        return max(compiled) if compiled else COMPILE_PRIOR_S

    def cost(self, overrides: Sequence[str]) -> float:
        compiles = "hardware.compile=true" in overrides and not self.cfg.hardware.compile
        return 3 * self.run_estimate() + (2 * self.compile_estimate() if compiles else 0.0)

    # ------------------------------------------------------------------------------------------- finder

    def finder(self, cfg: Config) -> int:
        """The batch finder's micro-batch for ``cfg`` (cached per key here and in its own cache file)."""
        plan = batch_finder.search_for(cfg, self.device, self.dataset, self.tokenizer, self.warm.encode)
        if plan.key not in self.found:
            self.say(f"batch finder: {plan.key}")
            self.found[plan.key] = batch_finder.find(cfg, self.device, self.dataset, self.tokenizer,
                                                     encode=self.warm.encode).micro_batch
        return self.found[plan.key]

    def assess(self) -> list[Assessment]:
        context = levers.Context(self.device, self.model_class, self.current_decisions, self.micro_batch,
                                 self.accumulation, self.finder)
        return levers.assess_all(self.user_cfg, context, self.only)

    # --------------------------------------------------------------------------------------------- runs

    def train_run(self, cfg: Config, name: str, role: str, parent: Tracker, tags: Optional[dict] = None) -> Run:
        position = len(self.runs)
        began = time.monotonic()
        tracker = start(cfg.tracking, run_name=name, parent_run_id=parent.run_id,
                        tags={"maxout.command": "audit-run", "maxout.audit.role": role,
                              "maxout.audit.position": str(position), **(tags or {})})
        # The first run of the current config always completes: without it there is nothing to compare with.
        timer = budget_timer(self.left() - REPORT_RESERVE_S) if self.runs else contextlib.nullcontext()
        with closing(tracker), timer:
            measured = benchmark.measure(cfg, self.device, self.dataset, tracker, self.warm)
        run = Run(name, role, position, tracker.run_id, measured.metrics, time.monotonic() - began, measured.params)
        self.runs.append(run)
        return run

    def current(self) -> Run:
        run = self.train_run(self.cfg, f"current #{len(self.currents) + 1}", "current", self.current_child)
        self.currents.append(run)
        return run

    def pair(self, name: str, role: str, overrides: Sequence[str]) -> dict:
        """``name`` twice between two runs of the current config; its child run holds the two and the result."""
        cfg = levers.with_overrides(self.cfg, overrides)
        child = start(self.cfg.tracking, run_name=name, parent_run_id=self.parent.run_id,
                      tags={"maxout.command": "audit-lever", "maxout.audit.lever": name,
                            "maxout.audit.role": role})
        with closing(child):
            before = self.currents[-1]
            first = self.train_run(cfg, f"{name} #1", role, child, {"maxout.audit.order": "after current"})
            second = self.train_run(cfg, f"{name} #2", role, child, {"maxout.audit.order": "before current"})
            after = self.current()
            result = paired(first, second, before, after)
            result.update(overrides=list(overrides), run_id=child.run_id,
                          run_ids=[first.run_id, second.run_id], current_run_ids=[before.run_id, after.run_id])
            child.log_params({**first.params, "audit.overrides": " ".join(overrides)})
            child.log_metrics(result_metrics(result), step=0)
        return result

    def measure_lever(self, row: Assessment) -> None:
        if self.spent:
            row.status, row.reason = NOT_REACHED, "budget: spent before its turn"
            return
        cost = self.cost(row.overrides)
        free = self.left() - REPORT_RESERVE_S - 3 * self.run_estimate()  # keep room for the best combination
        if cost > free:
            row.status, row.reason = NOT_REACHED, f"budget: needs ~{cost:.0f} s, {max(free, 0):.0f} s left for it"
            self.say(f"{row.name}: not reached ({row.reason})")
            return
        self.say(f"lever {row.name}: {' '.join(row.overrides)} (~{cost:.0f} s)")
        began = time.monotonic()
        try:
            row.result = self.pair(cell_name(row.overrides), "lever", row.overrides)
            row.status = MEASURED
        except BudgetSpent:
            row.status, row.reason = NOT_REACHED, (f"budget: spent while it ran (estimated ~{cost:.0f} s, stopped "
                                                   f"after {time.monotonic() - began:.0f} s)")
            self.spent = True
            self.say(f"{row.name}: stopped, the budget is spent")
        except Exception as err:  # one lever that breaks must not lose the others: record it, go on
            row.status, row.reason = FAILED, f"{type(err).__name__}: {first_line(err)}"
            self.say(f"{row.name}: failed ({row.reason})")

    # ---------------------------------------------------------------------------------------------- run

    def run(self, out_dir: Optional[str]) -> Audit:
        cfg, device = self.cfg, self.device
        out = Path(out_dir or tempfile.mkdtemp(prefix="maxout-audit-"))
        out.mkdir(parents=True, exist_ok=True)
        self.parent = start(cfg.tracking, run_name=f"audit {run_name(self.user_cfg)}",
                            tags={"maxout.command": "audit", "maxout.audit": "true", "maxout.model": cfg.model.name,
                                  "maxout.data": cfg.data.name, "maxout.hardware_profile": cfg.hardware.name})
        with closing(self.parent):
            self.parent.log_params({"audit.budget_s": f"{self.budget_s:g}", "audit.steps": str(self.steps),
                                    "audit.overrides": " ".join(self.overrides),
                                    "audit.levers": ",".join(self.only or levers.NAMES), **device_params(device)})
            rows = self.assess()
            self.say(f"probing where the time goes ({self.steps} steps timed)")
            probe = breakdown.probe(cfg, device, self.dataset, self.tokenizer, self.micro_batch, self.steps,
                                    self.warm.encode)
            self.current_child = start(cfg.tracking, run_name=f"current: {run_name(self.user_cfg)}",
                                       parent_run_id=self.parent.run_id,
                                       tags={"maxout.command": "audit-lever", "maxout.audit.role": "current"})
            with closing(self.current_child):
                self.say("measuring the current config")
                self.current()
                for row in rows:
                    if row.status == MEASURE:
                        self.measure_lever(row)
                best = self.best(rows)
                current = self.current_figures(probe)
                self.current_child.log_params(self.currents[0].params)
                self.current_child.log_metrics(current_metrics(current), step=0)
            report = self.assemble(rows, best, current, probe)
            files = audit_report.write(report, out)
            for path in files.values():
                self.parent.log_artifact(str(path), "audit")
            self.parent.log_metrics(summary_metrics(report), step=0)
            self.parent.set_tags({NOTE: note(files["markdown"].read_text(), "audit/audit.md")})
            if report["verdict"]["overrides"]:
                self.parent.set_tags({"maxout.audit.recommended": report["verdict"]["overrides"]})
        report["elapsed_s"] = round(self.elapsed(), 1)  # the report's own figure is from before its writing
        return Audit(report, files, self.parent.run_id, experiment_of(self.parent))

    # -------------------------------------------------------------------------------------------- verdict

    def best(self, rows: list[Assessment]) -> dict:
        """The levers that helped, combined; measured again where there are several and the budget allows."""
        helped = [r for r in rows if r.status == MEASURED and not r.lever.cost and r.result["speedup"] >= MIN_GAIN
                  and (r.name != "compile" or self.compile_payback(r)["pays"])]
        if not helped:
            return {"overrides": [], "levers": [], "measured": False, "speedup": 1.0, "name": "current"}
        combined: dict[str, str] = {}
        for row in sorted(helped, key=lambda r: r.result["speedup"]):  # on a shared key the faster lever wins
            combined.update(o.split("=", 1) for o in row.overrides)
        overrides = [f"{k}={v}" for k, v in combined.items()]
        names = [r.name for r in helped]
        if len(helped) == 1:
            return {"overrides": overrides, "levers": names, "measured": False, "name": helped[0].name,
                    "speedup": helped[0].result["speedup"], "run_id": helped[0].result.get("run_id")}
        cost, free = self.cost(overrides), self.left() - REPORT_RESERVE_S
        if cost > free or self.spent:
            self.say(f"best combination not measured (budget: needs ~{cost:.0f} s)")
            return {"overrides": overrides, "levers": names, "measured": False, "name": "combination",
                    "speedup": None, "reason": f"budget: needs ~{cost:.0f} s, {max(free, 0):.0f} s left for it"}
        self.say(f"best combination: {' '.join(overrides)} (~{cost:.0f} s)")
        try:
            result = self.pair(f"best: {cell_name(overrides)}", "best", overrides)
        except BudgetSpent:
            return {"overrides": overrides, "levers": names, "measured": False, "name": "combination",
                    "speedup": None, "reason": "budget: spent while it ran"}
        except Exception as err:  # noqa: BLE001 - reported, the single levers still stand
            return {"overrides": overrides, "levers": names, "measured": False, "name": "combination",
                    "speedup": None, "reason": f"failed: {type(err).__name__}: {first_line(err)}"}
        return {**result, "overrides": overrides, "levers": names, "measured": True, "name": "combination"}

    def compile_payback(self, row: Assessment) -> dict:
        """After how many steps compile's seconds are won back by its faster steps, vs a run of this config."""
        r = row.result
        saving = 1 / r["current_it_per_s"] - 1 / r["it_per_s"] if r.get("it_per_s") and r.get("current_it_per_s") \
            else 0.0
        compile_s = r.get("compile_s") or 0.0
        out = {"compile_s": compile_s, "speedup": r["speedup"], "saving_ms_per_step": 1000 * saving,
               "run_steps": self.run_steps}
        if saving <= 0:
            return {**out, "steps": None, "pays": False,
                    "text": f"compile never pays back here: its steady state ran {r['speedup']:.2f}x the current "
                            f"config's, so no step wins back its {compile_s:.0f} s"}
        steps = math.ceil(compile_s / saving)
        pays = steps <= self.run_steps
        return {**out, "steps": steps, "pays": pays,
                "text": f"compile pays back after {steps} steps ({compile_s:.0f} s to compile, "
                        f"{1000 * saving:.0f} ms saved per step); a run of this config is {self.run_steps} steps, "
                        f"so it {'pays' if pays else 'does not pay'} for HPO trials of this length"}

    def current_figures(self, probe: breakdown.Breakdown) -> dict:
        runs, device = self.currents, self.device
        med = lambda key: _median([r.metrics.get(key) for r in runs])  # noqa: E731
        precision = named(self.current_decisions, "precision").effective
        peak = hardware.peak_flops(device, precision, named(self.current_decisions, "tf32").effective)
        memory = _median([r.memory_gb for r in runs])
        limit = (device.total_memory_gb if device.is_cuda
                 else (batch_finder.budget_bytes(self.cfg, device) or 0) / GIB)
        return {"samples_per_s": med(THROUGHPUT), "tokens_per_s": med("perf/steady_tokens_per_s"),
                "it_per_s": med("perf/steady_it_per_s"), "mfu": med("perf/mfu"),
                "peak_tflops": peak / 1e12 if peak else None, "precision": precision,
                "padding_efficiency": med("perf/padding_efficiency"), "gpu_utilization": med("gpu/utilization_mean"),
                **{f"{k}_share": v for k, v in probe.shares().items()}, "step_ms": probe.step_ms,
                "host_syncs_per_step": probe.host_syncs_per_step, "sync_source": probe.sync_source,
                "peak_memory_gb": memory, "memory_limit_gb": round(limit, 2),
                "headroom_gb": (limit - memory) if memory is not None else None,
                "memory_source": ("CUDA peak allocated vs device memory" if device.is_cuda else
                                  "peak tensor bytes of the worst step (eager) vs available host memory"),
                "micro_batch": self.micro_batch, "accumulation_steps": self.accumulation,
                "runs": len(runs), "run_ids": [r.run_id for r in runs]}

    def assemble(self, rows: list[Assessment], best: dict, current: dict, probe: breakdown.Breakdown) -> dict:
        measured = [r for r in rows if r.status == MEASURED]
        plain = [(r.result["speedup"], r.name, list(r.overrides)) for r in measured if r.name in best["levers"]]
        if best.get("measured"):
            plain.append((best["speedup"], "combination", best["overrides"]))
        fastest = max(plain, default=(1.0, "current", []))
        if fastest[0] <= 1.0:
            fastest = (1.0, "current", [])
        compile_row = next((r for r in measured if r.name == "compile"), None)
        payback = self.compile_payback(compile_row) if compile_row else {"text": _compile_not_measured(rows)}
        costly = [{"lever": r.name, "speedup": r.result["speedup"], "cost": r.lever.cost} for r in measured
                  if r.lever.cost and r.result["speedup"] >= MIN_GAIN]
        share = 1.0 / fastest[0]
        verdict = {
            "share_of_best": share, "best_speedup": fastest[0], "best": fastest[1],
            "overrides": " ".join(fastest[2]), "command": " ".join(combine(self.overrides, fastest[2])),
            "text": (f"you are at {share:.0%} of the fastest configuration measured on this device"
                     + (f" ({fastest[1]}, {fastest[0]:.2f}x)" if fastest[1] != "current" else
                        ": no lever measured made it faster")),
            "compile": payback, "with_cost": costly,
            "not_reached": [r.name for r in rows if r.status == NOT_REACHED],
        }
        return {
            "device": {"kind": self.device.kind, "name": self.device.name, "label": device_label(self.device),
                       "cpu_count": self.device.cpu_count,
                       "memory_gb": self.device.total_memory_gb or self.device.host_memory_gb},
            "config": {"overrides": " ".join(self.overrides), "model": self.cfg.model.name,
                       "data": self.cfg.data.name, "profile": self.cfg.hardware.name, "name": run_name(self.user_cfg)},
            "budget_s": self.budget_s, "elapsed_s": round(self.elapsed(), 1), "steps": self.steps,
            "current": current,
            "levers": [lever_entry(r) for r in rows],
            "best": best, "verdict": verdict,
            "runs": [{"name": r.name, "role": r.role, "position": r.position, "wall_s": round(r.wall_s, 2),
                      "samples_per_s": r.throughput, "run_id": r.run_id} for r in self.runs],
            "mlflow": {"parent_run_id": self.parent.run_id, "experiment_id": experiment_of(self.parent)},
        }


# ------------------------------------------------------------------------------------------------- helpers


def device_label(device: DeviceInfo) -> str:
    if device.is_cuda:
        return f"{device.name} ({device.total_memory_gb} GiB)"
    return f"CPU {device.name}, {device.cpu_count} cores"


def cell_name(overrides: Sequence[str]) -> str:
    """``data.bucketing=true hardware.precision=bf16`` -> ``bucketing=on precision=bf16`` (as run names say it)."""
    parts = []
    for override in overrides:
        key, _, value = override.partition("=")
        parsed = {"true": True, "false": False}.get(value.lower(), value)
        parts.append(show(key.rsplit(".", 1)[-1], parsed))
    return " ".join(parts)


def combine(overrides: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The user's overrides with ``extra`` on top: a key given in both keeps only ``extra``'s value (Hydra refuses
    the same key twice)."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in keys] + list(extra)


def paired(first: Run, second: Run, before: Run, after: Run) -> dict:
    """The lever's runs against the current config's right before and right after them."""
    ratios = [first.throughput / before.throughput, second.throughput / after.throughput]
    memory = _median([first.memory_gb, second.memory_gb])
    base_memory = _median([before.memory_gb, after.memory_gb])
    return {"speedup": statistics.median(ratios), "speedup_after_current": ratios[0],
            "speedup_before_current": ratios[1],
            "samples_per_s": statistics.median([first.throughput, second.throughput]),
            "current_samples_per_s": statistics.median([before.throughput, after.throughput]),
            "it_per_s": _median([first.metrics.get("perf/steady_it_per_s"),
                                 second.metrics.get("perf/steady_it_per_s")]),
            "current_it_per_s": _median([before.metrics.get("perf/steady_it_per_s"),
                                         after.metrics.get("perf/steady_it_per_s")]),
            "memory_gb": memory, "memory_ratio": memory / base_memory if memory and base_memory else None,
            "compile_s": first.metrics.get("time/compile_s", 0.0),
            "compile_s_second": second.metrics.get("time/compile_s", 0.0)}


def result_metrics(result: dict) -> dict:
    """What a lever's child run shows: the figures the report prints for it."""
    keys = {"speedup": "audit/speedup", "speedup_after_current": "audit/speedup_after_current",
            "speedup_before_current": "audit/speedup_before_current", "memory_ratio": "audit/memory_ratio",
            "samples_per_s": THROUGHPUT, "current_samples_per_s": "audit/current_samples_per_s",
            "compile_s": "time/compile_s", "memory_gb": "audit/peak_memory_gb"}
    return {metric: result[key] for key, metric in keys.items() if result.get(key) is not None}


def lever_entry(row: Assessment) -> dict:
    entry = {"name": row.name, "what": row.lever.what, "status": row.status, "overrides": " ".join(row.overrides),
             "reason": row.reason, "cost": row.lever.cost}
    if row.status == CANNOT_USE:
        entry["decision"] = row.decision  # the run param opt.<decision>.reason says the same
    if row.result:
        entry.update({k: v for k, v in row.result.items() if k != "overrides"})
    return entry


CURRENT_METRICS = {"samples_per_s": THROUGHPUT, "tokens_per_s": "perf/steady_tokens_per_s", "mfu": "perf/mfu",
                   "padding_efficiency": "perf/padding_efficiency", "gpu_utilization": "gpu/utilization_mean",
                   "data_wait_share": "breakdown/data_wait_share", "optimizer_share": "breakdown/optimizer_share",
                   "forward_backward_share": "breakdown/forward_backward_share", "step_ms": "breakdown/step_ms",
                   "host_syncs_per_step": "breakdown/host_syncs_per_step", "peak_memory_gb": "mem/peak_gb",
                   "headroom_gb": "mem/headroom_gb"}


def current_metrics(current: dict) -> dict:
    """The current config's figures under the run's metric names (medians of its runs, and the probe's)."""
    return {metric: current[key] for key, metric in CURRENT_METRICS.items() if current.get(key) is not None}


def summary_metrics(report: dict) -> dict:
    verdict = report["verdict"]
    statuses = [lever["status"] for lever in report["levers"]]
    return {"audit/share_of_best": verdict["share_of_best"], "audit/best_speedup": verdict["best_speedup"],
            "audit/levers_measured": float(statuses.count(MEASURED)),
            "audit/levers_not_reached": float(statuses.count(NOT_REACHED)), "audit/elapsed_s": report["elapsed_s"],
            **current_metrics(report["current"])}


def experiment_of(tracker: Tracker) -> Optional[str]:
    """The experiment a tracked run is in (None: nothing is stored)."""
    if tracker.run_id is None:
        return None
    import mlflow  # lazy: loaded by the MLflow tracker already; tracking=none never gets here

    return mlflow.MlflowClient().get_run(tracker.run_id).info.experiment_id


def _compile_not_measured(rows: list[Assessment]) -> str:
    row = next(r for r in rows if r.name == "compile")
    why = row.reason or row.status
    return f"compile was not measured ({row.status}{': ' + why if why != row.status else ''})"


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
