# Distributed training platform: one Makefile from bare machines to training runs.
# Area-specific targets live in mk/*.mk (included below); each appends the
# checks it owns to TEST_TARGETS so `make test` runs everything.
SHELL = /usr/bin/env bash -o pipefail
.SHELLFLAGS = -ec
.DEFAULT_GOAL := help

# Every variable set on make's command line keeps its text. make expands a variable's value each
# time the variable is referenced, tested or exported to a recipe, before any quoting: so
# `make validate JOB='$(shell cmd)'` would run cmd, even with JOB never used. Each command-line
# value holding a `$` becomes a simple variable whose value is its own unexpanded text
# ($(value V), read inside eval, so the text itself is never parsed as make syntax), exported as
# command-line variables are. A newline is refused: make cuts a recipe line at it. The environment
# is not rewritten: whoever sets make's environment already runs make (MAKEFLAGS=--eval=...).
# Variables that name a program (PY, PYTHON, GPU_PY, TERRAFORM, ANSIBLE_PLAYBOOK) run what they name.
define _make_newline


endef
$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),\
  $(if $(findstring $(_make_newline),$(value $(v))),\
    $(error $(v) holds a newline: a make variable is one line (make cuts a recipe line at a newline)))\
  $(if $(findstring $$,$(value $(v))),$(eval override $(v) := $$(value $(v)))$(eval export $(v)))))

ROOT        := $(abspath .)
PYTHON      ?= python3
# The virtual environments: the runtime's, and one per operations tool set.
VENV        := $(ROOT)/.venv
OPS_VENV    := $(ROOT)/.venv-ops
TF_VENV     := $(ROOT)/.venv-tf
CHECKOV_VENV := $(ROOT)/.venv-checkov
PY          := $(VENV)/bin/python
TOOLS_DIR   := $(ROOT)/.tools
# uv installs every venv's packages: the same pins as pip in less CPU and half the wall time (the
# runtime's .venv from a cold cache: 45 CPU-s and 29 s against pip's 63 CPU-s and 79 s).
UV_VERSION  := 0.13.9
UV          := $(TOOLS_DIR)/uv-$(UV_VERSION)/bin/uv
# $(call uv_install,VENV_DIR,ARGS): install ARGS into VENV_DIR's Python. Compiled to bytecode at
# install, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI machines), nothing writes .pyc
# later, and every process would compile torch, Ray and MLflow from source (make test 22.8 -> 36 min).
uv_install  = $(UV) pip install --quiet --compile-bytecode --python $(1)/bin/python $(2)
# torch's CPU wheel lies in /opt/wheels on the project's CI machines; elsewhere the index serves it.
PIP_FLAGS   := $(if $(wildcard /opt/wheels),--find-links /opt/wheels) -c $(ROOT)/requirements/constraints.txt
CACHE_DIR   := $(ROOT)/.cache
JOB         ?= resnet50
CLOUD       ?= local
SET         ?=
# Recipes read SET from the environment ("$$SET"), so values with spaces and quotes reach the CLI intact.
export SET
RESUME      ?=
TEST_TARGETS :=
# $(call q,VALUE): VALUE as one single-quoted shell word. Every variable a user sets on the command
# line reaches recipes through it, so `make validate JOB='x;cmd'` names a job called "x;cmd".
q = '$(subst ','\'',$(1))'

# $(call venv_stamp,VENV_DIR,REQUIREMENT_FILES): the stamp a venv's rule makes; its name
# holds a hash of the requirement files, so changing a pin rebuilds that venv.
venv_stamp = $(1)/.stamp-$(shell cat $(2) 2>/dev/null | sha256sum | cut -c1-12)
# $(call venv_create,VENV_DIR): first recipe lines of every venv rule.
define venv_create
@rm -f $(1)/.stamp-*
@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
endef

