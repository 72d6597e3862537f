"""Versions, aliases and the promotion rule over the MLflow Model Registry.

A version carries what an operator asks of a model in production (tags): the run that made it, its
step, config hash and git commit, and its metric values as ``metric.<name>`` (the final report's,
plus any evaluation the pipeline adds). Promotion moves an alias (``champion``) to a version only
when the version's value of a named metric beats the current holder's, unless forced.

Errors: RegistryError (bad input: an unknown model, version or alias, a metric the version lacks;
exit 2), ClusterError (MLflow unreachable; exit 3), PromotionRefused (the rule said no; exit 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.cluster import ClusterError
from runtime.errors import ConfigError
from runtime.observe.mlflow_http import first_line

METRIC_TAG = "metric."  # version tags holding metric values: metric.val/accuracy = "0.93"
DEFAULT_ALIAS = "champion"


class RegistryError(ConfigError):
    """Bad input to the registry: what was asked for does not exist or cannot be compared."""


class PromotionRefused(Exception):
    """The version does not beat the alias's current holder on the named metric."""


@dataclass
class Version:
    name: str
    version: str
    run_id: str | None
    source: str
    aliases: list[str]
    tags: dict[str, str]

    def metrics(self) -> dict[str, float]:
        return {k[len(METRIC_TAG):]: float(v) for k, v in self.tags.items() if k.startswith(METRIC_TAG)}


def client(uri: str) -> Any:
    """A registry client. Its callers (the tracker, ``models`` commands, the flow) have bounded MLflow's
    HTTP settings for the process first (runtime.observe.mlflow_http.bound_mlflow_http): a dead server
    then fails a call in seconds, not minutes."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def metric_tags(metrics: dict[str, Any]) -> dict[str, str]:
    """``metric.<name>`` tags for the numeric values of ``metrics``."""
    return {f"{METRIC_TAG}{k}": repr(float(v)) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _unreachable(uri: str, e: BaseException) -> ClusterError:
    return ClusterError(f"MLflow at {uri} unreachable: {first_line(e)}")


def _call(uri: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """One registry call: MLflow's own 'does not exist' passes through, anything else means unreachable."""
    from mlflow.exceptions import MlflowException

    try:
        return fn(*args, **kwargs)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS"):
            raise
        raise _unreachable(uri, e) from None
    except Exception as e:  # noqa: BLE001 (requests' and urllib3's connection errors)
        raise _unreachable(uri, e) from None


def _version(v: Any) -> Version:
    return Version(str(v.name), str(v.version), v.run_id, str(v.source), list(getattr(v, "aliases", []) or []),
                   dict(v.tags or {}))


def register(uri: str, name: str, run_id: str, source: str, tags: dict[str, str]) -> Version:
    """A new version of ``name`` (created when new) from the model at ``source`` of ``run_id``."""
    from mlflow.exceptions import MlflowException

    c = client(uri)
    try:
        _call(uri, c.create_registered_model, name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise RegistryError(f"{name}: {first_line(e)}") from None
    return _version(_call(uri, c.create_model_version, name, source, run_id, tags=tags))


def _missing(uri: str, name: str) -> RegistryError:
    known = [m.name for m in _call(uri, client(uri).search_registered_models, max_results=50)]
    return RegistryError(f"no registered model {name!r} at {uri}" +
                         (f" (registered: {', '.join(sorted(known))})" if known else " (none registered yet)"))


def versions(uri: str, name: str) -> list[Version]:
    """Every version of ``name``, newest first."""
    from mlflow.exceptions import MlflowException

    c = client(uri)
    try:
        model = _call(uri, c.get_registered_model, name)
    except MlflowException:
        raise _missing(uri, name) from None
    aliases: dict[str, list[str]] = {}
    for alias, version in (model.aliases or {}).items():
        aliases.setdefault(str(version), []).append(alias)
    found = _call(uri, c.search_model_versions, f"name = '{name}'")
    out = [_version(v) for v in found]
    for v in out:
        v.aliases = sorted(aliases.get(v.version, []))
    return sorted(out, key=lambda v: int(v.version), reverse=True)


def models(uri: str) -> list[tuple[str, dict[str, str], str | None]]:
    """(name, aliases -> version, latest version) of every registered model."""
    rows = []
    for m in _call(uri, client(uri).search_registered_models, max_results=1000):
        latest = max((int(v.version) for v in (m.latest_versions or [])), default=None)
        rows.append((str(m.name), {a: str(v) for a, v in (m.aliases or {}).items()},
                     str(latest) if latest is not None else None))
    return sorted(rows)


def resolve(uri: str, name: str, ref: str) -> Version:
    """A version of ``name`` by number, alias or ``latest``."""
    all_versions = versions(uri, name)
    if ref == "latest" and all_versions:
        return all_versions[0]
    for v in all_versions:
        if v.version == ref or ref in v.aliases:
            return v
    aliases = ", ".join(sorted({a for v in all_versions for a in v.aliases})) or "none"
    numbers = ", ".join(v.version for v in all_versions) or "none"
    raise RegistryError(f"{name}: no version or alias {ref!r} (versions {numbers}; aliases {aliases})")


def holder(uri: str, name: str, alias: str) -> Version | None:
    """The version ``alias`` points at, or None when no version holds it."""
    return next((v for v in versions(uri, name) if alias in v.aliases), None)


def better(candidate: float, current: float, mode: str) -> bool:
    """Strictly better: a tie keeps the current holder (no churn between equal models)."""
    return candidate > current if mode == "max" else candidate < current


def default_mode(metric: str) -> str:
    """Losses, errors and times go down; everything else (accuracy, throughput) up."""
    return "min" if any(w in metric for w in ("loss", "error", "time", "seconds")) else "max"


@dataclass
class Promotion:
    version: Version
    previous: Version | None
    forced: bool
    reason: str


def promote(uri: str, name: str, ref: str, *, alias: str = DEFAULT_ALIAS, metric: str | None = None,
            mode: str | None = None, force: bool = False) -> Promotion:
    """Point ``alias`` at version ``ref`` of ``name`` if it beats the holder on ``metric``, or ``force``.

    Raises RegistryError (unknown name/version, the candidate lacks ``metric``, no metric and no
    ``force``), PromotionRefused (not better), ClusterError (MLflow unreachable)."""
    candidate = resolve(uri, name, ref)
    current = holder(uri, name, alias)
    reason = "forced"
    if not force:
        if metric is None:
            raise RegistryError("promote needs --metric NAME (the rule compares it with the current holder's) "
                                "or --force")
        have = candidate.metrics()
        if metric not in have:
            raise RegistryError(f"{name} version {candidate.version} has no value of {metric!r} (it has: "
                                f"{', '.join(sorted(have)) or 'no metric tags'})")
        direction = mode or default_mode(metric)
        held = current.metrics().get(metric) if current else None
        if current is None:
            reason = f"{alias} was unset"
        elif current.version == candidate.version:
            reason = f"already {alias}"
        elif held is None:
            reason = f"version {current.version} has no {metric}"
        elif better(have[metric], held, direction):
            reason = f"{metric} {have[metric]:.6g} beats {held:.6g} ({direction})"
        else:
            raise PromotionRefused(f"{name} version {candidate.version}: {metric} {have[metric]:.6g} does not beat "
                                   f"{alias} (version {current.version}, {held:.6g}; {direction} wins); "
                                   "--force promotes it anyway")
    _call(uri, client(uri).set_registered_model_alias, name, alias, candidate.version)
    candidate.aliases = sorted({*candidate.aliases, alias})
    return Promotion(candidate, current if current and current.version != candidate.version else None, force, reason)
