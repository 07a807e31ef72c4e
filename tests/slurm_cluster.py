"""A real two-node Slurm cluster on this machine, for tests: Debian's slurm-wlm and munge, started like
tests/services.py starts PostgreSQL, and stopped.

The two nodes are two network namespaces, each a host with its own address on a private bridge (veth pairs):
node ``n1`` is 10.X.0.11 and ``n2`` 10.X.0.12, the controller (slurmctld, munged) 10.X.0.1 in this machine's own
namespace. One slurmd runs in each namespace. Why namespaces and not Slurm's multiple-slurmd mode (several slurmd
of one host, on other ports; a build option, ``--enable-multiple-slurmd``): namespaces make the job see what a real
cluster gives it, two hosts with two addresses, torchrun's rendezvous and gloo crossing a link to the first node,
nothing shared through loopback; and they need no particular build of Slurm. The file system is shared, as a cluster's home or project file system is.

Needs root (namespaces, bridge, slurmd). Runs every daemon in the foreground under its own session, and stops them
by their process groups; the namespaces and links are deleted at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import services

NODES = ("n1", "n2")
POLL_S = 0.25  # how often wait() and wait_array() ask slurmctld (a few ms of CPU for scontrol/squeue each)


@dataclass
class Cluster:
    root: Path
    env: dict  # SLURM_CONF for sbatch, squeue, scancel, scontrol
    controller_addr: str
    node_addrs: dict  # node name -> address
    namespaces: dict  # node name -> network namespace
    setup_s: float

    slurmd_pids: dict  # node name -> its slurmd's pid

    def run(self, *cmd: str, check: bool = True, timeout: float = 30, env: dict | None = None
            ) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster, in this process's environment (sbatch exports it to the job)."""
        env = {**os.environ, **self.env, **(env or {})}
        return subprocess.run(list(cmd), env=env, capture_output=True, text=True, check=check, timeout=timeout)

    def sbatch(self, script: Path, *args: str, env: dict | None = None) -> str:
        out = self.run("sbatch", "--parsable", *args, str(script), env=env).stdout.strip()
        return out.split(";")[0]

    def state(self, job_id: str) -> str:
        """The job's state (squeue while it is known there, else scontrol's record)."""
        out = self.run("scontrol", "show", "job", job_id, "-o", check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def wait(self, job_id: str, timeout: float = 300, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                              "NODE_FAIL", "OUT_OF_MEMORY", "GONE")) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(POLL_S)
        raise TimeoutError(f"job {job_id} still {self.state(job_id)} after {timeout}s\n{self.logs()}")

    def wait_array(self, job_id: str, timeout: float = 300) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.split()
            if not out:
                return out
            time.sleep(POLL_S)
        raise TimeoutError(f"array {job_id} still queued after {timeout}s")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def processes_in(self, node: str) -> list[int]:
        """Pids of the processes whose network namespace is ``node``'s (its slurmd and what it started)."""
        ns = os.stat(f"/run/netns/{self.namespaces[node]}").st_ino
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(proc / "ns" / "net").st_ino == ns:
                        found.append(int(proc.name))
        return found


