"""Reading a job: the YAML file (UTF-8, each key once, small when aliases expand), ``RT_*``
environment overrides, ``--set`` overrides, then validation into a ``JobConfig``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from runtime.cluster import DEFAULT_PORTS
from runtime.config.base import Origins, capped, did_you_mean, format_errors, set_dotted, short
from runtime.config.schema.job import JobConfig
from runtime.errors import ConfigError

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"
ENV_PREFIX = "RT_"
MAX_JOB_BYTES = 1 << 20  # a job file is a page of settings; a megabyte is a mistake (or an attack)
MAX_YAML_DEPTH = 64  # nesting levels: the deepest job (tune.space) needs 5; PyYAML recurses per level
MAX_YAML_NODES = 100_000  # values after expanding aliases: stops "billion laughs" before it is built

# RT_* variables the runtime reads as settings of its own (not config overrides); every other
# RT_ variable must be an override, RT_SECTION__FIELD (a single underscore is a typo, not ignored).
RUNTIME_SETTINGS = (
    "RT_CLUSTER_DIR", "RT_PROMETHEUS_BIN", "RT_NODE_EXPORTER_BIN", "RT_PROMETHEUS_SD_DIR", "RT_METRICS_HOST",
    "RT_METRICS_BIND", "RT_METRICS_PORT", "RT_INSTANCE_TYPE", "RT_S3_SSE", "RT_S3_SSE_KMS_KEY_ID",
    "RT_TUNE_STATE_KEY_FILE",  # runtime.tune.sealed_state: the key that seals Tune's search state
    "RT_GCS_FT", "RT_REDIS_SERVER_BIN",  # runtime.cluster: `make cluster-up GCS_FT=1` (Redis for the GCS)
    "RT_TRAIN_SPARES",  # runtime.train.spares: 0 turns off the spare worker processes kept for a restart
    "RT_TEST_HOLD",  # runtime.train.hold: tests only, every rank waits at a named step for a file
    "RT_TEST_SAMPLES",  # runtime.train.sample_log: tests only, each rank records the sample ids of its steps
    "RT_TEST_CENSUS",  # tests/support/census.py: the test session's marker on the processes it starts
    # runtime.cluster.state_file.port(): RT_<SERVICE>_PORT moves a local cluster's service
    *(f"RT_{service.upper()}_PORT" for service in DEFAULT_PORTS),
)


def available_jobs(jobs_dir: Path = JOBS_DIR) -> list[str]:
    return sorted(p.stem for p in jobs_dir.glob("*.yaml"))


def resolve_job_path(job: str, jobs_dir: Path = JOBS_DIR) -> Path:
    """Accept a job name (``resnet50``) or a path to a YAML file."""
    try:
        return _job_path(job, jobs_dir)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # a name too long for the file system, a NUL byte in it
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"job {short(job)} is neither a job name nor a readable file ({why})") from None


def _job_path(job: str, jobs_dir: Path) -> Path:
    p = Path(job)
    if p.suffix in (".yaml", ".yml") or os.sep in job:
        if not p.is_file():
            hint = ""
            if p.stem in available_jobs(jobs_dir):
                hint = f"; did you mean the job name {p.stem!r} (jobs/{p.stem}.yaml), e.g. `validate {p.stem}`?"
            what = ("is a folder, not a file" if p.is_dir() else
                    "is not a regular file" if p.exists() else "does not exist")
            raise ConfigError(f"job file {short(job)} {what}{hint}")
        return p
    candidate = jobs_dir / f"{job}.yaml"
    if not candidate.is_file():
        jobs = available_jobs(jobs_dir)
        raise ConfigError(f"unknown job {short(job)}{did_you_mean(job, jobs)}; available jobs: {', '.join(jobs)}")
    return candidate


def _yaml_problem(where: str, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    return f"{at}: not valid YAML: {problem}"


def _walk_nodes(node: yaml.Node, path: tuple[str, ...], where: str, origins: Origins, errors: list[str],
                sizes: dict[int, int]) -> int:
    """Record each key's line, collect duplicate keys; return the node count with aliases expanded."""
    if id(node) in sizes:  # an alias: counted again (what expanding it costs), walked once
        return sizes[id(node)]
    count = 1
    sizes[id(node)] = count  # a recursive alias counts once
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = str(key_node.value)
                if key in seen:
                    errors.append(f"{where}:{line}: duplicate key {'.'.join((*path, key))!r} "
                                  f"(first set on line {seen[key]}); a job file sets each field once")
                seen.setdefault(key, line)
                origins.setdefault((*path, key), f"{where}:{line}")
                count += _walk_nodes(value_node, (*path, key), where, origins, errors, sizes)
            else:
                count += _walk_nodes(value_node, path, where, origins, errors, sizes)
            if count > MAX_YAML_NODES:
                break
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            count += _walk_nodes(item, path, where, origins, errors, sizes)
            if count > MAX_YAML_NODES:
                break
    sizes[id(node)] = count
    return count


