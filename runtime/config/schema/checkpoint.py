"""The ``checkpoint`` section: where runs and checkpoints are stored, how often they are committed,
how many are kept, and what a failed save or a node drain does.

Its own module, as every section has (runtime.config.schema); the storage backends it names are
parsed by runtime.config.values and runtime.config.storage.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from runtime.config.base import MAX_WAIT_S, Strict
from runtime.config.values import parse_http_url, parse_storage


class CheckpointConfig(Strict):
    storage: str = Field("runs", description="Local folder or s3://bucket/prefix for runs and checkpoints.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto...).")
    interval_steps: int = Field(50, ge=1, description="Checkpoint every N optimizer steps.")
    at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Also commit a checkpoint right after these steps, before their report, so that report "
                    "carries it: where a scheduler may clone a trial (runtime.tune adds PBT's perturbation points).")
    keep: int = Field(3, ge=1, description="Valid checkpoints kept; the newest valid one is never deleted.")
    max_failures: int = Field(3, ge=-1, description="Worker-group restarts Ray may do; -1 = unlimited.")
    on_failure: Literal["continue", "stop"] = Field("continue", description="When a save fails.")
    s3_retry_s: float = Field(
        60.0, gt=0, le=MAX_WAIT_S,
        description="How long a checkpoint save or load on S3 rides out an unreachable endpoint, retrying with "
                    "backoff, before it counts as failed (on_failure then decides).")
    on_node_drain: Literal["checkpoint", "ignore"] = Field(
        "checkpoint",
        description="When Ray drains a node of the run (a spot notice, the remediation service): checkpoint = commit "
                    "at the next boundary, train no step the restart would redo and give the node back to Ray (unless "
                    "another job runs there), so that Ray restarts the group on the other nodes at once rather than "
                    "at the drain's deadline; ignore = train on, lose what the last commit missed.")
    enabled: bool = True

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        parse_storage(v).check()
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else parse_http_url(v)
