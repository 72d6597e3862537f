"""The ``tune:`` section of a tuning job: search space, method, metric; checked before anything runs.

A tuning job is a normal job plus a ``tune:`` section (:class:`TuneConfig`): a search space
over dotted config keys (each a :class:`Param`), a method, the metric and mode.
:func:`parse_tune` validates it against the job (every bound of the space must make a valid
job) and hands back a :class:`TuneSpec`; :func:`apply_params` makes one trial's job.
"""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from runtime.config import JobConfig, Strict, config_from_dict, format_errors, set_dotted, short
from runtime.config.base import Origins
from runtime.errors import ConfigError
from runtime.observe.catalog import metric_names

# Methods whose scheduler acts on every intermediate result (stops, pauses or clones trials).
SCHEDULERS = ("asha", "hyperband", "pbt")

# What the loop reports at every report or evaluation (declared in runtime/observe/catalog.py):
# the only valid search metrics.
KNOWN_METRICS = metric_names(searchable=True)
DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice", "grid")


class PBTConfig(Strict):
    """Population-Based Training; intervals are in optimizer steps (the loop's ``step``)."""

    perturbation_interval: int = Field(20, ge=1, description="Steps between exploit/explore decisions.")
    quantile_fraction: float = Field(0.25, gt=0, le=0.5, description="Bottom fraction copies the top fraction.")
    resample_probability: float = Field(0.25, ge=0, le=1, description="Explore: resample instead of perturbing.")
    synch: bool = Field(False, description="Trials wait at each interval for the whole population (paused and "
                                           "restarted from their checkpoint): every decision compares all trials.")


@dataclass(frozen=True)
class Param:
    """One search-space entry, e.g. ``optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}``."""

    key: str
    kind: str
    args: tuple[Any, ...]

    def samples(self) -> list[Any]:
        """Values that bound the space: every one must make a valid job."""
        if self.kind in ("choice", "grid"):
            return list(self.args)
        if self.kind == "randint":  # Ray's randint excludes the upper bound
            return [self.args[0], self.args[1] - 1]
        return list(self.args)

    def domain(self, as_grid: bool = False) -> Any:
        from ray import tune as rt

        if self.kind == "grid" or (as_grid and self.kind == "choice"):
            return rt.grid_search(list(self.args))
        if self.kind == "choice":
            return rt.choice(list(self.args))
        return {"loguniform": rt.loguniform, "uniform": rt.uniform, "randint": rt.randint}[self.kind](*self.args)


def _parse_param(key: str, spec: Any) -> Param:
    where = f"tune.space.{key}"
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"{where}: expected one distribution, e.g. {{loguniform: [1.0e-4, 1.0e-1]}}, "
                         f"got {short(spec)}")
    kind, args = next(iter(spec.items()))
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"{where}: unknown distribution {short(kind)}; use one of {', '.join(DISTRIBUTIONS)}")
    if not isinstance(args, list):
        raise ValueError(f"{where}: {kind} takes a list, got {short(args)}")
    if kind in ("choice", "grid"):
        if not args:
            raise ValueError(f"{where}: {kind} needs at least one value")
        return Param(key, kind, tuple(args))
    if len(args) != 2:
        raise ValueError(f"{where}: {kind} takes [low, high], got {short(args)}")
    if any(isinstance(a, bool) for a in args):
        raise ValueError(f"{where}: {kind} bounds must be numbers, not booleans, got {short(args)}")
    try:  # YAML 1.1 reads 1e-4 (no dot) as text: accept it as the number it means
        low, high = (int(a) if kind == "randint" else float(a) for a in args)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {kind} bounds must be numbers, got {short(args)}") from None
    if kind == "randint" and any(float(a) != int(float(a)) for a in args):
        raise ValueError(f"{where}: randint bounds must be integers, got {short(args)}")
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{where}: {kind} bounds must be finite numbers (not .inf or .nan), got {short(args)}")
    if not low < high:
        raise ValueError(f"{where}: low must be < high, got [{low}, {high}]")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"{where}: loguniform needs low > 0, got {low}")
    return Param(key, kind, (low, high))


