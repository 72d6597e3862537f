"""A batch made by several loader workers: each sends its part (the samples of the pieces it reads,
plan.assign_pieces), and the main process puts the parts back in the batch's order.

What a merged batch holds is byte for byte what one worker collating the whole batch would have
made (``collate_crops`` / ``collate_encoded``): the same images in the same places, the same
layout (NCHW over an NHWC buffer), the same skipped samples in the same order. The merge is the
one copy of the images the DataLoader's pinning thread makes for an unsplit batch, done straight
into pinned memory (the DataLoader then pins nothing) by a thread of its own (``merged_batches``),
as the pinning thread does it: the training thread only takes ready batches from a queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runtime.data.images import HostBatch

MERGED_AHEAD = 2  # merged batches waiting for the training thread, besides the one being merged
POLL_S = 0.1  # how often a merging thread blocked on a full queue looks whether its reader has gone


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
    size = xs[0].shape[-1]
    nhwc = torch.empty((len(order), size, size, 3), dtype=torch.uint8, pin_memory=pin)
    out, parts = nhwc.numpy(), [x.permute(0, 2, 3, 1).numpy() for x in xs]
    for i, (_, k, row) in enumerate(order):  # a copy per image through numpy: torch's indexed writes cost 5-7x
        out[i] = parts[k][row]
    return nhwc.permute(0, 3, 1, 2)


def _merge_encoded(xs: list[Any], order: list[tuple[int, int, int]], pin: bool) -> Any:
    """EncodedImages parts -> the one collate_encoded makes of the whole batch."""
    from runtime.data.gpu import EncodedImages

    lengths = [xs[k].offsets[row + 1] - xs[k].offsets[row] for _, k, row in order]
    offsets = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
    data = torch.empty(offsets[-1], dtype=torch.uint8)
    view, parts = data.numpy(), [x.data.numpy() for x in xs]
    for i, (_, k, row) in enumerate(order):
        if lengths[i]:
            view[offsets[i]:offsets[i + 1]] = parts[k][xs[k].offsets[row]:xs[k].offsets[row + 1]]
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


@dataclass
class _Failed:
    """What ended the merging thread: an error (a loader worker's, re-raised by the reader) or None at the end."""

    error: BaseException | None


def merged_batches(parts: Iterator[Part], workers: int, pin: bool) -> Iterator[HostBatch]:
    """Whole batches from ``parts`` (each batch's ``workers`` parts consecutive, DataLoader's
    round robin), merged by a thread started here, up to MERGED_AHEAD batches ahead."""
    ready: queue.Queue[HostBatch | _Failed] = queue.Queue(maxsize=MERGED_AHEAD)
    gone = threading.Event()  # the reader stopped early: stop merging, drop the DataLoader
    # Pinning from a thread whose current device is another than the rank's would open a CUDA
    # context on that device: select the caller's, as DataLoader's pinning thread does.
    device = torch.accelerator.current_device_index() if pin else None

    def put(item: HostBatch | _Failed) -> bool:
        while not gone.is_set():
            try:
                ready.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def merge() -> None:
        try:
            if device is not None:
                torch.accelerator.set_device_index(device)
            for group in zip(*[parts] * workers, strict=False):
                if not put(merge_parts(list(group), pin)):
                    return
            put(_Failed(None))
        except BaseException as e:  # handed to the reader, which raises it
            put(_Failed(e))

    threading.Thread(target=merge, name="shard-batch-merge", daemon=True).start()
    return _taken(ready, gone)


def _taken(ready: queue.Queue[HostBatch | _Failed], gone: threading.Event) -> Iterator[HostBatch]:
    try:
        while not isinstance(item := ready.get(), _Failed):
            yield item
        if item.error is not None:
            raise item.error
    finally:
        gone.set()