def _check_depth(text: str, where: str) -> None:
    """Refuse nesting deeper than MAX_YAML_DEPTH before PyYAML's recursive composer meets it
    (a RecursionError otherwise); the event parser is iterative. Syntax errors are left to compose."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else 0
                    raise ConfigError(f"{where}:{line}: nested more than {MAX_YAML_DEPTH} "
                                      "levels deep; a job file is a page of settings")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return


def read_job_file(path: Path) -> tuple[dict[str, Any], Origins]:
    """A job file's mapping and the file:line each key came from; every problem is a ConfigError.

    Stricter than ``yaml.safe_load``: the file must be UTF-8 and non-empty, set each key once
    (PyYAML keeps the last of duplicates silently) and stay small when its aliases expand.
    """
    where = str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the job file ({e.strerror or e})") from None
    if len(data) > MAX_JOB_BYTES:
        raise ConfigError(f"{where}: {len(data):,} bytes is too large for a job file (at most {MAX_JOB_BYTES:,})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{where}:{line}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                          "(save the file as UTF-8)") from None
    _check_depth(text, where)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(where, e)) from None
    if root is None:
        raise ConfigError(f"{where}: the job file is empty; it needs at least one section, e.g. "
                          "`model: {name: resnet50}` (see jobs/digits_smoke.yaml)")
    if not isinstance(root, yaml.MappingNode):
        kind = "list" if isinstance(root, yaml.SequenceNode) else "single value"
        raise ConfigError(f"{where}: expected a mapping of sections (model, data, ...), got a {kind}")
    origins: Origins = {}
    errors: list[str] = []
    if _walk_nodes(root, (), where, origins, errors, {}) > MAX_YAML_NODES:
        raise ConfigError(f"{where}: expands to more than {MAX_YAML_NODES:,} values (YAML aliases?); "
                          "a job file is a page of settings")
    if errors:
        raise ConfigError("\n".join(capped(errors)))
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:  # constructor errors (bad tags, unhashable keys) surface only here
        raise ConfigError(_yaml_problem(where, e)) from None
    return raw, origins


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], yaml-parsed c)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {short(item)}: expected dotted.key=value, e.g. optimizer.lr=0.05")
    if len(raw) > 4096:
        raise ConfigError(f"bad override {short(item)}: the value is {len(raw):,} characters (at most 4,096)")
    _check_depth(raw, f"bad override {short(item)}: value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {short(item)}: value is not valid YAML ({e.__class__.__name__})") from None
    return key.split("."), value


def env_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``RT_OPTIMIZER__LR=0.05`` -> ``("optimizer.lr=0.05", "RT_OPTIMIZER__LR")`` (``__`` separates levels).

    Reads ``os.environ`` when ``environ`` is None; the runtime's own settings (RUNTIME_SETTINGS) are
    skipped, and any other RT_ variable without ``__`` is an error naming the override it resembles.
    """
    env = os.environ if environ is None else environ
    out: list[tuple[str, str]] = []
    bad: list[str] = []
    for k, v in sorted(env.items()):
        if not k.startswith(ENV_PREFIX) or k in RUNTIME_SETTINGS:
            continue
        if "__" not in k:
            bad.append(f"  {k}: overrides separate levels with a double underscore: did you mean "
                       f"{_env_suggestion(k)}?")
            continue
        out.append((k[len(ENV_PREFIX):].lower().replace("__", ".") + "=" + v, k))
    if bad:
        raise ConfigError("\n".join(["environment: RT_ variables that are neither overrides (RT_SECTION__FIELD) nor "
                                     f"the runtime's settings ({', '.join(RUNTIME_SETTINGS)}):", *capped(bad)]))
    return out


