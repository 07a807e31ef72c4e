"""Run maxout's GPU-report paths with only the modules the GPU machine would have: its image's packages, the carried
wheels, the standard library and the project's own tree. Any other import fails as it would there.

    python -m benchmarks.gpu.closure --allow NAME,NAME,...        # distributions allowed besides the image's
    python -m benchmarks.gpu.closure --carried DIR                # ... or a folder the wheels were installed into

Every import statement of the project's code and of the carried packages is checked: the file the module came from
belongs to installed distributions (their RECORD files); one owned only by distributions that are neither on the
image (image-packages.txt) nor carried is refused with ModuleNotFoundError, which is what the GPU machine would
raise (so optional imports behind ``except ImportError`` behave as there). Presence is checked, not
versions: the versions here are the lock's (constraints.txt), the image's are listed where known.

The workload: import every room of maxout and the GPU report's sections, a tracked tiny training run on an MLflow
SQLite store (params, metrics, the pyfunc model), an Optuna study on a journal file, and pytest collecting the
gpu-marked tests. Run by ``make gpu-wheels`` (``wheels.py check``) and by tests/test_gpu_report.py.
"""

from __future__ import annotations

import argparse
import builtins
import csv
import importlib
import importlib.metadata
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> set[str]:
    """Distribution names in a requirements-style file (``name`` or ``name==version`` lines, # comments)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize(re.split(r"[=<>!~;\[ ]", line, maxsplit=1)[0]))
    return names


def owners() -> dict[str, set[str]]:
    """Installed file (real path) -> the distributions whose RECORD lists it.

    os.path.realpath of each of the ~100k files took 5-6 s, and dist.files' path objects 2 s more: a RECORD is read as
    the csv it is (what dist.files parses; without one, dist.files), the real path of each folder is taken once, and
    a file's own name is resolved only where it is a link (or "." / ".."): the same real paths."""
    found: dict[str, set[str]] = {}
    folders: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = normalize(dist.metadata["Name"])
        record = dist.read_text("RECORD")
        if record:
            base = os.fspath(dist.locate_file(""))
            paths = [os.path.join(base, row[0]) for row in csv.reader(record.splitlines()) if row]
        else:
            paths = [os.fspath(dist.locate_file(file)) for file in dist.files or ()]
        for path in paths:
            head, tail = os.path.split(path)
            if tail in ("", ".", "..") or os.path.islink(path):
                real = os.path.realpath(path)
            else:
                if head not in folders:
                    folders[head] = os.path.realpath(head)
                real = os.path.join(folders[head], tail)
            found.setdefault(real, set()).add(name)
    return found


class ImageOnly:
    """Wraps ``__import__`` and ``importlib.import_module``: when the project's code or a carried package imports a
    module whose file belongs only to distributions that are neither on the image nor carried, the import fails.

    Checked at every import statement, cached or not (a module the image's pandas already loaded is still refused
    to maxout), and only for our code and the carried packages: the image's own packages import what they like (the
    image is consistent there; their versions here differ, e.g. huggingface-hub 2 here needs httpx2, the image's
    1.33 does not)."""

    def __init__(self, image: set[str], carried: set[str]):
        self.allowed, self.carried, self.owners = image | carried, carried, owners()
        self.root = str(ROOT) + os.sep
        self.refused: list[str] = []
        self._import, self._import_module = builtins.__import__, importlib.import_module
        # per file name as given: its real path, and whether it is our code or a carried package's. Import statements
        # run hundreds of thousands of times (many inside functions): a realpath each was ~60% of a closure run.
        self._real: dict[str, str] = {}
        self._enforced: dict[str, bool] = {}

    def install(self) -> None:
        builtins.__import__, importlib.import_module = self.guarded_import, self.guarded_import_module

    def real(self, file: str) -> str:
        if file not in self._real:
            self._real[file] = os.path.realpath(file)
        return self._real[file]

    def owner(self, file: str | None) -> set[str]:
        return self.owners.get(self.real(file), set()) if file else set()

    def enforced(self, importer_file: str | None) -> bool:
        """Our code (the project tree, outside .venv) or a carried package is importing."""
        if not importer_file:
            return False
        if importer_file not in self._enforced:
            path = self.real(importer_file)
            self._enforced[importer_file] = (path.startswith(self.root) and f"{os.sep}.venv{os.sep}" not in path) \
                or bool(self.owner(path) & self.carried)
        return self._enforced[importer_file]

    def check(self, name: str) -> None:
        owned_by = self.owner(getattr(sys.modules.get(name), "__file__", None))
        if owned_by and not owned_by & self.allowed:
            self.refused.append(f"{name} ({', '.join(sorted(owned_by))})")
            raise ModuleNotFoundError(f"No module named {name!r}: {', '.join(sorted(owned_by))} is neither on the "
                                      f"GPU image nor carried", name=name)

    def guarded_import(self, name, globals=None, locals=None, fromlist=(), level=0):
        module = self._import(name, globals, locals, fromlist, level)
        # An import statement passes its module's globals. importlib's helpers pass none (find_spec("a.b") imports
        # "a": `import mlflow` probes databricks.agents so), and an extension module importing from C passes
        # importlib's (cryptography's Rust core imports _cffi_backend): the importer is then the first caller
        # outside importlib and this guard.
        importer = (globals or {}).get("__file__")
        if not importer or _machinery(globals):
            importer = _caller_outside_importlib(sys._getframe(1))
        if level == 0 and self.enforced(importer):
            self.check(name)
            for item in fromlist or ():
                if f"{name}.{item}" in sys.modules:
                    self.check(f"{name}.{item}")
        return module

    def guarded_import_module(self, name, package=None):
        module = self._import_module(name, package)
        caller = sys._getframe(1).f_globals.get("__file__")
        if not name.startswith(".") and self.enforced(caller):
            self.check(name)
        return module


