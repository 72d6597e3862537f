"""Grafana dashboards (generated JSON) and helpers to evaluate their queries."""
