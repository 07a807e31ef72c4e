"""The wheels the GPU machine's image lacks: fetch them for CPython 3.12 / manylinux x86_64, prove the set complete.

    python benchmarks/gpu/wheels.py download [--dest .gpu-wheels]     # make gpu-wheels runs both
    python benchmarks/gpu/wheels.py check [--dest .gpu-wheels]

``download`` fetches every pin of wheels.txt (``pip download --no-deps --only-binary=:all:`` for 3.12 / manylinux
x86_64; a pin that PyPI has only as source, antlr4-python3-runtime 4.9.3, is built into a pure-Python wheel here),
removes anything else from the folder, prints each size and the total, and fails above 40 MiB (the device carries
64 MiB with the working tree).

``check``, without a Python 3.12 on this machine, proves what it can:
1. the folder holds exactly one wheel per pin, and pip would install each on CPython 3.12 / manylinux x86_64
   (``pip install --dry-run --no-index --no-deps`` against the folder with the GPU machine's tags);
2. every requirement the wheels declare is carried or on the image (image-packages.txt), with versions checked
   where known; the ones neither carried nor on the image are listed (maxout's paths never import them: 3. says so);
3. the closure: the wheels that install on this Python are installed into an empty folder (the others, built for
   3.12 only, are taken from the project's venv at the same versions), and benchmarks/gpu/closure.py runs maxout's
   GPU paths with only the image's packages, that folder and the standard library importable.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIMIT_MIB = 40
GPU_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--platform",
            "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
# The GPU machine's interpreter, for evaluating environment markers in the wheels' requirements.
GPU_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def pins(path: Path = HERE / "wheels.txt") -> dict[str, Version]:
    """Canonical name -> pinned version, from a requirements file of ``name==version`` lines."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            found[canonicalize_name(req.name)] = Version(spec.version)
    return found


def image() -> dict[str, Version | None]:
    """The GPU image's packages, with their versions where known."""
    found: dict[str, Version | None] = {}
    for line in (HERE / "image-packages.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = Version(version) if version else None
    return found


def wheels(dest: Path) -> dict[str, Path]:
    """Canonical name -> its wheel in ``dest``; fails on two versions of one name."""
    found: dict[str, Path] = {}
    for path in sorted(dest.glob("*.whl")):
        name = canonicalize_name(parse_wheel_filename(path.name)[0])
        if name in found:
            raise SystemExit(f"two wheels of {name} in {dest}: {found[name].name}, {path.name}; delete one")
        found[name] = path
    return found


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def download(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    wanted = pins()
    for name, path in wheels(dest).items():  # what the pins no longer name must not travel
        if wanted.get(name) != parse_wheel_filename(path.name)[1]:
            path.unlink()
            print(f"removed {path.name}")
    have = wheels(dest)
    for name, version in wanted.items():
        if name in have:
            continue
        got = pip("download", "-q", "--no-deps", "--only-binary=:all:", *GPU_TAGS, "-d", str(dest),
                  f"{name}=={version}")
        if got.returncode != 0:  # no wheel on the index: build the pure-Python one from source
            built = pip("wheel", "-q", "--no-deps", "--no-binary", name, "-w", str(dest), f"{name}=={version}")
            if built.returncode != 0:
                print(got.stderr + built.stderr, file=sys.stderr)
                raise SystemExit(f"no wheel for {name}=={version} for CPython 3.12 / manylinux x86_64, and none could "
                                 f"be built")
        print(f"fetched {name}=={version}")
    for path in wheels(dest).values():
        if "none-any" not in path.name and not any(t in path.name for t in ("cp312", "abi3")):
            raise SystemExit(f"{path.name} is not for CPython 3.12: delete it and run again")
    return report_size(dest)


def report_size(dest: Path) -> int:
    files = sorted(wheels(dest).values(), key=lambda p: -p.stat().st_size)
    total = sum(p.stat().st_size for p in files)
    for path in files:
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
    print(f"{total / 2**20:7.2f} MiB  in {len(files)} wheels in {dest} (limit {LIMIT_MIB} MiB)")
    if total > LIMIT_MIB * 2**20:
        print(f"error: the wheels take {total / 2**20:.1f} MiB, over the {LIMIT_MIB} MiB limit", file=sys.stderr)
        return 1
    return 0


def declared(found: dict[str, Path]) -> tuple[list[str], list[str]]:
    """(version conflicts, requirements neither carried nor on the image), from the wheels' METADATA."""
    import zipfile

    on_image, carried = image(), {n: parse_wheel_filename(p.name)[1] for n, p in found.items()}
    conflicts, missing = [], []
    for name, path in found.items():
        with zipfile.ZipFile(path) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            lines = archive.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.partition(":")[2].strip())
            if req.marker is not None and not req.marker.evaluate(GPU_ENV):
                continue
            dep = canonicalize_name(req.name)
            version = carried.get(dep, on_image.get(dep))
            if dep not in carried and dep not in on_image:
                missing.append(f"{req.name} (for {name})")
            elif version is not None and not req.specifier.contains(version, prereleases=True):
                conflicts.append(f"{name} needs {req}, {'carried' if dep in carried else 'the image has'} {version}")
    return conflicts, sorted(set(missing))


def check(dest: Path) -> int:
    wanted, found = pins(), wheels(dest)
    wrong = sorted(set(wanted) ^ set(found)) + [n for n in wanted if n in found and
                                                  parse_wheel_filename(found[n].name)[1] != wanted[n]]
    if wrong:
        print(f"error: {dest} does not match wheels.txt ({', '.join(wrong)}): run make gpu-wheels", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="maxout-gpu-wheels-") as tmp:
        dry = pip("install", "--dry-run", "--no-index", "--no-deps", "--only-binary=:all:", *GPU_TAGS, "--target",
                  str(Path(tmp) / "dry"), "--find-links", str(dest), *[f"{n}=={v}" for n, v in wanted.items()])
        if dry.returncode != 0:
            print(dry.stderr, file=sys.stderr)
            print("error: pip would not install the wheels on CPython 3.12 / manylinux x86_64", file=sys.stderr)
            return 1
        print(f"1. pip would install all {len(found)} wheels on CPython 3.12 / manylinux x86_64 (dry run)")
        conflicts, missing = declared(found)
        for conflict in conflicts:
            print(f"error: {conflict}", file=sys.stderr)
        if conflicts:
            return 1
        print(f"2. declared requirements: met by the wheels or the image, versions checked where known; neither "
              f"carried nor on the image (never imported by maxout's paths, see 3.): {', '.join(missing) or 'none'}")
        here = {t for t in sys_tags()}
        local = [p for p in found.values() if parse_wheel_filename(p.name)[3] & here]
        elsewhere = sorted(set(found) - {canonicalize_name(parse_wheel_filename(p.name)[0]) for p in local})
        target = Path(tmp) / "site"
        installed = pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target),
                        *map(str, local))
        if installed.returncode != 0:
            print(installed.stderr, file=sys.stderr)
            return 1
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
        closure = subprocess.run([sys.executable, "-m", "benchmarks.gpu.closure", "--carried", str(target),
                                  "--allow", ",".join(elsewhere)], cwd=ROOT, env=env)
        print(f"3. closure: {len(local)} wheels installed from {dest}, {', '.join(elsewhere) or 'none'} from the "
              f"venv (built for 3.12 only): {'ok' if closure.returncode == 0 else 'FAILED'}")
        return closure.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("download", "check", "size"))
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    args = parser.parse_args(argv)
    return {"download": download, "check": check, "size": report_size}[args.command](args.dest)


if __name__ == "__main__":
    sys.exit(main())
