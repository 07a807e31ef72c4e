"""Rootless Docker for the tests: the test user's own engine (Debian's docker.io in rootless mode, through its
dockerd-rootless.sh: rootlesskit, newuidmap, slirp4netns), the usual Docker of shared GPU servers (issue 38).

In it the user's own files show up inside a container as uid 0, and the container's root is that user on the host:
so `mlflow run .` finds a store that "belongs to root", and the job must run as root to write as the user. The
engine runs as the test user (docker_engine.USER) with everything under ROOTLESS_DIR, a folder of that user's: its
data root outlives the session, so the image's layers are loaded once per image, not once per session.

The image is not built again: the root engine's image (docker_engine.engine(), `make image-cpu`) is copied into
this one with `docker save | docker load` when the ids differ (a loaded image keeps its id). About 55 s for a new
image on these machines; 19 s when only the project's own layer changed, as a new commit's image does
(docker/Dockerfile keeps the venv's GBs in a layer that only the lock changes, and load skips layers it has).

What the machine must allow (docker/install-engine.sh sees to the packages and to /dev/net/tun): the user's
sub-uid and sub-gid ranges (useradd gives them), user namespaces, and /dev/net/tun open to all (Debian's default,
0666), for slirp4netns's tap device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from . import docker_engine

ROOTLESS_DIR = docker_engine.ENGINE_DIR / "rootless"
CONTRIB = "/usr/share/docker.io/contrib"  # where Debian's docker.io keeps dockerd-rootless.sh
START_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 15 * 60


def _missing() -> list[str]:
    tools = {"rootlesskit": "rootlesskit", "newuidmap": "uidmap", "slirp4netns": "slirp4netns"}
    missing = [f"{tool} (apt-get install {package})" for tool, package in tools.items() if not shutil.which(tool)]
    if not Path(CONTRIB, "dockerd-rootless.sh").is_file():
        missing.append(f"{CONTRIB}/dockerd-rootless.sh (apt-get install docker.io)")
    tun = Path("/dev/net/tun")
    if not tun.exists() or stat.S_IMODE(tun.stat().st_mode) & 0o006 != 0o006:
        missing.append("/dev/net/tun open to all users (chmod 666 /dev/net/tun, Debian's default)")
    return missing


def _user_env(user: pwd.struct_passwd) -> dict[str, str]:
    return {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name, "LANG": "C.UTF-8",
            "XDG_RUNTIME_DIR": str(ROOTLESS_DIR / "run"), "PATH": f"{CONTRIB}:/usr/local/bin:/usr/bin:/bin:/usr/sbin"}


def _stop(pid: int) -> None:
    """rootlesskit (the process the script execs into) stops its dockerd and containerd on SIGTERM."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait_s
        while docker_engine._alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not docker_engine._alive(pid):
            return


def _start(user: pwd.struct_passwd) -> tuple[subprocess.Popen, str]:
    """The user's dockerd-rootless.sh, once its socket answers. One an earlier session left running is stopped."""
    leftover = ROOTLESS_DIR / "rootlesskit.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(leftover.read_text())
        if docker_engine._alive(pid) and Path(f"/proc/{pid}/comm").read_text().strip() == "rootlesskit":
            _stop(pid)
    for sub in ("run", "data", "exec"):
        (ROOTLESS_DIR / sub).mkdir(parents=True, exist_ok=True)
        os.chown(ROOTLESS_DIR / sub, user.pw_uid, user.pw_gid)
    os.chown(ROOTLESS_DIR, user.pw_uid, user.pw_gid)
    (ROOTLESS_DIR / "run").chmod(0o700)  # XDG_RUNTIME_DIR: the user's alone
    sock = ROOTLESS_DIR / "run" / "docker.sock"
    command = docker_engine._as_user(user, f"{CONTRIB}/dockerd-rootless.sh", "--data-root", str(ROOTLESS_DIR / "data"),
                                     "--exec-root", str(ROOTLESS_DIR / "exec"), "-H", f"unix://{sock}",
                                     "--pidfile", str(ROOTLESS_DIR / "run" / "docker.pid"))
    log = open(ROOTLESS_DIR / "dockerd.log", "ab")
    proc = subprocess.Popen(command, env=_user_env(user), cwd=ROOTLESS_DIR, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    leftover.write_text(str(proc.pid))  # setpriv and the script exec: this pid is rootlesskit's
    host = f"unix://{sock}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if subprocess.run(["docker", "version"], env={**os.environ, "DOCKER_HOST": host},
                          capture_output=True).returncode == 0:
            return proc, host
        time.sleep(0.5)
    _stop(proc.pid)
    tail = (ROOTLESS_DIR / "dockerd.log").read_text(errors="replace").splitlines()[-5:]
    raise RuntimeError(f"the rootless dockerd did not answer within {START_TIMEOUT_S} s: {' | '.join(tail)}")


def _image_id(host: str) -> str:
    done = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", docker_engine.IMAGE],
                          env={**os.environ, "DOCKER_HOST": host}, capture_output=True, text=True)
    return done.stdout.strip()


def _copy_image(source: str, dest: str) -> None:
    if _image_id(source) == _image_id(dest):
        return
    save = subprocess.Popen(["docker", "save", docker_engine.IMAGE], env={**os.environ, "DOCKER_HOST": source},
                            stdout=subprocess.PIPE)
    load = subprocess.run(["docker", "load", "-q"], env={**os.environ, "DOCKER_HOST": dest}, stdin=save.stdout,
                          capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
    save.stdout.close()
    if save.wait() or load.returncode:
        raise RuntimeError(f"copying {docker_engine.IMAGE} into the rootless engine failed: {load.stderr[-500:]}")
    docker_engine._prune(dest)  # the image this one replaced


@contextlib.contextmanager
def engine(rootful: docker_engine.Engine) -> Iterator[docker_engine.Engine]:
    """The test user's rootless engine, with ``rootful``'s image in it; stopped at the end (its data root stays)."""
    missing = _missing()
    if missing:
        pytest.fail("rootless Docker cannot start here: missing " + "; ".join(missing)
                    + " (docker/install-engine.sh, which make test runs as root, installs them)")
    user = pwd.getpwnam(docker_engine.USER)
    proc, host = _start(user)
    try:
        _copy_image(rootful.host, host)
        yield docker_engine.Engine(host, rootful.build_seconds, rootful.user_python)
    finally:
        _stop(proc.pid)
        proc.wait()


@contextlib.contextmanager
def ready_in_background(rootful: docker_engine.Engine) -> Iterator[concurrent.futures.Future]:
    """:func:`engine` entered in a thread from now on: the future's result is the rootless engine once the image is
    in it. A new image's `docker save | docker load` (2.7 GB, ~80 s and ~65 CPU-s on a new machine, where CI always
    is) then overlaps whatever the caller does meanwhile. At the end the thread is waited for and the engine
    stopped."""
    with contextlib.ExitStack() as stack, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rootless-engine") as pool:
        ready = pool.submit(stack.enter_context, engine(rootful))
        try:
            yield ready
        finally:
            concurrent.futures.wait([ready])  # then the pool, then the stack: the engine stops after it started
