"""When a rank saves (every ``checkpoint.interval_steps``, at ``checkpoint.at_steps``, on
preemption, at the end), what it saves, and how the ranks agree on the end-of-run save.

Every rank calls ``save`` (the payload gathers every rank's RNG). DDP: rank 0 writes the full
state. FSDP: every rank writes its own shards, rank 0 commits once all are done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from runtime.checkpoint import CheckpointError, CheckpointManager, CheckpointRef
from runtime.config import JobConfig
from runtime.run import RunInfo, StopKind, StopReason

if TYPE_CHECKING:
    from runtime.observe.metrics import WorkerMetrics


class Checkpointer:
    """The loop's checkpoint cadence and saves over a ``CheckpointManager`` (None: checkpoints off)."""

    def __init__(self, manager: CheckpointManager | None, cfg: JobConfig, run: RunInfo, *, rank: int, world: int,
                 distributed: bool, sharded: bool, device: torch.device, classes: list[str] | None,
                 gauges: WorkerMetrics | None, payload: Callable[[], dict[str, Any]],
                 on_failure: Callable[[StopReason], None]) -> None:
        self.manager = manager
        self.interval = cfg.checkpoint.interval_steps if manager is not None else 0
        self.at_steps = set(cfg.checkpoint.at_steps) if manager is not None else set()
        self.rank, self.distributed, self.sharded, self.device = rank, distributed, sharded, device
        self.meta: dict[str, Any] = {"config": cfg.model_dump(mode="json"), "config_hash": cfg.config_hash(),
                                     "world_size": world, "job_id": run.job_id}
        if classes:  # label i is classes[i]: what a user of the model needs
            self.meta["classes"] = list(classes)
        self.storage_uri = run.checkpoint_uri
        self.gauges = gauges
        self.payload = payload  # a collective when distributed: every rank builds it
        self.on_failure = on_failure  # with checkpoint.on_failure=stop: ask the loop to stop
        self.failed = False  # a save failed with on_failure=stop (rank 0 knows; the end agrees on it)
        self.restored_step: int | None = None  # the commit this attempt resumed from (set by the trainer)

    def commit_due(self, step: int) -> bool:
        """A commit at ``step`` before its report, so that report carries it (``checkpoint.at_steps``)."""
        return step in self.at_steps

    def interval_due(self, step: int) -> bool:
        """An asynchronous save after ``step``'s boundary (``checkpoint.interval_steps``), unless it commits anyway."""
        return not self.commit_due(step) and bool(self.interval) and step % self.interval == 0

    def save(self, step: int, blocking: bool = False) -> None:
        """Every rank, together: save the state at ``step``; ``blocking`` waits for the commit."""
        if self.manager is None:
            return
        payload = self.payload()
        if self.rank != 0 and not self.sharded:
            return
        try:
            if self.sharded:
                self.manager.save_sharded(payload, step, self.meta)
                if blocking:
                    self.manager.wait()
            else:
                self.manager.save(payload, step, self.meta, blocking=blocking)
        except CheckpointError as e:  # raised only with checkpoint.on_failure=stop
            self._failed(e)
        if self.gauges and self.rank == 0:
            self.gauges.update_storage(self.storage_uri)

    def finish(self, step: int) -> None:
        """Every rank at the end of the run: commit ``step`` unless rank 0's newest commit is that
        step already or a save failed; one broadcast, so all ranks take the same branch."""
        if self.manager is None:
            return
        last = self._flush() if self.rank == 0 else None
        committed = torch.tensor([float(last.step) if last else -1.0, float(self.failed)], device=self.device)
        if self.distributed:
            dist.broadcast(committed, src=0)  # all ranks must agree whether to save again
        if int(committed[0].item()) != step and not committed[1].item():
            self.save(step, blocking=True)

    def kept_step(self) -> int | None:
        """Rank 0, after ``finish``: the newest step committed in storage as far as this run knows (this
        attempt's newest commit, else the one it resumed from; None: none). The driver compares it with
        the final step: a final save lost to a full or failing storage must not read as a clean finish."""
        last = self.manager.last_committed() if self.manager is not None else None
        return last.step if last is not None else self.restored_step

    def settle(self) -> None:
        """Before the optimizer changes parameters in place: a sharded save's copy to CPU is done."""
        if self.manager is not None:
            self.manager.settle()

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer."""
        if self.manager is not None:
            try:
                self.manager.wait()
            finally:
                self.manager.close()

    def _flush(self) -> CheckpointRef | None:
        """Rank 0: wait for the save in flight; the newest committed checkpoint of this run."""
        assert self.manager is not None
        try:
            return self.manager.wait()
        except CheckpointError as e:
            self._failed(e)
            return self.manager.last_committed()

    def _failed(self, e: CheckpointError) -> None:
        """Rank 0: a failed save with on_failure=stop ends training cleanly (no Ray retry loop)."""
        self.failed = True
        self.on_failure(StopReason(StopKind.CHECKPOINT_FAILED, f"stopped: {e} (checkpoint.on_failure=stop)"))
