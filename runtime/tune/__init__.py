"""Hyperparameter search over a job with Ray Tune (docs/tune.md): ``parse_tune`` checks a tuning
job without a cluster, ``tune`` runs (or resumes) the search and returns a ``SearchOutcome``.

Modules: config (the ``tune:`` section), schedulers (method -> Ray Tune objects), trial (the
trainable that relays a Train run's reports to Tune), driver (``tune``), report (trials,
best trial, report files, MLflow parent run).
"""

from runtime.tune.config import TuneConfig, TuneSpec, parse_tune
from runtime.tune.driver import tune
from runtime.tune.report import SearchOutcome

__all__ = ["SearchOutcome", "TuneConfig", "TuneSpec", "parse_tune", "tune"]
