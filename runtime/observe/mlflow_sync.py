"""Catching MLflow up with a run folder after the fact: ``report <run> --sync`` (``sync``) and
``models register <run>`` (``register_run``), both idempotent through the folder's mlflow.json.

Its own module because it runs in a CLI process with no tracker: it reads history.jsonl and the
resolved config back and makes the same calls the live tracker would have (runtime.observe.mlflow_upload).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from runtime.cluster import ClusterError
from runtime.config import JobConfig
from runtime.errors import ConfigError
from runtime.observe.history import CURVES_FILE, ReportError, read_history
from runtime.observe.mlflow_http import bound_mlflow_http, first_line
from runtime.observe.mlflow_upload import CONFIG_FILE, STATE_FILE, MlflowUpload, ModelExporter, SyncState


def sync(run_dir: Path, export_model: ModelExporter | None = None) -> list[str]:
    """``report <run> --sync``: upload what MLflow lacks of a run folder; the lines to print.

    Idempotent: the run folder's mlflow.json names the MLflow run and how many reports it holds.
    Raises ClusterError when MLflow cannot be reached, ReportError when the run was not tracked.
    """

    state = SyncState.load(run_dir)
    if state is None:
        raise ReportError(f"{run_dir / STATE_FILE}: none (the run was not tracked in MLflow: tracking.mlflow=false, "
                          "or it was started before issue 27)")
    cfg = JobConfig.model_validate(yaml.safe_load((run_dir / CONFIG_FILE).read_text()))
    bound_mlflow_http()
    upload = MlflowUpload(state, cfg, export_model)
    history = read_history(run_dir)
    before, created = state.uploaded, state.run_id is None
    try:
        upload.open()
        state.save(run_dir)
        for i in range(before, len(history), 100):
            upload.metrics(history[i : i + 100])
            state.uploaded = min(len(history), i + 100)
            state.save(run_dir)
        upload.events()
        state.save(run_dir)
        closing = state.status is not None and not state.closed
        if closing:
            curves = run_dir / CURVES_FILE
            upload.close(history, [str(curves)] if curves.exists() else [])
            state.save(run_dir)
    except ClusterError:
        raise
    except Exception as e:  # noqa: BLE001
        state.save(run_dir)
        raise ClusterError(f"MLflow at {state.uri} unreachable: {first_line(e)}; {state.uploaded} of "
                           f"{len(history)} reports uploaded so far") from None
    lines = [f"MLflow run   {state.run_id} at {state.uri}" + (" (created now)" if created else "")]
    lines.append(f"reports      {len(history) - before} uploaded now, {len(history)} in MLflow")
    if closing:
        lines.append(f"end state    {state.status}, artifacts uploaded")
        if state.registered:
            lines.append(f"registered   {state.registered}")
    elif state.status is None:
        lines.append("end state    none yet (the run has not ended)")
    return lines


def register_run(run_dir: Path, name: str, export_model: ModelExporter,
                 metrics: dict[str, float] | None = None) -> tuple[str, str]:
    """``models register <run> --name NAME``: the run's model as a version of ``name``; (version, run id).

    Uploads what MLflow lacks of the run first (``sync``), logs the model if the run's end did not,
    and registers once: a run already registered under ``name`` gives its version again. ``metrics``
    (an evaluation's) become ``metric.*`` tags beside the run's final ones. Raises ReportError (not a
    tracked run, no checkpoint), ClusterError (MLflow unreachable)."""

    sync(run_dir, export_model)
    state = SyncState.load(run_dir)
    assert state is not None and state.run_id  # sync created and recorded the run
    if state.registered and state.registered.rsplit("/", 1)[0] == name:
        return state.registered.rsplit("/", 1)[1], state.run_id
    cfg = JobConfig.model_validate(yaml.safe_load((run_dir / CONFIG_FILE).read_text()))
    upload = MlflowUpload(state, cfg, export_model)
    try:
        if state.model_step is None and state.checkpoint_uri:
            with tempfile.TemporaryDirectory() as d:
                upload.log_model(state.run_id, Path(d))
            state.save(run_dir)
        if state.model_step is None:
            raise ReportError(f"{run_dir}: no model to register (no readable checkpoint under "
                              f"{state.checkpoint_uri or 'the run'}; see the warning above)")
        history = read_history(run_dir)
        if metrics:
            history = [*history, metrics]
        upload.register(state.run_id, name, history)
    except (ClusterError, ReportError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001
        raise ClusterError(f"MLflow at {state.uri} unreachable: {first_line(e)}") from None
    finally:
        state.save(run_dir)
    assert state.registered
    return state.registered.rsplit("/", 1)[1], state.run_id
