"""The method of a search as Ray Tune objects: searcher, scheduler and parameter space.

Every scheduler runs on the loop's ``step`` (optimizer steps), so budgets (``max_t``,
grace periods, PBT intervals) are in compute, whatever a trial's speed.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.tune.config import TuneConfig, TuneSpec


def search_alg(tc: TuneConfig) -> Any:
    """Ray Tune's own searchers: Optuna (TPE) or random/grid variants with a fixed seed."""
    if tc.method == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=tc.seed)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # A variant generator is not a Searcher: Tune ignores TuneConfig.max_concurrent_trials for it.
    return BasicVariantGenerator(random_state=tc.seed, max_concurrent=tc.max_concurrent_trials)


def asha_grace(spec: TuneSpec) -> int:
    """ASHA's first rung: tune.grace_period, else max_t / rf^2 (three rungs, the last at max_t)."""
    tc = spec.tune
    return tc.grace_period or max(1, int(spec.max_t / tc.reduction_factor**2))


def decision_steps(spec: TuneSpec) -> list[int]:
    """Steps before max_t at which the scheduler judges trials: ASHA's rungs or PBT's perturbation
    points. A ``val/`` metric is evaluated there too (train.eval_at_steps), so a rung compares fresh
    held-out values and a trial it stops has trained exactly to the rung, not on to the next
    scheduled evaluation (the final step is always evaluated)."""
    tc = spec.tune
    if tc.method == "asha":
        # ASHAScheduler's rungs (ray.tune.schedulers.async_hyperband._Bracket, bracket 0).
        grace, rf = asha_grace(spec), tc.reduction_factor
        count = int(math.log(spec.max_t / grace) / math.log(rf) + 1)
        return sorted({m for k in range(count) if (m := math.ceil(grace * rf**k)) < spec.max_t})
    if tc.method == "pbt":
        return list(range(tc.pbt.perturbation_interval, spec.max_t, tc.pbt.perturbation_interval))
    return []


def scheduler(spec: TuneSpec) -> Any:
    """Early stopping (ASHA, HyperBand) or PBT, all on the loop's ``step`` so budgets are in compute."""
    tc = spec.tune
    if tc.method == "asha":
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(time_attr="step", max_t=spec.max_t, grace_period=asha_grace(spec),
                             reduction_factor=tc.reduction_factor)
    if tc.method == "hyperband":
        from ray.tune.schedulers import HyperBandScheduler

        return HyperBandScheduler(time_attr="step", max_t=spec.max_t, reduction_factor=tc.reduction_factor)
    if tc.method == "pbt":
        from ray.tune.schedulers import PopulationBasedTraining

        mutations = {p.key: list(p.args) if p.kind == "choice" else p.domain() for p in tc.params if p.kind != "grid"}
        return PopulationBasedTraining(
            time_attr="step", perturbation_interval=tc.pbt.perturbation_interval, hyperparam_mutations=mutations,
            quantile_fraction=tc.pbt.quantile_fraction, resample_probability=tc.pbt.resample_probability,
            synch=tc.pbt.synch,
        )
    return None


def param_space(tc: TuneConfig) -> dict[str, Any]:
    return {p.key: p.domain(as_grid=tc.method == "grid") for p in tc.params}
