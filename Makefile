# Two commands from a fresh clone:  make run  (train the demo on the embedded MLflow store)  and  make test.
# Both create .venv and install into it: the pinned CPU/CUDA-agnostic torch first, so nothing pulls a second,
# multi-GB torch build, then the project with its locked versions (constraints.txt).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
UV_VERSION ?= 0.13.9
STAMP := $(VENV)/.installed
IMAGE ?= maxout:latest
# The CPU stand-in's base: Debian bookworm from Debian's own packages (debootstrap), imported into Docker. No image
# registry is needed, and its Python (3.11) takes the wheels this machine's pip finds, the CPU torch build included.
BASE_CPU ?= maxout-base:bookworm
DEBIAN_MIRROR ?= http://deb.debian.org/debian
IMAGE_WHEELS := build/image-wheels
# Made when the wheels above are downloaded: again only when the lock or the project's dependencies change (pip
# resolving the ~190 locked packages against the index took 28 CPU-s a build on the Zen 1 CI CPU, for no new file)
IMAGE_WHEELS_STAMP := build/image-wheels.torch-$(TORCH_VERSION).stamp
CPU_BUILD_ARGS = --build-arg BUILDER_BASE=$(BASE_CPU) --build-arg RUNTIME_BASE=$(BASE_CPU) \
	--build-arg WHEELS=$(IMAGE_WHEELS) --build-arg TORCH_SPEC=torch==$(TORCH_VERSION) \
	--build-arg "TORCH_PIP_ARGS=--no-index --find-links /wheels" --build-arg "PIP_ARGS=--no-index --find-links /wheels"
# make image-cpu tags docker/Dockerfile's build stages as $(IMAGE_CACHE):<stage>, the next build's cache
IMAGE_CACHE ?= maxout-build
CPU_CACHED_STAGES := builder package
# make image-cuda-check: the CUDA image built here, from the same Debian base and PyPI's (CUDA) torch build
CUDA_CHECK_IMAGE ?= maxout:cuda-check
CUDA_WHEELS := build/image-wheels-cuda
# pip with this machine's own settings off (a local find-links folder holds the CPU torch build), so that it takes
# PyPI's wheels: PyPI's default Linux torch wheel is the CUDA build.
PYPI_PIP := env PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= $(BIN)/python -m pip
# Builds use the host's network: it works with and without Docker's bridge (dockerd --bridge=none has none).
BUILD_NETWORK ?= host
COMPOSE := docker compose --env-file docker/.env -f docker/compose.yaml
# The GPU report (benchmarks/README.md): the wheels its machine's image lacks, and the report itself. gpu-report
# uses the venv's Python where there is one, else python3 (the GPU machine: no venv, wheels on PYTHONPATH).
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
OUT ?= benchmarks/out/gpu
# The rehearsal's replica of the GPU machine's image (a Python 3.12 venv, outside the tree: GBs of CUDA libraries)
GPU_REPLICA ?= /tmp/maxout-gpu-replica
GPU_REPLICA_PYTHON ?= python3.12

.PHONY: install run test test-fast ui docs docs-serve clean lint image image-cpu image-cuda-check image-base-cpu platform-up \
	platform-down check-hardware benchmark audit gpu-wheels gpu-commit gpu-report gpu-rehearsal fuzz

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	@# The project and its ~190 locked packages through uv: parallel downloads and installs, 27 s from a cold cache
	@# against pip's 98 s (2026-11-28, the same lock, the same packages). --compile-bytecode as pip does: CI sets
	@# PYTHONDONTWRITEBYTECODE, and the suite's processes would otherwise compile torch and transformers from source.
	@# torch stays pip's (above: where this machine's pip finds the pinned build); uv keeps it, as the lock allows.
	@# Where uv cannot install (an index only pip's own config knows, say), pip does it instead.
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c constraints.txt -e '.[dev,demo,docs]' \
	  || $(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,demo,docs]'
	touch $(STAMP)

install: $(STAMP)

## run: train projects/nli_demo with MiniLM on the embedded default (hardware=auto, SQLite + local artifacts)
run: install
	$(BIN)/maxout train hardware=auto
	@echo "Browse the run: make ui   (MLflow UI on http://127.0.0.1:5000; the store: ./mlflow.db and ./mlruns)"

