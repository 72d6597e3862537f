##@ Pipeline

# Metaflow asks who runs a flow; CI's shell may have no USER.
export METAFLOW_USER ?= $(or $(USER),platform)
BUDGET ?= 0
MODEL  ?=

.PHONY: flow
flow: setup cluster-ready ## Tune -> train -> evaluate -> register (Metaflow): make flow JOB=digits_tune [BUDGET=4] [MODEL=name] [SET="..."] [RESUME=1].
	$(if $(RESUME),$(PY) flows/train_flow.py resume,$(PY) flows/train_flow.py run --job $(call q,$(JOB)) --budget $(call q,$(BUDGET)) --set "$$SET" $(if $(MODEL),--model_name $(call q,$(MODEL))))

.PHONY: models
models: setup ## The MLflow Model Registry: make models ARGS="list" | ARGS="promote digits 3 --metric eval/accuracy" (each word one argument).
	$(PY) -m runtime models $(foreach a,$(ARGS),$(call q,$(a)))
