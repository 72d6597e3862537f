"""MLflow tracking for training runs: best-effort, bounded and recoverable.

The driver opens the MLflow run (params = the flattened resolved config, tags) before the
workers start and passes its id to them; rank 0 attaches to it for system metrics of its node.
Metrics are the values rank 0 reports (already reduced across ranks: mean loss/accuracy, global
throughput). Artifacts at the end: resolved config, a training-curve PNG and the final model.
Without a server, tracking falls back to a local sqlite store and says where.

A tracking server is a convenience: a run's outcome never depends on it (issue 27).
- Bounded: MLflow's own HTTP settings are lowered for the runtime's calls (MLFLOW_HTTP_DEFAULTS;
  settings the user exported win). MLflow's defaults retry a call 7 times with exponential backoff
  and 120 s timeouts: minutes per call against a dead server.
- Off the report path: one sender thread per run makes every MLflow call; the driver only queues
  a report (a bounded queue: a report that finds it full is counted and uploaded from the
  history instead).
- Visible: one console line when MLflow becomes unreachable and one when it is back; urllib3's
  line per retry is dropped.
- Recoverable: the run folder's mlflow.json (SyncState) says what MLflow holds; what it missed is
  uploaded from history.jsonl when it is back, at the end of the run, or by
  ``python -m runtime report <run> --sync`` (same MLflow run, no step twice).

Over 400 lines (738) and doing several jobs (the sender, the sync state, the end-of-run upload,
system metrics): it should split into those parts; not done in the stop that grew it, as no
fresh-clone run was left to prove the split (issue 31's open part).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from runtime.cluster import ROOT, ClusterError, tracking_uri
from runtime.cluster.processes import http_ok
from runtime.config import JobConfig
from runtime.errors import ConfigError
from runtime.layout import LOCAL_RUNS, storage_paths
from runtime.observe.history import CURVES_FILE, HISTORY_FILE, ReportError, read_history
from runtime.versions import versions

if TYPE_CHECKING:
    from runtime.run import TrainOutcome

log = logging.getLogger("runtime.observe.tracking")

NUMERIC_PREFIXES = ("train/", "val/", "time/", "cost/")  # cost/: spend, projection, rate (docs/cost.md)
# MLflow's HTTP client settings for the runtime's calls (its defaults in brackets). A call against a
# refused port fails in ~1-3 s; against a server that accepts and never answers in 3 x 5 s + backoff.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",  # seconds per attempt [120]
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # [7]
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # an int to MLflow [2]
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",  # [1.0]
}
STATE_FILE = "mlflow.json"  # SyncState, beside history.jsonl
CONFIG_FILE = "resolved_config.yaml"  # the run's resolved config, logged as an artifact and read by --sync
QUEUE_MAX = 1000  # reports waiting for the sender; beyond, they wait in history.jsonl
PROBE_EVERY_S = 5.0  # while MLflow is unreachable: how often the sender asks it again
CLOSE_WAIT_S = 120.0  # the end of a run waits at most this for the sender (artifacts, a last catch-up)
BATCH_METRICS = 1000  # MLflow's log_batch limit
MODEL_ARTIFACT = "model"  # the final model's folder in the run's artifacts: runs:/<run_id>/model
# Writes a run's final model as an MLflow model folder: (cfg, checkpoint URI, folder) -> (folder, step),
# or None without a checkpoint. Given by the layer that can build networks (runtime.train.export):
# tracking sits below it. Without one, the final weights are logged as a bare state_dict file.
ModelExporter = Callable[[JobConfig, str, Path], "tuple[Path, int] | None"]


class _NoRetryLines(logging.Filter):
    """urllib3 logs a WARNING per retry of every request (49 lines on the console of the issue's run):
    the tracker's two state lines say it instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying")


def bound_mlflow_http() -> None:
    """MLflow calls from this process: short timeouts and few retries, unless the user set their own."""
    for key, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    pool = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _NoRetryLines) for f in pool.filters):
        pool.addFilter(_NoRetryLines())


