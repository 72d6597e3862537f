"""``make bench BENCH=tune``: compute ASHA saves, and the per-trial overhead of a Tune trial.

1. The same search (digits_tune, same seed -> the same sampled configurations) runs twice,
   interleaved: with ASHA, and with every trial run to max_steps (FIFO). Compute is counted
   as trial-iterations (optimizer steps trained, summed over trials) and as trial wall
   seconds; saved = 1 - ASHA / full. Both runs must pick the same best configuration.
2. Per-trial overhead = (trial wall time - time inside training steps) / trial wall time,
   from each trial's trial_timing.json (time/step_s x steps, reported by the loop). This is
   Train worker-group start-up, data/model set-up, checkpoints and teardown: a fixed cost per
   trial, so the result also says how long a trial must train for the overhead to be < 5%.

Needs a Ray cluster (``make cluster-up`` or RAY_ADDRESS=local for a throwaway one).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = 1  # A/B pairs; each pair is 2 searches of 6 short trials
OVERRIDES = (
    "tracking.mlflow=false", "tracking.prometheus=false",
    "train.max_steps=90", "train.log_every_steps=5", "checkpoint.interval_steps=30",
    "tune.num_samples=6", "tune.max_concurrent_trials=2", "tune.seed=7",
    "tune.grace_period=10", "tune.reduction_factor=3",
    "tune.space={optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}, optimizer.name: {choice: [sgd, adamw]}}",
)


def _search(storage: str, method: str, name: str) -> Any:
    from runtime.config import load_job
    from runtime.tune import tune

    cfg = load_job("digits_tune", [f"checkpoint.storage={storage}", f"tune.method={method}", *OVERRIDES], environ={})
    return tune(cfg, name, show_progress=False)


def _compute(out: Any) -> dict[str, Any]:
    walls = [t.wall_seconds or 0.0 for t in out.trials]
    return {"trial_steps": sum(t.steps for t in out.trials), "trial_wall_s": round(sum(walls), 1),
            "search_wall_s": round(out.wall_seconds, 1), "steps_per_trial": [t.steps for t in out.trials],
            "best_trial": out.best.trial_id if out.best else None,
            "best_params": out.best.params if out.best else None, "best_value": out.best.best if out.best else None}


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.launch import connect
    from runtime.tune import TrialRow

    connect()
    pairs: list[dict[str, Any]] = []
    overheads: list[float] = []
    fixed: list[float] = []
    full_trials: list[TrialRow] = []
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as storage:
        for i in range(ROUNDS):
            asha = _search(storage, "asha", f"asha-{i}")  # A then B, interleaved across rounds
            full = _search(storage, "random", f"full-{i}")
            a, f = _compute(asha), _compute(full)
            pairs.append({"asha": a, "full": f,
                          "steps_saved": round(1 - a["trial_steps"] / f["trial_steps"], 3),
                          "trial_wall_saved": round(1 - a["trial_wall_s"] / f["trial_wall_s"], 3),
                          "search_wall_saved": round(1 - a["search_wall_s"] / f["search_wall_s"], 3),
                          "same_best_config": a["best_params"] == f["best_params"]})
            for t in (*asha.trials, *full.trials):
                if t.wall_seconds and t.train_seconds is not None:
                    overheads.append(1 - t.train_seconds / t.wall_seconds)
                    fixed.append(t.wall_seconds - t.train_seconds)
            full_trials = full.trials
        from runtime.tune import plot_trials

        png = results_dir / "tune_trial_curves.png"
        plot_trials(full_trials, "train/loss", pairs[-1]["full"]["best_trial"], png)
    med_fixed = statistics.median(fixed) if fixed else None
    result = {
        "asha_steps_saved_median": statistics.median(p["steps_saved"] for p in pairs),
        "asha_trial_wall_saved_median": statistics.median(p["trial_wall_saved"] for p in pairs),
        "asha_search_wall_saved_median": statistics.median(p["search_wall_saved"] for p in pairs),
        "asha_same_best_config": all(p["same_best_config"] for p in pairs),
        "goal_compute_saved": 0.6,
        "trial_overhead_median": round(statistics.median(overheads), 4) if overheads else None,
        "trial_overhead_range": [round(min(overheads), 4), round(max(overheads), 4)] if overheads else None,
        "trial_fixed_overhead_s_median": round(med_fixed, 1) if med_fixed is not None else None,
        # A trial whose fixed cost is F seconds needs F / 0.05 seconds of training for < 5 %.
        "train_s_per_trial_for_5pct": round(med_fixed / 0.05) if med_fixed is not None else None,
        "goal_trial_overhead": 0.05,
        "pairs": pairs,
        "png": str(png),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (results_dir / "tune_pairs.json").write_text(json.dumps(pairs, indent=2))
    return result
