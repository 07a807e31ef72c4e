"""A real Docker engine for the tests that run `mlflow run .` the way a user does.

- The engine: Debian's dockerd on a socket, data root and exec root of its own, without iptables or a bridge
  (containers use the host's network: `-A network=host`), started with setsid and stopped by its pid file. The
  data root lives in ENGINE_DIR and outlives the session, so a second session reuses the image layers.
- The image: `make image-cpu`, once per session: the CPU stand-in built from docker/Dockerfile on a Debian base
  made with debootstrap (no registry is reachable here).
- The user: an ordinary account (not root), in the group that owns the engine's socket, runs `mlflow run` from a
  copy of the project that it owns, as a fresh clone would be. Its `mlflow` is a virtualenv of its own in
  ENGINE_DIR (the system's Python, the locked mlflow and docker packages; rebuilt when constraints.txt changes),
  not the checkout's .venv: that one lies wherever the checkout was cloned, often under a private folder (/root
  is 0700, and so are many home folders and CI workspaces), where another user cannot read it.

Root is needed to start the engine and to create the user; CI runs as root (.ci/run installs docker.io and
debootstrap when they are missing).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

from . import services
from .conftest import ROOT

ENGINE_DIR = Path(os.environ.get("MAXOUT_DOCKER_DIR", "/var/tmp/maxout-docker"))
GROUP = "maxout-docker"
USER = "maxout-user"
IMAGE = "maxout:latest"
BUILD_TIMEOUT_S = 45 * 60
BACKGROUND_NICENESS = 15  # the engine and the image build yield the CPU to the tests that run beside them


@dataclass
class Engine:
    host: str  # DOCKER_HOST
    build_seconds: float
    user_python: str  # the test user's Python with mlflow (user_python())

    @property
    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": self.host}

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env={**os.environ, **self.env}, capture_output=True, text=True,
                              check=check)


def _need(tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is missing: apt-get install {package} (.ci/run installs it)")


def _ensure_user() -> pwd.struct_passwd:
    if subprocess.run(["getent", "group", GROUP], capture_output=True).returncode:
        subprocess.run(["groupadd", GROUP], check=True)
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--groups", GROUP, "--shell", "/bin/bash", USER], check=True)
        return pwd.getpwnam(USER)


def _start_daemon(storage_driver: Optional[str], root: Optional[Path] = None) -> tuple[subprocess.Popen, str]:
    """dockerd with its data root, exec root, pid file and socket under ``root`` (ENGINE_DIR), once it answers.
    An engine an earlier session left running there is stopped first (_stop_leftover), and only this process's
    own dockerd counts as started: the pid file must name it."""
    root = root or ENGINE_DIR
    for sub in ("data", "exec"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    _stop_leftover(root)
    sock = root / "docker.sock"
    # Niced, like the image build below: started in the background (prepare_in_background), the engine and its
    # builds must leave the two cores to the tests running meanwhile, some of which time themselves.
    cmd = ["nice", "-n", str(BACKGROUND_NICENESS), "dockerd", "--iptables=false", "--ip6tables=false",
           "--bridge=none", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
           "--pidfile", str(root / "docker.pid"), "-H", f"unix://{sock}", "--group", GROUP]
    if storage_driver:
        cmd.append(f"--storage-driver={storage_driver}")
    log = open(root / "dockerd.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    host = f"unix://{sock}"
    deadline = time.monotonic() + 180  # niced: on a loaded machine it starts after everyone else's work
    while time.monotonic() < deadline and proc.poll() is None:
        ok = subprocess.run(["docker", "version"], env={**os.environ, "DOCKER_HOST": host}, capture_output=True)
        if ok.returncode == 0 and _pid_in(root) == proc.pid:  # ours answers, not another engine on this socket
            return proc, host
        time.sleep(0.5)
    _stop_daemon(proc)
    raise RuntimeError(f"dockerd did not start (storage driver {storage_driver or 'default'}); see "
                       f"{root / 'dockerd.log'}")


def _pid_in(root: Path) -> Optional[int]:
    with contextlib.suppress(OSError, ValueError):
        return int((root / "docker.pid").read_text().strip())
    return None


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie has: it only waits for its parent to read its status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_leftover(root: Path) -> None:
    """Stop the dockerd that an earlier session left running on ``root``, and remove a stale pid file.

    A session killed before its end (Ctrl-C reaches the tests, not the engine: it runs in a session of its own)
    leaves its engine running. Before this, the next session's dockerd refused to start on the pid file, the
    readiness check was answered by the old engine on the same socket, and the sessions shared it; the first of them
    to end then unmounted the old engine's host network namespace (exec/netns/default, _unmount_leftovers) under
    it, and every later `docker run --network host` failed inside runc with "can't get final child's PID from pipe:
    EOF" while containers without the host network still started (issue 36). dockerd also refuses a pid file whose
    number a live process of any kind now has, so a stale one goes too."""
    pid = _pid_in(root)
    if pid is None:
        return
    comm = ""
    with contextlib.suppress(OSError):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    if comm == "dockerd" and _alive(pid):
        print(f"docker_engine: stopping the engine an earlier session left running (dockerd pid {pid}, {root})",
              file=sys.stderr)
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)  # dockerd and the containerd it started (start_new_session: one group)
            deadline = time.monotonic() + wait_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not _alive(pid):
                break
    (root / "docker.pid").unlink(missing_ok=True)
    _unmount_leftovers(root)


def _stop_daemon(proc: subprocess.Popen) -> None:
    services.stop(proc, timeout_s=30)  # dockerd and the containerd it started: one process group


def _unmount_leftovers(root: Optional[Path] = None) -> None:
    """dockerd leaves its network namespace bind-mounted under the exec root when it stops: unmount it, so that the
    folder can be removed (and a later engine starts clean). Only once that engine is gone: a running engine needs
    it for every container on the host network."""
    netns = (root or ENGINE_DIR) / "exec" / "netns" / "default"
    if os.path.ismount(netns):
        subprocess.run(["umount", str(netns)], capture_output=True)


def _prepare() -> tuple[subprocess.Popen, Engine]:
    """Start the engine, build the image and the test user's virtualenv; the engine is stopped if that fails."""
    _ensure_user()
    try:
        proc, host = _start_daemon(None)  # overlay2 where the file system allows it
    except RuntimeError:
        proc, host = _start_daemon("vfs")  # copies every layer whole: slower, works everywhere
    try:
        started = time.monotonic()
        build = subprocess.run(["nice", "-n", str(BACKGROUND_NICENESS), "make", "image-cpu"], cwd=ROOT,
                               env={**os.environ, "DOCKER_HOST": host},
                               capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if build.returncode:
            raise RuntimeError(f"make image-cpu failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}")
        _prune(host, before=started)
        # The containers the tests start (runc and the job inside) inherit the engine's priority: niced, a job would
        # get a tenth of a core beside the other xdist worker's tests, and runc's set-up would crawl.
        subprocess.run(["renice", "-n", "0", "-g", str(proc.pid)], capture_output=True)
        return proc, Engine(host, time.monotonic() - started, user_python())
    except BaseException:
        _stop(proc)
        raise


def _prune(host: str, before: Optional[float] = None) -> None:
    """Remove what each session's build leaves behind on the data root, which outlives it: the image the new build
    replaced and the build stages' images that newer ones replaced (2.6 GB and 3.3 GB each; 35 GB had piled up and
    filled the disk mid-build), and the containers of runs that ended. ``before`` (a time.monotonic() value): only
    the images made before it. The stages of the current build are tagged (make image-cpu: maxout-build:builder and
    :package), so they stay the next build's cache; untagged, this prune deleted them, and every other session
    reinstalled the venv and loaded the whole image into the rootless engine again (55 s)."""
    env = {**os.environ, "DOCKER_HOST": host}
    since = ["--filter", f"until={int(time.monotonic() - before) + 1}s"] if before is not None else []
    subprocess.run(["docker", "image", "prune", "-f", *since], env=env, capture_output=True)
    subprocess.run(["docker", "container", "prune", "-f"], env=env, capture_output=True)


def _stop(proc: subprocess.Popen, root: Optional[Path] = None) -> None:
    _stop_daemon(proc)
    _unmount_leftovers(root)


_prepared: Optional[concurrent.futures.Future] = None
# Under pytest-xdist the controller prepares the engine (it outlives every worker) and hands it to the worker that
# runs the Docker tests through this file: {"host", "build_seconds", "user_python"} or {"error"}. None: this process
# prepares its own (a plain pytest run).
HANDOFF: Optional[Path] = None
# The test files whose tests use the engine: the controller sees only test ids, not fixtures, when it decides to
# start the engine; conftest checks this list against the fixtures every worker collected.
ENGINE_TEST_FILES = ("tests/test_mlflow_run.py",)


def prepare_in_background(handoff: Optional[Path] = None) -> None:
    """Start :func:`_prepare` in a thread while the rest of the suite runs (conftest calls this once the tests
    that use the engine are collected). On a fresh machine it takes minutes that wait mostly on the network and the
    disk (debootstrap, pip downloads, image layers), not on the two cores the other tests use. With ``handoff`` (the
    xdist controller), the result is written there for the worker that runs the Docker tests."""
    global _prepared
    if _prepared is None and os.geteuid() == 0 and all(map(shutil.which, ("dockerd", "docker", "debootstrap"))):
        if handoff:
            handoff.unlink(missing_ok=True)
        _prepared = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="docker-engine").submit(
            _prepare_and_hand_off if handoff else _prepare, *([handoff] if handoff else []))


