"""What every config section shares: the strict model base, bounds, the dotted-key setter,
the config hash, and the one way a validation error becomes a message.

A message names the file or call, the dotted field path, what is expected in words, the value
given and where it was set (file:line, ``--set``, ``RT_*``); the same text for job files,
overrides and models built in code.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from runtime.errors import ConfigError

RUN_NAME_MAX = 128
# A job's name and a registered model's: they become folders, MLflow experiments and models:/ URIs.
JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# Sanity bounds: values past these are typos (an extra zero), not experiments.
MAX_BATCH = 65_536  # per-worker micro-batch: 65,536 CIFAR images are 200 MB of input alone
MAX_CLASSES = 1_000_000
MAX_SYNTHETIC = 100_000_000
MAX_STEPS = 1_000_000_000
MAX_WORKERS = 4096
# The longest a run may wait on one thing (a collective, a retried S3 call, workers to fit): past a
# week it is a hang by another name, and torch's collective timeout overflows its timedelta near 10**14 s.
MAX_WAIT_S = 7 * 86_400
MAX_ERRORS_SHOWN = 20

Origins = dict[tuple[str, ...], str]


class Strict(BaseModel):
    """Unknown fields, infinities/NaN and booleans given for numbers are errors in every section.

    Constructing a section (``DataConfig(batch_size=0)``), assigning a field or copying with
    ``model_copy(update=...)`` raises the same formatted :class:`ConfigError` a job file gets.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(format_errors(e, f"{type(self).__name__}(...)", root=type(self))) from None

    # Validation of a whole job builds sections without calling __init__ (pydantic-core runs
    # only a base __init__ marked so): the formatted error is raised once, for the whole job.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(format_errors(e, f"{type(self).__name__}.{name} = ...", root=type(self))) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update``, the result is validated like a job file (pydantic's own skips that)."""
        if not update:
            return super().model_copy(deep=deep)
        raw = {**self.model_dump(mode="python", exclude_unset=False), **update}
        try:
            return type(self).model_validate(raw)
        except ValidationError as e:
            raise ConfigError(format_errors(e, f"{type(self).__name__}.model_copy(update=...)",
                                            root=type(self))) from None

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1: `batch_size: true` is a mistake, never a number.
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _wants_number_not_bool(field.annotation) and _holds_bool(v):
            raise ValueError("must be a number, not a boolean (true/false)")
        return v


def _type_args(ann: Any) -> set[Any]:
    """Every type named inside ``ann`` (unions, containers, Annotated), ``ann`` included."""
    out = {ann}
    for a in typing.get_args(ann):
        out |= _type_args(a)
    return out


def _wants_number_not_bool(ann: Any) -> bool:
    kinds = _type_args(ann)
    return bool(kinds & {int, float}) and bool not in kinds


def _holds_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, bool) for x in v)
    if isinstance(v, dict):
        return any(isinstance(x, bool) for x in v.values())
    return False


def set_dotted(raw: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    """Set ``raw[a][b][c] = value`` for ``path`` [a, b, c], making missing sections; the one dotted-key
    setter (``--set``, ``RT_*``, Tune's search space). ``item`` names the override in the error."""
    node = raw
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"bad override {short(item)}: {part!r} is not a section")
        node = nxt
    node[path[-1]] = value


