"""MLflow tracking for training runs.

The driver creates the run (params = the flattened resolved config, tags) before
the workers start and passes its id to them; rank 0 attaches to it for system
metrics of its node. Metrics are the values rank 0 reports (already reduced
across ranks: mean loss/accuracy, global throughput). Artifacts at the end:
resolved config, a training-curve PNG and the final model. Without a server,
tracking falls back to a local sqlite store and says where.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from runtime.cluster import ROOT, tracking_uri
from runtime.config import JobConfig
from runtime.layout import LOCAL_RUNS
from runtime.observe.versions import versions

if TYPE_CHECKING:
    from runtime.train.run import TrainOutcome

log = logging.getLogger("runtime.observe.tracking")

NUMERIC_PREFIXES = ("train/", "val/", "time/")


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


class Tracker:
    """One MLflow run per training run."""

    def __init__(self, uri: str, experiment: str, run_name: str, cfg: JobConfig,
                 parent_run_id: str | None = None, extra_tags: dict[str, str] | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        mlflow.set_tracking_uri(uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        v = versions()
        tags = {
            "mlflow.runName": run_name, "job_name": cfg.name, "git_commit": git_commit(),
            "host": socket.gethostname(), "world_size": str(cfg.distributed.num_workers),
            "torch_version": v["torch"], "ray_version": v["ray"], "config_hash": cfg.config_hash(),
            **(extra_tags or {}),
        }
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        existing = self.client.search_runs([exp_id], f"tags.`mlflow.runName` = '{run_name}'", max_results=1)
        if existing:  # a resumed run keeps its MLflow run
            self.run_id = existing[0].info.run_id
        else:
            self.run_id = self.client.create_run(exp_id, tags=tags, run_name=run_name).info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(val)[:6000]) for k, val in cfg.flat().items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.cfg = cfg

    @classmethod
    def for_job(cls, cfg: JobConfig, run_name: str, parent_run_id: str | None = None,
                extra_tags: dict[str, str] | None = None) -> Tracker | None:
        if not cfg.tracking.mlflow:
            return None
        uri = cfg.tracking.mlflow_uri or tracking_uri()
        if not uri:
            uri = local_store_uri()
            log.warning("no MLflow server (run `make cluster-up`); tracking to the local store %s", uri)
        try:
            return cls(uri, cfg.tracking.experiment or cfg.name, run_name, cfg, parent_run_id, extra_tags)
        except Exception as e:  # tracking must not block training; say so loudly
            log.error("MLflow tracking disabled: cannot reach %s (%s)", uri, e)
            return None

    def log_step_metrics(self, item: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(item.get("step", 0))
        ts = int(float(item.get("_time", 0)) * 1000)
        metrics = [Metric(k, float(v), ts, step) for k, v in item.items()
                   if k.startswith(NUMERIC_PREFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if "cost/estimated_dollars" in item:
            metrics.append(Metric("cost/estimated_dollars", float(item["cost/estimated_dollars"]), ts, step))
        if metrics:
            try:
                self.client.log_batch(self.run_id, metrics=metrics)
            except Exception as e:
                log.warning("MLflow log failed: %s", e)

    def finish(self, outcome: TrainOutcome, status: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            cfg_path = Path(d) / "resolved_config.yaml"
            cfg_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
            self.client.log_artifact(self.run_id, str(cfg_path))
            # The driver already wrote the run folder's copy (runtime.train.driver.train); a Tune trial has none.
            png = Path(outcome.plots[0]) if outcome.plots else Path(d) / "training_curves.png"
            if outcome.plots or plot_curves(outcome.history, png):
                self.client.log_artifact(self.run_id, str(png))
            model = export_final_model(outcome.checkpoint_uri, self.cfg, Path(d))
            if model is not None:
                self.client.log_artifact(self.run_id, str(model), artifact_path="model")
        if outcome.metrics.get("stop_reason"):
            self.client.set_tag(self.run_id, "stop_reason", str(outcome.metrics["stop_reason"]))
        if outcome.preempted:
            self.client.set_tag(self.run_id, "preempted", "true")
        self.client.set_terminated(self.run_id, status=status)


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