def _env_suggestion(name: str) -> str:
    """RT_OPTIMIZER_LR -> RT_OPTIMIZER__LR when that names a field; else the generic shape."""
    words = name[len(ENV_PREFIX):].lower()
    for section, model in _sections().items():
        if words.startswith(section + "_"):
            field = words[len(section) + 1:]
            if field in model.model_fields:
                return f"{ENV_PREFIX}{section.upper()}__{field.upper()}"
    return "RT_<SECTION>__<FIELD>, e.g. RT_OPTIMIZER__LR=0.05"


def _sections() -> dict[str, type[BaseModel]]:
    out = {}
    for name, f in JobConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out[name] = f.annotation
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[str, str]], origins: Origins) -> list[str]:
    """Set each ``(dotted.key=value, origin)`` in ``raw`` (later wins); record origins; return lines applied."""
    applied = []
    for item, origin in overrides:
        keys, value = parse_override(item)
        try:
            set_dotted(raw, keys, value, item)
        except ConfigError as e:
            raise ConfigError(f"{e} (from {origin})") from None
        for k in [k for k in origins if k[: len(keys)] == tuple(keys)]:
            del origins[k]  # the override replaced what the file said there
        origins[tuple(keys)] = origin
        applied.append(f"{'.'.join(keys)} = {short(value)}  ({origin})")
    return applied


def load_job(
    job: str,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    jobs_dir: Path = JOBS_DIR,
    *,
    applied: list[str] | None = None,
    origins: Origins | None = None,
) -> JobConfig:
    """Load a job file, apply environment then ``--set`` overrides (``--set`` wins), validate.

    ``environ``: RT_* overrides are read only from this mapping (the CLI passes ``os.environ``);
    None reads none, so a notebook's environment cannot change a job behind its back.
    ``applied``: filled with one line per override that took effect (``validate --show``).
    ``origins``: filled with where each key was set (``file:line``, ``--set ...``, the RT_ variable),
    for checks made after loading to name it too (``parse_tune(cfg, origins)``: the tune section).
    """
    path = resolve_job_path(job, jobs_dir)
    raw, found = read_job_file(path)
    origins = {} if origins is None else origins
    origins.update(found)
    raw.setdefault("name", path.stem)
    items = (env_overrides(environ) if environ is not None else []) + [
        (o, f"--set {short(o)}") for o in overrides or []]
    lines = apply_overrides(raw, items, origins)
    if applied is not None:
        applied.extend(lines)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, str(path), origins, root=JobConfig)) from None


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Validate a job given as a dict (as a job file would hold it); ConfigError lists every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (model, data, ...), got {type(raw).__name__}")
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, source, root=JobConfig)) from None


def with_overrides(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """``cfg`` with ``dotted.key=value`` overrides applied, validated like a job file."""
    raw = cfg.model_dump(mode="json")
    origins: Origins = {}
    apply_overrides(raw, [(o, f"override {short(o)}") for o in overrides], origins)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, cfg.name, origins, root=JobConfig)) from None
