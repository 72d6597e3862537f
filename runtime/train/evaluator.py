"""When to evaluate (``train.eval_at_steps``, every ``train.eval_every_epochs``) and how: one pass
over the validation loader, summed on the device, one all-reduce and one read at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.data import Stage
from runtime.train.setup import autocast


class Evaluator:
    """Every rank evaluates its shard of the validation set; the sums are all-reduced."""

    def __init__(self, model: nn.Module, loader: Iterable[Any] | None, stage: Stage, *, device: torch.device,
                 amp_dtype: torch.dtype | None, batch_size: int, pad_to_batch: bool,
                 memory_format: torch.memory_format, distributed: bool, at_steps: Iterable[int],
                 every_epochs: int, micro_batch: Callable[[], int] | None = None) -> None:
        self.model, self.loader, self.stage = model, loader, stage
        self.device, self.amp_dtype, self.memory_format = device, amp_dtype, memory_format
        self.batch_size = batch_size
        self.pad_to_batch = pad_to_batch  # a compiled model: keep every batch at the compiled shape
        self.distributed = distributed
        self.at_steps = set(at_steps)
        self.every_epochs = every_epochs
        self.pending = False  # an epoch ended on an evaluation epoch: evaluate after this step
        self.loss_fn = nn.CrossEntropyLoss()
        # The training micro-batch (data.micro_batch): a forward without gradients at that size fits.
        self.micro_batch = micro_batch or (lambda: batch_size)

    def epoch_ended(self, epoch: int) -> None:
        """``epoch`` epochs are done: evaluate at the next boundary when it is an evaluation epoch."""
        if epoch % self.every_epochs == 0:
            self.pending = True

    def due(self, step: int) -> bool:
        """Evaluate after ``step``? A True answer is acted on at once, so it clears the pending epoch."""
        due = self.pending or step in self.at_steps
        self.pending = False
        return due

    def run(self) -> dict[str, Any]:
        """val/loss and val/accuracy over every rank's shard; {} without a validation set."""
        if self.loader is None:
            return {}
        self.model.eval()
        totals = torch.zeros(3, device=self.device)
        full = self.batch_size
        with torch.no_grad():
            for batch in self.loader:
                x, y = self.stage(batch)
                n = y.shape[0]
                if self.pad_to_batch and n < full:
                    # A short last batch would recompile the model (30-60 s) and turn on dynamic
                    # shapes: pad it to the compiled shape and leave the padding out of the sums.
                    x = torch.cat([x, x[:1].expand(full - n, *x.shape[1:])])
                    x = x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x
                pieces = x.split(self.micro_batch())
                with autocast(self.device, self.amp_dtype):
                    out = (self.model(x) if len(pieces) == 1 else torch.cat([self.model(p) for p in pieces]))[:n]
                totals[0] += self.loss_fn(out.float().flatten(0, -2), y.flatten()) * y.numel()
                totals[1] += (out.argmax(-1) == y).sum()
                totals[2] += y.numel()
        if self.distributed:
            dist.all_reduce(totals)
        loss, right, count = totals.tolist()  # evaluation is a boundary: one read
        count = max(count, 1.0)
        return {"val/loss": loss / count, "val/accuracy": right / count}
