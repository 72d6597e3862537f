"""The loop's resumable state: each component's ``state_dict``, merged into a checkpoint's ``trainer`` part.

As in torchtitan, whatever a resume must continue owns its state: ``TrainState`` (where the
loop is in the data and the run), ``StepStats`` (the non-finite counters) and ``MicroBatcher``
(the micro-batch an out-of-memory halved, or the probe chose). Each is a ``Stateful``; the
trainer lists them and nothing else copies their fields. Their keys are disjoint and stored in
one flat mapping of integers, the layout checkpoints have always had, so a checkpoint written
before this split loads unchanged and a sharded (DCP) one keeps the keys its template names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from runtime.data.order import resume_index
from runtime.train.device_input import Position


def reshard_position(batch_in_epoch: int, batch_size: int, old_world: int, world: int) -> tuple[int, int]:
    """A rank's resume index after the world size changed, and how many samples will be seen twice.

    The checkpoint's position is the global samples consumed in the epoch, k x b x W (every
    sampler deals one world-independent order, runtime.data.order); W' ranks continue at the
    largest whole loader step not past it. Exact (0 repeated) when the position is a whole
    number of W' x b samples, which keep=global_batch guarantees: an epoch and every step are
    whole global batches, so a checkpoint sits on one.
    """
    return resume_index(batch_in_epoch * batch_size * old_world, batch_size, world)


class Stateful(Protocol):
    """A part of the loop that a resume continues (torch.distributed.checkpoint's protocol)."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: Mapping[str, int]) -> None: ...


@dataclass
class TrainState:
    """Where the loop is: enough to continue at the next batch."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    # The data position, global samples consumed in `epoch` = batch_in_epoch x data.batch_size x world:
    batch_in_epoch: int = 0  # loader batches this rank trained on in `epoch`
    world: int = 0  # ranks that trained to here (batch_in_epoch is per rank); 0 = not recorded

    def state_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key in self.__dict__:
            if key in state:
                setattr(self, key, int(state[key]))

    def consume(self, pos: Position, epoch_ended: Callable[[int], None]) -> None:
        """Count a loader batch as trained on; ``epoch_ended(new_epoch)`` on each epoch's end."""
        if pos.epoch != self.epoch:  # the previous epoch ended short of its full batches
            self._end_epoch(epoch_ended)
            self.epoch = pos.epoch
        self.batch_in_epoch = pos.index + 1
        if pos.last:
            self._end_epoch(epoch_ended)

    def _end_epoch(self, epoch_ended: Callable[[int], None]) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0
        epoch_ended(self.epoch)

    def reshard(self, world: int, batch_size: int) -> tuple[int, int] | None:
        """Continue the epoch at the same sample on ``world`` ranks (an elastic resize); returns
        (the world that wrote the checkpoint, samples repeated), or None when it is unchanged."""
        old = self.world or world  # 0: a checkpoint from before sizes were recorded
        self.world = world
        if old == world:
            return None
        self.batch_in_epoch, repeated = reshard_position(self.batch_in_epoch, batch_size, old, world)
        return old, repeated


def merged_state(parts: Iterable[Stateful]) -> dict[str, int]:
    """The ``trainer`` part of a checkpoint: every component's state in one mapping."""
    merged: dict[str, int] = {}
    for part in parts:
        state = part.state_dict()
        overlap = merged.keys() & state.keys()
        if overlap:
            raise ValueError(f"{type(part).__name__} state reuses the key(s) {sorted(overlap)} of another part")
        merged.update(state)
    return merged


def load_merged(parts: Iterable[Stateful], saved: Mapping[str, int]) -> None:
    """Give each component its keys of a checkpoint's ``trainer`` part (absent keys: its defaults)."""
    for part in parts:
        part.load_state_dict(saved)
