"""What a search hands back: one row per trial, the best trial, the report files and the MLflow parent run.

The report (``report.csv``, ``report.md``, ``trial_curves.png``, ``best.yaml``) is written into
the search folder (runtime.layout); the parent run gets the report as artifacts, the best
trial's curves, hyperparameters and resolved config.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.layout import local_folder, trial_checkpoints, trial_folder, trial_run_name
from runtime.tune.config import TuneSpec, apply_params
from runtime.tune.sealed_state import inner_path
from runtime.tune.trial import TIMING_FILE, WALL_FILE


@dataclass
class TrialRow:
    trial_id: str
    status: str
    params: dict[str, Any]
    best: float | None
    last: float | None
    steps: int
    iterations: int
    wall_seconds: float | None
    train_seconds: float | None
    restored_from: str
    startup_seconds: float | None = None  # trial start -> first training step (Train start-up)
    teardown_seconds: float | None = None  # last report -> trial end
    runner: str = ""  # "process": trained in the trial's own process; "train": through a Ray Train run
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)


@dataclass
class SearchOutcome:
    """What a search hands back to the CLI, tests and the benchmark."""

    name: str
    search_dir: str
    metric: str
    mode: str
    trials: list[TrialRow]
    best: TrialRow | None
    interrupted: bool
    report_files: dict[str, str]
    parent_run_id: str | None = None
    mlflow_uri: str | None = None
    wall_seconds: float = 0.0

    def override_line(self, job: str) -> str:
        """The best hyperparameters as a ready-to-run command."""
        if self.best is None:
            return ""
        sets = " ".join(f"{k}={_fmt(v)}" for k, v in self.best.params.items())
        return f'make train JOB={job} SET="{sets}"'


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _better(a: float, b: float, mode: str) -> bool:
    return a > b if mode == "max" else a < b


def collect_trials(results: Any, spec: TuneSpec, search_name: str, search_dir: str,
                   storage_filesystem: Any) -> list[TrialRow]:
    """One row per trial from Tune's results (its metric history is Tune's own progress record)."""
    from runtime.checkpoint import open_storage

    metric, mode = spec.tune.metric, spec.tune.mode
    keys = [p.key for p in spec.tune.params]
    records: dict[str, Any] | None = None
    rows = []
    for r in results:
        config, record, status = r.config, None, _status(r)
        # Interrupted (Ctrl+C) before its first report, no result carries its config; or ended
        # before a restore, its restored last result may lack Tune's `done` (Tune sets it on the
        # trial's final result in memory only): Tune's saved search state has both.
        if config is None or status == "UNFINISHED":
            records = records if records is not None else _trial_records(search_dir, storage_filesystem)
            record = records.get(r.path)
            config = config if config is not None else (record.config if record is not None else {})
            if (status == "UNFINISHED" and record is not None and record.status == "TERMINATED"
                    and (record.last_result or {}).get("step")):
                status = "TERMINATED"
        hist = trial_progress(r)
        values = [h[metric] for h in hist if isinstance(h.get(metric), (int, float)) and not math.isnan(h[metric])]
        best = (max(values) if mode == "max" else min(values)) if values else None
        # The trial's own progress rows name it; r.metrics can be a PBT donor's copied last result.
        own = Counter(str(h["trial_id"]) for h in hist if h.get("trial_id"))
        trial_id = (own.most_common(1)[0][0] if own else (r.metrics or {}).get("trial_id")
                    or (record.trial_id if record is not None else Path(r.path).name))
        folder = open_storage(trial_folder(search_dir, search_name, trial_id),
                              endpoint_url=spec.job.checkpoint.endpoint_url)
        timing = {**_read_json(folder, TIMING_FILE), **_read_json(folder, WALL_FILE)}
        if "train_seconds" not in timing:  # stopped early (ASHA): its last report says how long it trained
            timing["train_seconds"] = max((h.get("trial/train_seconds", 0.0) for h in hist), default=None)
        restored = sorted({str(h.get("restored_from_trial")) for h in hist if h.get("restored_from_trial")})
        rows.append(TrialRow(
            trial_id=trial_id, status=status,
            params={k: config.get(k) for k in keys}, best=best, last=values[-1] if values else None,
            steps=int(max((h.get("step", 0) for h in hist), default=0)), iterations=len(hist),
            wall_seconds=timing.get("wall_seconds"), train_seconds=timing.get("train_seconds"),
            restored_from=",".join(restored), history=hist,
            startup_seconds=timing.get("startup_seconds"), teardown_seconds=timing.get("teardown_seconds"),
            runner=next((str(h["trial/runner"]) for h in reversed(hist) if h.get("trial/runner")), ""),
        ))
    return sorted(rows, key=lambda t: t.trial_id)


def _trial_records(search_dir: str, storage_filesystem: Any) -> dict[str, Any]:
    """Tune's trial records from the saved search state, by trial folder: they hold the id and
    hyperparameters of trials that were pending or had just started when the search stopped."""
    from ray.tune import ExperimentAnalysis

    analysis = ExperimentAnalysis(inner_path(search_dir), storage_filesystem=storage_filesystem)
    return {t.path: t for t in analysis.trials if t.path}


def _read_json(storage: Any, name: str) -> dict[str, Any]:
    """A small JSON document from storage, or {} when it is not there (yet)."""
    try:
        return dict(json.loads(storage.get_bytes(name)))
    except Exception:
        return {}


def trial_progress(result: Any) -> list[dict[str, Any]]:
    """Every result the trial reported: its own progress.csv (complete across PBT restarts)."""
    progress = Path(result.path) / "progress.csv"
    if progress.is_file():
        import pandas as pd

        # Ids are text even when every character is a digit ("00399867" is a trial id, not a number).
        text = {"trial_id", "restored_from_trial", "trial/run_name", "mlflow_run_id", "checkpoint_dir_name",
                "date", "hostname", "node_ip"}
        rows = pd.read_csv(progress, dtype=dict.fromkeys(text, str)).to_dict("records")
    else:
        df = result.metrics_dataframe
        rows = df.to_dict("records") if df is not None else []
    # Empty cells (a key only some results carry) come back as NaN: make them absent.
    return [{k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))} for row in rows]


def _status(result: Any) -> str:
    """ERROR, TERMINATED (ran to the end or stopped by the scheduler) or UNFINISHED (interrupted search)."""
    if result.error:
        return "ERROR"
    return "TERMINATED" if (result.metrics or {}).get("done") else "UNFINISHED"


def pick_best(rows: list[TrialRow], mode: str) -> TrialRow | None:
    """The trial with the best metric value it ever reported (Tune's scope='all')."""
    best = None
    for row in rows:
        if row.best is not None and (best is None or _better(row.best, best.best, mode)):  # type: ignore[arg-type]
            best = row
    return best


def write_report(out: SearchOutcome, spec: TuneSpec, job: str) -> dict[str, str]:
    """report.csv, report.md, trial_curves.png and best.yaml in the search folder (local storage)."""
    import csv

    folder = local_folder(out.search_dir, out.name)
    folder.mkdir(parents=True, exist_ok=True)
    keys = [p.key for p in spec.tune.params]
    header = ["trial_id", "status", *keys, f"best {out.metric}", f"last {out.metric}", "steps", "iterations",
              "wall_s", "train_s", "startup_s", "teardown_s", "restored_from"]
    table = [[t.trial_id, t.status, *[t.params.get(k) for k in keys], t.best, t.last, t.steps, t.iterations,
              _round(t.wall_seconds), _round(t.train_seconds), _round(t.startup_seconds),
              _round(t.teardown_seconds), t.restored_from] for t in out.trials]
    files = {"csv": str(folder / "report.csv"), "md": str(folder / "report.md"),
             "png": str(folder / "trial_curves.png"), "best": str(folder / "best.yaml")}
    with open(files["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(table)
    best = out.best
    md = [f"# Search {out.name}", "",
          f"method **{spec.tune.method}**, metric **{out.metric}** ({out.mode}), {len(out.trials)} trials", ""]
    if best:
        md += [f"Best trial **{best.trial_id}**: {out.metric} = {best.best:.6g}", "",
               "```", out.override_line(job), "```", ""]
    md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join("" if c is None else (f"{c:.6g}" if isinstance(c, float) else str(c)) for c in row)
           + " |" for row in table]
    Path(files["md"]).write_text("\n".join(md) + "\n")
    Path(files["best"]).write_text(yaml.safe_dump({
        "trial_id": best.trial_id if best else None, "metric": out.metric, "mode": out.mode,
        "value": best.best if best else None, "params": best.params if best else {},
        "command": out.override_line(job)}, sort_keys=False))
    plot_trials(out.trials, out.metric, best.trial_id if best else None, Path(files["png"]))
    return files


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def plot_trials(trials: list[TrialRow], metric: str, best_id: str | None, out: Path) -> None:
    """The search metric and train loss against step, one line per trial, the best one bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for t in trials:
        for ax, key in zip(axes, (metric, "train/loss"), strict=True):
            pts = [(h["step"], h[key]) for h in t.history if isinstance(h.get(key), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=2.5 if t.trial_id == best_id else 1,
                        label=t.trial_id + (" (best)" if t.trial_id == best_id else ""))
    for ax, title in zip(axes, (metric, "train/loss"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if axes[0].lines:  # a search stopped before any report has no curve to name
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def finish_parent(parent: Any, out: SearchOutcome, spec: TuneSpec) -> None:
    """Parent run: report artifacts, the best trial's curves and model; close trials Tune stopped early."""
    from mlflow.entities import Metric

    from runtime.run import TrainOutcome

    client = parent.client
    for path in out.report_files.values():
        client.log_artifact(parent.run_id, path, artifact_path="tune_report")
    by_name = {trial_run_name(out.name, t.trial_id): t for t in out.trials}
    exp_id = client.get_run(parent.run_id).info.experiment_id
    for run in client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent.run_id}'", max_results=1000):
        row = by_name.get(run.info.run_name)
        stopped = row is not None and row.status == "TERMINATED" and row.steps < spec.max_t
        client.set_tag(run.info.run_id, "tune.stopped_early", str(stopped).lower())
        if run.info.status == "RUNNING":  # a trial stopped by the scheduler never reached its own finish
            client.set_terminated(run.info.run_id, status="KILLED")
    best = out.best
    if best is None:
        client.set_terminated(parent.run_id, status="FAILED")
        return
    client.set_tag(parent.run_id, "tune.best_trial", best.trial_id)
    client.log_batch(parent.run_id, metrics=[Metric(f"best/{out.metric}", float(best.best or 0),
                                                    int(time.time() * 1000), 0)])
    for k, v in best.params.items():
        client.set_tag(parent.run_id, f"tune.best.{k}", _fmt(v))
    outcome = TrainOutcome(run_name=out.name, run_dir=out.search_dir,
                           checkpoint_uri=trial_checkpoints(out.search_dir, out.name, best.trial_id),
                           metrics={}, history=best.history)
    parent.cfg = apply_params(spec.base, best.params)  # the resolved config logged is the best one
    parent.finish(outcome, status="KILLED" if out.interrupted else "FINISHED")
