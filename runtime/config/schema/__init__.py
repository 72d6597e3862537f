"""The job configuration: each section of a job file a typed, validated model, and ``JobConfig``
composing them.

A job file (``jobs/<name>.yaml``) is a ``JobConfig``; every field is documented next to its
validation, in the module of its section. Unknown fields are errors (a typo must not silently
fall back to a default), and every error names the file and the dotted field path.

One module per section, so that a change to one section (a model, a data source, a storage
option) is read and made in one short file:

- ``model``: ``ModelConfig`` and its ``TransformerConfig``;
- ``data``: ``DataConfig``, and what a local data folder must hold;
- ``optimizer``: ``OptimizerConfig``, ``ScheduleConfig``, ``PrecisionConfig``;
- ``train``: ``TrainConfig`` and its ``LocalSGDConfig``, ``NonFiniteConfig``, ``StragglerConfig``;
- ``distributed``: ``DistributedConfig``, ``WorkerRange``, ``ElasticConfig``, ``FSDPConfig``;
- ``checkpoint``: ``CheckpointConfig``;
- ``tracking``: ``TrackingConfig``;
- ``cost``: ``CostConfig``;
- ``job``: ``JobConfig``, the checks across sections, and ``flatten``.

This module re-exports every section so that ``from runtime.config.schema import CostConfig``
works from any package.
"""

from runtime.config.base import MAX_WAIT_S
from runtime.config.schema.checkpoint import CheckpointConfig
from runtime.config.schema.cost import CostConfig
from runtime.config.schema.data import DataConfig
from runtime.config.schema.distributed import DistributedConfig, ElasticConfig, FSDPConfig, WorkerRange
from runtime.config.schema.job import JobConfig, flatten
from runtime.config.schema.model import ModelConfig, TransformerConfig
from runtime.config.schema.optimizer import OptimizerConfig, PrecisionConfig, ScheduleConfig
from runtime.config.schema.tracking import TrackingConfig
from runtime.config.schema.train import LocalSGDConfig, NonFiniteConfig, StragglerConfig, TrainConfig

__all__ = [
    "MAX_WAIT_S",
    "CheckpointConfig",
    "CostConfig",
    "DataConfig",
    "DistributedConfig",
    "ElasticConfig",
    "FSDPConfig",
    "JobConfig",
    "LocalSGDConfig",
    "ModelConfig",
    "NonFiniteConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "ScheduleConfig",
    "StragglerConfig",
    "TrackingConfig",
    "TrainConfig",
    "TransformerConfig",
    "WorkerRange",
    "flatten",
]