def _machinery(globals: dict | None) -> bool:
    """The globals are the import machinery's own (importlib, or this guard)."""
    name = (globals or {}).get("__name__") or ""
    return name == "importlib" or name.startswith("importlib.") or (globals or {}).get("__file__") == __file__


def _caller_outside_importlib(frame) -> str | None:
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib") or
                                 _machinery(frame.f_globals)):
        frame = frame.f_back
    return frame.f_globals.get("__file__") if frame is not None else None


def absent_pytest_plugins(allowed: set[str]) -> list[str]:
    """``-p no:NAME`` for each pytest plugin (a ``pytest11`` entry point) of a distribution the GPU machine lacks:
    pytest there never sees it, and here its import would be refused (platformdirs' plugin, which the docs extra
    brings in through mkdocs)."""
    import importlib.metadata

    names = sorted({ep.name for ep in importlib.metadata.entry_points(group="pytest11")
                    if ep.dist is not None and normalize(ep.dist.metadata["Name"]) not in allowed})
    return [arg for name in names for arg in ("-p", f"no:{name}")]


def workload(tmp: Path, allowed: set[str]) -> list[str]:
    """What the GPU report and the gpu tests do, in small: returns what ran."""
    import importlib

    done = []
    for module in ("maxout.cli", "maxout.train", "maxout.tracking.mlflow_run", "maxout.tracking.spool",
                   "maxout.insight.benchmark", "maxout.insight.hardware_report", "maxout.hpo.study",
                   "maxout.registry.promotion", "maxout.serving.pyfunc", "benchmarks.gpu_report",
                   "benchmarks.gpu.sections.charts", "benchmarks.bench_vs_hf_trainer", "benchmarks.tracking_overhead",
                   "torch.profiler", "transformers.trainer"):
        importlib.import_module(module)
    done.append("imports")

    from maxout import loading
    from maxout.train import train

    os.environ["MAXOUT_STATE_DIR"] = str(tmp / "state")
    cfg = loading.load(["hardware=cpu", "model=tiny", "tracking=local", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                        f"tracking.artifact_location={(tmp / 'artifacts').as_uri()}", "tracking.system_metrics=true",
                        "tracking.system_metrics_interval_s=0.5", "train.max_steps=2", "train.epochs=1",
                        f"checkpoint.dir={tmp / 'checkpoints'}"])
    result = train(cfg, progress=False, verbose=False)
    assert result.run_id and result.model_uri, "the tracked run logged no model"
    import mlflow

    run = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db").get_run(result.run_id)
    assert run.info.status == "FINISHED" and "train/loss" in run.data.metrics, run.info
    done.append("tracked training on SQLite with the pyfunc model")

    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.create_study(storage=JournalStorage(JournalFileBackend(str(tmp / "optuna.journal"))))
    study.optimize(lambda trial: trial.suggest_float("x", -1.0, 1.0) ** 2, n_trials=3)
    done.append("optuna study on a journal file")

    import pytest

    files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *absent_pytest_plugins(allowed), "-m", "gpu",
                        *files])
    assert code in (0, 5), f"pytest could not collect the gpu tests (exit {code})"
    done.append(f"pytest collected the gpu tests of {len(files)} files")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow", default="", help="comma-separated distributions allowed besides the image's")
    parser.add_argument("--carried", type=Path, help="a folder the carried wheels were installed into (pip --target), "
                                                     "first on PYTHONPATH")
    args = parser.parse_args(argv)
    carried = {normalize(n) for n in args.allow.split(",") if n}
    if args.carried:  # the distributions installed there
        carried |= {normalize(d.metadata["Name"]) for d in importlib.metadata.distributions(path=[str(args.carried)])}
    guard = ImageOnly(listed(HERE / "image-packages.txt"), carried)
    guard.install()
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory(prefix="maxout-closure-") as tmp:
        try:
            done = workload(Path(tmp), guard.allowed)
        except Exception as err:
            traceback.print_exc(limit=-8)  # where the missing module was imported from
            print(f"closure: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            for name in guard.refused:
                print(f"closure: refused {name}", file=sys.stderr)
            return 1
    print("closure: ok: " + "; ".join(done))
    if guard.refused:  # refused imports that something caught (optional features): fine, but say which
        print("closure: optional imports that would be missing there: " + ", ".join(sorted(set(guard.refused))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
