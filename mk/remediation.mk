##@ Remediation (alert -> drain -> replace)

# Debian's Alertmanager beside the Prometheus tools (same apt-get download + dpkg -x, no root
# install): the remediation tests route real alerts through it to the service's webhook.
ALERTMANAGER_DEB_VERSION ?= 0.25.0-1+b4
ALERTMANAGER = $(PROMETHEUS_TOOLS_DIR)/usr/bin/prometheus-alertmanager
AM_TEMPLATE_DIR = /usr/share/prometheus/alertmanager
# Spelled from TOOLS_DIR: mk/tools.mk (PROMETHEUS_TOOLS_DIR) is included after this file, and a
# target name is expanded when read.
ALERTMANAGER_STAMP = $(TOOLS_DIR)/prometheus/.am-stamp-$(ALERTMANAGER_DEB_VERSION)

.PHONY: alertmanager-tools
# After prometheus-tools (order only): both run apt, which takes one lock.
alertmanager-tools: $(ALERTMANAGER_STAMP) | prometheus-tools ## Unpack Debian's Alertmanager into .tools/prometheus.

$(ALERTMANAGER_STAMP): | prometheus-tools
	@mkdir -p "$(CACHE_DIR)/debs" "$(PROMETHEUS_TOOLS_DIR)"
	@cd "$(CACHE_DIR)/debs" && deb=$$(ls prometheus-alertmanager_$(subst :,%3a,$(ALERTMANAGER_DEB_VERSION))_*.deb 2>/dev/null | head -n1 || true); \
	if [ -z "$$deb" ]; then \
	  apt-get download -q -o APT::Sandbox::User=root prometheus-alertmanager=$(ALERTMANAGER_DEB_VERSION) \
	    || { echo "apt-get download prometheus-alertmanager failed: set ALERTMANAGER_DEB_VERSION to a version 'apt-cache policy prometheus-alertmanager' lists" >&2; exit 1; }; \
	  deb=$$(ls prometheus-alertmanager_*.deb | head -n1); \
	fi; \
	dpkg -x "$$deb" "$(PROMETHEUS_TOOLS_DIR)"
	@# Debian's build reads its notification templates from this absolute path (no flag moves it):
	@# without them every config is refused ("failed to parse templates"). Two small text files.
	@mkdir -p $(AM_TEMPLATE_DIR) && for t in default.tmpl email.tmpl; do \
	  test -e $(AM_TEMPLATE_DIR)/$$t || cp "$(PROMETHEUS_TOOLS_DIR)$(AM_TEMPLATE_DIR)/$$t" $(AM_TEMPLATE_DIR)/; done
	@"$(ALERTMANAGER)" --version >/dev/null 2>&1
	@rm -f "$(PROMETHEUS_TOOLS_DIR)"/.am-stamp-*
	@touch "$@"

# `make lint` checks ops/ (ruff, and mypy through pyproject.toml); its tests run in test-python
# (tests/unit and tests/integration/test_remediation_loop.py).

# tests/unit/test_remediation_service.py confirms alerts with a real Alertmanager: unpacked before
# the suites start, not by whichever test reaches it first.
test-python: alertmanager-tools
