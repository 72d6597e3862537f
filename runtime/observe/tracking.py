"""MLflow tracking while a run runs: best-effort, bounded and recoverable.

The driver opens the MLflow run (params = the flattened resolved config, tags) before the
workers start and passes its id to them; rank 0 attaches to it for system metrics of its node
(``attach_system_metrics``). Metrics are the values rank 0 reports (already reduced across ranks:
mean loss/accuracy, global throughput). Artifacts at the end: resolved config, a training-curve PNG
and the final model. Without a server, tracking falls back to a local sqlite store and says where.

A tracking server is a convenience: a run's outcome never depends on it.
- Bounded: MLflow's own HTTP settings are lowered for the runtime's calls
  (runtime.observe.mlflow_http; settings the user exported win).
- Off the report path: one sender thread per run (``Tracker``) makes every MLflow call; the driver
  only queues a report (a bounded queue: a report that finds it full is counted and uploaded from
  the history instead).
- Visible: one console line when MLflow becomes unreachable and one when it is back; urllib3's
  line per retry is dropped.
- Recoverable: the run folder's mlflow.json (runtime.observe.mlflow_upload.SyncState) says what
  MLflow holds; what it missed is uploaded from history.jsonl when it is back, at the end of the
  run, or by ``python -m runtime report <run> --sync`` (runtime.observe.mlflow_sync).

The calls themselves are in runtime.observe.mlflow_upload, the curves in runtime.observe.curves.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from runtime.cluster import ClusterError, tracking_uri
from runtime.cluster.processes import http_ok
from runtime.config import JobConfig
from runtime.layout import storage_paths
from runtime.observe.history import HISTORY_FILE, read_history
from runtime.observe.mlflow_http import bound_mlflow_http, local_store_uri
from runtime.observe.mlflow_upload import CONFIG_FILE, MlflowUpload, ModelExporter, SyncState, run_tags

if TYPE_CHECKING:
    from runtime.run import TrainOutcome

log = logging.getLogger("runtime.observe.tracking")

QUEUE_MAX = 1000  # reports waiting for the sender; beyond, they wait in history.jsonl
PROBE_EVERY_S = 5.0  # while MLflow is unreachable: how often the sender asks it again
CLOSE_WAIT_S = 120.0  # the end of a run waits at most this for the sender (artifacts, a last catch-up)


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
            self._came_back()  # said before the catch-up it announces (and before `uploaded` moves)
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

    def _close(self, end: _End) -> None:
        source = read_history(self.run_dir) if self.keeps_history else end.history
        try:
            self.upload.close(source, end.plots)
        except Exception as e:  # noqa: BLE001
            log.debug("MLflow at %s: %s", self.uri, e)
            self._went_away()
        self._save()


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
