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