# uv itself, from PyPI through the machine's pip, into a venv of its own.
$(UV):
	@rm -rf $(TOOLS_DIR)/uv-*
	@$(PYTHON) -m venv $(TOOLS_DIR)/uv-$(UV_VERSION)
	@# Without the lines the machine's pip config prints for each local index that lacks uv.
	@$(TOOLS_DIR)/uv-$(UV_VERSION)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION) 2>&1 \
	  | { grep -v '^WARNING: Location' || true; }

.PHONY: uv
uv: $(UV)

##@ General

.PHONY: help
help: ## Show this help.
	@# Colour only on a terminal (and not with NO_COLOR); the column fits the longest target name.
	@color=0; if [ -t 1 ] && [ -z "$${NO_COLOR:-}" ]; then color=1; fi; \
	awk -v color=$$color 'BEGIN { FS = ":.*##" } \
	  /^[a-zA-Z_0-9-]+:.*##/ { n++; sec[n] = ""; name[n] = $$1; t = $$2; sub(/^ +/, "", t); text[n] = t; \
	                           if (length($$1) > w) w = length($$1); next } \
	  /^##@/ { n++; sec[n] = substr($$0, 5) } \
	  END { c = color ? "\033[36m" : ""; b = color ? "\033[1m" : ""; r = color ? "\033[0m" : ""; \
	        printf "\nUsage:\n  make %s<target>%s\n", c, r; fmt = "  %s%-" w "s%s  %s\n"; \
	        for (i = 1; i <= n; i++) if (sec[i] != "") printf "\n%s%s%s\n", b, sec[i], r; \
	                                 else printf fmt, c, name[i], r, text[i] }' $(MAKEFILE_LIST)

