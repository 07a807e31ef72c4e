# Two commands from a fresh clone:  make run  (train the demo on the embedded MLflow store)  and  make test.
# Both create .venv and install into it: the pinned CPU/CUDA-agnostic torch first, so nothing pulls a second,
# multi-GB torch build, then the project with its locked versions (constraints.txt).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
IMAGE ?= maxout:latest
COMPOSE := docker compose --env-file docker/.env -f docker/compose.yaml

.PHONY: install run test test-fast ui clean lint image platform-up platform-down check-hardware benchmark

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## run: train projects/nli_demo with MiniLM on the embedded default (hardware=auto, SQLite + local artifacts)
run: install
	$(BIN)/maxout train hardware=auto
	@echo "Browse the run: make ui   (MLflow UI on http://127.0.0.1:5000, store under ./mlruns)"

## test: the whole suite, slow end-to-end tests included (what CI runs)
test: install
	$(BIN)/python -m pytest -q

## test-fast: everything but the slow end-to-end tests
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

## ui: the MLflow UI on the embedded store
ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db --default-artifact-root ./mlruns/artifacts \
	  --host 127.0.0.1 --port 5000

## lint: hadolint on every Dockerfile (settings in .hadolint.yaml; CI runs this before the tests)
lint: install
	$(BIN)/hadolint docker/Dockerfile docker/services.Dockerfile

## image: the CUDA training image that MLproject's docker_env names (`mlflow run .` runs its commands in it)
image:
	docker build -f docker/Dockerfile -t $(IMAGE) .

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

clean:
	rm -rf $(VENV) mlruns .pytest_cache
