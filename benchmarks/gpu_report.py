"""Every GPU claim maxout makes, measured in planned device calls: report.md, report.json and PNG charts in --out.

    make gpu-report OUT=DIR ARGS="--plan call1"      # then ARGS="--plan call2", then ARGS="--plan call3"
    python -m benchmarks.gpu_report --out DIR --plan call1
    python -m benchmarks.gpu_report --out DIR --sections mfu,ablation --budget-s 300   # any subset

A GPU machine is lent for 15 minutes in all, its start, the transfers and the gaps between calls included, and one
command runs for at most 10 minutes. So the report is planned calls (``--plan``, benchmarks/gpu/sections):

- call1 (at most 8 minutes): the headline. maxout vs the Trainer's best flags at batch 64 on both mixes in both
  orders, the MFU of BERT-base at <= 128 tokens at a given micro-batch with compile off and one torch.profiler
  profile, and packed vs bucketed batches (target P8) with what is left.
- call2 (at most 5 minutes): every ``pytest -m gpu`` test, the batch finder against real memory, then tracking overhead
  and NVML utilization with what is left.
- call3 (what the loan has left, ~3 minutes on a warm machine): the MFU of BERT-base compiled, with its profile.

The hpo workers, the ablation, the audit and BERT-large's MFU fit none of the calls: each needs a loan of its own
(``--sections hpo``).

benchmarks/README.md has each call's command verbatim (the carried wheels installed first). Each section runs in its own
process with a time limit; one that is not worth starting in the time left is skipped with the reason, and the report
ends with the command that runs what was cut. While a section runs, whatever it has recorded is merged into
report.json and report.md every few seconds, so a section (or the whole command) killed at a limit keeps every figure
it had. On a machine without CUDA the CPU-safe sections run at ``--scale smoke`` (tiny models, a few steps) and the
others say why they were skipped: tests/test_gpu_report.py runs it that way.

Options: --plan (call1, call2, call3: sections, budget and per-section limits), --budget-s (default 540, or the
plan's), --sections (a comma-separated subset, run in registry order), --scale (auto: full with CUDA, smoke without),
--cuda (auto: ask torch in a subprocess; no: rehearse the CPU path), --keep-work (keep the scratch folder).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a file: make `benchmarks.gpu` importable as it is under `python -m`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import report  # noqa: E402 - after the path fix above
from benchmarks.gpu.registry import SCALES, Context, Plan, Section, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = "benchmarks.gpu.sections:SECTIONS"
RESERVE_S = 10.0  # kept back from the budget for the last report write and the charts
LOG_TAIL = 25
POLL_S = 2.0  # how often a running section's records are merged into the report
# The commit of the tree: `make gpu-commit` (part of `make gpu-wheels`) writes it into the wheels folder, which travels
# with every device call (`carry`); the report prefers it to git (commit()).
COMMIT_FILES = (".gpu-wheels/COMMIT",)


def load_registry(spec: str) -> list[Section]:
    module, _, attr = spec.partition(":")
    return list(getattr(importlib.import_module(module), attr))


def load_plans(spec: str) -> dict[str, Plan]:
    """The registry module's PLANS (none: no --plan)."""
    module = importlib.import_module(spec.partition(":")[0])
    return {p.name: p for p in getattr(module, "PLANS", ())}


def compile_cache(cuda: bool) -> Optional[str]:
    """On a GPU, inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR, unless set) in an ignored folder of the tree,
    which the device machine keeps from one call to the next while it stays warm: a graph compiled in call 1 (maxout's
    BERT-base in vs_trainer, symbolic shapes) is then found again in call 3 (mfu_compiled, the same graph at another
    batch size) instead of being compiled for ~100 s again. "warm" when it already held entries. None on a CPU: the
    test suite's processes keep their own."""
    if not cuda:
        return None
    folder = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor-cache")))
    state = "warm" if folder.is_dir() and any(folder.iterdir()) else "cold"
    return f"{folder} ({state})"