include $(sort $(wildcard mk/*.mk))

##@ Development

SETUP_STAMP := $(call venv_stamp,$(VENV),requirements/runtime.txt requirements/dev.txt requirements/constraints.txt)

.PHONY: setup
setup: $(SETUP_STAMP) ## Create .venv from the pinned requirements (torch CPU wheel from /opt/wheels when present).

$(SETUP_STAMP): | $(UV)
	$(call venv_create,$(VENV))
	$(call uv_install,$(VENV),$(PIP_FLAGS) -r requirements/dev.txt)
	$(call uv_install,$(VENV),--no-deps -e .)
	@touch $@

.PHONY: lint
lint: setup ## Ruff over the Python code; mypy over runtime/, ops/ and generate.py (pyproject.toml).
	$(VENV)/bin/ruff check runtime tests benchmarks kubernetes generate.py dashboards alerts ops flows
	$(VENV)/bin/mypy
	@# tests/ has no packages: two test files with one basename stop pytest at collection.
	@dups=$$(find tests -name 'test_*.py' -printf '%f\n' | sort | uniq -d); \
	  if [ -n "$$dups" ]; then echo "lint: test file names used twice under tests/: $$dups (rename one)"; exit 1; fi
	@# mypy leaves tests/ out: collecting them catches an import of a name that is gone.
	$(PY) -m pytest --collect-only -q -p no:cacheprovider tests/unit tests/integration tests/observability tests/kubernetes tests/gpu >/dev/null

TEST_TARGETS += lint

# How many suites `make test` runs at once. 2 (default): the Python suites beside the others
# (test hosts, Terraform, linters) with make -j2, each suite's output printed whole when it ends.
# 1: one after another, output streamed. Either way every suite runs (-k) and a failure fails the target.
TEST_JOBS ?= 2
# The niceness of the suites beside the Python ones (and the venvs they install). 0: since the test
# hosts grew (27.6 min of a 38.4-min make test, 2026-11-30), that side's chain of suites, not the
# Python suites (33.5), sets the wall time; at 10 it lost the CPU to anything at 0 beside it (two
# busy loops: the Ansible tests 26.7 min against 4.8) on the longest path (docs/performance.md).
SIDE_NICE ?= 0
SYNC = $(if $(filter-out 1,$(TEST_JOBS)),--output-sync=target)
# PYTEST_ARGS="--durations=0 -x": pytest's arguments, split on spaces, one quoted word each (as ARGS).
PYTEST_WORDS = $(foreach a,$(PYTEST_ARGS),$(call q,$(a)))

.PHONY: test
# MAKE_TEST_TOOLS_INSTALLED: a test that skips asking for a make target fails here (tests/support/tool_skips.py).
test: ## Run every test suite (runtime, observability, Terraform, Ansible hosts), two at a time; TEST_JOBS=1 runs one at a time.
	@MAKE_TEST_TOOLS_INSTALLED=1 $(MAKE) --no-print-directory -k -j$(call q,$(TEST_JOBS)) $(SYNC) test-suites

.PHONY: test-cpu
# The sampler is stdlib only: it runs on the system's Python before `make test` builds the venv.
test-cpu: ## make test under process accounting (root; Debian's acct) and a /proc sampler: CPU per command and per kind of process.
	@command -v accton >/dev/null || apt-get install -y -q acct >/dev/null
	@mkdir -p .cache && : > .cache/test.pacct && accton $(CURDIR)/.cache/test.pacct >/dev/null
	@python3 tests/support/cpu_sampler.py .cache/test-cpu.json & sampler=$$!; \
	  rc=0; $(MAKE) --no-print-directory test || rc=$$?; accton off >/dev/null; kill $$sampler; wait $$sampler; \
	  echo "CPU by command (calls, %, real min, CPU min; processes still running at the end are not counted):"; \
	  sa -f .cache/test.pacct -a -c | sed -n 1,30p; python3 tests/support/cpu_sampler.py --report .cache/test-cpu.json; \
	  exit $$rc

.PHONY: test-suites
test-suites: setup prometheus-tools test-python side-suites

.PHONY: side-suites
# uv first, in this make: the suites' own makes install their venvs with it side by side.
# -j1: one suite at a time in this slot. Without it this make shares make test's jobserver, takes
# both of its slots (the test hosts beside ansible-lint, then beside the Ansible tests) and the
# Python suites, the longest, waited 11+ minutes to start.
side-suites: | $(UV)
	@nice -n $(call q,$(SIDE_NICE)) $(MAKE) --no-print-directory -j1 -k $(SYNC) $(foreach t,$(TEST_TARGETS),$(call q,$(t)))

.PHONY: test-python
test-python: setup prometheus-tools ## The runtime's pytest suites (unit, integration on a local Ray cluster, observability).
	RT_PROMETHEUS_BIN=$(call q,$(PROMETHEUS)) $(PY) -m pytest tests/unit tests/integration tests/observability tests/kubernetes tests/gpu \
	  -q --durations=25 $(PYTEST_WORDS)

# make coverage's suites (SUITES="tests/unit tests/integration/test_training.py"), split on spaces.
SUITES ?= tests/unit
COVERAGE_DIR := $(CACHE_DIR)/coverage

# Ray ends its workers from C++ (ray.kill), past every hook coverage.py saves in: this .pth,
# copied into the venv's site-packages, runs tests/support/coverage_flush.py, which saves a Ray Train
# worker's data when Ray Train shuts it down. It does nothing unless COVERAGE_RT_FLUSH names that file,
# which only this target sets; it stays in the venv (inert) and nothing else there is touched. Not an
# RT_ name: every CLI a test starts inherits it, and the runtime refuses RT_ variables it does not know.
COVERAGE_PTH := rt_coverage_flush.pth

# Not part of make test: measuring every line costs CPU that make test's 90-minute CI budget has
# no room for (tests/unit: docs/performance.md). Only .cache/coverage is emptied; the combined data
# stays there for `coverage html` or `coverage report -m`. The tests' exit status is make's.
.PHONY: coverage
coverage: setup prometheus-tools ## Line coverage of runtime/, ops/, flows/ over SUITES (default tests/unit), Ray workers and gloo ranks included; a table per package, .cache/coverage/report.{txt,json}. Not in make test (overhead).
	@rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	@cp tests/support/$(COVERAGE_PTH) "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	@rc=0; COVERAGE_RT_FLUSH=$(call q,$(ROOT)/tests/support/coverage_flush.py) RT_PROMETHEUS_BIN=$(call q,$(PROMETHEUS)) \
	  $(PY) -m coverage run -m pytest \
	  $(foreach s,$(SUITES),$(call q,$(s))) -q -p no:cacheprovider $(PYTEST_WORDS) || rc=$$?; \
	  $(PY) -m coverage combine -q; \
	  $(PY) -m coverage json -q -o $(COVERAGE_DIR)/report.json; \
	  { $(PY) tests/support/coverage_table.py $(COVERAGE_DIR)/report.json; echo; $(PY) -m coverage report; } \
	    > $(COVERAGE_DIR)/report.txt; \
	  $(PY) tests/support/coverage_table.py $(COVERAGE_DIR)/report.json; \
	  echo "coverage: per file in $(COVERAGE_DIR)/report.txt and report.json (SUITES: $(SUITES))"; exit $$rc

# The inner loop's one end-to-end run: the shipped digits job on 2 Ray Train workers (one run,
# checked by four tests), on a cluster of Ray alone (no MLflow or Prometheus server to start).
QUICK_E2E := $(foreach t,test_two_worker_ddp_keeps_ranks_identical_and_loss_falls \
               test_digits_converges_above_90_percent_with_two_workers \
               test_a_rank_held_alone_is_named_on_the_drivers_console_and_the_run_goes_on_when_it_moves \
               test_a_run_without_ray_datasets_starts_no_ray_data_actor,tests/integration/test_training.py::$(t))

# Each layer once: the unit tests but those marked slow (each slow one's layer has faster tests beside
# it: a real MLflow server, sharded and full-disk checkpoints, tensor parallel, DDP against FSDP), the
# combination matrix (every strategy and model family trained a few steps), one Ray Train run.
# The unit tests run in two pytest-xdist workers, each test file whole in one (its module fixtures once):
# they wait on subprocesses and servers a third of their time, so two cores finish them in about half.
.PHONY: test-quick
test-quick: setup $(TF_STAMP) ## The inner loop (goal 5 min on 2 idle cores; docs/performance.md): ruff, generate --check, fast unit tests, the combination matrix, one Ray Train run.
	$(VENV)/bin/ruff check runtime tests benchmarks kubernetes generate.py dashboards alerts ops flows
	$(PY) -m generate --check
	$(PY) -m pytest tests/unit -m "not slow" -n 2 --dist loadfile -q --durations=10 $(PYTEST_WORDS)
	$(PY) -m pytest tests/unit/train/test_combination_matrix.py $(QUICK_E2E) --ray-only-cluster -q --durations=10 $(PYTEST_WORDS)

.PHONY: bench
bench: setup cluster-ready ## Benchmarks (BENCH="runtime_overhead checkpoint ..."); JSON/PNG under benchmarks/results/.
	@mkdir -p benchmarks/results
	$(PY) -m benchmarks.run $(foreach b,$(BENCH),$(call q,$(b)))

# The Python gpu-check runs with: the project's venv here, or the host's CUDA Python on a lent
# machine (shared/device/gpu-env.sh BUNDLE make gpu-check GPU_PY=python3).
GPU_PY ?= $(PY)

.PHONY: gpu-check
gpu-check: ## On a GPU host: tests/gpu, then the GPU benchmarks -> benchmarks/results/gpu/<device>.json and .md; fails without CUDA.
	@test -x "$$(command -v $(GPU_PY))" || { echo "gpu-check: $(GPU_PY) not found: run make setup, or pass GPU_PY=python3 on a GPU host"; exit 1; }
	$(GPU_PY) -m benchmarks.gpu_check

##@ Generated files

# generate.py lists every generated file with the program that writes it (dashboards, runbook
# links, the PrometheusRule, the KubeRay schemas, Terraform's example inventory). The inventory
# is rendered by Terraform from .venv-tf (about 1.5 s), hence $(TF_STAMP); defined in
# mk/terraform.mk, which is included above, so it is set when these lines are read.

.PHONY: generate
generate: setup $(TF_STAMP) ## Write every generated file whose generator's output differs (generate.py lists them).
	$(PY) -m generate

.PHONY: generate-check
generate-check: setup $(TF_STAMP) ## Fail naming each stale generated file and the command that fixes it (changes nothing).
	$(PY) -m generate --check

TEST_TARGETS += generate-check

##@ Cluster

# Prerequisite of the targets that need a cluster: the local one unless RAY_ADDRESS names one.
.PHONY: cluster-ready
cluster-ready:
	@if [ -z "$$RAY_ADDRESS" ]; then $(MAKE) --no-print-directory cluster-up; fi

.PHONY: cluster-up
cluster-up: ## Start the cluster: local Ray head + MLflow + Prometheus (NODES=3: 2 more raylets here; GCS_FT=1: the GCS survives a crash, via Redis; CLOUD=aws: Terraform + Ansible).
ifeq ($(CLOUD),local)
	@$(MAKE) --no-print-directory setup prometheus-tools
	$(PY) -m runtime cluster up $(if $(NUM_CPUS),--num-cpus $(call q,$(NUM_CPUS))) $(if $(NODES),--nodes $(call q,$(NODES)))
else
	@$(if $(filter-out aws baremetal,$(CLOUD)),echo "CLOUD="$(call q,$(CLOUD))": expected local or aws or baremetal" >&2; exit 2)
	@$(MAKE) --no-print-directory $(call q,cluster-up-$(CLOUD))
endif

.PHONY: cluster-down
cluster-down: ## Stop exactly what cluster-up started (CLOUD=aws: terraform destroy).
ifeq ($(CLOUD),local)
	@test -x $(PY) || { echo "nothing to stop (no .venv)"; exit 0; }
	$(PY) -m runtime cluster down
else
	@$(if $(filter-out aws,$(CLOUD)),echo "CLOUD="$(call q,$(CLOUD))": expected local or aws" >&2; exit 2)
	@$(MAKE) --no-print-directory $(call q,cluster-down-$(CLOUD))
endif

.PHONY: cluster-status
cluster-status: setup ## Show what is running and where.
	$(PY) -m runtime cluster status

##@ Training

.PHONY: train
train: setup cluster-ready ## Train a job: make train JOB=resnet50 [SET="optimizer.lr=0.05 train.max_steps=100"] [RUN=name] [TAKE_OVER=1: a lock left by another host].
	$(PY) -m runtime train $(call q,$(JOB)) --sets "$$SET" $(if $(RUN),--run-name $(call q,$(RUN))) $(if $(TAKE_OVER),--take-over)

.PHONY: tune
tune: setup cluster-ready ## Hyperparameter search: make tune JOB=digits_tune [RESUME=1].
	$(PY) -m runtime tune $(call q,$(JOB)) --sets "$$SET" $(if $(RESUME),--resume) $(if $(RUN),--run-name $(call q,$(RUN)))

.PHONY: logs
logs: setup ## A run's lines from every node and rank, in time order: make logs RUN=name [RANK=1] [ATTEMPT=2] [SINCE=10m] [GREP=regex] [TAIL=100] [FOLLOW=1].
	$(PY) -m runtime logs $(call q,$(RUN)) $(if $(RANK),--rank $(call q,$(RANK))) $(if $(ATTEMPT),--attempt $(call q,$(ATTEMPT))) $(if $(SINCE),--since $(call q,$(SINCE))) $(if $(GREP),--grep $(call q,$(GREP))) $(if $(TAIL),--tail $(call q,$(TAIL))) $(if $(FOLLOW),--follow)

.PHONY: validate
validate: setup ## Validate a job file without running it: make validate JOB=resnet50 [SET="..."] [SHOW=1] [GPU_MEMORY_GB=80].
	$(PY) -m runtime validate $(call q,$(JOB)) --sets "$$SET" $(if $(SHOW),--show) $(if $(GPU_MEMORY_GB),--gpu-memory-gb $(call q,$(GPU_MEMORY_GB)))
