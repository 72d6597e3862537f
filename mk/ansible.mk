# Operations: Ansible roles that turn bare hosts into a GPU Ray cluster, and the
# nspawn test hosts that prove them (tests/hosts/). Tools live in .venv-ops.
OPS_STAMP     := $(call venv_stamp,$(OPS_VENV),$(ROOT)/requirements/ops.txt)
OPS_BIN       := $(OPS_VENV)/bin
ANSIBLE_DIR   := $(ROOT)/ansible
INVENTORY     ?= $(ANSIBLE_DIR)/inventories/local
NODE          ?=
OPS_HOST_PKGS := systemd-container debootstrap dpkg-dev apt-utils openssh-client iproute2 util-linux rsyslog rsyslog-relp logrotate nftables
HOSTS_PYTEST_ARGS ?=
export ANSIBLE_CONFIG := $(ANSIBLE_DIR)/ansible.cfg

##@ Operations (Ansible)

$(OPS_STAMP): $(ROOT)/requirements/ops.txt | $(UV)
	$(call venv_create,$(OPS_VENV))
	$(call uv_install,$(OPS_VENV),-r $(ROOT)/requirements/ops.txt)
	@touch $@

.PHONY: ops-setup
ops-setup: $(OPS_STAMP) ## Create the ops tools venv (.venv-ops: ansible-core, ansible-lint, testinfra).

.PHONY: ops-host-packages
# After prometheus-tools (order only): both may run apt, which takes one lock, and `make test
# TEST_JOBS=2` would otherwise start them side by side.
ops-host-packages: | prometheus-tools ## Install the Debian packages the test hosts need (systemd-nspawn, debootstrap, dpkg-dev).
	@missing=""; for p in $(OPS_HOST_PKGS); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1 || apt-get update; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	fi

.PHONY: ansible-lint
# prometheus-tools: tests/ansible check the rendered Prometheus config with promtool; ops-host-packages:
# they run the log_shipping role's rendered rsyslog configs with the real rsyslogd and logrotate.
ansible-lint: ops-setup prometheus-tools ops-host-packages ## Lint roles and playbooks (production profile) and run tests/ansible (role logic on the controller).
	cd $(ANSIBLE_DIR) && PATH=$(OPS_BIN):$$PATH $(OPS_BIN)/ansible-lint --offline --profile production
	$(OPS_BIN)/pytest -q -p no:cacheprovider $(ROOT)/tests/ansible

# One lab for both files, one after the other. Two labs side by side (one per file) were measured
# in a fresh-clone make test: the hosts suite ended 2 min sooner, the CPU-bound Python suites beside
# it 2 min later (their 2 cores also ran the second lab's Ansible and Ray), make test 25.1 min
# against 23.0: make test's time is the Python suites', so the labs share one.
# The lab's inventory is the AWS example's, applied against moto (tests/terraform/moto_cluster.py, .venv-tf; its stamp's
# rule is in mk/terraform.mk, read after this file).
.PHONY: test-hosts
test-hosts: ops-setup ops-host-packages $(call venv_stamp,$(TF_VENV),$(ROOT)/requirements/terraform.txt) ## Apply the playbooks to nspawn test hosts, on the inventory Terraform renders, and verify them (slow).
	$(OPS_BIN)/pytest -rs -v -p no:cacheprovider $(ROOT)/tests/hosts $(foreach a,$(HOSTS_PYTEST_ARGS),$(call q,$(a)))

.PHONY: cluster-up-baremetal
cluster-up-baremetal: ops-setup ## Bring up a cluster on your hosts: make cluster-up-baremetal INVENTORY=path/to/hosts.yml
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(call q,$(INVENTORY)) playbooks/site.yml
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(call q,$(INVENTORY)) playbooks/health_check.yml

.PHONY: health-check
health-check: ops-setup ## Run the health gate on every host: make health-check INVENTORY=...
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(call q,$(INVENTORY)) playbooks/health_check.yml

.PHONY: replace-node
replace-node: ops-setup ## Replace a dead worker: make replace-node NODE=<name> INVENTORY=...
	@test -n $(call q,$(NODE)) || { echo "Set NODE=<inventory name of the worker to replace>"; exit 2; }
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(call q,$(INVENTORY)) playbooks/replace_node.yml -e node=$(call q,$(NODE))

TEST_TARGETS += ansible-lint test-hosts