def compile_threads() -> str:
    """TORCHINDUCTOR_COMPILE_THREADS for the sections: the cores this process may use, unless already set. Inductor
    compiles its Triton kernels in that many worker processes; BERT-base took ~36 s per graph on the H200 with it."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(len(os.sched_getaffinity(0))))
    return os.environ["TORCHINDUCTOR_COMPILE_THREADS"]


def cuda_visible(mode: str) -> bool:
    """Whether torch sees a CUDA device, asked in a subprocess so that this process never holds a CUDA context
    (its memory would shrink what the batch-finder section measures)."""
    if mode != "auto":
        return mode == "yes"
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return found.stdout.strip().endswith("True")


def device_name() -> str | None:
    """The GPU's name, asked in a subprocess as cuda_visible() does (a call without the environment section still
    says which device it ran on)."""
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                           capture_output=True, text=True)
    return found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout.strip() else None


def missing_needs(section: Section, cuda: bool) -> str:
    for need in section.needs:
        if need == "cuda" and not cuda:
            return section.why_cuda
        if need != "cuda" and importlib.util.find_spec(need) is None:
            return f"needs the {need} package, which is not installed"
    return ""


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit(root: Path = ROOT) -> dict:
    """The commit of the tree this report runs from, where it was read, and what git says beside it.

    The COMMIT file first: `make gpu-wheels` writes it from the working tree just before the tree travels, and git on
    the device cannot be trusted. A copy with no .git of its own sits inside another repository, whose HEAD is not
    this tree's (the first GPU report named that one); and on 2026-11-26 the copy carried a .git of the last landed
    commit with this tree as uncommitted changes, so git said "ac83f3c-dirty" where the file said c5cb8fe. git answers
    only where there is no file and the tree is the top of its own repository; its view is kept beside the file's
    (``git``: None where it is not the tree's own repository), so a reader sees when the two disagree."""
    seen = _git_view(root)
    for name in COMMIT_FILES:
        words = (root / name).read_text().split() if (root / name).is_file() else []
        if words:
            return {"commit": words[0], "source": name, "git": seen}
    if seen:
        return {"commit": seen, "source": "git", "git": seen}
    return {"commit": None, "source": f"the tree has no .git of its own and no {' or '.join(COMMIT_FILES)} "
                                      f"(make gpu-commit writes it)", "git": None}


def _git_view(root: Path) -> str | None:
    """HEAD (-dirty with uncommitted changes to tracked files) where ``root`` is the top of its own repository."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != root.resolve():
        return None
    head = _git(root, "rev-parse", "--short", "HEAD")
    if not head:
        return None
    changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if changed else "")


class Runner:
    """Runs the selected sections one by one, each in a child process within the budget, and rewrites the report
    after each."""

    def __init__(self, args: argparse.Namespace, sections: list[Section], selected: list[Section],
                 limits: dict | None = None):
        self.args, self.sections = args, {s.name: s for s in sections}
        self.selected, self.limits = selected, limits or {}
        self.started = time.time()
        self.deadline = self.started + args.budget_s
        self.cuda = cuda_visible(args.cuda)
        self.scale = args.scale if args.scale != "auto" else ("full" if self.cuda else "smoke")
        self.out = Path(args.out).resolve()
        self.work = Path(tempfile.mkdtemp(prefix="maxout-gpu-report-"))
        self.entries = [{"name": s.name, "status": "pending"} for s in selected]
        found = commit()
        self.meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "device": device_name() if self.cuda else None,
                     "cuda": self.cuda, "scale": self.scale, "budget_s": args.budget_s, "plan": args.plan,
                     "commit": found["commit"], "commit_source": found["source"], "commit_git": found["git"],
                     "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu_report", *sys.argv[1:]]),
                     "python": sys.version.split()[0], "compile_threads": compile_threads(),
                     "compile_cache": compile_cache(self.cuda), "elapsed_s": 0.0}

    def save(self, charts: bool = True) -> None:
        self.meta["elapsed_s"] = time.time() - self.started
        env = next((e for e in self.entries if e["name"] == "environment"), None)
        if env and env.get("results", {}).get("device"):
            self.meta["device"] = env["results"]["device"].get("name")
        report.write(self.out, self.meta, self.entries, self.sections, charts=charts)

    def limit(self, section: Section) -> float:
        """What a section may take: the plan's limit for it (None: all that is left), else its own maximum."""
        if section.name in self.limits:
            return self.limits[section.name] if self.limits[section.name] is not None else float("inf")
        return section.max_s[self.scale]

    def run(self) -> int:
        self.save()
        for entry, section in zip(self.entries, self.selected):
            left = self.deadline - time.time() - RESERVE_S
            why = missing_needs(section, self.cuda)
            if why:
                entry.update(status="skipped", reason=why)
            elif left < section.min_s[self.scale]:
                entry.update(status="skipped", budget_cut=True,
                             reason=f"time budget: {max(left, 0):.0f} s left, it needs at least "
                                    f"{section.min_s[self.scale]} s")
            else:
                self.run_one(section, entry, min(self.limit(section), left))
            print(f"gpu_report: {section.name}: {report.STATUS.get(entry['status'], entry['status'])}"
                  f"{': ' + (entry.get('reason') or entry.get('error') or '') if entry['status'] != 'ok' else ''}",
                  flush=True)
            self.save()
        self.summary()
        return 1 if any(e["status"] in ("failed", "crashed") for e in self.entries) else 0

    def run_one(self, section: Section, entry: dict, limit: float) -> None:
        name = section.name
        result_file, state_file, log_file = (self.work / f"{name}.{x}" for x in ("result.json", "state.json", "log"))
        state_file.write_text(json.dumps({e["name"]: e for e in self.entries if e.get("results")}, default=str))
        command = [sys.executable, "-m", "benchmarks.gpu_report", "--child", name, "--registry", self.args.registry,
                   "--scale", self.scale, "--work", str(self.work), "--state", str(state_file), "--result",
                   str(result_file), "--deadline", str(time.time() + limit)]
        entry.update(status="running", limit_s=round(limit))
        self.save()
        started = time.time()
        # maxout's own files (checkpoints, the batch finder's cache, the spool) go to the scratch folder, not the tree
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MAXOUT_STATE_DIR": str(self.work / "state")}
        # A process group of its own, which _stop kills whole at the section's limit (the hpo section's supervisor and
        # workers with it); not a session of its own, which isolates it no further from a terminal's Ctrl-C and which
        # the section's own commands could not join when the tests fork them warm (tests/warm_maxout.py, ROUTED)
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 process_group=0, env=env)
        pump = threading.Thread(target=_pump, args=(child, log_file, name), daemon=True)
        pump.start()
        timed_out, code, seen = False, None, None
        while True:  # every POLL_S: what the section recorded so far goes into the report (a kill keeps it)
            try:
                code = child.wait(timeout=max(min(POLL_S, started + limit - time.time()), 0.01))
                break
            except subprocess.TimeoutExpired:
                if time.time() >= started + limit:
                    timed_out, code = True, _stop(child)
                    break
            seen = self.merge(entry, result_file, seen)
        pump.join(timeout=10)
        payload = _read(result_file)
        entry.update(seconds=time.time() - started, results=payload.get("results", {}))
        if timed_out:
            kept = "; what it recorded before is kept" if entry["results"] else ""
            entry.update(status="timeout", reason=f"killed at its limit of {limit:.0f} s{kept}",
                         budget_cut=limit < self.limit(section))
        elif code == 0 and payload.get("status") == "ok":
            entry.update(status="ok")
        elif payload.get("status") == "failed":
            entry.update(status="failed", error=payload.get("error"), traceback=payload.get("traceback"))
        else:
            entry.update(status="crashed", error=f"the process ended with exit code {code} before it reported")
        if entry["status"] != "ok" and log_file.exists():
            entry["log_tail"] = log_file.read_text(errors="replace").splitlines()[-LOG_TAIL:]

    def merge(self, entry: dict, result_file: Path, seen: float | None) -> float | None:
        """Copy a running section's records into the report when its result file changed (charts at the end)."""
        try:
            stamp = result_file.stat().st_mtime_ns
        except FileNotFoundError:
            return seen
        if stamp != seen:
            results = _read(result_file).get("results")
            if results:
                entry.update(results=results, seconds=None)
                self.save(charts=False)
        return stamp

    def summary(self) -> None:
        print(f"\ngpu_report: {self.meta['device'] or 'unknown device'}, scale {self.scale}, "
              f"{time.time() - self.started:.0f} s of a {self.args.budget_s:.0f} s budget; report in {self.out}")
        for e in self.entries:
            seconds = f"{e['seconds']:.0f} s" if e.get("seconds") is not None else ""
            print(f"  {e['name']:14s} {report.STATUS.get(e['status'], e['status']):22s} {seconds:>6s}  "
                  f"{e.get('reason') or e.get('error') or ''}")
        cut = [e["name"] for e in self.entries if e.get("budget_cut")]
        if cut:
            print(f"  not finished for lack of time; next: python -m benchmarks.gpu_report --out DIR --sections "
                  f"{','.join(cut)}")


