##@ Kubernetes

# Manifests for KubeRay (kubernetes/): `kubectl kustomize` renders an overlay
# offline; kubernetes/k8s_cli.py fills in one job's values (k8s_render.py) and
# checks the result (k8s_checks.py).
# OVERLAY: a folder in kubernetes/overlays (cpu-demo, local-gpu, eks).
OVERLAY ?= cpu-demo
IMAGE   ?=
GPUS    ?=
WORKERS ?=
NAMESPACE ?=
K8S_OUT ?=
K8S_RENDER_ARGS = --job $(call q,$(JOB)) --overlay $(call q,$(OVERLAY)) $(if $(IMAGE),--image $(call q,$(IMAGE))) $(if $(GPUS),--gpus $(call q,$(GPUS))) \
                  $(if $(WORKERS),--workers $(call q,$(WORKERS))) $(if $(RUN),--run-name $(call q,$(RUN))) \
                  $(if $(NAMESPACE),--namespace $(call q,$(NAMESPACE)))

.PHONY: k8s-tools
k8s-tools: ## Check that kubectl with kustomize v5 is installed (nothing to install: it ships with the image).
	@command -v kubectl >/dev/null || { echo "kubectl is missing: install kubectl >= 1.27 (it bundles kustomize v5)" >&2; exit 3; }
	@kubectl version --client 2>/dev/null | grep -E 'Kustomize Version: v5' >/dev/null \
	  || { echo "kubectl has no kustomize v5 (kubectl version --client): install kubectl >= 1.27" >&2; exit 3; }

.PHONY: k8s-render
k8s-render: setup k8s-tools ## Render the manifests for a job: make k8s-render JOB=resnet50 OVERLAY=eks [IMAGE=repo:tag GPUS=n WORKERS=n RUN=name NAMESPACE=ns K8S_OUT=file].
	$(PY) kubernetes/k8s_cli.py render $(K8S_RENDER_ARGS) $(if $(K8S_OUT),-o $(call q,$(K8S_OUT)))

.PHONY: k8s-submit
k8s-submit: setup k8s-tools ## Render and apply a job to the current kube context: make k8s-submit JOB=resnet50 OVERLAY=eks.
	$(PY) kubernetes/k8s_cli.py submit $(K8S_RENDER_ARGS)

.PHONY: k8s-check
k8s-check: setup k8s-tools ## Render every overlay and check it (schemas, semantics, Containerfile): the tests/kubernetes suite.
	$(VENV)/bin/mypy --strict kubernetes/*.py
	$(PY) -m pytest -q tests/kubernetes


.PHONY: k8s-cluster
k8s-cluster: setup k8s-tools ## Render a long-lived RayCluster sized for a job (workers scale from zero): make k8s-cluster JOB=resnet50 OVERLAY=eks [WORKERS=8].
	$(PY) kubernetes/k8s_cli.py cluster $(K8S_RENDER_ARGS) $(if $(K8S_OUT),-o $(call q,$(K8S_OUT)))

# tests/kubernetes runs in the root Makefile's test-python; k8s-check runs it alone.
