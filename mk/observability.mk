##@ Observability

# Included before mk/tools.mk (sorted order): $(PROMTOOL) is defined there with
# `=`, so it is only expanded inside recipes. Prerequisites name the
# `prometheus-tools` target instead of the binary's path.
ALERT_RULES = $(sort $(wildcard $(ROOT)/alerts/*.rules.yml))
ALERT_TESTS = $(sort $(wildcard $(ROOT)/alerts/tests/*.test.yml))

.PHONY: alerts-check
alerts-check: prometheus-tools ## Check the alert rules and run their promtool unit tests (runbook links: make generate-check).
	"$(PROMTOOL)" check rules $(ALERT_RULES)
	"$(PROMTOOL)" test rules $(ALERT_TESTS)

.PHONY: observability-test
observability-test: prometheus-tools ## Run the dashboard and alert tests (pytest, real Prometheus on loopback).
	@test -x "$(PY)" || { echo "$(PY) missing: create the runtime venv first (see README)" >&2; exit 1; }
	"$(PY)" -m pytest -q "$(ROOT)/tests/observability"

# The pytest suite in tests/observability runs in the root Makefile's
# test-python; observability-test above runs it alone. The dashboards and the
# runbook links are written by `make generate` (generate.py) and checked by
# `make generate-check`, with every other generated file.
TEST_TARGETS += alerts-check
