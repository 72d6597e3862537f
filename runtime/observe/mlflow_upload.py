"""What goes to MLflow for one run and what it already holds: the run's tags and params, its metrics,
run events, the end-of-run artifacts (resolved config, curves, final model) and the registered version.

``MlflowUpload`` makes the calls and raises when one fails; ``SyncState`` (the run folder's
mlflow.json) records what MLflow holds, so that the live tracker (runtime.observe.tracking) and the
catch-up after the fact (runtime.observe.mlflow_sync) upload the same things once and never a step
twice. Its own module because both of those use it and neither needs the other.

A run folder is read as untrusted input (anyone who can write the storage can plant one):
``SyncState.read`` refuses a damaged or ill-typed mlflow.json naming the file, and the files of a
run folder that go to MLflow are read with ``read_regular`` (no symbolic link followed, no FIFO
opened), so a link to a secret file uploads nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.cluster import ROOT
from runtime.config import JobConfig
from runtime.observe.curves import plot_curves
from runtime.observe.history import CURVES_FILE, ReportError
from runtime.observe.mlflow_http import first_line
from runtime.versions import versions

log = logging.getLogger(__name__)

NUMERIC_PREFIXES = ("train/", "val/", "time/", "cost/")  # cost/: spend, projection, rate (docs/cost.md)
STATE_FILE = "mlflow.json"  # SyncState, beside history.jsonl
CONFIG_FILE = "resolved_config.yaml"  # the run's resolved config, logged as an artifact and read by --sync
BATCH_METRICS = 1000  # MLflow's log_batch limit
MODEL_ARTIFACT = "model"  # the final model's folder in the run's artifacts: runs:/<run_id>/model
STATE_LIMIT = 64 << 20  # bytes of mlflow.json read at most (its events list is the only part that grows)
ARTIFACT_LIMIT = 64 << 20  # bytes of a run folder's plot read at most (a curves PNG is ~100 KB)
# Writes a run's final model as an MLflow model folder: (cfg, checkpoint URI, folder) -> (folder, step),
# or None without a checkpoint. Given by the layer that can build networks (runtime.train.export):
# tracking sits below it. Without one, the final weights are logged as a bare state_dict file.
ModelExporter = Callable[[JobConfig, str, Path], "tuple[Path, int] | None"]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5,
                             check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_tags(cfg: JobConfig, run_name: str, parent_run_id: str | None,
             extra_tags: dict[str, str] | None) -> dict[str, str]:
    v = versions()
    tags = {
        "mlflow.runName": run_name, "job_name": cfg.name, "git_commit": git_commit(),
        "host": socket.gethostname(), "world_size": str(cfg.distributed.num_workers),
        "torch_version": v["torch"], "ray_version": v["ray"], "config_hash": cfg.config_hash(),
        **(extra_tags or {}),
    }
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    return tags


def report_metrics(item: dict[str, Any]) -> list[Any]:
    """The MLflow metrics of one report: its numeric train/val/time values and the cost estimates."""
    from mlflow.entities import Metric

    step = int(item.get("step", 0))
    ts = int(float(item.get("_time", 0)) * 1000)
    metrics = [Metric(k, float(v), ts, step) for k, v in item.items()
               if k.startswith(NUMERIC_PREFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return metrics


def read_regular(path: Path, limit: int) -> bytes | None:
    """A run folder's file as it is: None when absent; ReportError naming it when it is a symbolic
    link (never followed: a link to ~/.netrc would upload that), not a regular file (a FIFO would
    block the read), unreadable or over ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ReportError(f"{path}: a symbolic link; refused (a run folder's files are read as they are, "
                              "never through a link)") from None
        raise ReportError(f"{path}: cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ReportError(f"{path}: not a regular file; refused")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ReportError(f"{path}: over {limit >> 20} MiB; refused (expected a file the run wrote)")
    return data


# mlflow.json's fields and the JSON types each may hold (a planted file must not reach MLflow's
# calls as a TypeError, or as a float where a step count belongs).
_OPT = type(None)
_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "uri": (str,), "experiment": (str,), "run_name": (str,), "tags": (dict,), "run_id": (str, _OPT),
    "uploaded": (int,), "status": (str, _OPT), "end_tags": (dict,), "checkpoint_uri": (str, _OPT),
    "closed": (bool,), "events": (list,), "model_step": (int, _OPT), "registered": (str, _OPT)}