# The suite's parallel run (pytest-xdist): one worker per core of the 2-core machines it is sized for. Groups
# (tests/conftest.py: XDIST_GROUPS) keep the Docker tests and the modules that share expensive module fixtures on
# one worker each; the queue keeps the collection order (the Docker tests last, while their image builds).
TEST_WORKERS ?= 2
PYTEST_PARALLEL ?= -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

## test: the whole suite, slow end-to-end tests included (what CI runs); as root it first installs the Docker
##   engine, debootstrap and Compose that tests/test_mlflow_run.py and the compose check use, and chromium (the
##   browser test, tests/test_ui_browser.py), if missing
test: install
	docker/install-engine.sh
	@# Bytecode for the project's own tree, once: the suite starts a few hundred Python processes, and where
	@# PYTHONDONTWRITEBYTECODE is set (CI images) each would otherwise compile maxout from source again.
	$(BIN)/python -m compileall -q -j 0 platform tests benchmarks projects > /dev/null
	@# Every test's time in build/test-results.xml: python -m benchmarks.suite_time summary says where it went
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=25 --junitxml=build/test-results.xml

## test-fast: everything but the slow end-to-end tests
test-fast: install
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

## fuzz: the fuzzers (tests/test_fuzz_config.py, tests/test_fuzz_data.py) for FUZZ_MINUTES, before a release: rounds of
##   FUZZ_SCALE times make test's examples, each with a fresh random seed (Hypothesis profile `long`), until the time
##   is spent (past it, the last round's examples return at once). A failure stops it; .hypothesis/ keeps the example
##   to replay first next time. Statistics per round in $(FUZZ_LOG).   make fuzz FUZZ_MINUTES=20
FUZZ_MINUTES ?= 20
FUZZ_SCALE ?= 3
FUZZ_LOG ?= build/fuzz.log
fuzz: install
	@mkdir -p $(dir $(FUZZ_LOG)); : > $(FUZZ_LOG); \
	end=$$(( $$(date +%s) + $(FUZZ_MINUTES) * 60 )); round=0; \
	while [ $$(date +%s) -lt $$end ]; do \
	  round=$$((round + 1)); seed=$$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); left=$$(( end - $$(date +%s) )); \
	  echo "maxout: fuzz round $$round, seed $$seed, $$left s left" | tee -a $(FUZZ_LOG); \
	  MAXOUT_FUZZ=long FUZZ_SCALE=$(FUZZ_SCALE) FUZZ_DEADLINE=$$end $(BIN)/python -m pytest -q \
	    tests/test_fuzz_config.py tests/test_fuzz_data.py --hypothesis-seed=$$seed --hypothesis-show-statistics \
	    >> $(FUZZ_LOG) 2>&1 || { echo "maxout: fuzz: round $$round failed (seed $$seed): $(FUZZ_LOG)"; exit 1; }; \
	  tail -n 1 $(FUZZ_LOG); \
	done; echo "maxout: fuzz: $$round rounds in $(FUZZ_MINUTES) min, nothing found" | tee -a $(FUZZ_LOG)

## ui: the MLflow UI on the embedded store; it prints the address of the maxout experiment's runs table in the
##   model-training view (MLflow 3 otherwise opens on its GenAI view, traces, empty for training runs)
ui: install
	@echo "maxout: open $$($(BIN)/maxout tracking url --tracking-uri sqlite:///mlflow.db)"
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --default-artifact-root ./mlruns \
	  --host 127.0.0.1 --port 5000

## docs: the documentation site into build/site (mkdocs build --strict: a broken link, a missing page or a warning
##   fails it); its reference pages are written from the code at build time (docs/hooks/gen_reference.py)
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## docs-serve: the site at http://127.0.0.1:8000, rebuilt as its pages or the code change
docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8000 --watch platform/maxout

## lint: hadolint on every Dockerfile (settings in .hadolint.yaml; CI runs this before the tests)
lint: install
	$(BIN)/hadolint docker/Dockerfile docker/services.Dockerfile

## image: the CUDA training image that MLproject's docker_env names (`mlflow run .` runs its commands in it)
image:
	docker build --network $(BUILD_NETWORK) -f docker/Dockerfile -t $(IMAGE) .

$(IMAGE_WHEELS_STAMP): pyproject.toml constraints.txt | install
	$(BIN)/python -m pip download -q -d $(IMAGE_WHEELS) -c constraints.txt --prefer-binary \
	  torch==$(TORCH_VERSION) setuptools wheel "$(CURDIR)[demo]"
	touch $@