def _read(path: Path) -> dict:
    """A section's result file (written whole, then renamed: never half a file), or {} where there is none yet."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _pump(child: subprocess.Popen, log_file: Path, name: str) -> None:
    """Copy the child's output to its log and to this process's output, line by line."""
    with open(log_file, "w") as log:
        for line in child.stdout:
            log.write(line)
            print(f"[{name}] {line}", end="", flush=True)


def _stop(child: subprocess.Popen) -> int | None:
    """End the child and everything it started (its own process group): SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            return child.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return child.poll()


def child_main(args: argparse.Namespace) -> int:
    from maxout.errors import exit_without_collecting  # lazy: the section's process only

    exit_without_collecting()  # with torch, transformers and mlflow loaded, the exit's last collection costs seconds
    os.chdir(ROOT)
    section = {s.name: s for s in load_registry(args.registry)}[args.child]
    ctx = Context(section.name, args.scale, Path(args.work), json.loads(Path(args.state).read_text()),
                  args.deadline, Path(args.result))
    return run_child(section, ctx)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu"), help="where the report goes")
    p.add_argument("--plan", default=None, help="a planned device call: call1 (the headline, 8 minutes), call2 "
                                               "(the GPU tests, the finder, tracking: 5 minutes) or call3 (MFU "
                                               "compiled: what the loan has left)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole report (default: the plan's, else 540)")
    p.add_argument("--sections", default=None, help="a comma-separated subset of the sections (registry order)")
    p.add_argument("--scale", choices=("auto", *SCALES), default="auto",
                   help="full: the real models; smoke: tiny ones, a few steps; auto: full with CUDA, else smoke")
    p.add_argument("--cuda", choices=("auto", "yes", "no"), default="auto", help=argparse.SUPPRESS)
    p.add_argument("--keep-work", action="store_true", help="keep the scratch folder and print where it is")
    p.add_argument("--registry", default=REGISTRY, help=argparse.SUPPRESS)  # tests run stand-in sections
    for hidden in ("--child", "--work", "--state", "--result"):  # the child process's side
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        return child_main(args)
    sections = load_registry(args.registry)
    plans, limits = load_plans(args.registry), {}
    if args.plan is not None:
        if args.plan not in plans:
            print(f"gpu_report: error: unknown plan {args.plan!r} (valid: {', '.join(plans) or 'none'})",
                  file=sys.stderr)
            return 2
        plan = plans[args.plan]
        limits = plan.limits
        args.sections = args.sections or ",".join(plan.sections)
        args.budget_s = plan.budget_s if args.budget_s is None else args.budget_s
    args.budget_s = 540.0 if args.budget_s is None else args.budget_s
    names = [n.strip() for n in (args.sections or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in {s.name for s in sections}]
    if unknown:
        print(f"gpu_report: error: unknown section {unknown[0]!r} (valid: {', '.join(s.name for s in sections)})",
              file=sys.stderr)
        return 2
    if args.budget_s <= RESERVE_S:
        print(f"gpu_report: error: --budget-s={args.budget_s:g} must be more than {RESERVE_S:g} s", file=sys.stderr)
        return 2
    runner = Runner(args, sections, [s for s in sections if not names or s.name in names], limits)
    try:
        return runner.run()
    finally:
        if args.keep_work:
            print(f"gpu_report: scratch folder kept: {runner.work}")
        else:
            shutil.rmtree(runner.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
