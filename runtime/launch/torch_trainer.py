"""Ray Train's ``TorchTrainer`` less the Ray Data actor that a run without Ray Datasets never uses.

Ray 2.60 starts a ``DatasetManager`` actor at every worker-group start (first start, each
restart and resize) whatever the trainer was given; it is one more Python process importing Ray
Data (about 1.6 CPU-seconds), on the restart's critical path when cores are few. This runtime's
loaders are its own (``runtime.data``), so no run here passes ``datasets``: without them the
callback that starts the actor is dropped; with them, nothing changes.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2.torch.torch_trainer import TorchTrainer  # what ray.train.torch exports under Train V2


class LeanTorchTrainer(TorchTrainer):
    """``TorchTrainer`` without the Ray Data callback when there are no ``datasets``."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks: list[Any] = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [c for c in callbacks if not isinstance(c, DatasetsCallback)]
