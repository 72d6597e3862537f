"""Hyperparameter search over a job with Ray Tune (docs/tune.md): ``parse_tune`` checks a tuning
job without a cluster, ``tune`` runs (or resumes) the search and returns a ``SearchOutcome``."""

from runtime.tune.config import parse_tune
from runtime.tune.driver import tune
from runtime.tune.search_report import SearchOutcome

__all__ = ["SearchOutcome", "parse_tune", "tune"]
