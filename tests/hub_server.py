"""A real Hugging Face Hub-protocol server on loopback for tests: olah (a self-hosted Hub mirror) serving tiny model
repositories that the test creates as git repositories, plus what a test needs around it: Debian's nginx in front
of it to stage a gated repo, and a proxy that cuts one download short.

Clients reach it as they reach the Hub: ``HF_ENDPOINT=<url>`` (and HF_HUB_OFFLINE unset). Olah serves any branch,
tag or commit of ``<root>/mirrors/models/ORG/NAME``. Run offline, it answers 401 for a file missing from the repo
(transformers probes optional files) and for ``/api/models/ORG/NAME`` without a revision unless its metadata cache
already holds the repo's refs; ``make_model_repo`` writes that cache with olah's own functions (platform-notes).

    root = tmp_path / "hub"
    commits = make_model_repo(root, "maxout-test/tiny-bert")   # {"v1": sha, "main": sha}, tag v1 = first commit
    with hub_server(root) as url:                               # e.g. http://127.0.0.1:40123
        ...  # HF_ENDPOINT=url maxout train model=bert_base model.name_or_path=maxout-test/tiny-bert
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from .services import free_port

TOKENIZER = Path(__file__).resolve().parents[1] / "platform" / "maxout" / "assets" / "bert-base-uncased-tokenizer"
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 512}
# Fixed commit dates: olah picks a repo's newest commit by date, and two commits in the same second would tie.
DATES = ("2026-01-01T00:00:00+0000", "2026-01-02T00:00:00+0000")
NGINX_CACHE = Path(os.environ.get("MAXOUT_TEST_CACHE", Path.home() / ".cache" / "maxout-tests")) / "nginx"


def _git(repo: Path, *args: str, date: Optional[str] = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "maxout tests", "GIT_AUTHOR_EMAIL": "tests@maxout.invalid",
           "GIT_COMMITTER_NAME": "maxout tests", "GIT_COMMITTER_EMAIL": "tests@maxout.invalid"}
    if date:
        env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def make_model_repo(root: Path, repo_id: str = "maxout-test/tiny-bert") -> dict[str, str]:
    """A tiny BERT (random weights, 2 layers, hidden 32) with maxout's bundled tokenizer, saved with save_pretrained
    into a git repository at ``root/mirrors/models/<repo_id>``: commit 1 tagged ``v1``, then commit 2 on main that
    changes the config (dropout 0.2) and the weights. Returns ``{"v1": sha1, "main": sha2}``, and writes olah's
    metadata cache for both refs and both commits (see the module's docstring)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    repo = root / "mirrors" / "models" / repo_id
    repo.mkdir(parents=True)
    AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(repo)
    torch.manual_seed(0)
    config = BertConfig(**TINY_BERT)
    BertForSequenceClassification(config).save_pretrained(repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "tiny bert", date=DATES[0])
    _git(repo, "tag", "v1")
    config.hidden_dropout_prob = 0.2
    BertForSequenceClassification(config).save_pretrained(repo)
    _git(repo, "commit", "-q", "-a", "-m", "dropout 0.2, new weights", date=DATES[1])
    commits = {"v1": _git(repo, "rev-parse", "v1^{commit}"), "main": _git(repo, "rev-parse", "main")}
    seed_metadata(root, repo_id, ["main", "v1", *commits.values()])
    return commits


def seed_metadata(root: Path, repo_id: str, refs: list[str]) -> None:
    """Olah's metadata cache for ``refs`` of a local repo, written with olah's own functions; ``main``'s is also
    the repo's newest-commit record (meta_head.json), which answers ``/api/models/ORG/NAME``."""
    from olah.mirror.repos import LocalMirrorRepo
    from olah.utils.cache_utils import write_cache_request
    from olah.utils.repo_utils import get_meta_save_path

    org, name = repo_id.split("/")
    local = LocalMirrorRepo(str(root / "mirrors" / "models" / org / name), "models", org, name)
    for ref in refs:
        meta = local.get_meta(ref)
        path = get_meta_save_path(str(root / "cache"), "models", org, name, ref)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        asyncio.run(write_cache_request(path, 200, {"content-type": "application/json"}, json.dumps(meta).encode()))
        if ref == "main":
            Path(path).with_name("meta_head.json").write_text(json.dumps(meta))


@contextlib.contextmanager
def hub_server(root: Path, port: Optional[int] = None) -> Iterator[str]:
    """olah, offline, serving ``root/mirrors`` on a free loopback port (or ``port``: a restart on the same address);
    yields its URL, e.g. ``http://127.0.0.1:40123``, and stops it on exit."""
    port = port or free_port()
    (root / "cache").mkdir(parents=True, exist_ok=True)
    config = root / f"olah-{port}.toml"
    config.write_text(f"""[basic]
host = "127.0.0.1"
port = {port}
repos-path = "{root / 'cache'}"
mirrors-path = ["{root / 'mirrors'}"]
mirror-netloc = "127.0.0.1:{port}"
mirror-lfs-netloc = "127.0.0.1:{port}"

[accessibility]
offline = true
""")
    olah = Path(sys.executable).with_name("olah-cli")
    log = open(root / f"olah-{port}.log", "ab")
    # cwd=root: olah writes its own logs under ./logs
    proc = subprocess.Popen([str(olah), "-c", str(config)], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_port(port, proc, timeout_s=60)  # uvicorn listens once the app has started
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def nginx_binary() -> Path:
    """Debian's nginx, fetched once per machine with ``apt-get download`` and unpacked (``dpkg-deb -x``) into a
    cache folder: run as a user process, nothing installed. Needs only libraries Debian's base already has."""
    binary = NGINX_CACHE / "usr" / "sbin" / "nginx"
    if binary.is_file():
        return binary
    NGINX_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=NGINX_CACHE.parent) as work:
        os.chmod(work, 0o755)  # apt downloads as its own user, _apt
        subprocess.run(["apt-get", "-q", "download", "nginx"], cwd=work, check=True, capture_output=True)
        unpacked = Path(work) / "root"
        subprocess.run(["dpkg-deb", "-x", str(next(Path(work).glob("nginx_*.deb"))), str(unpacked)], check=True)
        if not binary.is_file():  # a parallel session may have unpacked it meanwhile
            unpacked.rename(NGINX_CACHE)
    return binary
    with tempfile.TemporaryDirectory() as work:
        os.chmod(work, 0o755)  # apt downloads as its own user, _apt
        subprocess.run(["apt-get", "-q", "download", "nginx"], cwd=work, check=True, capture_output=True)
        debs = sorted(Path(work).glob("nginx_*.deb"))
        staging = Path(tempfile.mkdtemp(prefix="nginx-", dir=NGINX_CACHE.parent if NGINX_CACHE.parent.exists()
                                        else None))
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(staging)], check=True)
        NGINX_CACHE.parent.mkdir(parents=True, exist_ok=True)
        if not binary.is_file():
            shutil.move(str(staging), str(NGINX_CACHE))
    return binary