def config_hash(config: Any) -> str:
    """Stable hash of a resolved config (key order does not matter): MLflow's tag and checkpoint meta."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ----------------------------------------------------------------------------- error messages

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 2


def short(value: Any) -> str:
    """A value as an error shows it: never more than ~80 characters, however large the input."""
    out = _SHORT.repr(value)
    return out if len(out) <= 80 else out[:60] + f"... ({len(out):,} characters)"


def capped(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_ERRORS_SHOWN:
        return lines
    return [*lines[:MAX_ERRORS_SHOWN], f"  ... and {len(lines) - MAX_ERRORS_SHOWN:,} more (fix these first)"]


def did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# Names users bring from other frameworks; difflib cannot see that `learning_rate` means `lr`.
SYNONYMS = {
    "learning_rate": "optimizer.lr", "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay",
    "momentum": "optimizer.momentum", "batch_size": "data.batch_size", "batch": "data.batch_size",
    "workers": "distributed.num_workers", "num_workers": "distributed.num_workers", "gpus": "distributed.use_gpu",
    "use_gpu": "distributed.use_gpu", "steps": "train.max_steps", "max_steps": "train.max_steps",
    "epochs": "train.epochs", "num_epochs": "train.epochs", "warmup": "schedule.warmup_steps",
    "warmup_steps": "schedule.warmup_steps", "dtype": "precision.dtype", "seed": "train.seed",
    "optimiser": "optimizer", "scheduler": "schedule", "lr_schedule": "schedule", "dataset": "data",
    "checkpointing": "checkpoint", "checkpoints": "checkpoint", "mlflow": "tracking.mlflow",
}


def _suggest_field(parent: tuple[str, ...], name: str, fields: list[str]) -> str:
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}? "
    target = SYNONYMS.get(name.lower())
    if target:
        here = ".".join(parent)
        if target.rpartition(".")[0] == here:
            return f"did you mean {target.rpartition('.')[2]!r}? "
        return f"did you mean {target!r}? "
    return ""


_UNION_TAG = re.compile(r"[a-z][a-z-]*(\[.*\])?")


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _clean_loc(loc: tuple[Any, ...], root: type[BaseModel]) -> tuple[tuple[str, ...], type[BaseModel] | None]:
    """Drop pydantic's union-member tags (``use_gpu.literal['auto']``); return the path and its parent model."""
    model: type[BaseModel] | None = root
    parent: type[BaseModel] | None = root
    ann: Any = None
    out: list[str] = []
    for part in loc:
        if model is not None:
            out.append(str(part))
            parent = model
            field = model.model_fields.get(str(part))
            ann = field.annotation if field else None
            model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        elif _is_union(ann) and isinstance(part, str) and _UNION_TAG.fullmatch(part):
            ann = None  # a member tag: the user's value is one field, not a member of a type
        else:
            out.append(str(part))
            parent, ann = None, None
    return tuple(out), parent


def _plain(msg: str, etype: str) -> str:
    """pydantic's wording made plain: 'must be ...' rather than 'Input should be ...'."""
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if etype == "finite_number":
        return "must be a finite number (not .inf or .nan)"
    for prefix in ("Input should be ", "String should be "):
        if msg.startswith(prefix):
            msg = "must be " + msg[len(prefix):]
    return msg.replace(", unable to interpret input", "").replace(", unable to parse string as an integer", "") \
              .replace(", unable to parse string as a number", "")


def _origin_of(path: tuple[str, ...], origins: Origins) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return ""


def format_errors(err: ValidationError, source: str, origins: Origins | None = None, *,
                  root: type[BaseModel], prefix: tuple[str, ...] = ()) -> str:
    """One line per bad field: dotted path, what is expected in words, the value, where it was set;
    a single bad field is the whole message, on one line.

    ``root``: the model validated (JobConfig, or the section that was); ``prefix``: where it sits in a job.
    """
    origins = origins or {}
    grouped: dict[tuple[str, ...], list[Any]] = {}
    parents: dict[tuple[str, ...], type[BaseModel] | None] = {}
    for e in err.errors(include_url=False):
        path, parent = _clean_loc(tuple(e["loc"]), root)
        path = (*prefix, *path)
        grouped.setdefault(path, []).append(e)
        parents.setdefault(path, parent)
    lines = []
    for path, errs in grouped.items():
        loc = ".".join(path) or "<root>"
        first = errs[0]
        got = first.get("input")
        if first["type"] == "extra_forbidden":
            parent = parents[path]
            fields = list(parent.model_fields) if parent else []
            msg = f"unknown field; {_suggest_field(path[:-1], path[-1], fields)}valid fields here: {', '.join(fields)}"
            shown = ""
        elif first["type"] == "missing":
            msg, shown = "required field is missing", ""
        else:
            if len(errs) > 1:  # one value against each member of a union: say what any member takes
                wants = [_plain(x["msg"], x["type"]).removeprefix("must be ") for x in errs]
                msg = "must be " + " or ".join(dict.fromkeys(wants))
            else:
                msg = _plain(first["msg"], first["type"])
            expected = [x.get("ctx", {}).get("expected", "") for x in errs if x["type"] == "literal_error"]
            if expected and isinstance(got, str):
                msg += did_you_mean(got, re.findall(r"'([^']*)'", " ".join(expected)))
            shown = "" if isinstance(got, dict) else f" (got {short(got)})"
        named = [tuple(n.split(".")) for n in re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+", msg)]
        origin = next((o for o in (_origin_of(n, origins) for n in named if n[: len(path)] == path) if o), "") \
            or _origin_of(path, origins) \
            or next((o for k, o in origins.items() if k[: len(path)] == path), "")  # set below it (RT_FOO__BAR)
        where = "" if named and named[0][: len(path)] == path else f"{loc}: "
        lines.append(f"  {where}{msg}{shown}" + (f"  [from {origin}]" if origin and origin != source else ""))
    if len(lines) == 1:  # one problem, one line: the source, then the field and what it expects
        return f"{source}: {lines[0].strip()}"
    head = f"{source}: invalid job configuration ({len(lines)} errors)"
    return "\n".join([head, *capped(lines)])