_EVENT_TYPES: dict[str, tuple[type, ...]] = {"metrics": (dict,), "step": (int,), "ts_ms": (int,), "tags": (dict,)}


def _typed(value: Any, kinds: tuple[type, ...]) -> bool:
    """``value`` is one of ``kinds``; a JSON true is not an int here."""
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def _state_problem(raw: Any) -> str | None:
    """What is wrong with a parsed mlflow.json, or None."""
    if not isinstance(raw, dict):
        return f"a JSON {type(raw).__name__}, not an object"
    required = {"uri", "experiment", "run_name", "tags"}
    if missing := sorted(required - raw.keys()):
        return f"no {', '.join(missing)}"
    if unknown := sorted(raw.keys() - _STATE_TYPES.keys()):
        return f"unknown field {unknown[0]!r}"
    for key, value in raw.items():
        if not _typed(value, _STATE_TYPES[key]):
            return f"{key} is a JSON {type(value).__name__}"
    if raw.get("uploaded", 0) < 0:
        return f"uploaded is {raw['uploaded']}, expected a count >= 0"
    for key in ("tags", "end_tags"):
        if not all(isinstance(v, str) for v in raw.get(key, {}).values()):
            return f"{key} holds a value that is not a string"
    for i, event in enumerate(raw.get("events", [])):
        if not isinstance(event, dict) or event.keys() != _EVENT_TYPES.keys() or not all(
                _typed(event[k], t) for k, t in _EVENT_TYPES.items()):
            return f"events[{i}] is not {{metrics, step, ts_ms, tags}}"
        if not all(_typed(v, (int, float)) for v in event["metrics"].values()):
            return f"events[{i}].metrics holds a value that is not a number"
    return None


@dataclass
class SyncState:
    """What the MLflow run holds of a run folder, saved as its mlflow.json after every change."""

    uri: str
    experiment: str
    run_name: str
    tags: dict[str, str]
    run_id: str | None = None  # None until the MLflow run was created (MLflow was down at start-up)
    uploaded: int = 0  # the first `uploaded` reports of history.jsonl are in MLflow
    status: str | None = None  # the run's end state (FINISHED, FAILED, ...) once it ended
    end_tags: dict[str, str] = field(default_factory=dict)
    checkpoint_uri: str | None = None
    closed: bool = False  # the end state, end tags and artifacts are in MLflow
    events: list[dict[str, Any]] = field(default_factory=list)  # run events (Tracker.log_event) not yet sent
    model_step: int | None = None  # the step of the final model logged as runs:/<run_id>/model
    registered: str | None = None  # "<name>/<version>" once tracking.register_as registered it

    @classmethod
    def load(cls, run_dir: Path) -> SyncState | None:
        """The run folder's state, or None when it has none or a damaged one (the tracker starts afresh)."""
        try:
            return cls.read(run_dir)
        except ReportError:
            return None

    @classmethod
    def read(cls, run_dir: Path) -> SyncState | None:
        """The run folder's state; None when it has none; ReportError naming the file when it is
        damaged (not JSON, a field missing or of the wrong type), a link or not a regular file."""
        path = run_dir / STATE_FILE
        data = read_regular(path, STATE_LIMIT)
        if data is None:
            return None
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise ReportError(f"{path}: damaged (not JSON: {e}); expected the MLflow state a tracked run "
                              "writes") from None
        problem = _state_problem(raw)
        if problem:
            raise ReportError(f"{path}: damaged ({problem}); expected the MLflow state a tracked run writes")
        return cls(**raw)

    def save(self, run_dir: Path) -> None:
        """Atomically (a temporary file renamed); a failing disk costs the record, not the run."""
        tmp = run_dir / f".{STATE_FILE}.tmp"
        try:
            tmp.write_text(json.dumps(asdict(self), indent=1))
            os.replace(tmp, run_dir / STATE_FILE)
        except OSError as e:
            log.warning("%s: not written: %s", run_dir / STATE_FILE, e.strerror or e)


