"""Prometheus alert rules (*.rules.yml), their promtool tests (tests/) and runbook (runbook.md)."""
