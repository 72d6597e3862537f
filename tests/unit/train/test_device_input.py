"""Batches reach the step with their epoch position; synthetic data is sharded like real data."""

from __future__ import annotations

import torch

from runtime.config import DataConfig
from runtime.data import DataBundle
from runtime.train.device_input import DevicePrefetcher, SyntheticLoader, host_batches, make_stage, synthetic_loaders

CPU = torch.device("cpu")


class ListLoader:
    """An EpochLoader over fixed batches: batch i of epoch e is (e, i)."""

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


def test_prefetcher_yields_every_batch_once_in_order_one_fetched_ahead() -> None:
    bundle = DataBundle(None, None, 10, 1, 1)
    stage = make_stage(CPU, bundle, torch.contiguous_format)
    fetched: list[int] = []

    def source():  # type: ignore[no-untyped-def]
        for i, (b, p) in enumerate(host_batches(ListLoader(4), 4, 0, 0)):
            fetched.append(i)
            yield (b[1].float().view(1, 1, 1, 1), b[1]), p

    pre = DevicePrefetcher(source(), stage, CPU)
    first = [int(next(pre)[1]) for _ in range(3)]
    assert first == [0, 1, 2] and fetched == [0, 1, 2, 3]  # the next batch is already in flight


def test_uint8_images_are_normalised_on_the_device_with_the_bundles_mean_and_std() -> None:
    bundle = DataBundle(None, None, 10, 3, 2, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    stage = make_stage(CPU, bundle, torch.channels_last)
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out, _ = stage((x, torch.tensor([1])))
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([1.0, 3.0, 1.0]))


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
    from runtime.train.device_input import SyntheticPool

    pools = [SyntheticPool(6000, 130, 4, seed=5, split=s, device=CPU, batch_size=8) for s in (0, 1)]
    assert pools[0].size == 6000 and 130 > SyntheticPool.TEMPLATE_CHUNK  # classes span several chunks
    means = [torch.stack([p.images[p.labels == c].mean(0) for c in range(130)]) for p in pools]
    corr = torch.corrcoef(torch.stack([means[0].flatten(), means[1].flatten()]))[0, 1]
    assert corr > 0.8  # same templates under independent noise
    again = SyntheticPool(6000, 130, 4, seed=5, split=0, device=CPU, batch_size=8)
    assert torch.equal(again.images, pools[0].images) and torch.equal(again.labels, pools[0].labels)
