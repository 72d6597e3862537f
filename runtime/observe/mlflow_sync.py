"""Catching MLflow up with a run folder after the fact: ``report <run> --sync`` (``sync``) and
``models register <run>`` (``register_run``), both idempotent through the folder's mlflow.json.

Its own module because it runs in a CLI process with no tracker: it reads history.jsonl and the
resolved config back and makes the same calls the live tracker would have (runtime.observe.mlflow_upload).

The run folder is untrusted input, as Tune's state is: anyone who can write the storage can plant
one. So the MLflow server is the caller's (``uri``: runtime.observe.mlflow_http.configured_uri), never
the one mlflow.json names, which would receive the caller's MLflow credentials; the checkpoint is
the run folder's own (``<run folder>/checkpoints``; on an object store, the caller's configured
storage and the folder's name), never a location mlflow.json or the resolved config names; its files
are read without following links.

The resolved config is the run's too: it says what was trained (the network the checkpoint is loaded
into, the params and config logged), never where anything is read or sent. Its object store and
endpoint must be the caller's (``configured_storage``: the RT_CHECKPOINT__* variables ``train``
itself reads) or the command refuses naming both; its ``tracking.register_as`` is not acted on (a
sync would register the folder's weights under a name of its choosing): ``models register`` takes
the name from the caller.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from runtime.cluster import ClusterError
from runtime.config import JobConfig
from runtime.config.schema import CheckpointConfig
from runtime.config.storage import parse_storage
from runtime.errors import ConfigError
from runtime.layout import checkpoint_uri, storage_paths
from runtime.observe.history import CURVES_FILE, ReportError, read_history
from runtime.observe.mlflow_http import bound_mlflow_http, first_line
from runtime.observe.mlflow_upload import (
    CONFIG_FILE,
    STATE_FILE,
    STATE_LIMIT,
    MlflowUpload,
    ModelExporter,
    SyncState,
    read_regular,
)

# The caller's checkpoint storage and its endpoint: the overrides `train` reads (runtime.config.load),
# so that a run trained with them set is synced with the same ones set.
STORAGE_ENV, ENDPOINT_ENV = "RT_CHECKPOINT__STORAGE", "RT_CHECKPOINT__ENDPOINT_URL"


@dataclass
class Registered:
    """What ``register_run`` made: the version of the registered model, its MLflow run, the server."""

    version: str
    run_id: str
    uri: str


def _config(run_dir: Path) -> JobConfig:
    """The run's resolved config; ReportError naming the file when it is missing or damaged."""
    path = run_dir / CONFIG_FILE
    data = read_regular(path, STATE_LIMIT)
    if data is None:
        raise ReportError(f"{path}: none (a tracked run writes it at start; without it nothing can be synced)")
    try:
        return JobConfig.model_validate(yaml.safe_load(data))
    except yaml.YAMLError as e:
        raise ReportError(f"{path}: damaged (not YAML: {first_line(e)})") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "the top level"
        raise ReportError(f"{path}: damaged ({where}: {err['msg']}); expected the resolved config the run "
                          "wrote") from None


def configured_storage(environ: Mapping[str, str] | None = None) -> CheckpointConfig:
    """The caller's checkpoint storage and endpoint: RT_CHECKPOINT__STORAGE (else checkpoint.storage's
    default) and RT_CHECKPOINT__ENDPOINT_URL (else none: the store's own environment); ReportError
    naming the variable when one is not a storage location or an http(s) URL."""
    env = os.environ if environ is None else environ
    storage, endpoint = env.get(STORAGE_ENV), env.get(ENDPOINT_ENV)
    try:
        return CheckpointConfig(**({"storage": storage} if storage else {}), endpoint_url=endpoint or None)
    except ValidationError as e:
        err = e.errors()[0]
        name = STORAGE_ENV if err["loc"] == ("storage",) else ENDPOINT_ENV
        raise ReportError(f"{name}: {err['msg']}") from None


def _trusted(run_dir: Path, cfg: JobConfig, mine: CheckpointConfig) -> JobConfig:
    """``cfg`` with its object store and endpoint the caller's (``mine``); ReportError naming the config when it
    names another store or endpoint (the registered weights would be read from where the run folder
    chose, with the caller's storage credentials). A local run's checkpoint is its folder's own
    (``_checkpoints``), so its config is left as it is."""
    named = cfg.checkpoint
    if not parse_storage(named.storage).remote:
        return cfg
    how = (f"set {STORAGE_ENV} (and {ENDPOINT_ENV} for an S3-compatible server) to the storage your runs use; "
           "a run folder never chooses where its model is read from")
    if parse_storage(named.storage).uri != parse_storage(mine.storage).uri:
        raise ReportError(f"{run_dir / CONFIG_FILE}: names checkpoint storage {ascii(named.storage)}, not the "
                          f"configured {mine.storage!r} ({STORAGE_ENV}); refused: {how}")
    if named.endpoint_url != mine.endpoint_url:
        raise ReportError(f"{run_dir / CONFIG_FILE}: names checkpoint endpoint {ascii(named.endpoint_url)}, not "
                          f"the configured {mine.endpoint_url!r} ({ENDPOINT_ENV}); refused: {how}")
    checkpoint = named.model_copy(update={"storage": mine.storage, "endpoint_url": mine.endpoint_url})
    return cfg.model_copy(update={"checkpoint": checkpoint})


