"""Batches on the device, staged ahead of the step that uses them.

``host_batches`` walks a rank's loader epoch by epoch and tags every batch with its
position, so the trainer's resume state counts the batches it *trained on*, not those
already fetched ahead. ``DevicePrefetcher`` stages the next batches in a producer thread on
its own CUDA stream while batch N computes (pinned host memory, ``non_blocking``, an event
per batch, ``record_stream``); uint8 images cross the bus as uint8 and are normalised on the
device. On CPU the same code runs, threads included, with the copies as no-ops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from runtime.data import DataBundle, EpochLoader
from runtime.data.base import Stage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Position:
    """Where a batch sits in this rank's pass over the data."""

    epoch: int
    index: int  # 0-based batch index within the epoch
    last: bool  # the epoch's last full batch


def host_batches(loader: EpochLoader, batches_per_epoch: int, epoch: int, index: int) -> Iterator[tuple[Any, Position]]:
    """Endless (batch, position) pairs from (epoch, index) on; an epoch ends after its full batches."""
    while True:
        loader.set_position(epoch, index)
        for batch in loader:
            if index >= batches_per_epoch:
                break
            yield batch, Position(epoch, index, index + 1 == batches_per_epoch)
            index += 1
        epoch, index = epoch + 1, 0


def make_stage(device: torch.device, bundle: DataBundle, memory_format: torch.memory_format,
               device_stage: Stage | None = None) -> Stage:
    """Host batch -> normalised (x, y) on the device. uint8 images are normalised there with the
    bundle's mean/std (given in 0..1 units, applied in 0..255 units: one subtract, one divide);
    without them uint8 images are only scaled to 0..1."""
    channels = bundle.in_channels
    mean = torch.tensor([255.0 * m for m in (bundle.mean or (0.0,) * channels)], device=device).view(1, -1, 1, 1)
    std = torch.tensor([255.0 * s for s in (bundle.std or (1.0,) * channels)], device=device).view(1, -1, 1, 1)

    def stage(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if device_stage is not None:
            x, y = device_stage(batch)
        else:
            x, y = batch
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
        if x.dtype == torch.uint8:
            x = (x.float() - mean) / std
        return (x.contiguous(memory_format=memory_format) if x.dim() == 4 else x), y

    return stage


@dataclass
class _Ready:
    """A staged batch; on CUDA ``event`` marks the end of its work on the producer's stream."""

    x: torch.Tensor
    y: torch.Tensor
    pos: Position
    event: torch.cuda.Event | None


@dataclass
class _Failed:
    """The producer's exception (or the source's StopIteration), re-raised on the training thread."""

    error: BaseException


class DevicePrefetcher:
    """Iterator of (x, y, position) on the device, staged up to ``DEPTH`` batches ahead by a producer thread.

    The thread owns its CUDA stream and hands each batch over with an event the training
    thread's stream waits on, so the training thread never blocks on the device. Why a
    thread and not only a side stream: GPU decode (nvJPEG through torchvision) synchronises
    its host thread twice per batch and Huffman-decodes progressive JPEGs on the host; that
    now overlaps the step instead of delaying its launches.

    The host batches themselves are taken from the source on the training thread and handed
    to the producer: starting a loader's iterator forks its worker processes, and a fork from
    a thread other than the one CUDA was set up on has aborted those workers
    (``cudaErrorInitializationError``, seen on an H100). Taking a batch from a DataLoader is a
    queue read; the expensive parts run in its workers and the producer.

    ``threaded=False`` (data made on the device: synthetic images, token windows) stages
    inline on the training stream: a gather has nothing to overlap, and a thread would only
    hold extra batches in memory. On CPU the same code runs, threads included, with the
    copies as no-ops. Call ``close`` when done (the trainer does): it stops and joins the thread.
    """

    DEPTH = 2  # staged batches waiting; with one in the producer's hands, at most 3 batches ahead
    JOIN_S = 60.0  # close() waits this long for a producer stuck in a stage

    def __init__(self, source: Iterator[tuple[Any, Position]], stage: Stage, device: torch.device,
                 threaded: bool = True) -> None:
        self.source, self.stage = source, stage
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":  # the producer thread must select the same device: it is per thread
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            if threaded:
                self.stream = torch.cuda.Stream(device)
        self.device = device
        self.wait_s = 0.0  # host seconds the training thread waited for the loader or a staged batch
        self._todo: queue.Queue[tuple[Any, Position] | _Failed] = queue.Queue()  # host batches for the producer
        self._queue: queue.Queue[_Ready | _Failed] = queue.Queue(maxsize=self.DEPTH)
        self._stop = threading.Event()
        self._fed_all = False  # the source ended or failed: nothing more to hand over
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._produce, name="device-prefetch", daemon=True)
            self._thread.start()
            for _ in range(self.DEPTH + 1):
                self._feed()

    # ------------------------------------------------------------ producer thread

    def _produce(self) -> None:
        try:
            if self.stream is None:
                self._loop()
            else:
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(self.stream):
                    self._loop()
        except BaseException as e:  # noqa: BLE001  (every failure reaches the training thread)
            self._put(_Failed(e))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._todo.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, _Failed):  # the source's error (or its end), in its place in the order
                self._put(item)
                return
            batch, pos = item
            x, y = self.stage(batch)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
            if not self._put(_Ready(x, y, pos, event)):
                return

    def _put(self, item: _Ready | _Failed) -> bool:
        """Block while the queue is full, but give up once close() asks: False then."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    # ------------------------------------------------------------ training thread

    def _feed(self) -> None:
        """Take the next host batch from the source (here, on the training thread) for the producer."""
        if self._fed_all:
            return
        t0 = time.perf_counter()
        try:
            item: tuple[Any, Position] | _Failed = next(self.source)
        except BaseException as e:  # noqa: BLE001  (StopIteration included: raised after the batches before it)
            item, self._fed_all = _Failed(e), True
        self.wait_s += time.perf_counter() - t0
        self._todo.put(item)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, Position]:
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise RuntimeError("data: the prefetcher is closed")
        if self._thread is None:
            return self._inline()
        self._feed()  # keep the producer DEPTH + 1 batches ahead
        t0 = time.perf_counter()
        item = self._queue.get()  # the producer always puts: a batch, or a failure (it never dies silently)
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, _Failed):
            self._error = item.error
            self.close()
            raise item.error
        if item.event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(item.event)  # device-side wait: the host goes on launching the step
            item.x.record_stream(main)  # made on the producer's stream, used (and freed) on this one
            item.y.record_stream(main)
        return item.x, item.y, item.pos

    def _inline(self) -> tuple[torch.Tensor, torch.Tensor, Position]:
        t0 = time.perf_counter()
        batch, pos = next(self.source)
        self.wait_s += time.perf_counter() - t0
        x, y = self.stage(batch)
        return x, y, pos

    def close(self) -> None:
        """Stop the producer and join it; staged batches are dropped. Safe to call twice."""
        self._stop.set()
        if self._thread is None:
            return
        deadline = time.monotonic() + self.JOIN_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    self._queue.get_nowait()  # unblock a put (the producer also polls the stop flag)
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
        while not self._queue.empty():
            self._queue.get_nowait()  # a batch put just before the stop: free its memory now
        if self._thread.is_alive():
            log.warning("data: the prefetch thread did not stop within %.0f s (stuck in a stage?)", self.JOIN_S)
