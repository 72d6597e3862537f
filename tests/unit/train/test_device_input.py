"""Batches reach the step with their epoch position; synthetic data is sharded like real data."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from runtime.config import DataConfig
from runtime.data import DataBundle, Stage
from runtime.data.synthetic import SyntheticLoader, synthetic_loaders
from runtime.train.device_input import (
    DevicePrefetcher,
    Position,
    host_batches,
    make_stage,
)

CPU = torch.device("cpu")


class ListLoader:
    """An EpochLoader over fixed batches: batch i of epoch e is (e, i)."""

    skipped = 0

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.start = n, 0, 0

    def set_position(self, epoch: int, batch_index: int) -> None:
        self.epoch, self.start = epoch, batch_index

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.start, self.n):
            yield torch.tensor([self.epoch]), torch.tensor([i])


def test_positions_mark_each_epochs_last_batch_and_resume_mid_epoch() -> None:
    it = host_batches(ListLoader(3), 3, epoch=1, index=2)
    got = [(b[0].item(), b[1].item(), p.epoch, p.index, p.last) for b, p in (next(it) for _ in range(4))]
    assert got == [(1, 2, 1, 2, True), (2, 0, 2, 0, False), (2, 1, 2, 1, False), (2, 2, 2, 2, True)]


def test_an_epoch_stops_at_its_full_batches_even_if_the_loader_has_more() -> None:
    it = host_batches(ListLoader(5), 2, epoch=0, index=0)
    assert [(p.epoch, p.index, p.last) for _, p in (next(it) for _ in range(3))] == [
        (0, 0, False), (0, 1, True), (1, 0, False)]


def _numbered(n_per_epoch: int, epoch: int = 0, index: int = 0, fetched: list[int] | None = None,
              fail_at: int | None = None, delay_s: float = 0.0) -> Iterator[tuple[Any, Position]]:
    """(x, y) host batches from host_batches, y = the batch index; optionally slow, or failing at a count."""
    for count, (b, p) in enumerate(host_batches(ListLoader(n_per_epoch), n_per_epoch, epoch, index)):
        if fail_at is not None and count == fail_at:
            raise ValueError(f"bad batch {count}")
        if fetched is not None:
            fetched.append(count)
        time.sleep(delay_s)
        yield (b[1].float().view(1, 1, 1, 1), b[1]), p


def _prefetcher(source: Iterator[tuple[Any, Position]], stage: Stage | None = None) -> DevicePrefetcher:
    return DevicePrefetcher(source, stage or make_stage(CPU, DataBundle(None, None, 10, 1, 1),
                                                       torch.contiguous_format), CPU)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "device-prefetch"]


def test_prefetcher_yields_every_batch_once_in_order_a_bounded_number_ahead() -> None:
    fetched: list[int] = []
    pre = _prefetcher(_numbered(4, fetched=fetched))
    try:
        got = [(int(y), p.epoch, p.index) for _, y, p in (next(pre) for _ in range(6))]
        assert got == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (0, 1, 0), (1, 1, 1)]
        most = 6 + DevicePrefetcher.DEPTH + 1  # DEPTH staged in the queue plus one in the producer's hands
        deadline = time.monotonic() + 10
        while len(fetched) < most and time.monotonic() < deadline:
            time.sleep(0.01)  # let the producer run as far ahead as it may
        time.sleep(0.1)
        assert len(fetched) == most  # ahead, and never further
    finally:
        pre.close()


def test_a_slow_consumer_gets_the_same_batches_in_the_same_order() -> None:
    pre = _prefetcher(_numbered(5))
    try:
        got = []
        for _ in range(8):
            x, y, p = next(pre)
            time.sleep(0.02)  # the step is slower than the producer: the queue stays full
            got.append((float(x.flatten()[0]), int(y), p.epoch, p.index, p.last))
    finally:
        pre.close()
    assert got == [(float(i % 5), i % 5, i // 5, i % 5, i % 5 == 4) for i in range(8)]


def test_resuming_from_the_last_consumed_position_continues_exactly_where_training_stopped() -> None:
    pre = _prefetcher(_numbered(3, epoch=1, index=2))
    consumed = [next(pre)[2] for _ in range(4)]  # the producer has fetched further: that must not count
    pre.close()
    last = consumed[-1]
    epoch, index = (last.epoch + 1, 0) if last.last else (last.epoch, last.index + 1)  # as Trainer._consume
    again = _prefetcher(_numbered(3, epoch=epoch, index=index))
    try:
        resumed = [next(again)[2] for _ in range(3)]
    finally:
        again.close()
    straight = _prefetcher(_numbered(3, epoch=1, index=2))
    try:
        uninterrupted = [next(straight)[2] for _ in range(7)]
    finally:
        straight.close()
    assert consumed + resumed == uninterrupted


def test_a_loader_error_is_raised_on_the_training_thread_after_the_good_batches() -> None:
    pre = _prefetcher(_numbered(10, fail_at=3))
    assert [int(next(pre)[1]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad batch 3") as caught:
        next(pre)
    assert any(f.name == "_numbered" for f in traceback.extract_tb(caught.value.__traceback__))  # producer's frames
    with pytest.raises(ValueError, match="bad batch 3"):
        next(pre)  # and on every later call, not a hang
    assert not pre._thread.is_alive()


def test_a_stage_error_is_raised_on_the_training_thread() -> None:
    def stage(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("decode failed")

    pre = _prefetcher(_numbered(4), stage)
    with pytest.raises(RuntimeError, match="decode failed"):
        next(pre)
    pre.close()


def test_a_finite_source_ends_the_iteration() -> None:
    source = iter([((torch.ones(1, 1, 1, 1), torch.tensor([i])), Position(0, i, i == 1)) for i in range(2)])
    pre = _prefetcher(source)
    assert [int(y) for _, y, _ in pre] == [0, 1]


def test_close_stops_a_producer_blocked_on_a_full_queue_or_a_slow_loader() -> None:
    before = len(_prefetch_threads())
    blocked = _prefetcher(_numbered(4))
    slow = _prefetcher(_numbered(4, delay_s=0.3))
    next(blocked)
    time.sleep(0.1)  # the queue is full: its producer waits to put
    blocked.close()
    slow.close()  # its producer is inside the loader's next(): joined once that returns
    blocked.close()  # twice is harmless
    assert not blocked._thread.is_alive() and not slow._thread.is_alive()
    assert len(_prefetch_threads()) == before
    with pytest.raises(RuntimeError, match="prefetcher is closed"):
        next(blocked)


def test_time_waiting_for_a_slow_loader_is_counted() -> None:
    pre = _prefetcher(_numbered(4, delay_s=0.05))
    try:
        for _ in range(3):
            next(pre)
    finally:
        pre.close()
    assert pre.wait_s >= 0.05


def test_uint8_images_are_normalised_on_the_device_with_the_bundles_mean_and_std() -> None:
    bundle = DataBundle(None, None, 10, 3, 2, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    stage = make_stage(CPU, bundle, torch.channels_last)
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out, _ = stage((x, torch.tensor([1])))
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([1.0, 3.0, 1.0]))


def test_channels_last_host_batches_reach_the_model_in_the_asked_memory_format() -> None:
    bundle = DataBundle(None, None, 10, 3, 4, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    nhwc = torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8)
    x = nhwc.permute(0, 3, 1, 2)  # what collate_crops hands over: NCHW shape, channels_last memory
    want = (x.float() / 255 - 0.5) / 0.25
    last, _ = make_stage(CPU, bundle, torch.channels_last)((x, torch.tensor([0, 1])))
    normalised = (x.float() - 127.5) / 63.75  # the stage's own arithmetic keeps the input's layout...
    assert normalised.is_contiguous(memory_format=torch.channels_last)
    assert normalised.contiguous(memory_format=torch.channels_last) is normalised  # ...so this is a no-op
    assert last.is_contiguous(memory_format=torch.channels_last) and torch.allclose(last, want, atol=1e-5)
    plain, _ = make_stage(CPU, bundle, torch.contiguous_format)((x, torch.tensor([0, 1])))
    assert plain.is_contiguous() and torch.allclose(plain, want, atol=1e-5)


def test_float_batches_pass_through_unchanged() -> None:
    stage = make_stage(CPU, DataBundle(None, None, 10, 3, 2), torch.contiguous_format)
    x = torch.randn(2, 3, 2, 2)
    assert torch.equal(stage((x, torch.tensor([0, 1])))[0], x)


def test_synthetic_shards_are_disjoint_cover_the_data_and_change_per_epoch() -> None:
    loaders = [SyntheticLoader(20, 2, r, 5, seed=3, shuffle=True, pin=False) for r in range(2)]
    seen = [torch.cat([ids for ids, _ in ld]) for ld in loaders]
    assert len(seen[0]) == len(seen[1]) == 10
    assert sorted(torch.cat(seen).tolist()) == list(range(20))
    loaders[0].set_position(1, 1)
    later = torch.cat([ids for ids, _ in loaders[0]])
    assert len(later) == 5 and not torch.equal(later, seen[0][5:])  # epoch 1 has its own order


def test_synthetic_evaluation_gives_every_rank_the_same_number_of_batches() -> None:
    counts = [len(list(SyntheticLoader(7, 2, r, 2, seed=0, shuffle=False, pin=False))) for r in range(2)]
    assert counts == [2, 2]


def test_synthetic_images_are_made_once_and_looked_up_by_sample_id() -> None:
    cfg = DataConfig(source="synthetic", num_samples=64, val_samples=16, batch_size=8, image_size=8, num_classes=4)
    loaders, train_stage, val_stage = synthetic_loaders(cfg, 1, 0, CPU)
    ids = torch.tensor([3, 3, 5])
    x, y = train_stage((ids, ids))
    assert x.shape == (3, 3, 8, 8) and torch.equal(x[0], x[1]) and not torch.equal(x[0], x[2])
    assert y.dtype == torch.int64 and int(y.max()) < 4
    assert loaders.batches_per_epoch == 8 and loaders.val is not None
    vx, _ = val_stage((ids, ids))
    assert not torch.equal(vx[0], x[0])  # held-out samples are not training samples


def test_uint8_images_without_mean_and_std_are_scaled_to_unit_range() -> None:
    stage = make_stage(CPU, DataBundle(None, None, 10, 1, 2), torch.contiguous_format)
    out, _ = stage((torch.full((1, 1, 2, 2), 255, dtype=torch.uint8), torch.tensor([0])))
    assert torch.equal(out, torch.ones(1, 1, 2, 2))


def test_synthetic_class_templates_are_shared_by_train_and_validation_across_template_chunks() -> None:
    from runtime.data.synthetic import SyntheticPool

    pools = [SyntheticPool(6000, 130, 4, seed=5, split=s, device=CPU, batch_size=8) for s in (0, 1)]
    assert pools[0].size == 6000 and 130 > SyntheticPool.TEMPLATE_CHUNK  # classes span several chunks
    means = [torch.stack([p.images[p.labels == c].mean(0) for c in range(130)]) for p in pools]
    corr = torch.corrcoef(torch.stack([means[0].flatten(), means[1].flatten()]))[0, 1]
    assert corr > 0.8  # same templates under independent noise
    again = SyntheticPool(6000, 130, 4, seed=5, split=0, device=CPU, batch_size=8)
    assert torch.equal(again.images, pools[0].images) and torch.equal(again.labels, pools[0].labels)
