"""An epoch's sample order, the same at every world size and number of loader workers.

The order is one seeded permutation of the sample indices per epoch, a function of
(seed, epoch) alone. Each loader step of W ranks x b samples consumes the next W x b
positions of it, rank r taking positions r, r + W, r + 2W, ... (DistributedSampler's deal):
after k batches per rank exactly the first k x b x W positions are used, whatever W was.
So a checkpoint's data position is one number, the *global* samples consumed in the epoch
(``TrainState``: per-rank batches x b x the world that trained them), and a group of any
size continues at that position with nothing repeated and nothing skipped when it is a
whole number of its own loader steps (``resume_index``).

An epoch holds a whole number of ``unit`` samples, the global batch of one optimizer step
(``epoch_unit``); the remainder of the permutation (fewer than ``unit`` samples, different
every epoch) is left out, as drop-last does. With ``distributed.elastic.keep=global_batch``
the unit is the same at every size, so the epoch's samples are too, no optimizer step spans
two epochs, and every checkpoint sits at a multiple of the unit: a whole number of loader
steps at every allowed size (JobConfig refuses ranges where it is not).
"""

from __future__ import annotations

import torch

from runtime.config import JobConfig
from runtime.errors import ConfigError


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of sample indices 0..n-1 (DistributedSampler's: randperm seeded seed + epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def epoch_length(n: int, unit: int) -> int:
    """Samples an epoch uses: the largest whole number of ``unit`` samples in ``n``."""
    return n // unit * unit


def rank_indices(order: torch.Tensor, used: int, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of an epoch that uses the first ``used`` positions of ``order``: every
    ``world``-th position from ``rank`` on, so loader step k of all ranks is positions
    [k x b x world, (k + 1) x b x world)."""
    return order[:used][rank::world]


def check_epoch(n: int, world: int, batch_size: int, unit: int, what: str) -> None:
    """Refuse, in one line, a data set whose epoch would hold no loader step or no global batch."""
    if n // world < batch_size:
        raise ConfigError(f"data: {n} {what} give each of {world} workers fewer than "
                          f"data.batch_size={batch_size}; add data or lower the batch size")
    if n < unit:
        raise ConfigError(f"data: {n} {what} are fewer than one global batch of {unit} (workers x "
                          "data.batch_size x train.grad_accum_steps), the whole steps an epoch is made of; "
                          "add data, or lower the batch size or the accumulation")


def epoch_unit(cfg: JobConfig) -> int:
    """Samples per optimizer step: workers x data.batch_size x train.grad_accum_steps.

    Given the job as sized for its current group (``for_world``), this is the global batch,
    which ``keep=global_batch`` holds constant across resizes; with ``keep=per_worker_batch``
    it changes with the size, as the global batch does.
    """
    return cfg.global_batch_size()


def resume_index(consumed: int, batch_size: int, world: int) -> tuple[int, int]:
    """(per-rank batch to resume at, samples that will be used twice) for ``consumed`` global
    samples of the epoch on ``world`` ranks: the largest whole loader step not past
    ``consumed``, so nothing is skipped; repeated is 0 whenever ``consumed`` is a whole number
    of ``world`` x ``batch_size`` (always, with keep=global_batch), else under one loader step."""
    step = batch_size * world
    index = consumed // step
    return index, consumed - index * step
