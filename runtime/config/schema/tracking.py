"""The ``tracking`` section: MLflow and Prometheus, and the name a run's model is registered under.

Its own module, as every section has (runtime.config.schema): what runtime.observe's tracking
reads of a job is found in one short file.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from runtime.config.base import JOB_NAME_RE, Strict
from runtime.config.values import parse_mlflow_uri


class TrackingConfig(Strict):
    mlflow: bool = True
    mlflow_uri: str | None = Field(None, description="MLflow server; None = the local cluster's or a local store.")
    experiment: str | None = Field(None, description="MLflow experiment; default = job name.")
    required: bool = Field(
        False, description="An unreachable MLflow server at start-up is an error (exit 3, nothing started) "
                           "instead of a warning; the run then tracks best-effort as usual."
    )
    register_as: str | None = Field(
        None, description="Register the run's final model under this name in the MLflow Model Registry "
                          "(a new version per run; `python -m runtime models promote` sets aliases)."
    )
    prometheus: bool = True
    prometheus_linger_s: float = Field(
        0.0, ge=0, le=300, description="Keep worker exporters up this long after the run for a final scrape."
    )

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, v: str | None) -> str | None:
        return None if v is None else parse_mlflow_uri(v)

    @field_validator("register_as")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        if v is not None and not JOB_NAME_RE.fullmatch(v):
            raise ValueError("use letters, digits, '.', '_' or '-', starting with a letter or digit (it goes into "
                             "models:/<name>@<alias> URIs)")
        return v
