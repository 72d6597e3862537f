"""What a boundary reports: the window's statistics, the loop's counters and rates, and the facts
that belong to the next report only (restore warnings, the step resumed from, a resize), and the
console lines (notices) the driver prints once: each writer appends, none replaces another's.

Where the report goes afterwards is ``reporter.Reporter``'s concern.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from runtime.config import JobConfig
from runtime.train.loop_state import TrainState
from runtime.train.stats import Boundary

# Dense bf16 tensor-core peak per GPU (vendor datasheets, no sparsity): the MFU denominator.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def language_model_rates(cfg: JobConfig, samples_per_s: float, device: torch.device,
                         world: int) -> dict[str, float]:
    """tokens/s and, on a GPU in the table, model FLOPs utilisation (PaLM's 6N + 12 L T d per token)."""
    from runtime.train.model_zoo import parameter_count

    t = cfg.model.transformer
    tokens = samples_per_s * t.seq_len
    out = {"train/tokens_per_s": tokens}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        if peak:
            per_token = 6 * parameter_count(cfg.model) + 12 * t.layers * t.seq_len * t.dim
            out["train/mfu"] = tokens * per_token / (peak * world)
    return out


class MetricsAssembler:
    """Builds each report's metrics from host values only (the boundary's exchange read the device)."""

    def __init__(self, cfg: JobConfig, device: torch.device, world: int, total_steps: int, *,
                 learning_rate: Callable[[], float | torch.Tensor], comm_seconds: Callable[[], float],
                 skipped_samples: Callable[[], int]) -> None:
        self.cfg, self.device, self.world, self.total_steps = cfg, device, world, total_steps
        self.log_every = cfg.train.log_every_steps
        self.learning_rate = learning_rate
        self.comm_seconds = comm_seconds
        self.skipped_samples = skipped_samples
        self._once: dict[str, Any] = {}  # facts for the next report (note), then cleared
        self.notices: list[str] = []  # console lines for the next report, in the order they were noted

    def note(self, facts: Mapping[str, Any]) -> None:
        """Facts for the next report only (the restore's, a resize, the micro-batch, the timeline): the
        one way the loop's one-off values enter a report; a key noted again replaces the earlier value."""
        self._once.update(facts)

    def noted(self, key: str) -> Any:
        """A fact noted for the next report (None: none under ``key``)."""
        return self._once.get(key)

    def notify(self, *lines: str) -> None:
        """Lines for the driver to print once (rank 0's report carries them): a drain, a micro-batch halved."""
        self.notices.extend(lines)

    def take_notices(self) -> tuple[str, ...]:
        """The lines noted since the last report; the next report starts with none."""
        lines, self.notices = tuple(self.notices), []
        return lines

    def should_log(self, step: int) -> bool:
        """A report step (``train.log_every_steps``)."""
        return step % self.log_every == 0

    def assemble(self, b: Boundary, state: TrainState, extra: dict[str, Any] | None) -> dict[str, Any]:
        """The metrics for the boundary ``b`` at ``state``; ``extra`` (evaluation, committed step) goes on
        top. Control (final, stop reason, notices) travels beside them (runtime.run.Report)."""
        metrics: dict[str, Any] = dict(b.metrics)
        metrics.update({
            "step": state.global_step,
            "epoch": state.epoch,
            "samples_seen": state.samples_seen,
            "total_steps": self.total_steps,
            "train/learning_rate": self.learning_rate(),
            "train/nonfinite_steps": b.nonfinite_total,
            "world_size": self.world,
            "comm_seconds": self.comm_seconds(),
        })
        if self.cfg.model.name == "gpt" and "train/throughput" in metrics:
            metrics.update(language_model_rates(self.cfg, metrics["train/throughput"], self.device, self.world))
        if self.device.type == "cuda":  # the allocator's own count: no device sync
            metrics["gpu/peak_memory_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
        metrics["data/skipped_samples"] = self.skipped_samples()
        if extra:
            metrics.update(extra)
        metrics.update(self._once)
        self._once = {}
        return metrics
