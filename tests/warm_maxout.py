"""``maxout`` commands in processes of their own, forked from one process that imported the heavy libraries once.

A test that starts ``python -m maxout ...`` pays ~5 CPU-s of imports (torch, transformers, MLflow, Optuna) before
the command's first line, on the 2-core test machines; for the processes whose behaviour a test reads (exit codes,
signals, a SIGKILL mid-run, a supervisor's workers), not their start-up, that is waste. :func:`popen` and
:func:`run` give such a process for ~0.3 CPU-s instead: a per-test-process server (``python -m tests.warm_maxout``,
started on first use, ended with its parent) imported maxout's command modules once, and forks one child per command.
The child is what a fresh process that imported the same modules first would be, as in tests/job_race.py: its own
pid, session (``start_new_session``) or process group (``process_group``), working folder, environment (the
caller's, set before the command runs), and standard streams (the caller's pipes or files, passed over a Unix
socket); it runs ``cli.run(argv)`` and exits as ``python -m maxout`` does. Signals reach it directly (its pid is
real); its exit status comes back through the socket.

``popen(argv, program="mlflow")`` forks ``python -m mlflow ...`` the same way: tests/services.py's MLflow servers
(:func:`mlflow_command`). ``program="tests.job_race"`` (any of :data:`HELPERS`) forks ``python -m tests.job_race ...``:
the tests' own multi-process drivers, which import maxout or MLflow and then fork or hold a lock themselves;
``program="benchmarks.gpu_report"`` and ``"benchmarks.hpo_time_to_best"`` run those benchmarks whole, and
``program="torch.distributed.run"`` torchrun. A forked command's own ``python -m maxout ...`` children are forked from
the same server where the caller reads nothing of them but their Popen (:data:`ROUTED`: torchrun's workers, the GPU
report's sections, the time-to-best segments).

What it is not: a test of the interpreter's start-up (tests/test_cli.py keeps one: an unknown profile from a fresh
``python -m maxout``), nor of settings read at import (the server imports with the caller's environment of that
moment: tests that change HF_* variables, read by huggingface_hub at import, start fresh processes; test_hub.py).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
START_TIMEOUT_S = 300  # the server's imports: ~6 CPU-s, minutes only on a machine loaded far past its cores


# ------------------------------------------------------------------------------------------------- the caller's side
class Process:
    """The part of subprocess.Popen the tests use, for a command the server forked: ``pid``, ``returncode``,
    ``stdout``/``stderr`` (file objects where PIPE was asked), ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``terminate``, ``kill``."""

    def __init__(self, argv: Sequence[str], env: Optional[dict] = None, cwd: Path = ROOT, stdout: Any = None,
                 stderr: Any = None, text: bool = True, start_new_session: bool = False, program: str = "maxout",
                 stdin: Any = None, unbuffered: bool = False, process_group: Optional[int] = None):
        if program not in PROGRAMS:
            raise ValueError(f"tests.warm_maxout: program={program!r} (valid: {', '.join(PROGRAMS)})")
        self.args = [program, *argv]
        self.returncode: Optional[int] = None
        self.stdin: Optional[IO] = None
        self.stdout: Optional[IO] = None
        self.stderr: Optional[IO] = None
        sent, mine = [], []  # the fds the child gets (0, 1, 2); the child's ends of new pipes, closed here once sent
        if stdin == PIPE:
            read, write = os.pipe()
            self.stdin = open(write, "w" if text else "wb")
            sent.append(read)
            mine.append(read)
        elif stdin == DEVNULL:
            sent.append(os.open(os.devnull, os.O_RDONLY))
            mine.append(sent[-1])
        else:
            sent.append(0 if stdin is None else stdin if isinstance(stdin, int) else stdin.fileno())
        for name, spec in (("stdout", stdout), ("stderr", stderr)):
            if spec == DEVNULL:
                sent.append(os.open(os.devnull, os.O_WRONLY))
                mine.append(sent[-1])
            elif spec == PIPE:
                read, write = os.pipe()
                setattr(self, name, open(read, "r" if text else "rb", **({"errors": "replace"} if text else {})))
                sent.append(write)
                mine.append(write)
            elif spec == STDOUT:
                sent.append(sent[1])
            elif spec is None:
                sent.append(1 if name == "stdout" else 2)
            else:
                sent.append(spec if isinstance(spec, int) else spec.fileno())
        request = {"program": program, "argv": list(argv), "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd), "new_session": start_new_session, "process_group": process_group,
                   "unbuffered": unbuffered}
        server = _ROUTE or _server()  # in a command the server forked: that same server
        if program in RUN_MAXOUT_COMMANDS:
            _check_import_time_settings(request["env"], server.settings)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(str(server.path))
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], sent)
        for fd in mine:
            os.close(fd)  # the child holds them now: EOF here when it exits, and there when self.stdin closes
        self._buffer = b""
        self.pid = int(self._line(None))

    def _line(self, timeout: Optional[float]) -> Optional[str]:
        """The server's next line on this connection; None if none came within ``timeout`` (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"tests.warm_maxout: the server ended before {self.args} did")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def poll(self) -> Optional[int]:
        return self._status(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _status(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: Optional[float] = None) -> tuple:
        """Everything the child writes to its pipes, read to their end, then its exit status, as Popen's (no
        ``input``: no caller writes one)."""
        if input is not None:
            raise ValueError("tests.warm_maxout: communicate(input=...) is not supported")
        outputs: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=name, f=stream: outputs.__setitem__(n, f.read()), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return outputs.get("stdout"), outputs.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __enter__(self) -> "Process":  # subprocess.run's `with Popen(...) as process`
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(argv: Sequence[str], **kwargs: Any) -> Process:
    """``subprocess.Popen([python, "-m", "maxout", *argv], cwd=ROOT, text=True, **kwargs)``, forked warm
    (``program="mlflow"``: ``python -m mlflow``, see :func:`mlflow_command`)."""
    return Process(argv, **kwargs)


def run(argv: Sequence[str], env: Optional[dict] = None, timeout: Optional[float] = None,
        cwd: Path = ROOT, program: str = "maxout") -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", program, *argv], capture_output=True, text=True, ...)``, forked warm; a
    command still running at ``timeout`` is killed, as subprocess.run does."""
    proc = Process(argv, env=env, cwd=cwd, stdout=PIPE, stderr=PIPE, program=program)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Read at import by the libraries the server imports (huggingface_hub's cache and offline switch, torch's and
# transformers' own settings): a child cannot take other values from its environment, so a request that sets others
# is refused. OpenMP's thread count, read when torch loads it, is set in the child instead (_become).
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH")
# ... except those read where they are used: inductor's cache folder is read at each compile, and the first compile
# in a process writes the default back into os.environ (torch/_inductor/runtime/cache_dir_utils.py), so a test
# process that compiled once would otherwise differ from its server for the rest of the session; and what torchrun's
# agent gives its workers (TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE, TORCH_NCCL_ASYNC_ERROR_HANDLING, ...), read
# by torch.distributed when the worker joins the job (rendezvous.py, errors/error_handler.py, ProcessGroupNCCL)
READ_AT_USE = ("TORCHINDUCTOR_CACHE_DIR", "TORCHELASTIC_", "TORCH_NCCL_")
# ... and those read at import that the child sets again to what its own import would have made of them (_become):
# inductor's compile threads (torch/_inductor/config.py's decide_compile_threads; the GPU report sets them)
SET_AGAIN = ("TORCHINDUCTOR_COMPILE_THREADS",)
# The tests' own drivers, run as ``python -m NAME ARGV`` would run them (runpy, as __main__): each imports only what
# the server imported already (maxout, MLflow), then forks its own children or holds a lock.
HELPERS = ("tests.job_race", "tests.registry_race", "tests.lock_stress", "tests.lock_holder")
# Benchmarks whose tests run them whole: they start maxout commands (and the report, its sections) themselves,
# forked from the same server in turn (ROUTED).
BENCHMARKS = ("benchmarks.gpu_report", "benchmarks.hpo_time_to_best")
# torchrun (``python -m torch.distributed.run``, what its console script runs): its agent starts its workers forked
# from the same server in turn (ROUTED), as `maxout train --nproc-per-node`'s launcher does in a forked maxout command
LAUNCHERS = ("torch.distributed.run",)
# maxout's own modules run as programs: hpo.workers=auto's throughput probe (hpo/auto_workers.py starts one per slot)
MAXOUT_MODULES = ("maxout.hpo.probe",)
RUN_AS_MAIN = (*HELPERS, *BENCHMARKS, *LAUNCHERS, *MAXOUT_MODULES)  # each run by runpy, as ``python -m NAME`` runs it
PROGRAMS = ("maxout", "mlflow", *RUN_AS_MAIN)
# The programs that run maxout commands, which may reach the Hub or read torch's settings: a request whose
# IMPORT_TIME_PREFIXES settings differ from the server's is refused. The others read none of them: MLflow's server,
# its scoring server (a logged model's local files), and the registry's lock and race drivers.
RUN_MAXOUT_COMMANDS = ("maxout", "tests.job_race", *BENCHMARKS, *MAXOUT_MODULES)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


# What every test's own body runs with, set by tests/conftest.py (HF_HUB_OFFLINE=1 and a dead Hub endpoint): the
# server starts with it whoever starts it first. A module fixture's warm command (`mlflow models serve`, a server)
# runs before the tests' per-test environment is set; a server started there once imported without HF_HUB_OFFLINE,
# and every later test's maxout command in that process was refused (2026-11-29).
SERVER_ENVIRONMENT: dict[str, str] = {}


class _Server:
    def __init__(self, proc: Optional[subprocess.Popen], folder: Path, env: Optional[dict] = None):
        self.proc, self.folder, self.path = proc, folder, folder / "socket"
        self.settings = import_time_settings(os.environ if env is None else env)
        self.group = os.getpgid(0)  # read in the server itself (ROUTED): the group its children start in
        self.session = os.getsid(0)  # ... and their session, whose groups a child may join (_routed)


def import_time_settings(env) -> dict:
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(READ_AT_USE) and k not in SET_AGAIN}


def _check_import_time_settings(env: dict, server: dict) -> None:
    differ = sorted(set(import_time_settings(env).items()) ^ set(server.items()))
    if differ:
        raise ValueError(f"tests.warm_maxout: {sorted({k for k, _ in differ})} differ from the server's, which "
                         f"imported with them: start this command as a fresh process")


_SERVER: Optional[_Server] = None
_LOCK = threading.Lock()


def _server() -> _Server:
    """This process's server, started on first use (its imports, once) and stopped at exit."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.proc.poll() is not None:
            folder = Path(tempfile.mkdtemp(prefix="maxout-warm-"))
            env = {**os.environ, **SERVER_ENVIRONMENT}
            proc = subprocess.Popen([sys.executable, "-m", "tests.warm_maxout", str(folder / "socket")], cwd=ROOT,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)
            ready = _read_ready(proc)
            if ready != "ready":
                proc.kill()
                raise RuntimeError(f"tests.warm_maxout's server did not start: {ready!r}")
            _SERVER = _Server(proc, folder, env)
            atexit.register(_stop, _SERVER)
        return _SERVER


def children_cpu_s() -> float:
    """CPU seconds of the commands this process's server forked and reaped so far (theirs and their own children's):
    they are the server's children, not this process's, so RUSAGE_CHILDREN misses them (tests/timing.py adds them).
    The commands those commands started through the server (ROUTED) are the server's children too."""
    if _SERVER is None:
        return 0.0
    try:  # /proc/PID/stat: after the command's name in parentheses, cutime and cstime are the 14th and 15th fields
        fields = Path(f"/proc/{_SERVER.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def _read_ready(proc: subprocess.Popen) -> str:
    """The server's first line ("ready" once it listens), or what it said instead, within START_TIMEOUT_S."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline().strip()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    return line[0] if line else f"nothing within {START_TIMEOUT_S} s"


def _stop(server: _Server) -> None:
    import shutil

    server.proc.kill()
    server.proc.wait()
    shutil.rmtree(server.folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- the server's side
def preload() -> None:
    """The imports maxout's commands make, once, before any fork (here, and in tests/job_race.py)."""
    import mlflow  # noqa: F401
    import optuna  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.bert import modeling_bert  # noqa: F401  (the tiny model's classes)

    from maxout import cli  # noqa: F401
    from maxout.hpo import study  # noqa: F401
    from maxout.registry import promotion  # noqa: F401
    from maxout.serving import inference  # noqa: F401
    from maxout.train import launch, train  # noqa: F401  (launch: torchrun's agent, which starts workers: ROUTED)

    # What a tracked command imports when it gets there (the SQL stores, the pyfunc model it logs, the charts, the
    # git tags MLflow reads): ~650 modules, 1.2 of a tiny tracked training's 4.5 CPU-s after the lines above
    # (measured 2026-11-28). None reads a setting a test varies at import.
    for name in ("mlflow.pyfunc", "mlflow.store.tracking.sqlalchemy_store",
                 "mlflow.store.model_registry.sqlalchemy_store", "alembic", "matplotlib.pyplot", "git", "PIL.Image",
                 "pygments", "maxout.tracking.mlflow_run", "maxout.serving.pyfunc"):
        importlib.import_module(name)
    # What each command computes the same way the first time it gets there, from the installed packages alone:
    # - MLflow's map of modules to packages, which a model's log or load checks its requirements against: every
    #   installed distribution's file list read, 0.5 CPU-s per process;
    # - Optuna's fANOVA (scikit-learn, 1 CPU-s), which a study's param-importances plot imports at its end.
    from mlflow.utils import requirements_utils

    requirements_utils._init_modules_to_packages_map()
    importlib.import_module("optuna.importance._fanova")


def serve(path: Path) -> list[str]:
    """Fork one child per request until the parent that started this server is gone. Returns only in a child: the
    program and argv of the command it runs (the module's __main__ runs it, so that the child's stack holds nothing
    of this loop). Each request's connection gets the child's pid, then its exit status once reaped (its pidfd
    readable)."""
    preload()
    # Frozen before the first fork: a child's full collections skip the ~800,000 objects it inherits instead of
    # traversing them (and writing to their pages, each a copy-on-write fault): a forked tiny tracked train costs
    # 1.7-1.8 CPU-s instead of 2.1-2.3 (2026-11-28)
    gc.collect()
    gc.freeze()
    route = _Server(None, path.parent)  # what a forked command needs to start its own commands here (ROUTED)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the request's connection)
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in events.select(timeout=1.0):
            if key.fileobj is listener:
                conn = listener.accept()[0]
                request, fds = _receive(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    events.close()
                    listener.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    return _become(request, fds, conn, route)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                events.register(pidfd, selectors.EVENT_READ)
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                events.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the caller is gone
                conn.close()
    raise SystemExit(0)  # the parent ended: so does the server (its children run on, as they would)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("tests.warm_maxout: a request ended early")
        data += more
    return json.loads(data), list(fds)


def _become(request: dict, fds: list[int], conn: socket.socket, route: _Server) -> list[str]:
    """In the child: the request's session, streams, folder and environment, as a new process would have them."""
    global _ROUTE
    _ROUTE = route
    conn.close()
    if request["new_session"]:
        os.setsid()
    elif request.get("process_group") is not None:  # 0: a group of its own; else the caller's (in the same session)
        os.setpgid(0, request["process_group"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read TMPDIR again: the server's imports may have cached its own
    threads = next((request["env"][v] for v in THREAD_VARIABLES if request["env"].get(v, "").isdigit()), None)
    if threads is not None and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # what OMP_NUM_THREADS gives a process that loads torch after it is set
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:  # SET_AGAIN
        inductor.compile_threads = inductor.decide_compile_threads()
    if request.get("unbuffered") or request["env"].get("PYTHONUNBUFFERED"):
        _unbuffer()
    _route_commands(request["program"])
    if request["program"] == "mlflow":
        sys.argv = ["mlflow", *request["argv"]]
    elif request["program"] in RUN_AS_MAIN:
        sys.argv = [request["program"], *request["argv"]]  # runpy puts the module's file first, as -m does
    else:
        sys.argv = [str(ROOT / "platform" / "maxout" / "__main__.py"), *request["argv"]]
    return [request["program"], *request["argv"]]


def _unbuffer() -> None:
    """What ``python -u`` (or PYTHONUNBUFFERED) makes of stdout and stderr at start-up: each write goes through at
    once (a line a parent reads live, or keeps when this process is killed). The server's own streams stay referenced
    (sys.__stdout__, sys.__stderr__): nothing closes the descriptors."""
    import io

    for fd, name in ((1, "stdout"), (2, "stderr")):
        before = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=before.encoding,
                                            errors=before.errors, write_through=True))


# ------------------------------------------------------------------------------------- the commands' own commands
# Where a forked command starts ``python [-u] -m PROGRAM ...`` itself and reads nothing of that process but what a
# Popen gives (its pid, poll, wait, signals, streams), the server forks it too: ~6 CPU-s of imports less each (torch,
# transformers, MLflow; measured 2026-11-28 with -X importtime on a tiny training), as if started fresh but for its
# parent, which is the server, not the caller. These places:
# - torchrun's agent starting its workers (torch's SubprocessHandler), in ``maxout train --nproc-per-node N``;
# - the GPU report's runner starting its sections, and the time-to-best benchmark starting its studies' segments
#   (their subprocess.Popen, in ROUTED_FROM's processes);
# - maxout hpo's supervisor starting its workers (a forked maxout command's subprocess.Popen): a worker watches its
#   supervisor through its standard input (hpo/supervisor.py), not through its parent's pid, so a forked one stops
#   when its supervisor is gone as a fresh one does (tests/test_hpo_workers.py keeps one supervisor fresh);
# - the GPU report's hpo section starting a study's supervisor in the section's own process group (the report's kill
#   at the section's limit reaches the group): the forked child joins that group, which the runner starts in the
#   server's session (process_group=0, not a session of its own; a process can join only a group of its session).
#   Fresh, each study's supervisor and workers cost ~25 CPU-s of imports each on the Zen 1 CI CPU (2026-12-02).
# - hpo.workers=auto's throughput probes (hpo/auto_workers.py), from a forked maxout command or, in
#   :func:`forking_here`, from the test's own process.
ROUTED = ("maxout", "benchmarks.gpu_report", *MAXOUT_MODULES)
ROUTED_FROM = (*BENCHMARKS, "maxout")
POPEN_KEYWORDS = {"env", "cwd", "stdin", "stdout", "stderr", "text", "universal_newlines", "bufsize", "close_fds",
                  "start_new_session", "process_group"}
_ROUTE: Optional[_Server] = None  # in a command the server forked: that server (_become)


def _routed(args: Any, positional: tuple, kwargs: dict) -> Optional[tuple[str, list[str], bool, Optional[int]]]:
    """(program, argv, unbuffered, process group) where ``Popen(args, *positional, **kwargs)`` can be forked from the
    server and be what it would start; None where it cannot (anything else, other options, other import-time
    settings, a process group in another session)."""
    words = [str(w) for w in args] if isinstance(args, (list, tuple)) else []
    if positional or set(kwargs) - POPEN_KEYWORDS or kwargs.get("close_fds") is False or words[:1] != [
            sys.executable]:
        return None
    module = words.index("-m") + 1 if "-m" in words else len(words)  # the module's name, after -m
    options = words[1:module - 1]
    if module >= len(words) or set(options) - {"-u"}:
        return None
    program, argv = words[module], words[module + 1:]
    env = os.environ if kwargs.get("env") is None else kwargs["env"]
    if program not in ROUTED or import_time_settings(env) != _ROUTE.settings:
        return None
    group = kwargs.get("process_group")
    if not kwargs.get("start_new_session") and group is None and os.getpgid(0) != _ROUTE.group:
        group = os.getpgid(0)  # it would join this process's group: one forked from the server starts in the server's
    if group and os.getsid(0) != _ROUTE.session:
        return None  # a group of another session (this process's own, say): a process can join none of those
    return program, argv, "-u" in options, group


def _routing(popen: type) -> type:
    """``popen``, except that a command :func:`_routed` admits is forked from the server (a :class:`Process`)."""

    class Routed(popen):
        def __new__(cls, args: Any, *positional: Any, **kwargs: Any) -> Any:
            found = _routed(args, positional, kwargs)
            if found is None:
                return super().__new__(cls)
            program, argv, unbuffered, group = found
            return Process(argv, env=kwargs.get("env"), cwd=kwargs.get("cwd") or os.getcwd(),
                           stdin=kwargs.get("stdin"), stdout=kwargs.get("stdout"), stderr=kwargs.get("stderr"),
                           text=bool(kwargs.get("text") or kwargs.get("universal_newlines")),
                           start_new_session=bool(kwargs.get("start_new_session")), program=program,
                           unbuffered=unbuffered, process_group=group)

    return Routed


@contextlib.contextmanager
def forking_here() -> Iterator[None]:
    """In the test's own process, what a forked command has (ROUTED): its ``subprocess.Popen`` of a program of ROUTED
    forked from this process's server, for code a test calls in-process that starts such processes itself
    (auto_workers.run_probes). Restored on exit."""
    global _ROUTE
    before, popen = _ROUTE, subprocess.Popen
    _ROUTE = _server()
    subprocess.Popen = _routing(popen)
    try:
        yield
    finally:
        _ROUTE, subprocess.Popen = before, popen


def _route_commands(program: str) -> None:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess_handler.Popen = _routing(subprocess_handler.Popen)  # imported by name there
    if program in ROUTED_FROM:
        subprocess.Popen = _routing(subprocess.Popen)


def mlflow_command(argv: list[str]) -> int:
    """``python -m mlflow ARGV``, as MLflow's console script runs it, with one difference: ``mlflow server`` runs its
    uvicorn in this process instead of a second interpreter. MLflow's own CLI still parses the options, prepares the
    stores and builds the server's environment and uvicorn's argv (mlflow.server._run_server); only the exec of
    ``python -m uvicorn ...`` is replaced by uvicorn's CLI called here with the same argv and environment. With
    ``--workers 1`` (the tests' servers) uvicorn serves in the process it starts in, so the server is one process:
    ~3 CPU-s and seconds of wall less per start on the 2-core test machines, for a suite that starts a few dozen
    (the fault tests stop and start servers mid-run, and wait for them). Signals reach uvicorn directly: SIGTERM
    stops it gracefully, as MLflow's CLI forwarding SIGTERM to its uvicorn child did."""
    import mlflow.server
    from mlflow.cli import cli as mlflow_cli

    spawn = mlflow.server._exec_cmd

    def serve_here(cmd, extra_env=None, **kwargs):
        if list(cmd[1:3]) != ["-m", "uvicorn"] or not _one_worker(cmd):
            return spawn(cmd, extra_env=extra_env, **kwargs)  # anything else: as MLflow does it
        os.environ.update(extra_env or {})
        return _uvicorn_here(cmd[3:])

    mlflow.server._exec_cmd = serve_here
    _score_here()
    return mlflow_cli.main(args=argv, prog_name="mlflow")


def _score_here() -> None:
    """``mlflow models serve --env-manager local``'s scoring server in this process, as ``mlflow server``'s uvicorn
    above: MLflow's backend downloads the model and builds the command and its environment (``bash -c "exec uvicorn
    --workers 1 ... mlflow.pyfunc.scoring_server.app:app"``, the model's path in the environment); uvicorn's CLI then
    runs here with them instead of in a new interpreter that imports torch and transformers again (~6 CPU-s). The
    parent-death signal MLflow sets on that child has no child to watch here."""
    import shlex
    import types

    from mlflow.pyfunc import backend

    def popen(cmd, env=None, **kwargs):
        words = shlex.split(cmd[2]) if list(cmd[:2]) == ["bash", "-c"] else []
        if words[:2] != ["exec", "uvicorn"] or words[-1] != "mlflow.pyfunc.scoring_server.app:app" \
                or not _one_worker(words):
            return subprocess.Popen(cmd, env=env, **kwargs)  # anything else: as MLflow does it
        os.environ.clear()
        os.environ.update(env or {})
        return _uvicorn_here(words[2:])

    backend.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})


def _one_worker(words: Sequence[str]) -> bool:
    """uvicorn's ``--workers 1``: it serves in the process it starts in (more would fork workers of their own)."""
    return "--workers" in words and words.index("--workers") + 1 < len(words) and \
        words[words.index("--workers") + 1] == "1"


def _uvicorn_here(args: Sequence[str]) -> Any:
    """uvicorn's CLI in this process, with the argv MLflow built for a new one; returns by SystemExit when it stops."""
    from uvicorn.main import main as uvicorn_main

    sys.argv = ["uvicorn", *args]
    return uvicorn_main.main(args=list(args), prog_name="uvicorn")


if __name__ == "__main__":
    program, *command = serve(Path(sys.argv[1]))
    if program == "mlflow":
        sys.exit(mlflow_command(command))
    if program in RUN_AS_MAIN:
        import runpy

        runpy.run_module(program, run_name="__main__", alter_sys=True)
        sys.exit(0)
    from maxout import cli

    sys.exit(cli.run(command))