class MlflowUpload:
    """Every MLflow call for one run; each is bounded (bound_mlflow_http) and raises when it fails."""

    def __init__(self, state: SyncState, cfg: JobConfig, export_model: ModelExporter | None = None, *,
                 register: bool = True) -> None:
        """``register``: at close, register the model as ``cfg.tracking.register_as`` (the live
        tracker, whose config is its caller's; never a sync, whose config is a run folder's)."""
        from mlflow.tracking import MlflowClient

        self.state, self.cfg, self.export_model, self.register_at_close = state, cfg, export_model, register
        self.client = MlflowClient(tracking_uri=state.uri)

    def open(self) -> str:
        """The MLflow run's id: created (tags, params) unless this run already has one."""
        if self.state.run_id:
            return self.state.run_id
        from mlflow.entities import Param

        exp = self.client.get_experiment_by_name(self.state.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.state.experiment)
        name = self.state.run_name
        existing = self.client.search_runs([exp_id], f"tags.`mlflow.runName` = '{name}'", max_results=1)
        if existing:  # a resumed run keeps its MLflow run
            self.state.run_id = str(existing[0].info.run_id)
            return self.state.run_id
        run_id = str(self.client.create_run(exp_id, tags=self.state.tags, run_name=name).info.run_id)
        params = [Param(k, str(val)[:6000]) for k, val in self.cfg.flat().items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])
        self.state.run_id = run_id
        return run_id

    def verify(self) -> None:
        """Raise unless MLflow answers; a run it does not know (a new server) is created again."""
        from mlflow.exceptions import RestException

        if self.state.run_id:
            try:
                self.client.get_run(self.state.run_id)
                return
            except RestException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                self.state.run_id, self.state.uploaded = None, 0
        self.open()

    def metrics(self, items: list[dict[str, Any]]) -> None:
        run_id = self.open()
        batch: list[Any] = []
        for item in items:
            batch += report_metrics(item)
            while len(batch) >= BATCH_METRICS:
                self.client.log_batch(run_id, metrics=batch[:BATCH_METRICS])
                batch = batch[BATCH_METRICS:]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def events(self) -> None:
        """Send the run events the state holds, oldest first, each dropped from it once sent."""
        from mlflow.entities import Metric, RunTag

        run_id = self.open()
        while self.state.events:
            e = self.state.events[0]
            self.client.log_batch(run_id, metrics=[Metric(k, float(v), int(e["ts_ms"]), int(e["step"]))
                                                   for k, v in e["metrics"].items()],
                                  tags=[RunTag(k, str(v)) for k, v in e["tags"].items()])
            self.state.events.pop(0)

    def close(self, history: list[dict[str, Any]], plots: list[str]) -> None:
        """Artifacts (resolved config, curves, final model), the registered version, end tags, end state.

        Each part already done (state.model_step, state.registered) is skipped when a close that
        failed half-way is tried again (the sender once MLflow is back, or ``report --sync``)."""
        run_id = self.open()
        with tempfile.TemporaryDirectory() as d:
            cfg_path = Path(d) / CONFIG_FILE
            cfg_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
            self.client.log_artifact(run_id, str(cfg_path))
            png = Path(d) / CURVES_FILE
            if _copy_plot(plots[0] if plots else None, png) or plot_curves(history, png):
                self.client.log_artifact(run_id, str(png))
            if self.state.checkpoint_uri and self.export_model is None:
                model = export_final_model(self.state.checkpoint_uri, self.cfg, Path(d))
                if model is not None:
                    self.client.log_artifact(run_id, str(model), artifact_path=MODEL_ARTIFACT)
            elif self.state.checkpoint_uri and self.state.model_step is None:
                self.log_model(run_id, Path(d))
        if (self.register_at_close and self.cfg.tracking.register_as and self.state.model_step is not None
                and not self.state.registered):
            self.register(run_id, self.cfg.tracking.register_as, history)
        for key, value in self.state.end_tags.items():
            self.client.set_tag(run_id, key, value)
        self.client.set_terminated(run_id, status=self.state.status or "FINISHED")
        self.state.closed = True

    def log_model(self, run_id: str, tmp: Path) -> None:
        """The final checkpoint as an MLflow model at runs:/<run_id>/model, written by ``export_model``.
        A checkpoint that cannot be read or a network that cannot be saved costs the model, with a
        warning, not the close; MLflow failing raises (tried again later)."""
        assert self.state.checkpoint_uri and self.export_model
        try:
            made = self.export_model(self.cfg, self.state.checkpoint_uri, tmp / MODEL_ARTIFACT)
        except Exception as e:  # noqa: BLE001 (a bad checkpoint, torch, MLflow's model checks: none may end the close)
            log.warning("no MLflow model logged for %s: %s", self.state.run_name, first_line(e))
            return
        if made is None:
            return
        folder, step = made
        self.client.log_artifacts(run_id, str(folder), MODEL_ARTIFACT)
        self.state.model_step = step

    def register(self, run_id: str, name: str, history: list[dict[str, Any]]) -> None:
        """A new version of ``name`` from this run's model, tagged with where it came from and its
        final metrics (``python -m runtime models promote`` compares those)."""
        from runtime.observe.registry import metric_tags, register

        tags = {"run_name": self.state.run_name, "run_id": run_id, "step": str(self.state.model_step),
                "config_hash": self.state.tags.get("config_hash", self.cfg.config_hash()),
                "git_commit": self.state.tags.get("git_commit", "unknown"), "job_name": self.cfg.name,
                "checkpoint": self.state.checkpoint_uri or "", **metric_tags(final_metrics(history))}
        version = register(self.state.uri, name, run_id, f"runs:/{run_id}/{MODEL_ARTIFACT}", tags)
        self.state.registered = f"{name}/{version.version}"


