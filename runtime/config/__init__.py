"""Typed, validated job configuration: ``from runtime.config import load_job, JobConfig, ...``.

- ``base``: the strict model base (``Strict``), bounds, ``set_dotted``, ``config_hash`` and the
  error messages (``format_errors``, ``short``);
- ``schema``: a package, one module per section of a job file (``ModelConfig`` ... ``CostConfig``)
  and ``JobConfig`` composing them;
- ``load``: job files, ``RT_*`` and ``--set`` overrides (``load_job``, ``config_from_dict``);
- ``checks``: device preflight, the runtime's RT_* settings, likely-mistake and no-effect
  warnings, run names;
- ``values``: what users type, parsed once (storage locations, URLs, ports, seeds) for the
  schema and every subcommand;
- ``storage``: a package, one storage location type per scheme (``parse_storage``).

This module re-exports what other packages import; everything else is imported from its module.
"""

from runtime.config.base import Strict, config_hash, format_errors, set_dotted, short
from runtime.config.checks import check_settings, job_warnings, planned_device, preflight, validate_run_name
from runtime.config.load import (
    RUNTIME_SETTINGS,
    available_jobs,
    config_from_dict,
    env_overrides,
    load_job,
    with_overrides,
)
from runtime.config.schema import DataConfig, FSDPConfig, JobConfig, ModelConfig

__all__ = [
    "RUNTIME_SETTINGS",
    "DataConfig",
    "FSDPConfig",
    "JobConfig",
    "ModelConfig",
    "Strict",
    "available_jobs",
    "check_settings",
    "config_from_dict",
    "config_hash",
    "env_overrides",
    "format_errors",
    "job_warnings",
    "load_job",
    "planned_device",
    "preflight",
    "set_dotted",
    "short",
    "validate_run_name",
    "with_overrides",
]
