"""The test suite's own Docker engine (tests/docker_engine.py): what it does when an earlier session left one running.

A session killed before its end leaves its engine running (it is in a session of its own, out of Ctrl-C's reach).
The next session must stop it and start its own: sharing it, the sessions unmounted its host network namespace under
it and every `docker run --network host` then failed inside runc (issue 36). A second, throw-away engine under a
folder of its own: the suite's engine (ENGINE_DIR) is not touched, and this test may run beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from . import docker_engine


def tiny_image(host: str, folder: Path) -> str:
    """An image of /bin/true and the two libraries it loads, imported from a tarball (no registry here)."""
    tarball = folder / "rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        for path in ("/bin/true", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
            tar.add(os.path.realpath(path), arcname=path.lstrip("/"))
    subprocess.run(["docker", "import", str(tarball), "maxout-true:test"], env={**os.environ, "DOCKER_HOST": host},
                   check=True, capture_output=True)
    return "maxout-true:test"


def host_network_run(host: str, image: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "run", "--rm", "--network", "host", image, "/bin/true"],
                          env={**os.environ, "DOCKER_HOST": host}, capture_output=True, text=True, timeout=120)


def test_an_engine_left_running_by_a_killed_session_is_stopped_and_host_network_containers_start():
    if os.geteuid() != 0 or not all(map(shutil.which, ("dockerd", "docker"))):
        pytest.skip("starting a Docker engine needs root and docker.io (CI runs as root and installs it)")
    if not all(os.path.exists(p) for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2")):
        pytest.skip("the tiny image is made of this x86-64 Debian's /bin/true and its libraries")
    root = Path(tempfile.mkdtemp(prefix="engine-", dir="/var/tmp"))  # short: the socket's path has a length limit
    docker_engine._ensure_user()  # the socket's group
    left = new = None
    try:
        left, host = docker_engine._start_daemon("vfs", root)  # a session that is then killed: never stopped
        image = tiny_image(host, root)
        assert host_network_run(host, image).returncode == 0

        new, host = docker_engine._start_daemon("vfs", root)  # the next session
        assert left.wait(timeout=10) is not None  # the leftover was stopped, not shared
        assert docker_engine._pid_in(root) == new.pid and new.poll() is None
        started = host_network_run(host, image)
        assert started.returncode == 0, started.stderr
    finally:
        for proc in (new, left):
            if proc is not None:
                docker_engine._stop(proc, root)
        assert not os.path.ismount(root / "exec" / "netns" / "default")
        shutil.rmtree(root, ignore_errors=True)
