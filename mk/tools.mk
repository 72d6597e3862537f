##@ Tools

# Prometheus, promtool and the node exporter come from Debian bookworm's
# packages, unpacked into the project's tool folder (no system-wide install,
# no systemd units): `apt-get download` + `dpkg -x`. Versions are pinned; a
# mirror that no longer carries them fails loudly naming the variable to change.
PROMETHEUS_DEB_VERSION    ?= 2.42.0+ds-5+deb12u1
NODE_EXPORTER_DEB_VERSION ?= 1.5.0-1+b6

PROMETHEUS_TOOLS_DIR = $(TOOLS_DIR)/prometheus
# Absolute paths for other areas' recipes (cluster-up, tests, alerts-check).
PROMETHEUS    = $(PROMETHEUS_TOOLS_DIR)/usr/bin/prometheus
PROMTOOL      = $(PROMETHEUS_TOOLS_DIR)/usr/bin/promtool
NODE_EXPORTER = $(PROMETHEUS_TOOLS_DIR)/usr/bin/prometheus-node-exporter
# The stamp names both versions, so changing a pin re-extracts.
PROMETHEUS_TOOLS_STAMP = $(PROMETHEUS_TOOLS_DIR)/.stamp-$(PROMETHEUS_DEB_VERSION)-$(NODE_EXPORTER_DEB_VERSION)

.PHONY: prometheus-tools
prometheus-tools: $(PROMETHEUS_TOOLS_STAMP) ## Unpack Debian's prometheus, promtool and node exporter into .tools/prometheus.

$(PROMETHEUS_TOOLS_STAMP):
	@debs="$(CACHE_DIR)/debs"; mkdir -p "$$debs" "$(PROMETHEUS_TOOLS_DIR)"
	@# Refresh the package index only when apt knows no candidate (fresh image).
	@policy=$$(apt-cache policy prometheus 2>/dev/null || true); \
	if [[ "$$policy" != *"Candidate:"* || "$$policy" == *"Candidate: (none)"* ]]; then \
	  echo "apt has no candidate for prometheus: running apt-get update"; \
	  apt-get update -qq; \
	fi
	@cd "$(CACHE_DIR)/debs" && for spec in prometheus=$(PROMETHEUS_DEB_VERSION) \
	    prometheus-node-exporter=$(NODE_EXPORTER_DEB_VERSION); do \
	  pkg=$${spec%%=*}; ver=$${spec#*=}; \
	  deb=$$(ls "$${pkg}_$${ver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true); \
	  if [ -z "$$deb" ]; then \
	    apt-get download -q -o APT::Sandbox::User=root "$$spec" \
	      || { echo "apt-get download $$spec failed: set PROMETHEUS_DEB_VERSION / NODE_EXPORTER_DEB_VERSION to a version 'apt-cache policy $$pkg' lists" >&2; exit 1; }; \
	    deb=$$(ls "$${pkg}_$${ver//:/%3a}_"*.deb | head -n1); \
	  fi; \
	  dpkg -x "$$deb" "$(PROMETHEUS_TOOLS_DIR)"; \
	done
	@"$(PROMTOOL)" --version >/dev/null
	@"$(PROMETHEUS)" --version >/dev/null
	@"$(NODE_EXPORTER)" --version >/dev/null 2>&1
	@rm -f "$(PROMETHEUS_TOOLS_DIR)"/.stamp-*
	@touch "$@"
	@echo "prometheus tools in $(PROMETHEUS_TOOLS_DIR)/usr/bin"
