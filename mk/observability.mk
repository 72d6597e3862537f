##@ Observability

# Included before mk/tools.mk (sorted order): $(PROMTOOL) is defined there with
# `=`, so it is only expanded inside recipes. Prerequisites name the
# `prometheus-tools` target instead of the binary's path.
ALERT_RULES = $(sort $(wildcard $(ROOT)/alerts/*.rules.yml))
ALERT_TESTS = $(sort $(wildcard $(ROOT)/alerts/tests/*.test.yml))

.PHONY: alerts-check
alerts-check: prometheus-tools ## Check the alert rules, their runbook links and run their promtool unit tests.
	cd "$(ROOT)" && $(PYTHON) -m alerts.runbooks --check
	"$(PROMTOOL)" check rules $(ALERT_RULES)
	"$(PROMTOOL)" test rules $(ALERT_TESTS)

.PHONY: alerts-runbooks
alerts-runbooks: ## Write every alert's runbook_url (rules and tests) from the one pattern in alerts/runbooks.py.
	cd "$(ROOT)" && $(PYTHON) -m alerts.runbooks

.PHONY: dashboards
dashboards: ## Regenerate the Grafana dashboards (dashboards/*.json) from dashboards/boards/*.py.
	cd "$(ROOT)" && $(PYTHON) -m dashboards.generate

.PHONY: dashboards-check
dashboards-check: ## Fail when the committed dashboard JSON differs from the generator's output.
	cd "$(ROOT)" && $(PYTHON) -m dashboards.generate --check

.PHONY: observability-test
observability-test: prometheus-tools ## Run the dashboard and alert tests (pytest, real Prometheus on loopback).
	@test -x "$(PY)" || { echo "$(PY) missing: create the runtime venv first (see README)" >&2; exit 1; }
	"$(PY)" -m pytest -q "$(ROOT)/tests/observability"

# The pytest suite in tests/observability runs in the root Makefile's
# test-python; observability-test above runs it alone.
TEST_TARGETS += alerts-check dashboards-check
