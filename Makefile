# Distributed training platform: one Makefile from bare machines to training runs.
# Area-specific targets live in mk/*.mk (included below); each appends the
# checks it owns to TEST_TARGETS so `make test` runs everything.
SHELL = /usr/bin/env bash -o pipefail
.SHELLFLAGS = -ec
.DEFAULT_GOAL := help

ROOT        := $(abspath .)
PYTHON      ?= python3
VENV        := $(ROOT)/.venv
PY          := $(VENV)/bin/python
PIP_FLAGS   := --find-links /opt/wheels -c $(ROOT)/requirements/constraints.txt
TOOLS_DIR   := $(ROOT)/.tools
CACHE_DIR   := $(ROOT)/.cache
CLUSTER_DIR := $(ROOT)/.cluster
JOB         ?= resnet50
CLOUD       ?= local
SET         ?=
RESUME      ?=
TEST_TARGETS :=

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "\nUsage:\n  make \033[36m<target>\033[0m\n"} /^[a-zA-Z_0-9-]+:.*?##/ { printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) } ' $(MAKEFILE_LIST)

include $(sort $(wildcard mk/*.mk))

##@ Development

SETUP_STAMP := $(VENV)/.stamp-$(shell cat requirements/runtime.txt requirements/dev.txt requirements/constraints.txt 2>/dev/null | sha1sum | cut -c1-12)

.PHONY: setup
setup: $(SETUP_STAMP) ## Create .venv from the pinned requirements (torch CPU wheel from /opt/wheels when present).

$(SETUP_STAMP):
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(PIP_FLAGS) -r requirements/dev.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	@rm -f $(VENV)/.stamp-*
	@touch $@

.PHONY: lint
lint: setup ## Ruff over Python code, mypy over runtime/.
	$(VENV)/bin/ruff check runtime tests benchmarks
	$(VENV)/bin/mypy

.PHONY: test
test: setup prometheus-tools test-python $(TEST_TARGETS) ## Run every test suite (runtime, observability, Terraform, Ansible hosts).

.PHONY: test-python
test-python: setup prometheus-tools ## The runtime's pytest suites (unit, integration on a local Ray cluster, observability).
	RT_PROMETHEUS_BIN=$(PROMETHEUS) $(PY) -m pytest tests/unit tests/integration tests/observability tests/gpu -q $(PYTEST_ARGS)

.PHONY: bench
bench: setup ## Benchmarks (BENCH="runtime_overhead checkpoint ..."); JSON/PNG under benchmarks/results/.
	@mkdir -p benchmarks/results
	@if [ -z "$$RAY_ADDRESS" ]; then $(MAKE) --no-print-directory cluster-up; fi
	$(PY) -m benchmarks.run $(BENCH)

##@ Cluster

.PHONY: cluster-up
cluster-up: ## Start the cluster: local Ray head + MLflow + Prometheus (NODES=3: 2 more raylets here; CLOUD=aws: Terraform + Ansible).
ifeq ($(CLOUD),local)
	@$(MAKE) --no-print-directory setup prometheus-tools
	$(PY) -m runtime cluster up $(if $(NUM_CPUS),--num-cpus $(NUM_CPUS)) $(if $(NODES),--nodes $(NODES))
else
	@$(MAKE) --no-print-directory cluster-up-$(CLOUD)
endif

.PHONY: cluster-down
cluster-down: ## Stop exactly what cluster-up started (CLOUD=aws: terraform destroy).
ifeq ($(CLOUD),local)
	@test -x $(PY) || { echo "nothing to stop (no .venv)"; exit 0; }
	$(PY) -m runtime cluster down
else
	@$(MAKE) --no-print-directory cluster-down-$(CLOUD)
endif

.PHONY: cluster-status
cluster-status: setup ## Show what is running and where.
	$(PY) -m runtime cluster status

##@ Training

.PHONY: train
train: setup ## Train a job: make train JOB=resnet50 [SET="optimizer.lr=0.05 train.max_steps=100"] [RUN=name].
	@if [ -z "$$RAY_ADDRESS" ]; then $(MAKE) --no-print-directory cluster-up; fi
	$(PY) -m runtime train $(JOB) $(foreach s,$(SET),--set $(s)) $(if $(RUN),--run-name $(RUN))

.PHONY: tune
tune: setup ## Hyperparameter search: make tune JOB=digits_tune [RESUME=1].
	@if [ -z "$$RAY_ADDRESS" ]; then $(MAKE) --no-print-directory cluster-up; fi
	$(PY) -m runtime tune $(JOB) $(foreach s,$(SET),--set $(s)) $(if $(RESUME),--resume) $(if $(RUN),--run-name $(RUN))

.PHONY: validate
validate: setup ## Validate a job file without running it: make validate JOB=resnet50.
	$(PY) -m runtime validate $(JOB) $(foreach s,$(SET),--set $(s))