## image-cpu: the same image for CPUs, tagged $(IMAGE) too, built without a registry: the Debian base below, and
##   the locked wheels (CPU torch included) downloaded here and installed offline in the build
image-cpu: install $(IMAGE_WHEELS_STAMP)
	docker image inspect $(BASE_CPU) >/dev/null 2>&1 || $(MAKE) image-base-cpu
	docker build --network $(BUILD_NETWORK) -f docker/Dockerfile -t $(IMAGE) $(CPU_BUILD_ARGS) .
	@# Its build stages are tagged too (cache hits: seconds), so that they stay the cache of the next build. Left
	@# untagged they are dangling images, which a prune deletes (tests/docker_engine.py prunes after each build):
	@# every other build then reinstalled the venv, and the rootless test engine loaded the whole image again.
	for stage in $(CPU_CACHED_STAGES); do docker build -q --network $(BUILD_NETWORK) -f docker/Dockerfile \
	  --target $$stage -t $(IMAGE_CACHE):$$stage $(CPU_BUILD_ARGS) . > /dev/null || exit 1; done

## image-cuda-check: the CUDA image (PyPI's CUDA torch build with its nvidia-* wheels) built here once and proven
##   inside: torch.version.cuda set, cuDNN and NCCL load, `maxout check-hardware` explains that no GPU is visible.
##   Prints the build time and the image size (benchmarks/RESULTS.md, "The CUDA image"), then deletes the image
##   and the build cache. Several GB of wheels and layers: not part of CI. The base is the CPU stand-in's Debian
##   (make image's default is the same release from a registry), the wheels downloaded here and installed offline.
image-cuda-check: install
	docker image inspect $(BASE_CPU) >/dev/null 2>&1 || $(MAKE) image-base-cpu
	$(PYPI_PIP) download -q -d $(CUDA_WHEELS) -c constraints.txt --index-url https://pypi.org/simple --prefer-binary \
	  torch==$(TORCH_VERSION) setuptools wheel "$(CURDIR)[demo]"
	start=$$(date +%s); docker build --network $(BUILD_NETWORK) -f docker/Dockerfile -t $(CUDA_CHECK_IMAGE) \
	  --build-arg BUILDER_BASE=$(BASE_CPU) --build-arg RUNTIME_BASE=$(BASE_CPU) --build-arg WHEELS=$(CUDA_WHEELS) \
	  --build-arg TORCH_SPEC=torch==$(TORCH_VERSION) --build-arg "TORCH_PIP_ARGS=--no-index --find-links /wheels" \
	  --build-arg "PIP_ARGS=--no-index --find-links /wheels" . \
	  && echo "maxout: built $(CUDA_CHECK_IMAGE) in $$(( $$(date +%s) - start )) s"
	@echo "maxout: image size $$(docker image inspect -f '{{.Size}}' $(CUDA_CHECK_IMAGE)) bytes (wheels: \
	$$(du -sh $(CUDA_WHEELS) | cut -f1))"
	docker run --rm -i $(CUDA_CHECK_IMAGE) python - < benchmarks/cuda_image_proofs.py
	docker run --rm $(CUDA_CHECK_IMAGE) maxout check-hardware
	docker image rm $(CUDA_CHECK_IMAGE)
	# The builder stage's image too: Docker's legacy builder keeps it untagged (a dangling image, about 9 GB).
	docker image prune -f
	docker builder prune -f

## image-base-cpu: $(BASE_CPU) from Debian's packages (debootstrap needs root and about a minute)
image-base-cpu:
	@command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
	rm -rf build/rootfs && mkdir -p build
	debootstrap --variant=minbase bookworm build/rootfs $(DEBIAN_MIRROR)
	tar -C build/rootfs -c . | docker import - $(BASE_CPU)
	rm -rf build/rootfs

## platform-up: the MLflow server (PostgreSQL, MinIO artifacts, basic auth) and optuna-dashboard, from docker/.env
platform-up: docker/.env
	@if grep -q change-me docker/.env; then \
	  echo "docker/.env still has change-me values: set real passwords first" >&2; exit 1; fi
	$(COMPOSE) up -d --build
	@echo "MLflow http://127.0.0.1:5000, optuna-dashboard :8080, MinIO console :9001 (ports and logins: docker/.env)"

