"""Held-out metrics of a trained model: the pipeline's ``evaluate`` step, and the check that a
registered model loaded back by alias reproduces them.

Evaluated here, in one process on the CPU, rather than by the trainer: the model under test is the
exported one (or the checkpoint's weights in the same network), not the live DDP replica.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.config import JobConfig
from runtime.errors import ConfigError
from runtime.train.export import final_model, normalised

EVAL_BATCH = 256


def evaluate_module(module: nn.Module | Any, cfg: JobConfig) -> dict[str, float]:
    """``eval/loss`` and ``eval/accuracy`` of ``module`` over the job's validation split.

    In-memory sources (digits, cifar10) only: they are the ones small enough to score in the
    pipeline's own process; larger sets are scored by the trainer (val/* in the run's reports)."""
    from runtime.data.builtin import BUILTIN, build_builtin

    if cfg.data.source not in BUILTIN or cfg.model.name == "gpt":
        raise ConfigError(f"evaluate: data.source={cfg.data.source} (model {cfg.model.name}) is scored by the "
                          "trainer (val/*), not here: use a digits or cifar10 job")
    bundle = build_builtin(cfg.data)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    loss, right, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(bundle.val), EVAL_BATCH):
            rows = [bundle.val[i] for i in range(start, min(start + EVAL_BATCH, len(bundle.val)))]
            x = normalised(torch.stack([r[0] for r in rows]), bundle.mean, bundle.std)
            y = torch.tensor([int(r[1]) for r in rows])
            out = module(x)
            loss += float(loss_fn(out, y))
            right += int((out.argmax(-1) == y).sum())
            count += len(rows)
    return {"eval/loss": loss / count, "eval/accuracy": right / count}


def evaluate_checkpoint(checkpoint_uri: str, cfg: JobConfig) -> dict[str, float]:
    """Held-out metrics of the newest valid checkpoint under ``checkpoint_uri``."""
    model = final_model(checkpoint_uri, cfg)
    if model is None:
        raise ConfigError(f"evaluate: no valid checkpoint under {checkpoint_uri}")
    return evaluate_module(model.module, cfg)