def _prepare_and_hand_off(handoff: Path) -> tuple[subprocess.Popen, Engine]:
    try:
        proc, running = _prepare()
    except BaseException as err:
        _write_json(handoff, {"error": f"{type(err).__name__}: {err}"})
        raise
    _write_json(handoff, {"host": running.host, "build_seconds": running.build_seconds,
                          "user_python": running.user_python})
    return proc, running


def _write_json(path: Path, value: dict) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # the worker never reads half a file


def _handed_off(handoff: Path) -> Engine:
    """The controller's engine, once it is ready (the worker waits for the file, at most as long as a build)."""
    import json

    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not handoff.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Docker engine was not ready within {BUILD_TIMEOUT_S} s ({handoff} never came)")
        time.sleep(1)
    got = json.loads(handoff.read_text())
    if "error" in got:
        raise RuntimeError(f"preparing the Docker engine failed: {got['error']}")
    return Engine(got["host"], got["build_seconds"], got["user_python"])


def stop_background() -> None:
    """At the end of the session: stop an engine prepared in the background (after waiting for its build, when the
    session ended first: the engine must not outlive it). Under xdist this is the controller, after every worker."""
    if _prepared is not None and _prepared.exception() is None:
        _stop(_prepared.result()[0])
    if HANDOFF is not None and _prepared is not None:
        HANDOFF.unlink(missing_ok=True)