## platform-down: stop the stack; the data stays in its volumes (add -v by hand to delete them)
platform-down: docker/.env
	$(COMPOSE) down

docker/.env:
	@echo "docker/.env is missing: cp docker/.env.example docker/.env and replace every change-me value" >&2; exit 1

## check-hardware: device, speed-ups it supports (or why not), what hardware=auto picks, the batch to use
##   make check-hardware ARGS="model=tiny --json"
check-hardware: install
	$(BIN)/maxout check-hardware $(ARGS)

## benchmark: ablation grid on the demo project, one MLflow child run per cell, table + charts on the parent run
##   make benchmark ARGS='--grid "precision=fp32,bf16 compile=off,on" --steps 20 --out benchmarks/out'
benchmark: install
	$(BIN)/maxout benchmark $(ARGS)

## audit: are we maxed out? the measured verdict for a config (the same overrides as train), within a budget
##   make audit ARGS="model=tiny hardware.precision=fp32 --budget-s 300"
audit: install
	$(BIN)/maxout audit $(ARGS)

clean:
	rm -rf $(VENV) mlruns mlflow.db .pytest_cache build

## gpu-wheels: the wheels the GPU machine's image lacks, for CPython 3.12 / manylinux x86_64, in $(GPU_WHEELS)
##   (git-ignored, at most 40 MiB; prints each size), then the proof that the set is complete (wheels.py check)
gpu-wheels: install gpu-commit
	$(BIN)/python benchmarks/gpu/wheels.py download --dest $(GPU_WHEELS)
	$(BIN)/python benchmarks/gpu/wheels.py check --dest $(GPU_WHEELS)

## gpu-commit: the tree's commit (-dirty with uncommitted changes to tracked files) in $(GPU_WHEELS)/COMMIT, which
##   travels with the wheels; the GPU report names it before git, whose view on the device machine's copy of the tree
##   is another commit's (run it after a commit)
gpu-commit:
	@mkdir -p $(GPU_WHEELS); c=$$(git rev-parse --short HEAD) || exit 1; git diff --quiet HEAD -- || c=$$c-dirty; \
	echo $$c > $(GPU_WHEELS)/COMMIT; echo "maxout: $(GPU_WHEELS)/COMMIT: $$c"

## gpu-report: the GPU report, one planned device call at a time (benchmarks/gpu_report.py; on a CPU the CPU-safe
##   parts)   make gpu-report OUT=DIR ARGS="--plan call1"   then   ARGS="--plan call2", ARGS="--plan call3"
gpu-report:
	$(GPU_PYTHON) -m benchmarks.gpu_report --out $(OUT) $(ARGS)

## gpu-rehearsal: the GPU machine's command on this CPU, in a replica of its image (benchmarks/gpu/replica.txt: Python
##   3.12, torch 2.11, transformers 5.17, ...; built once in $(GPU_REPLICA), a few GB from PyPI, so not in CI): the
##   carried wheels installed into a fresh folder, the closure check, then the report at smoke scale, with the
##   call's plan: make gpu-rehearsal GPU_REPLICA_PYTHON=/root/.pyenv/versions/3.12.1/bin/python3.12 \
##   OUT=/tmp/rehearsal-1 ARGS="--plan call1"   (then rehearsal-2 with call2, rehearsal-3 with call3)
gpu-rehearsal: gpu-wheels $(GPU_REPLICA)/.installed
	rm -rf $(GPU_REPLICA)-site && mkdir -p $(OUT)
	set -o pipefail; export PATH=$(GPU_REPLICA)/bin:$$PATH; \
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $(GPU_REPLICA)-site \
	  $(GPU_WHEELS)/*.whl || exit 1; export PYTHONPATH=$(GPU_REPLICA)-site:$$PWD/platform PYTHONUNBUFFERED=1; \
	python3 -m benchmarks.gpu.closure --carried $(GPU_REPLICA)-site || exit 1; \
	python3 -m benchmarks.gpu_report --out $(OUT) $(ARGS) 2>&1 | tee $(OUT)/report.log

$(GPU_REPLICA)/.installed: benchmarks/gpu/replica.txt
	test -x $(GPU_REPLICA)/bin/python || $(GPU_REPLICA_PYTHON) -m venv $(GPU_REPLICA)
	$(GPU_REPLICA)/bin/python -m pip install -q -r benchmarks/gpu/replica.txt
	touch $@