class TuneConfig(Strict):
    """The ``tune:`` section of a tuning job."""

    method: Literal["random", "grid", "optuna", "asha", "hyperband", "pbt"] = "random"
    metric: str = Field("val/accuracy", description="A metric the loop reports; see KNOWN_METRICS.")
    mode: Literal["max", "min"] = "max"
    num_samples: int = Field(8, ge=1, description="Trials to sample (grid: repeats of the whole grid).")
    max_concurrent_trials: int = Field(2, ge=1, description="Trials (Train runs) in flight at once.")
    space: dict[str, Any] = Field(description="Dotted job key -> {distribution: args}.")
    seed: int = Field(0, description="Seed of the searcher, so a search can be repeated.")
    max_t: int | None = Field(None, ge=1, description="ASHA/HyperBand: steps a trial may reach (default max_steps).")
    grace_period: int | None = Field(None, ge=1, description="ASHA: steps before a trial may be stopped.")
    reduction_factor: float = Field(3, gt=1, description="ASHA/HyperBand: keep 1/reduction_factor per rung.")
    pbt: PBTConfig = PBTConfig()
    trial_keep: int = Field(2, ge=1, description="Checkpoints each trial's own manager keeps.")
    max_disk_mb: float = Field(4096, gt=0, description="Cap on the search folder; finished trials are pruned.")
    trial_cpus: float = Field(
        0, ge=0,
        description="CPU reserved for each trial's driver process (its workers ask their own). 0: none, so "
                    "that max_concurrent_trials x workers fill the workers' CPUs exactly.")
    trial_memory_mb: float = Field(
        512, gt=0, description="Memory reserved for each trial's driver process (Tune needs it to ask for something).")
    max_failures: int = Field(
        2, ge=-1,
        description="Restarts of a failed trial from its newest checkpoint. Worker failures count too: Ray Train's "
                    "own restarts are off inside trials (see docs/tune.md).")
    trial_poll_interval_s: float = Field(
        0.1, gt=0, le=60,
        description="Ray Train's poll period inside each trial (replaces distributed.poll_interval_s): the end "
                    "of a trial is noticed this much later, and every trial pays it; trials are small, so "
                    "polling often costs little.")

    _params: list[Param] = PrivateAttr(default_factory=list)

    @property
    def params(self) -> list[Param]:
        return self._params

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        if v not in KNOWN_METRICS:
            known = ", ".join(KNOWN_METRICS)
            close = difflib.get_close_matches(v, KNOWN_METRICS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"metric {v!r} is not reported by the training loop; {hint}use one of {known}")
        return v

    @field_validator("space")
    @classmethod
    def _space(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("space is empty: name at least one key to search, e.g. optimizer.lr")
        for key, spec in v.items():
            _parse_param(key, spec)
        return v

    def model_post_init(self, _ctx: Any) -> None:
        self._params = [_parse_param(k, s) for k, s in self.space.items()]
        where = "tune.method"
        if self.method == "grid":
            cont = [p.key for p in self.params if p.kind not in ("choice", "grid")]
            if cont:
                raise ConfigError(f"{where}=grid needs choice/grid values for every key; continuous: {', '.join(cont)}")
        if self.method == "optuna":
            grid = [p.key for p in self.params if p.kind == "grid"]
            if grid:
                raise ConfigError(f"{where}=optuna cannot search grid values ({', '.join(grid)}); use choice")


@dataclass
class TuneSpec:
    """A validated search: the base job (without its tune section) and the search definition."""

    job: JobConfig
    tune: TuneConfig
    max_t: int

    @property
    def base(self) -> dict[str, Any]:
        return self.job.model_dump(mode="json", exclude={"tune"})


def parse_tune(cfg: JobConfig, origins: Origins | None = None) -> TuneSpec:
    """Validate the tune section against the job before anything runs (ConfigError names the field).

    ``origins``: where each key was set, as ``load_job(..., origins=...)`` records them: an error
    then names its source (file:line, --set or RT_ variable) as the job's other sections do.
    """
    if not cfg.tune:
        raise ConfigError(f"job {cfg.name!r} has no tune: section; add one (see docs/tune.md)")
    try:
        tc = TuneConfig.model_validate(cfg.tune)
    except ValidationError as e:
        raise ConfigError(format_errors(e, f"job {cfg.name!r}, tune: section", origins, root=TuneConfig,
                                        prefix=("tune",))) from None
    base = cfg.model_dump(mode="json", exclude={"tune"})
    for p in tc.params:
        if p.key.split(".")[0] in ("tune", "name"):
            raise ConfigError(f"tune.space.{p.key}: cannot search over {p.key.split('.')[0]!r}")
        for value in p.samples():
            try:
                apply_params(base, {p.key: value})
            except ConfigError as e:
                raise ConfigError(f"tune.space.{p.key}: value {value!r} does not make a valid job:\n{e}") from None
    max_t = tc.max_t or cfg.train.max_steps
    if tc.method in SCHEDULERS and not max_t:
        raise ConfigError(f"tune.method={tc.method} needs train.max_steps or tune.max_t (steps a trial may run)")
    if tc.grace_period and max_t and tc.grace_period > max_t:
        raise ConfigError(f"tune.grace_period={tc.grace_period} exceeds the {max_t} steps a trial runs")
    return TuneSpec(cfg.model_copy(update={"tune": None}), tc, int(max_t or 0))


def apply_params(base: dict[str, Any], params: dict[str, Any]) -> JobConfig:
    """The base job with dotted keys set (runtime.config.set_dotted, as ``--set`` does); validated
    like a job file."""
    raw = copy.deepcopy(base)
    for key, value in params.items():
        set_dotted(raw, key.split("."), value, key)
    return config_from_dict(raw, source=f"job with {params}")