@contextlib.contextmanager
def engine() -> Iterator[Engine]:
    """The engine, with the image built (by :func:`prepare_in_background` where it ran); stopped at the end (its
    data root stays, as a cache). A worker of an xdist run takes the controller's engine, which the controller
    stops at the end of the session."""
    global _prepared
    if os.geteuid() != 0:
        pytest.skip("starting a Docker engine needs root (CI runs as root)")
    _need("dockerd", "docker.io")
    _need("docker", "docker.io")
    _need("debootstrap", "debootstrap")
    if HANDOFF is not None:
        yield _handed_off(HANDOFF)
        return
    prepared, _prepared = _prepared, None  # the background engine serves the first caller only
    proc, running = prepared.result() if prepared is not None else _prepare()
    try:
        yield running
    finally:
        _stop(proc)


def project_copy(dest: Path, owner: str = USER) -> Path:
    """The working tree as a fresh clone would hold it (tracked files, and new files git does not ignore),
    owned by ``owner`` (the test user, or root)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    user = pwd.getpwnam(owner)
    for path in [dest, *dest.rglob("*")]:
        os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
    return dest


def _as_user(user: pwd.struct_passwd, *command: str) -> list[str]:
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--", *command]


def user_python() -> str:
    """The test user's own Python with the locked mlflow and docker packages: a virtualenv in ENGINE_DIR, made
    once per machine by this process's pip (its wheel cache) and made readable by all. Fails in one line, before
    any run, where the user still cannot run it."""
    user = pwd.getpwnam(USER)
    system = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/bin")
    if system is None:
        pytest.fail(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor} is missing: the test user's "
                    f"mlflow runs on the system's Python of the suite's version (apt-get install python3)")
    venv = ENGINE_DIR / "user-venv"
    python = venv / "bin" / "python"
    lock = (ROOT / "constraints.txt").read_bytes()
    stamp = venv / ".constraints"
    if not (stamp.exists() and stamp.read_bytes() == lock):
        shutil.rmtree(venv, ignore_errors=True)
        # --without-pip: Debian's Python has no ensurepip without python3-venv; this process's uv (make install puts
        # it in the venv; else its pip) installs into it. Bytecode compiled now, as pip does: the user cannot write
        # into the venv, so each of its mlflow runs would compile mlflow from source.
        subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], check=True)
        uv = shutil.which("uv", path=str(Path(sys.executable).parent))
        installer = ([uv, "pip", "install", "--compile-bytecode", "--python", str(python)] if uv else
                     [sys.executable, "-m", "pip", "--python", str(python), "install"])
        pip = subprocess.run([*installer, "-q", "-c", str(ROOT / "constraints.txt"), "mlflow", "docker"],
                             capture_output=True, text=True)
        if pip.returncode:
            pytest.fail(f"installing mlflow for {USER} into {venv} failed: {pip.stderr.strip()[-500:]}")
        subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)  # whatever the umask was
        stamp.write_bytes(lock)
    probe = subprocess.run(_as_user(user, str(python), "-c", "import mlflow, docker"), capture_output=True, text=True)
    if probe.returncode:
        pytest.fail(f"{USER} cannot run {python} (a parent folder of MAXOUT_DOCKER_DIR={ENGINE_DIR} is private?): "
                    f"point MAXOUT_DOCKER_DIR at a folder every user can reach, such as /var/tmp/maxout-docker; "
                    f"{(probe.stderr.strip().splitlines() or [''])[-1]}")
    return str(python)


def mlflow_run(engine: Engine, project: Path, args: Sequence[str], env: Optional[dict] = None,
               timeout_s: float = 900, as_user: str = USER) -> subprocess.CompletedProcess:
    """`mlflow run . ARGS` in ``project``, as ``as_user`` (the test user, or root), with only the environment a user
    would have (plus ``env``: a tracking URI, S3 keys)."""
    user = pwd.getpwnam(as_user)
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": user.pw_dir, "USER": as_user, "LOGNAME": as_user,
            "LANG": "C.UTF-8", **engine.env}
    # The suite's thread cap (tests/conftest.py: one torch thread per process, the other worker shares the cores),
    # which MLproject hands to the job by name as it would a user's: a tiny job took 18-21 CPU-s with torch's two
    # threads spinning against a busy core, 12 with one (measured 2026-11-28).
    if "OMP_NUM_THREADS" in os.environ:
        base["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    command = _as_user(user, engine.user_python, "-m", "mlflow", "run", ".", *args)
    result = subprocess.run(command, cwd=project, env={**base, **(env or {})}, capture_output=True, text=True,
                            timeout=timeout_s)
    if "OCI runtime create failed" in result.stderr:  # the engine, not maxout: say what the machine looked like
        result.stderr += "\n" + machine_state(engine)
    return result


def machine_state(engine: Engine) -> str:
    """What a container start that failed inside runc leaves to look at: memory, disk, tasks, the kernel's and the
    engine's last words. (Issue 36's three `docker run --network host` failures, runc's "can't get final child's PID
    from pipe: EOF", came from an engine whose host network namespace had been unmounted under it: _stop_leftover.)"""
    def out(*command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True)
        return (done.stdout + done.stderr).strip()

    log = ENGINE_DIR / "dockerd.log"
    lines = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
    return "\n".join(["--- machine state after the failed container start ---", out("free", "-m"),
                      out("df", "-h", str(ENGINE_DIR), "/tmp"), f"tasks: {len(os.listdir('/proc'))} /proc entries",
                      out("uptime"), *out("dmesg").splitlines()[-10:], *lines])