def local_store_uri() -> str:
    d = ROOT / LOCAL_RUNS
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / 'mlflow.db'}"


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
    model_step: int | None = None  # the step of the final model logged as runs:/<run_id>/model (issue 30)
    registered: str | None = None  # "<name>/<version>" once tracking.register_as registered it

    @classmethod
    def load(cls, run_dir: Path) -> SyncState | None:
        try:
            return cls(**json.loads((run_dir / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None

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

    def __init__(self, state: SyncState, cfg: JobConfig, export_model: ModelExporter | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.state, self.cfg, self.export_model = state, cfg, export_model
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
            png = Path(plots[0]) if plots else Path(d) / CURVES_FILE
            if plots or plot_curves(history, png):
                self.client.log_artifact(run_id, str(png))
            if self.state.checkpoint_uri and self.export_model is None:
                model = export_final_model(self.state.checkpoint_uri, self.cfg, Path(d))
                if model is not None:
                    self.client.log_artifact(run_id, str(model), artifact_path=MODEL_ARTIFACT)
            elif self.state.checkpoint_uri and self.state.model_step is None:
                self.log_model(run_id, Path(d))
        if self.cfg.tracking.register_as and self.state.model_step is not None and not self.state.registered:
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
            log.warning("no MLflow model logged for %s: %s", self.state.run_name, _first_line(e))
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


def final_metrics(history: list[dict[str, Any]]) -> dict[str, float]:
    """The newest value of every numeric train/, val/ and eval/ metric of a run's reports."""
    out: dict[str, float] = {}
    for item in history:
        for k, v in item.items():
            if k.startswith(("train/", "val/", "eval/")) and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)
    return out


@dataclass
class _End:
    """The sender's last job: the run ended; upload what is missing and close the MLflow run."""

    history: list[dict[str, Any]]
    plots: list[str]


@dataclass
class _Event:
    """A run event for the sender: metrics at a step and tags (an elastic resize)."""

    metrics: dict[str, float]
    step: int
    ts_ms: int
    tags: dict[str, str]


class Tracker:
    """One MLflow run per training run, fed by a sender thread so that MLflow never stalls a run.

    ``keeps_history``: the caller appends every report to the run folder's history.jsonl before
    logging it (the driver), so what MLflow missed is read back from there, now or by ``--sync``.
    Otherwise (a Tune trial) the tracker keeps the reports of this call in memory.
    """

    def __init__(self, upload: MlflowUpload, run_dir: Path, *, keeps_history: bool,
                 notify: Callable[[str], None]) -> None:
        self.upload, self.run_dir, self.keeps_history = upload, run_dir, keeps_history
        self.client = upload.client
        self.uri = upload.state.uri
        self.reachable = True  # as far as this tracker knows; False between the two console lines
        self.notify = notify
        self.dropped = 0  # reports that found the sender's queue full (uploaded from the history)
        self._seen: list[dict[str, Any]] = []  # without a history file: this call's reports
        self._base = len(read_history(run_dir)) if keeps_history else 0
        self._logged = 0
        self._last_probe = time.monotonic()
        self._queue: queue.Queue[tuple[int, dict[str, Any]] | _Event | _End] = queue.Queue(maxsize=QUEUE_MAX)
        self._sender = threading.Thread(target=self._send_loop, name="mlflow-sender", daemon=True)
        self._sender.start()

    @property
    def run_id(self) -> str:
        """The MLflow run's id; "" while it does not exist (MLflow was down at start-up)."""
        return self.upload.state.run_id or ""

    @property
    def state(self) -> SyncState:
        return self.upload.state

    @property
    def cfg(self) -> JobConfig:
        """The config logged as an artifact at the end (Tune's parent run logs its best trial's)."""
        return self.upload.cfg

    @cfg.setter
    def cfg(self, cfg: JobConfig) -> None:
        self.upload.cfg = cfg

    @classmethod
    def for_job(cls, cfg: JobConfig, run_name: str, parent_run_id: str | None = None,
                extra_tags: dict[str, str] | None = None, *, keeps_history: bool = False,
                notify: Callable[[str], None] | None = None,
                export_model: ModelExporter | None = None) -> Tracker | None:
        """The run's tracker; None when tracking is off, or (without ``keeps_history``) when MLflow
        cannot be reached at start-up. Raises ClusterError then when ``tracking.required``.
        ``export_model``: the final model goes to MLflow as an MLflow model (and is registered as
        ``tracking.register_as``) rather than as a bare state_dict."""
        if not cfg.tracking.mlflow:
            return None
        bound_mlflow_http()
        say = notify or log.warning
        uri = cfg.tracking.mlflow_uri or tracking_uri()
        if not uri:
            uri = local_store_uri()
            log.warning("no MLflow server (run `make cluster-up`); tracking to the local store %s", uri)
        run_dir = Path(storage_paths(cfg, run_name)[2])
        state = SyncState.load(run_dir) if keeps_history else None
        if state is None or state.uri != uri:
            state = SyncState(uri=uri, experiment=cfg.tracking.experiment or cfg.name, run_name=run_name,
                              tags=run_tags(cfg, run_name, parent_run_id, extra_tags))
        state.status, state.closed = None, False  # a resumed run is running again
        upload = MlflowUpload(state, cfg, export_model)
        try:
            upload.verify()
            reachable = True
        except Exception as e:  # noqa: BLE001 (MLflow raises many kinds; none may stop the run)
            log.debug("MLflow at %s: %s", uri, e)
            if cfg.tracking.required:
                raise ClusterError(f"MLflow at {uri} is unreachable and tracking.required is true: nothing "
                                   "was started (start it with `make cluster-up`, or set tracking.required=false "
                                   "to train and upload later)") from None
            if not keeps_history:
                say(f"MLflow at {uri} unreachable; this run is not tracked")
                return None
            reachable = False
        if keeps_history:  # what `report --sync` needs to create, fill and close the MLflow run later
            run_dir.mkdir(parents=True, exist_ok=True)
            config_file = run_dir / CONFIG_FILE
            try:
                config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            except OSError as e:
                log.warning("%s: not written: %s", config_file, e.strerror or e)
            state.save(run_dir)
        tracker = cls(upload, run_dir, keeps_history=keeps_history, notify=say)
        if not reachable:
            tracker._went_away()
        return tracker

    def log_step_metrics(self, item: dict[str, Any]) -> None:
        """Queue one report for MLflow; never waits."""
        index = self._base + self._logged
        if not self.keeps_history:
            self._seen.append(item)
        self._logged += 1
        try:
            self._queue.put_nowait((index, item))
        except queue.Full:
            self.dropped += 1

    def log_event(self, metrics: dict[str, float], step: int, tags: dict[str, str], at: float) -> None:
        """Queue a run event (metrics at ``step``, tags) for MLflow; never waits. Kept in mlflow.json
        until sent, so ``--sync`` sends what the run could not."""
        try:
            self._queue.put_nowait(_Event(metrics, step, int(at * 1000), tags))
        except queue.Full:
            self.dropped += 1

    def finish(self, outcome: TrainOutcome, status: str) -> None:
        """Record the end state, then let the sender upload what is missing and close the MLflow run;
        waits at most CLOSE_WAIT_S, raises nothing."""
        st = self.state
        st.status, st.checkpoint_uri = status, outcome.checkpoint_uri
        if outcome.metrics.get("stop_reason"):
            st.end_tags["stop_reason"] = str(outcome.metrics["stop_reason"])
        if outcome.preempted:
            st.end_tags["preempted"] = "true"
        self._save()
        try:
            self._queue.put(_End(list(outcome.history), list(outcome.plots)), timeout=CLOSE_WAIT_S)
        except queue.Full:
            pass
        self._sender.join(CLOSE_WAIT_S)
        self._save()

    def not_uploaded(self) -> str | None:
        """After finish: what MLflow lacks of this run and how to upload it, or None."""
        missing = max(0, self._base + self._logged - self.state.uploaded)
        if self.state.closed and not missing and not self.state.events:
            return None
        parts = [f"{missing} reports"] if missing else []
        if self.state.events:
            n = len(self.state.events)
            parts.append(f"{n} run event{'' if n == 1 else 's'}")
        if not self.state.closed:
            parts.append("the end state and artifacts" + (" (the model version of "
                         f"{self.cfg.tracking.register_as} included)" if self.cfg.tracking.register_as else ""))
        what = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
        if not self.keeps_history:
            return f"not in MLflow ({self.uri} unreachable): {what}"
        return (f"not in MLflow ({self.uri} unreachable): {what}; upload with "
                f"`python -m runtime report {self.run_dir} --sync`")

    def _save(self) -> None:
        if self.keeps_history:
            self.state.save(self.run_dir)

    def _went_away(self) -> None:
        if self.reachable:
            self.reachable = False
            where = self.run_dir / HISTORY_FILE if self.keeps_history else "memory"
            self.notify(f"MLflow at {self.uri} unreachable; metrics kept in {where}, will upload later")

    def _came_back(self) -> None:
        if not self.reachable:
            self.reachable = True
            self.notify(f"MLflow at {self.uri} reachable again; uploading what it missed")

    def _probe(self, force: bool = False) -> bool:
        """Whether to try MLflow again: at most every PROBE_EVERY_S; an HTTP server must answer /health."""
        now = time.monotonic()
        if not force and now - self._last_probe < PROBE_EVERY_S:
            return False
        self._last_probe = now
        return not self.uri.startswith("http") or http_ok(f"{self.uri.rstrip('/')}/health", timeout=2)

    def _send_loop(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=None if self.reachable else PROBE_EVERY_S)
                batch = [first]
            except queue.Empty:
                batch = []
            while len(batch) < QUEUE_MAX:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            live = [m for m in batch if isinstance(m, tuple)]
            end = next((m for m in batch if isinstance(m, _End)), None)
            events = [asdict(m) for m in batch if isinstance(m, _Event)]
            if events:
                self.state.events.extend(events)
                self._save()
            if self.reachable or self._probe(force=end is not None):
                # Up to the newest report logged when nothing is in hand or at the end (the last
                # reports may have found the queue full); else up to the newest in hand.
                everything = end is not None or not live
                self._upload(live, newest=self._base + self._logged if everything else None)
            if end is not None:
                if self.reachable:
                    self._close(end)
                return

    def _pending(self, live: list[tuple[int, dict[str, Any]]], newest: int | None) -> list[tuple[int, dict[str, Any]]]:
        """(index, report) for every report MLflow lacks, oldest first: the ones in hand, the rest
        (missed while unreachable, or past a full queue) read back from the history."""
        start = self.state.uploaded
        have = {i: item for i, item in live if i >= start}
        end = newest if newest is not None else max(have, default=start - 1) + 1
        if any(i not in have for i in range(start, end)):
            source = read_history(self.run_dir) if self.keeps_history else list(self._seen)
            have = {**{i: item for i, item in enumerate(source) if start <= i < end}, **have}
        return sorted(have.items())

    def _upload(self, live: list[tuple[int, dict[str, Any]]], newest: int | None) -> None:
        pending = self._pending(live, newest)
        try:
            self.upload.open()  # MLflow was down at start-up: the run is created now
            for i in range(0, len(pending), 100):
                chunk = pending[i : i + 100]
                self.upload.metrics([item for _, item in chunk])
                self.state.uploaded = chunk[-1][0] + 1
                self._save()
            if self.state.events:
                self.upload.events()
                self._save()
        except Exception as e:  # noqa: BLE001 (connection refused, timeouts, a 5xx: all mean "not now")
            log.debug("MLflow at %s: %s", self.uri, e)
            self._save()
            self._went_away()
            return
        self._came_back()

    def _close(self, end: _End) -> None:
        source = read_history(self.run_dir) if self.keeps_history else end.history
        try:
            self.upload.close(source, end.plots)
        except Exception as e:  # noqa: BLE001
            log.debug("MLflow at %s: %s", self.uri, e)
            self._went_away()
        self._save()


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
        raise ClusterError(f"MLflow at {state.uri} unreachable: {_first_line(e)}; {state.uploaded} of "
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
        raise ClusterError(f"MLflow at {state.uri} unreachable: {_first_line(e)}") from None
    finally:
        state.save(run_dir)
    assert state.registered
    return state.registered.rsplit("/", 1)[1], state.run_id


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


CURVE_PANELS = (("train/loss", "loss"), ("train/accuracy", "accuracy"), ("train/learning_rate", "learning rate"),
                ("train/throughput", "samples/s (global)"))


def curve_rows(history: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Reports holding a number for ``key``, one per step in step order. Steps redone after a
    restart were reported twice: the later report of a step is the one the run continued from."""
    by_step = {h["step"]: h for h in history
               if isinstance(h.get("step"), int) and isinstance(h.get(key), (int, float))}
    return [by_step[k] for k in sorted(by_step)]


def plot_curves(history: list[dict[str, Any]], out: Path) -> bool:
    """Loss, accuracy, learning rate and throughput against step (validation points on the first
    two); False when no report has a training loss. Written to a temporary name, then renamed,
    so a reader never sees half a PNG."""
    rows = curve_rows(history, "train/loss")
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_PANELS), figsize=(16, 3.6))
    for ax, (key, title) in zip(axes, CURVE_PANELS, strict=True):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label="train")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    val = [(h["step"], h["val/loss"], h.get("val/accuracy")) for h in curve_rows(history, "val/loss")]
    if val:
        axes[0].plot([v[0] for v in val], [v[1] for v in val], "o-", label="val")
        acc = [(v[0], v[2]) for v in val if isinstance(v[2], (int, float))]
        axes[1].plot([a[0] for a in acc], [a[1] for a in acc], "o-", label="val")
    for ax in axes[:2]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, dpi=90, format="png")
        os.replace(tmp, out)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written picture left behind (e.g. a full disk)
        raise
    finally:
        plt.close(fig)
    return True


def export_final_model(checkpoint_uri: str, cfg: JobConfig, out_dir: Path) -> Path | None:
    """The final weights as a plain state_dict file (loadable with weights_only=True)."""
    import torch

    from runtime.checkpoint import CheckpointManager

    try:
        mgr = CheckpointManager(checkpoint_uri, keep=cfg.checkpoint.keep, endpoint_url=cfg.checkpoint.endpoint_url)
        ref, payload, _ = mgr.load_latest()
        mgr.close()
    except Exception as e:
        log.warning("no final model exported: %s", e)
        return None
    if ref is None or payload is None:
        return None
    path = out_dir / f"{cfg.name}_step{ref.step}.pt"
    torch.save(payload["model"], path)
    return path


def attach_system_metrics(run_id: str | None, uri: str | None) -> Any:
    """Rank 0: sample CPU/memory/disk/network (and GPU) of its node into the run."""
    if not run_id or not uri:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        bound_mlflow_http()  # a dead server must not hold rank 0 at the end of the run
        os.environ.setdefault("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "2")
        os.environ.setdefault("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
        import mlflow

        mlflow.set_tracking_uri(uri)
        monitor = SystemMetricsMonitor(run_id, sampling_interval=2, samples_before_logging=1)
        monitor.start()
        return monitor
    except Exception as e:
        log.warning("system metrics disabled: %s", e)
        return None
