"""What MLflow's basic auth costs a training run, with and without the password-check cache that
docker/mlflow-auth.ini turns on (auth_cache_ttl_seconds = 60).

    python benchmarks/bench_tracking_auth.py              # 40 calls per server
    python benchmarks/bench_tracking_auth.py --calls 100

Three `mlflow server` processes on loopback, identical (SQLite backend, one worker, no job runner) but for the
login: none; basic auth with MLflow's default (every request hashes the password, PBKDF2); basic auth with the
stack's 60 s cache. One client sends each server the call a trainer sends most (a synchronous `log_batch` of 20
metrics), in the order A B C C B A, repeated, so drift on a shared machine hits every server alike. Reports the
median milliseconds per call and the ratios; writes benchmarks/out/tracking_auth.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import services  # noqa: E402  (the same server fixture the tests use)

ADMIN = ("admin", "bench-admin-password")


def server(stack: ExitStack, workdir: Path, name: str, cache_ttl_s: int | None) -> str:
    """An `mlflow server`: cache_ttl_s None = no login at all."""
    env, extra = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, []
    if cache_ttl_s is not None:
        ini = workdir / f"{name}.ini"
        ini.write_text(f"[mlflow]\ndefault_permission = EDIT\ndatabase_uri = sqlite:///{workdir / name}-auth.db\n"
                       f"authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                       f"auth_cache_ttl_seconds = {cache_ttl_s}\n")
        env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_USERNAME=ADMIN[0],
                   MLFLOW_AUTH_ADMIN_PASSWORD=ADMIN[1], MLFLOW_FLASK_SERVER_SECRET_KEY="bench-only")
        extra = ["--app-name", "basic-auth"]
    return stack.enter_context(services.mlflow_server(f"sqlite:///{workdir / name}.db", extra_args=extra, env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="log_batch calls per server")
    args = parser.parse_args()

    import mlflow
    from mlflow.entities import Metric

    os.environ.update(MLFLOW_TRACKING_USERNAME=ADMIN[0], MLFLOW_TRACKING_PASSWORD=ADMIN[1])
    contenders = {"no login": None, "basic auth, no cache (MLflow default)": 0, "basic auth, 60 s cache (stack)": 60}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="maxout-bench-auth-") as tmp:
        urls = {label: server(stack, Path(tmp), f"s{i}", ttl) for i, (label, ttl) in enumerate(contenders.items())}
        clients = {label: mlflow.MlflowClient(tracking_uri=url) for label, url in urls.items()}
        runs = {label: c.create_run(c.create_experiment("bench")).info.run_id for label, c in clients.items()}
        times: dict[str, list[float]] = {label: [] for label in contenders}
        order = list(contenders) + list(reversed(contenders))
        for i in range(args.calls // 2):
            for label in order:
                metrics = [Metric(f"m{k}", float(i), int(time.time() * 1000), i) for k in range(20)]
                start = time.perf_counter()
                clients[label].log_batch(runs[label], metrics=metrics)
                times[label].append(time.perf_counter() - start)
    median_ms = {label: 1000 * statistics.median(t) for label, t in times.items()}
    base = median_ms["no login"]
    result = {"calls_per_server": len(times["no login"]), "median_ms": median_ms,
              "ratio_to_no_login": {label: ms / base for label, ms in median_ms.items()},
              "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tracking_auth.json").write_text(json.dumps(result, indent=2))
    for label, ms in median_ms.items():
        print(f"{label:40s} {ms:8.1f} ms/call  x{ms / base:.2f}")
    print(f"(load average {result['load_avg_1m']:.1f} on {result['cpu_count']} cores)")


if __name__ == "__main__":
    main()
