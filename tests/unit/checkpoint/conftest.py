"""Shared helpers for the checkpoint tests: a tiny model trained a few steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.checkpoint import capture_rng_state


class Trainer:
    """A small model + SGD with momentum + StepLR, so every state part is non-trivial."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.step_count = 0

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            x = torch.randn(4, 8)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step_count += 1

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "trainer": {
                "epoch": 0,
                "global_step": self.step_count,
                "samples_seen": 4 * self.step_count,
            },
            "rng": capture_rng_state(),
        }


@pytest.fixture
def trainer() -> Trainer:
    t = Trainer()
    t.step(3)
    return t


@pytest.fixture
def make_trainer() -> type[Trainer]:
    return Trainer