def _copy_plot(plot: str | None, out: Path) -> bool:
    """``plot`` (a run folder's curves) copied to ``out`` for upload, read without following a
    link; False when there is none or it is refused (with a warning: the curves are drawn again
    from the history instead)."""
    if plot is None:
        return False
    try:
        data = read_regular(Path(plot), ARTIFACT_LIMIT)
    except ReportError as e:
        log.warning("%s", e)
        return False
    if data is None:
        return False
    out.write_bytes(data)
    return True


def final_metrics(history: list[dict[str, Any]]) -> dict[str, float]:
    """The newest value of every numeric train/, val/ and eval/ metric of a run's reports."""
    out: dict[str, float] = {}
    for item in history:
        for k, v in item.items():
            if k.startswith(("train/", "val/", "eval/")) and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)
    return out


def export_final_model(checkpoint_uri: str, cfg: JobConfig, out_dir: Path) -> Path | None:
    """The final weights as a plain state_dict file (loadable with weights_only=True)."""
    import torch

    from runtime.checkpoint import CheckpointReader

    try:
        reader = CheckpointReader(checkpoint_uri, endpoint_url=cfg.checkpoint.endpoint_url,
                                  s3_retry_s=cfg.checkpoint.s3_retry_s)
        ref, payload, _ = reader.load_latest()
    except Exception as e:
        log.warning("no final model exported: %s", e)
        return None
    if ref is None or payload is None:
        return None
    path = out_dir / f"{cfg.name}_step{ref.step}.pt"
    torch.save(payload["model"], path)
    return path
