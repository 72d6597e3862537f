"""A batch made by several loader workers: each sends its part (the samples of the pieces it reads,
plan.assign_pieces), and the main process puts the parts back in the batch's order.

What a merged batch holds is byte for byte what one worker collating the whole batch would have
made (``collate_crops`` / ``collate_encoded``): the same images in the same places, the same
layout (NCHW over an NHWC buffer), the same skipped samples in the same order. The merge is the
one copy of the images the DataLoader's pinning thread makes for an unsplit batch, done here
straight into pinned memory (the DataLoader then pins nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runtime.data.images import HostBatch


@dataclass
class Part:
    """One worker's part of the rank's batch ``batch``: its collated good samples (``host``, their
    places in the batch in ``places``) and its skipped samples with their places."""

    batch: int
    places: list[int]
    host: HostBatch
    skipped_at: list[int] = field(default_factory=list)  # places of host.skipped, in that order

    def pin_memory(self) -> Part:
        """DataLoader(pin_memory=True) calls this (a batch from one worker: nothing to merge)."""
        return Part(self.batch, self.places, self.host.pin_memory(), self.skipped_at)


def merge_parts(parts: list[Part], pin: bool) -> HostBatch:
    """The batch the parts (one per loader worker, each in its places' order) are pieces of."""
    if len({p.batch for p in parts}) != 1:
        raise RuntimeError(f"loader workers sent parts of different batches {[p.batch for p in parts]}")
    full = [p for p in parts if p.places or p.host.skipped]
    if len(full) <= 1:  # the whole batch came from one worker
        host = (full or parts)[0].host
        return host.pin_memory() if pin else host
    skipped = sorted((at, k, i) for k, p in enumerate(parts) for i, at in enumerate(p.skipped_at))
    # (place, part, row): the batch's good samples in order; its sample i is part k's row
    order = sorted((at, k, row) for k, p in enumerate(parts) for row, at in enumerate(p.places))
    base = np.cumsum([0] + [len(p.places) for p in parts]).tolist()
    y = torch.cat([p.host.y for p in parts])[torch.tensor([base[k] + row for _, k, row in order],
                                                          dtype=torch.int64)]
    xs = [p.host.x for p in parts]
    x = _merge_crops(xs, order, pin) if isinstance(xs[0], torch.Tensor) else _merge_encoded(xs, order, pin)
    return HostBatch(x, y.pin_memory() if pin else y, [parts[k].host.skipped[i] for _, k, i in skipped])


def _merge_crops(xs: list[torch.Tensor], order: list[tuple[int, int, int]], pin: bool) -> torch.Tensor:
    """NCHW views of NHWC uint8 crops -> one batch laid out as collate_crops lays it out."""
    size = next(x.shape[-1] for x in xs)
    nhwc = torch.empty((len(order), size, size, 3), dtype=torch.uint8, pin_memory=pin)
    for k, x in enumerate(xs):
        rows = [i for i, (_, part, _) in enumerate(order) if part == k]
        if rows:
            nhwc[torch.tensor(rows)] = x.permute(0, 2, 3, 1)
    return nhwc.permute(0, 3, 1, 2)


def _merge_encoded(xs: list[Any], order: list[tuple[int, int, int]], pin: bool) -> Any:
    """EncodedImages parts -> the one collate_encoded makes of the whole batch."""
    from runtime.data.gpu import EncodedImages

    lengths = [len(xs[k].jpeg(row)) for _, k, row in order]
    offsets = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
    data = torch.empty(offsets[-1], dtype=torch.uint8)
    view = data.numpy()
    for i, (_, k, row) in enumerate(order):
        if lengths[i]:
            view[offsets[i]:offsets[i + 1]] = xs[k].jpeg(row).numpy()
    where = [{row: j for j, row in enumerate(x.decoded_at)} for x in xs]
    decoded_at = [i for i, (_, k, row) in enumerate(order) if row in where[k]]
    size = xs[0].size
    decoded = torch.empty((len(decoded_at), size, size, 3), dtype=torch.uint8, pin_memory=pin and bool(decoded_at))
    for j, i in enumerate(decoded_at):
        _, k, row = order[i]
        decoded[j] = xs[k].decoded[where[k][row]].permute(1, 2, 0)
    return EncodedImages(size, data, offsets, [xs[k].boxes[row] for _, k, row in order],
                         [xs[k].flips[row] for _, k, row in order], [xs[k].names[row] for _, k, row in order],
                         decoded.permute(0, 3, 1, 2), decoded_at)

