"""``make bench BENCH=tune``: compute ASHA saves, and the per-trial overhead of a Tune trial.

1. ASHA vs the same search run to completion. The same search (digits_tune, same seed -> the
   same sampled configurations, same training seed -> the same curve for the same
   configuration, evaluated at the same steps) runs twice: with ASHA, and with every trial run
   to max_steps (FIFO).
   Compute is counted as trial-iterations (optimizer steps trained, summed over trials) and
   as trial wall seconds (the driver times every trial, stopped ones too); saved = 1 - ASHA /
   full. Both runs must pick the same best configuration.
2. Per-trial overhead = (trial wall time - time inside training steps) / trial wall time.
   Training time is time/step_s x steps, reported by the loop; the rest is start-up (one-worker
   trials train in the trial's own process: its imports, data and model set-up; multi-worker
   ones also start a Train controller and worker processes), evaluation, checkpoints, reporting
   and teardown. Most of it is a fixed cost per trial, so it is measured twice: on the trials
   of part 1 (two starting at once), and on trials that train for a few minutes alone, whose
   fixed cost F gives the training a trial needs for < 5 %: F / (F + T) < 0.05 <=> T > 19 F.

Needs a Ray cluster (``make cluster-up`` or RAY_ADDRESS=local for a throwaway one).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

COMMON = ("tracking.mlflow=false", "tracking.prometheus=false", "tune.seed=7")
# 12 configurations; digits at 28x28 (the MNIST size: ~45 ms a step on one core), 1600 steps
# (~36 epochs of 44 steps, ~100 s of training with two trials at once, about 6x a trial's fixed
# cost, see docs/tune.md). ASHA rungs at 100 and 400 steps (grace 100, reduction factor 4): held-out
# loss on digits swings up to 2x between epochs, and these rungs kept the full search's best in
# 84-88 % of simulated replays of recorded full curves (docs/tune.md). Trials are judged on
# val/loss, evaluated at the rungs (runtime.tune.trial.trial_base) and every 4 epochs.
ASHA = (
    *COMMON, "data.image_size=28", "train.max_steps=1600", "train.log_every_steps=20", "train.eval_every_epochs=4",
    "checkpoint.interval_steps=400", "tune.metric=val/loss", "tune.num_samples=12", "tune.max_concurrent_trials=2",
    "tune.grace_period=100", "tune.reduction_factor=4",
    "tune.space={optimizer.lr: {loguniform: [1.0e-4, 3.0e-1]}, optimizer.name: {choice: [sgd, adamw]}}",
)
# Two trials that each train for four to five minutes, one at a time (no contention on 2 cores). An
# epoch of digits is 11 steps here, so evaluation runs every 100 epochs (~20 s of training), not
# every few seconds.
LONG = (
    *COMMON, "data.batch_size=128", "train.max_steps=15000", "train.log_every_steps=100",
    "train.eval_every_epochs=100", "checkpoint.interval_steps=3000", "tune.method=random",
    "tune.num_samples=2", "tune.max_concurrent_trials=1",
    "tune.space={optimizer.lr: {loguniform: [1.0e-3, 1.0e-2]}}",
)


def _search(storage: str, name: str, *overrides: str) -> Any:
    from runtime.config import load_job
    from runtime.tune import tune

    cfg = load_job("digits_tune", [f"checkpoint.storage={storage}", *overrides], environ={})
    return tune(cfg, name, show_progress=False)


def _rungs() -> list[int]:
    """The steps the ASHA run evaluates at besides its epochs (runtime.tune.trial.trial_base)."""
    from runtime.config import load_job
    from runtime.tune import parse_tune
    from runtime.tune.trial import trial_base

    return list(trial_base(parse_tune(load_job("digits_tune", ["tune.method=asha", *ASHA], environ={})))
                ["train"]["eval_at_steps"])


def _compute(out: Any) -> dict[str, Any]:
    walls = [t.wall_seconds or 0.0 for t in out.trials]
    return {"trial_steps": sum(t.steps for t in out.trials), "trial_wall_s": round(sum(walls), 1),
            "search_wall_s": round(out.wall_seconds, 1), "steps_per_trial": [t.steps for t in out.trials],
            "best_trial": out.best.trial_id if out.best else None,
            "best_params": out.best.params if out.best else None, "best_value": out.best.best if out.best else None}


def _overhead(trials: list[Any]) -> dict[str, Any]:
    """Overhead share and where the time outside training steps goes, medians over trials."""
    rows = [t for t in trials if t.wall_seconds and t.train_seconds is not None]
    med = statistics.median

    def part(attr: str) -> float | None:
        vals = [getattr(t, attr) for t in rows if getattr(t, attr) is not None]
        return round(med(vals), 2) if vals else None

    shares = [1 - t.train_seconds / t.wall_seconds for t in rows]
    return {
        "trials": len(rows),
        "overhead_median": round(med(shares), 4) if shares else None,
        "overhead_range": [round(min(shares), 4), round(max(shares), 4)] if shares else None,
        "wall_s_median": round(med(t.wall_seconds for t in rows), 1) if rows else None,
        "train_s_median": round(med(t.train_seconds for t in rows), 1) if rows else None,
        "outside_steps_s_median": round(med(t.wall_seconds - t.train_seconds for t in rows), 1) if rows else None,
        "startup_s_median": part("startup_seconds"),
        "teardown_s_median": part("teardown_seconds"),
    }


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.launch.driver import connect
    from runtime.tune.search_report import plot_trials

    connect()
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as storage:
        asha = _search(storage, "asha", "tune.method=asha", *ASHA)
        # The full search evaluates where ASHA's rungs are too, so a configuration has the same
        # evaluations (and best value) in both runs.
        full = _search(storage, "full", "tune.method=random", *ASHA, f"train.eval_at_steps={_rungs()}")
        long = _search(storage, "long", *LONG)
        a, f = _compute(asha), _compute(full)
        png = results_dir / "tune_trial_curves.png"
        plot_trials(full.trials, full.metric, f["best_trial"], png)
    short = _overhead([*asha.trials, *full.trials])
    long_overhead = _overhead(long.trials)
    fixed = long_overhead["outside_steps_s_median"]
    result = {
        "asha_steps_saved": round(1 - a["trial_steps"] / f["trial_steps"], 3),
        "asha_trial_wall_saved": round(1 - a["trial_wall_s"] / f["trial_wall_s"], 3),
        "asha_search_wall_saved": round(1 - a["search_wall_s"] / f["search_wall_s"], 3),
        "asha_same_best_config": a["best_params"] == f["best_params"],
        "goal_compute_saved": 0.6,
        "trial_overhead_long": long_overhead,
        "trial_overhead_short": short,
        # F / (F + T) < 0.05 needs T > 19 F seconds of training per trial.
        "train_s_per_trial_for_5pct": round(19 * fixed) if fixed is not None else None,
        "goal_trial_overhead": 0.05,
        "asha": a,
        "full": f,
        "png": str(png),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (results_dir / "tune_trials.json").write_text(json.dumps(
        {name: [{k: v for k, v in vars(t).items() if k != "history"} for t in out.trials]
         for name, out in (("asha", asha), ("full", full), ("long", long))}, indent=2, default=str))
    return result
