# Operations: Ansible roles that turn bare hosts into a GPU Ray cluster, and the
# nspawn test hosts that prove them (tests/hosts/). Tools live in .venv-ops.
OPS_STAMP     := $(call venv_stamp,$(OPS_VENV),$(ROOT)/requirements/ops.txt)
OPS_BIN       := $(OPS_VENV)/bin
ANSIBLE_DIR   := $(ROOT)/ansible
INVENTORY     ?= $(ANSIBLE_DIR)/inventories/local
NODE          ?=
OPS_HOST_PKGS := systemd-container debootstrap dpkg-dev apt-utils openssh-client iproute2 util-linux
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
# prometheus-tools: tests/ansible check the rendered Prometheus config with promtool.
ansible-lint: ops-setup prometheus-tools ## Lint roles and playbooks (production profile) and run tests/ansible (role logic on the controller).
	cd $(ANSIBLE_DIR) && PATH=$(OPS_BIN):$$PATH $(OPS_BIN)/ansible-lint --offline --profile production
	$(OPS_BIN)/pytest -q -p no:cacheprovider $(ROOT)/tests/ansible

# Two labs side by side, one per file: the cluster's checks (site.yml, idempotence, replace_node.yml)
# and the self-healing scenarios, whose time is mostly waiting (alerts' `for:`, a run shrinking and
# growing back), each on its own nodes in its own network namespace. One after the other they took
# 20 min in make test. Exit 5 (no test left after HOSTS_PYTEST_ARGS' -k) is not a failure. The
# sub-make gets its own two job slots (MAKEFLAGS cleared: make test's are taken by the other suites).
HOSTS_SUITES := test-hosts-cluster test-hosts-selfheal

.PHONY: test-hosts $(HOSTS_SUITES)
test-hosts: ops-setup ops-host-packages ## Apply the playbooks to nspawn test hosts and verify them (two labs side by side; slow).
	@MAKEFLAGS= $(MAKE) --no-print-directory -k -j2 --output-sync=target $(HOSTS_SUITES) \
	  HOSTS_PYTEST_ARGS='$(HOSTS_PYTEST_ARGS)'

$(HOSTS_SUITES): ops-setup ops-host-packages
	@rc=0; $(OPS_BIN)/pytest -rs -v -p no:cacheprovider $(ROOT)/tests/hosts/$(@:test-hosts-%=test_%).py \
	  $(HOSTS_PYTEST_ARGS) || rc=$$?; [ $$rc -ne 5 ] || rc=0; exit $$rc

.PHONY: cluster-up-baremetal
cluster-up-baremetal: ops-setup ## Bring up a cluster on your hosts: make cluster-up-baremetal INVENTORY=path/to/hosts.yml
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(INVENTORY) playbooks/site.yml
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(INVENTORY) playbooks/health_check.yml

.PHONY: health-check
health-check: ops-setup ## Run the health gate on every host: make health-check INVENTORY=...
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(INVENTORY) playbooks/health_check.yml

.PHONY: replace-node
replace-node: ops-setup ## Replace a dead worker: make replace-node NODE=<name> INVENTORY=...
	@test -n "$(NODE)" || { echo "Set NODE=<inventory name of the worker to replace>"; exit 2; }
	cd $(ANSIBLE_DIR) && $(OPS_BIN)/ansible-playbook -i $(INVENTORY) playbooks/replace_node.yml -e node=$(NODE)

TEST_TARGETS += ansible-lint test-hosts