def _checkpoints(run_dir: Path, cfg: JobConfig) -> str:
    """The run's own checkpoint folder: beside its run folder, or on the caller's object store under
    the run folder's name (runtime.layout); ``cfg`` is ``_trusted``'s."""
    if not parse_storage(cfg.checkpoint.storage).remote:
        return checkpoint_uri(str(run_dir))
    try:
        return storage_paths(cfg, run_dir.name)[1]
    except ConfigError as e:
        raise ReportError(f"{run_dir}: {e}") from None


def _state(run_dir: Path, uri: str, storage: CheckpointConfig | None) -> tuple[SyncState, JobConfig, str | None]:
    """The folder's state bound to the configured server ``uri`` and checkpoint ``storage`` (None:
    ``configured_storage``), its config, and a note when mlflow.json named another server (whose
    run id and counts mean nothing at ``uri``)."""
    state = SyncState.read(run_dir)
    if state is None:
        raise ReportError(f"{run_dir / STATE_FILE}: none (the run was not tracked in MLflow: tracking.mlflow=false, "
                          "or it was started before the runtime kept one)")
    cfg = _config(run_dir)
    if state.checkpoint_uri:  # the run ended with a checkpoint: the folder's own, whatever the files say
        cfg = _trusted(run_dir, cfg, storage or configured_storage())
        state.checkpoint_uri = _checkpoints(run_dir, cfg)
    note = None
    if state.uri != uri:
        note = (f"mlflow.json names MLflow at {ascii(state.uri)}; sending to the configured {uri} instead "
                "(MLFLOW_TRACKING_URI or `make cluster-up`'s server; a run folder never chooses the server)")
        state.uri, state.run_id, state.uploaded, state.closed = uri, None, 0, False
        state.model_step, state.registered = None, None
    return state, cfg, note


def sync(run_dir: Path, uri: str, export_model: ModelExporter | None = None,
         storage: CheckpointConfig | None = None) -> list[str]:
    """``report <run> --sync``: upload what the MLflow server at ``uri`` lacks of a run folder; the
    lines to print. ``storage``: the caller's checkpoint storage (None: ``configured_storage``).

    Idempotent: the run folder's mlflow.json names the MLflow run and how many reports it holds.
    Raises ClusterError when MLflow cannot be reached, ReportError when the run was not tracked or
    its folder is damaged.
    """
    state, cfg, note = _state(run_dir, uri, storage)
    return _sync(run_dir, state, cfg, export_model, note)


def _sync(run_dir: Path, state: SyncState, cfg: JobConfig, export_model: ModelExporter | None,
          note: str | None) -> list[str]:
    bound_mlflow_http()
    upload = MlflowUpload(state, cfg, export_model, register=False)
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
            upload.close(history, [str(curves)] if curves.exists() or curves.is_symlink() else [])
            state.save(run_dir)
    except ClusterError:
        raise
    except Exception as e:  # noqa: BLE001
        state.save(run_dir)
        raise ClusterError(f"MLflow at {state.uri} unreachable: {first_line(e)}; {state.uploaded} of "
                           f"{len(history)} reports uploaded so far") from None
    lines = [f"note         {note}"] if note else []
    lines.append(f"MLflow run   {state.run_id} at {state.uri}" + (" (created now)" if created else ""))
    lines.append(f"reports      {len(history) - before} uploaded now, {len(history)} in MLflow")
    if closing:
        lines.append(f"end state    {state.status}, artifacts uploaded")
        if state.registered:
            lines.append(f"registered   {state.registered}")
        elif cfg.tracking.register_as and state.model_step is not None:
            lines.append(f"registered   not by a sync (the run's config asks for {ascii(cfg.tracking.register_as)}; "
                         "a run folder never chooses a registered model): python -m runtime models register "
                         f"{run_dir} --name NAME")
    elif state.status is None:
        lines.append("end state    none yet (the run has not ended)")
    return lines


def register_run(run_dir: Path, uri: str, name: str, export_model: ModelExporter,
                 metrics: dict[str, float] | None = None, storage: CheckpointConfig | None = None) -> Registered:
    """``models register <run> --name NAME``: the run's model as a version of ``name`` at the MLflow
    server ``uri``.

    Uploads what MLflow lacks of the run first (``sync``), logs the model if the run's end did not,
    and registers once: a run already registered under ``name`` gives its version again. ``metrics``
    (an evaluation's) become ``metric.*`` tags beside the run's final ones; ``storage`` is the caller's
    checkpoint storage (the flow's own config; None: ``configured_storage``). Raises ReportError (not a
    tracked run, a damaged folder, no checkpoint), ClusterError (MLflow unreachable)."""
    state, cfg, note = _state(run_dir, uri, storage)
    _sync(run_dir, state, cfg, export_model, note)
    assert state.run_id  # _sync created and recorded the run
    if state.registered and state.registered.rsplit("/", 1)[0] == name:
        return Registered(state.registered.rsplit("/", 1)[1], state.run_id, uri)
    upload = MlflowUpload(state, cfg, export_model, register=False)
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
    return Registered(state.registered.rsplit("/", 1)[1], state.run_id, uri)