def available() -> str:
    """Why a cluster cannot start here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "ip") if shutil.which(b) is None]
    return f"missing {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else ""


def _sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


# Latencies (the job tests wait on them): the main scheduling loop runs every second (sched_interval=1; an empty
# queue of two nodes costs nothing) and a submitted batch job is not held back (batch_sched_delay=0), so a job starts
# within about a second. KillWait is 60 s: the script's trap (`maxout tracking end-slurm-job`, a Python start-up that
# reads its config without torch: 2.1 s on an idle machine, 3.5 s with it, several times that on a loaded one) must
# finish before slurmd SIGKILLs it; a job whose processes end at once is not held by it. Note slurmd 22.05 checks a
# signalled job's end every second for 10 s, then only every 10 s: a job that takes 11-20 s to end after scancel or
# requeue is seen at 21 s (CANCELLED or PENDING comes then), a Slurm latency that no setting here shortens.
SLURM_CONF = """\
ClusterName=maxout
SlurmctldHost={host}({ctl})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1,batch_sched_delay=0
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=60
UnkillableStepTimeout=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PlugStackConfig={root}/plugstack.conf
SlurmdParameters=config_overrides
{nodes}
PartitionName=main Nodes={node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    """Start munged, slurmctld and one slurmd per node namespace; yield the cluster once both nodes are idle."""
    why = available()
    if why:
        raise RuntimeError(f"a Slurm cluster cannot start here: {why}")
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="maxout-slurm-"))
    tag = f"{os.getpid() % 100000}"
    net = _free_subnet()
    ctl_addr = f"10.{net}.0.1"
    addrs = {n: f"10.{net}.0.{11 + i}" for i, n in enumerate(NODES)}
    namespaces = {n: f"mx{tag}{n}" for n in NODES}
    bridge = f"mxb{tag}"
    procs: list[subprocess.Popen] = []
    links: list[str] = []
    try:
        _sh("ip", "link", "add", bridge, "type", "bridge")
        links.append(bridge)
        _sh("ip", "addr", "add", f"{ctl_addr}/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for node, ns in namespaces.items():
            host_end = f"mxv{tag}{node}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            links.append(host_end)
            _sh("ip", "link", "set", host_end, "master", bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addrs[node]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        (root / "state").mkdir()
        for node in NODES:
            (root / "spool" / node).mkdir(parents=True)
        (root / "plugstack.conf").write_text("")
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        procs.append(_start(["munged", "-F", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
                             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                             f"--seed-file={root}/munged.seed"], root / "munged.out.log"))
        _wait_for(lambda: (root / "munge.socket").exists(), 20, "munged's socket")
        host = socket.gethostname()
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs=2 RealMemory=2000 State=UNKNOWN"
                          for n, a in addrs.items())
        conf = root / "slurm.conf"
        conf.write_text(SLURM_CONF.format(host=host, ctl=ctl_addr, ctl_port=_free_port(ctl_addr),
                                          slurmd_port=6818, root=root, nodes=nodes, node_list=",".join(NODES)))
        env = {"SLURM_CONF": str(conf)}
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env={**os.environ, **env},
                                      stdout=(root / "slurmctld.out.log").open("ab"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        for node, ns in namespaces.items():
            # nsenter switches the network namespace only: `ip netns exec` would also mount a fresh /sys, without
            # the cgroup file system that slurmd 22.05 initialises (it refuses to start without it)
            procs.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "slurmd", "-D", "-N", node, "-f",
                                           str(conf)],
                                          env={**os.environ, **env},
                                          stdout=(root / f"slurmd-{node}.out.log").open("ab"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        c = Cluster(root, env, ctl_addr, addrs, namespaces, 0.0, {n: p.pid for n, p in zip(NODES, procs[-2:])})

        def idle() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}\n{c.logs()}")
            out = c.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
            return sorted(line.split()[1] for line in out if line.strip()) == ["idle", "idle"]

        _wait_for(idle, 60, "both nodes idle", c.logs)
        c.setup_s = time.monotonic() - started
        yield c
    finally:
        for proc in reversed(procs):
            services.stop(proc)
        for ns in namespaces.values():
            # what a job left behind in a node (a test asserts there is nothing), then the namespace
            with contextlib.suppress(FileNotFoundError):
                ino = os.stat(f"/run/netns/{ns}").st_ino
                for proc in Path("/proc").iterdir():
                    if proc.name.isdigit():
                        with contextlib.suppress(OSError):
                            if os.stat(proc / "ns" / "net").st_ino == ino:
                                os.kill(int(proc.name), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in reversed(links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _free_subnet() -> int:
    """N of a 10.N.0.0/24 that no route or address of this machine touches (the bridge must not shadow a network
    the machine uses), starting from one drawn from the pid (parallel sessions)."""
    import ipaddress

    used = [ipaddress.ip_network(word, strict=False) for word in
            subprocess.run(["ip", "-4", "-o", "route"], capture_output=True, text=True).stdout.split()
            + subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout.split()
            if "/" in word or word.count(".") == 3 and word.replace(".", "").isdigit()]
    for offset in range(200):
        net = 20 + (os.getpid() + offset) % 200
        candidate = ipaddress.ip_network(f"10.{net}.0.0/24")
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.N.0.0/24 for the test cluster's bridge")


def _wait_for(check, timeout_s: float, what: str, logs=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what}: not within {timeout_s}s\n{logs()}")