@contextlib.contextmanager
def gated(upstream: str, token: str, root: Path) -> Iterator[str]:
    """nginx in front of ``upstream`` that serves only requests carrying ``Authorization: Bearer <token>``; any
    other answers 401 with ``X-Error-Code: GatedRepo``, the header the Hub sets on a gated repo (huggingface_hub
    raises GatedRepoError on it). Yields the gate's URL."""
    port = free_port()
    prefix = root / f"nginx-{port}"
    prefix.mkdir(parents=True)
    conf = prefix / "nginx.conf"
    temp = "\n".join(f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                           "scgi"))
    conf.write_text(f"""daemon off;
master_process off;
pid {prefix / 'nginx.pid'};
error_log {prefix / 'error.log'} info;
events {{ worker_connections 64; }}
http {{
    access_log {prefix / 'access.log'};
{temp}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            if ($http_authorization != "Bearer {token}") {{
                add_header X-Error-Code GatedRepo always;
                add_header X-Error-Message "Access to this model is restricted: accept its licence" always;
                return 401;
            }}
            proxy_pass {upstream};
            proxy_http_version 1.1;
            proxy_buffering off;
        }}
    }}
}}
""")
    proc = subprocess.Popen([str(nginx_binary()), "-p", str(prefix), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(prefix / "stderr.log", "wb"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_port(port, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process for port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


@contextlib.contextmanager
def cutting_proxy(upstream: str, suffix: str = ".safetensors", cut_after: int = 100_000, times: int = 1
                  ) -> Iterator[dict]:
    """A loopback HTTP proxy to ``upstream`` that closes the connection after ``cut_after`` bytes of the response
    to the first ``times`` GET requests whose path ends with ``suffix``: a download interrupted mid-file. Every
    other request passes whole (one request per connection). Yields ``{"url", "cut", "requests", "statuses"}``:
    ``cut`` counts the interrupted responses, ``requests`` lists each request line (with its Range header, if any),
    ``statuses`` each response's status line."""
    host, up_port = upstream.rsplit("//", 1)[1].split(":")
    listener = socket.create_server(("127.0.0.1", 0))
    state = {"url": f"http://127.0.0.1:{listener.getsockname()[1]}", "cut": 0, "requests": [], "statuses": []}
    lock = threading.Lock()

    def serve(client: socket.socket) -> None:
        with client, socket.create_connection((host, int(up_port))) as server:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
            line, _, rest = head.partition(b"\r\n")
            headers = [h for h in rest.split(b"\r\n") if h and not h.lower().startswith(b"connection:")]
            server.sendall(line + b"\r\n" + b"\r\n".join(headers) + b"\r\nConnection: close\r\n\r\n")
            method, path = line.split()[:2]
            ranges = [h.decode() for h in headers if h.lower().startswith(b"range:")]
            with lock:
                state["requests"].append(" ".join([line.decode(), *ranges]))
                cut = method == b"GET" and path.split(b"?")[0].endswith(suffix.encode()) and state["cut"] < times
                state["cut"] += cut
            sent = 0
            while chunk := server.recv(65536):
                if sent == 0:
                    with lock:  # the status line: 206 where the server honoured a Range, 200 where it sent it all
                        state["statuses"].append(chunk.split(b"\r\n", 1)[0].decode())
                if cut and sent + len(chunk) >= cut_after:
                    client.sendall(chunk[:cut_after - sent])
                    client.shutdown(socket.SHUT_RDWR)
                    return
                client.sendall(chunk)
                sent += len(chunk)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield state
    finally:
        listener.close()


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A port that accepts connections and never answers: a Hub that hangs. Yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for conn in held:
            conn.close()
