"""Tar shards in a folder: pack/verify/inspect, the epoch plan (each sample once), exact resume, bad input."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from runtime.config import DataConfig
from runtime.data import file_loaders
from runtime.data.cli import main as data_cli
from runtime.data.shards.tools import pack
from runtime.errors import ConfigError
from tests.support.expected_warnings import LOADER_WORKERS_BEYOND_CORES

pytestmark = LOADER_WORKERS_BEYOND_CORES  # more loader workers than cores is the point here


def one_image_per_class_tree(root: Path, n_train: int, n_val: int = 0, px: int = 12) -> Path:
    """Class i holds one image, so a batch's labels name its samples exactly."""
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            d = root / split / f"c{i:03d}"
            d.mkdir(parents=True)
            Image.new("RGB", (px + i % 5, px), (i * 7 % 256, i * 13 % 256, 90)).save(d / "x.jpg", quality=90)
    if n_val:  # val classes must be train's
        for i in range(n_val, n_train):
            (root / "val" / f"c{i:03d}").mkdir()
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = one_image_per_class_tree(tmp_path_factory.mktemp("src"), 40, 11)
    out = tmp_path_factory.mktemp("packed") / "shards"
    pack(src, out, shard_size=7)
    return out


def epoch_labels(path: Path, world: int, rank: int, epoch: int, start: int = 0, workers: int = 0,
                 **kw: object) -> list[list[int]]:
    cfg = DataConfig(source="shards", path=str(path), image_size=8, batch_size=4, loader_workers=workers,
                     shuffle_buffer=5, **kw)  # type: ignore[arg-type]
    loaders = file_loaders(cfg, world, rank, on_gpu=False)
    loaders.train.set_position(epoch, start)
    return [y.tolist() for _, y in loaders.train]


def test_pack_writes_verified_shards_and_an_index_with_classes_and_counts(shards: Path) -> None:
    index = json.loads((shards / "index.json").read_text())
    assert index["classes"][:2] == ["c000", "c001"] and len(index["classes"]) == 40
    assert [e["samples"] for e in index["splits"]["train"]] == [7] * 5 + [5]
    assert [e["name"] for e in index["splits"]["val"]] == ["val/000000.tar", "val/000001.tar"]
    with tarfile.open(shards / "train/000000.tar") as tf:
        assert tf.getnames()[:4] == ["00000000.cls", "00000000.jpg", "00000001.cls", "00000001.jpg"]
    assert not list(shards.parent.glob(".*partial*"))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_is_seen_once_per_epoch_across_two_ranks(shards: Path, workers: int) -> None:
    for epoch in (0, 1):
        seen = [label for rank in (0, 1) for b in epoch_labels(shards, 2, rank, epoch, workers=workers) for label in b]
        # 40 samples, 2 ranks x batch 4: 5 batches per rank, nothing dropped or repeated
        assert sorted(seen) == list(range(40))
    assert epoch_labels(shards, 2, 0, 0, workers=workers) != epoch_labels(shards, 2, 0, 1, workers=workers)
    assert epoch_labels(shards, 2, 0, 1, workers=workers) == epoch_labels(shards, 2, 0, 1, workers=workers)


def test_remainder_below_a_global_batch_is_left_out_of_the_epoch(shards: Path) -> None:
    seen = [label for rank in range(3) for b in epoch_labels(shards, 3, rank, 0) for label in b]
    assert len(seen) == len(set(seen)) == 36  # 40 // (3 x 4) x 12


@pytest.mark.parametrize(("workers", "start"), [(0, 3), (2, 1), (2, 4), (3, 2)])
def test_resume_mid_epoch_yields_exactly_the_rest_of_the_uninterrupted_epoch(
        shards: Path, workers: int, start: int) -> None:
    cfg = DataConfig(source="shards", path=str(shards), image_size=8, batch_size=3, loader_workers=workers,
                     shuffle_buffer=4)
    loaders = file_loaders(cfg, 2, 1, on_gpu=False)
    loaders.train.set_position(2, 0)
    full = [(x.clone(), y.clone()) for x, y in loaders.train]
    loaders.train.set_position(2, start)
    rest = list(loaders.train)
    assert len(full) == loaders.batches_per_epoch == 6 and len(rest) == 6 - start
    for (x, y), (fx, fy) in zip(rest, full[start:], strict=True):
        assert torch.equal(y, fy) and torch.equal(x, fx)


def test_validation_reads_every_sample_once_in_order_across_ranks(shards: Path) -> None:
    cfg = DataConfig(source="shards", path=str(shards), image_size=8, batch_size=4, loader_workers=2)
    got = []
    for rank in (0, 1):
        val = file_loaders(cfg, 2, rank, on_gpu=False).val
        assert val is not None
        got += [label for _, y in val for label in y.tolist()]
    assert got == list(range(11))


def test_truncated_shard_drops_its_remaining_samples_counted_and_named(
        shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    tar = broken / "train/000002.tar"
    tar.write_bytes(tar.read_bytes()[:2500])  # cut inside the 2nd or 3rd sample
    seen = []
    with caplog.at_level(logging.WARNING, logger="runtime.data"):
        for rank in (0, 1):
            cfg = DataConfig(source="shards", path=str(broken), image_size=8, batch_size=4, shuffle_buffer=5)
            loaders = file_loaders(cfg, 2, rank, on_gpu=False)
            loaders.train.set_position(0, 0)
            batches = [y.tolist() for _, y in loaders.train]
            assert len(batches) == 5  # ranks keep their step count
            seen += [label for b in batches for label in b]
            skipped = loaders.train.skipped
            if rank == 0:
                first = skipped
    assert first + skipped == 40 - len(seen) >= 5
    assert "000002.tar" in caplog.text
    assert data_cli(["inspect", str(broken)]) == 2


def test_data_cli_pack_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = one_image_per_class_tree(tmp_path / "src", 6, 2)
    (src / "train/c001/bad.jpg").write_text("a text file named .jpg")
    assert data_cli(["pack", str(src), str(tmp_path / "out"), "--shard-size", "4"]) == 0
    out = capsys.readouterr()
    assert "train 6 samples in 2 shards" in out.out and "1 unreadable" in out.out and "bad.jpg" in out.err
    assert data_cli(["inspect", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "6 classes (c000, c001" in text and "train: 6 samples in 2 shards" in text
    assert "sample train/000000.tar:00000000: label 0, JPEG 12x12 RGB" in text and "0-16 KB" in text
    assert data_cli(["inspect", str(src)]) == 0
    assert "ImageFolder" in capsys.readouterr().out
    # refusals: nothing written
    assert data_cli(["pack", str(src), str(tmp_path / "out")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert data_cli(["pack", str(tmp_path / "src" / "train"), str(tmp_path / "o2")]) == 2
    assert "no train/ folder" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    assert data_cli(["pack", str(src), str(tmp_path / "o3"), "--shard-size", "0"]) == 2
    assert data_cli(["inspect", str(tmp_path / "nothing")]) == 2


def test_shards_without_index_are_counted_by_reading_them(shards: Path, tmp_path: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(shards, bare)
    (bare / "index.json").unlink()
    cfg = DataConfig(source="shards", path=str(bare), image_size=8, batch_size=4)
    loaders = file_loaders(cfg, 2, 0, on_gpu=False)
    assert loaders.batches_per_epoch == 5 and loaders.bundle.num_classes >= 7


def test_a_folder_without_shards_is_refused_naming_data_path(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    with pytest.raises(ConfigError, match="data.path: no shards under .*train/"):
        file_loaders(DataConfig(source="shards", path=str(tmp_path), batch_size=2), 1, 0, on_gpu=False)


def test_a_shard_of_unreadable_images_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    with tarfile.open(tmp_path / "train/000000.tar", "w") as tf:
        for i in range(4):
            for ext, payload in (("cls", b"0"), ("jpg", b"not a jpeg")):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    with pytest.raises(ConfigError, match="no readable image"):
        file_loaders(DataConfig(source="shards", path=str(tmp_path), batch_size=2), 1, 0, on_gpu=False)


@pytest.mark.parametrize("name", ["../outside.tar", "/tmp/outside.tar", "train/../../outside.tar",
                                  "train/sub/000000.tar", "val/000000.tar", "train/000000.txt", "train/.tar", 7])
def test_index_shard_names_outside_their_split_folder_or_not_tar_are_refused_naming_the_entry(
        shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: object) -> None:
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(shards, planted)
    index = json.loads((planted / "index.json").read_text())
    index["splits"]["train"][1]["name"] = name
    (planted / "index.json").write_text(json.dumps(index))
    cfg = DataConfig(source="shards", path=str(planted), batch_size=2)
    with pytest.raises(ConfigError, match=r"index.json: splits.train\[1\].name is .*; expected 'train/<name>.tar'"):
        file_loaders(cfg, 1, 0, on_gpu=False)
    assert data_cli(["inspect", str(planted)]) == 2
    assert "splits.train[1].name" in capsys.readouterr().err


def test_index_negative_sample_count_is_refused_naming_the_entry(shards: Path, tmp_path: Path) -> None:
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(shards, planted)
    index = json.loads((planted / "index.json").read_text())
    index["splits"]["val"][0]["samples"] = -3
    (planted / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"index.json: splits.val\[0\].samples is -3; expected a sample count >= 0"):
        file_loaders(DataConfig(source="shards", path=str(planted), batch_size=2), 1, 0, on_gpu=False)


def _garble(tar: Path, every: int) -> None:
    """Rewrite ``tar`` with every ``every``-th image member's bytes replaced by text (an undecodable sample)."""
    with tarfile.open(tar) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf]  # type: ignore[union-attr]
    with tarfile.open(tar, "w") as tf:
        for k, (m, data) in enumerate(members):
            if m.name.endswith(".jpg") and k // 2 % every == 0:
                data = b"not a jpeg " * 20
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data))


@pytest.mark.parametrize("gpu", [False, True])  # crops decoded by the workers, or JPEG bytes for nvJPEG
def test_workers_splitting_pieces_make_the_same_batches_as_workers_making_whole_batches(
        shards: Path, tmp_path: Path, gpu: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Object stores' mode (each piece read by one loader worker, the batch merged from every
    worker's part) against local files' (whole batches per worker), read from the same files:
    byte-identical batches, the same samples skipped in the same order."""
    import shutil

    from runtime.data.batches import recipes
    from runtime.data.shards.store import open_store
    from runtime.data.shards.stream import ShardLoader, ShardStream
    from runtime.data.shards.tars import load_index

    garbled = tmp_path / "garbled"
    shutil.copytree(shards, garbled)
    _garble(garbled / "train/000001.tar", 3)
    store = open_store(str(garbled))
    train_set = load_index(store).splits["train"]
    recipe = recipes(DataConfig(source="shards", path=str(garbled), image_size=8))[0]
    runs = []
    for by_piece, workers in ((False, 2), (True, 3)):
        stream = ShardStream(store, train_set, recipe, seed=0, world=2, rank=1, workers=workers, batch_size=4,
                             buffer=8, gpu=gpu, by_piece=by_piece)
        loader = ShardLoader(stream, workers, pin=False)
        loader.set_position(2, 1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="runtime.data"):
            batches = list(loader)
        runs.append((batches, loader.skipped, [r.getMessage().split(" (")[0] for r in caplog.records]))
    (whole, whole_skipped, whole_log), (merged, merged_skipped, merged_log) = runs
    assert len(whole) == len(merged) == 4 and whole_skipped == merged_skipped > 0 and whole_log == merged_log
    for (x, y), (mx, my) in zip(whole, merged, strict=True):
        assert torch.equal(y, my)
        if gpu:
            assert torch.equal(x.data, mx.data) and torch.equal(x.decoded, mx.decoded)
            assert (x.offsets, x.boxes, x.flips, x.names, x.decoded_at) == (
                mx.offsets, mx.boxes, mx.flips, mx.names, mx.decoded_at)
        else:
            assert torch.equal(x, mx) and x.stride() == mx.stride()  # NCHW over an NHWC buffer, as collated
    if not gpu:  # validation: every sample once, in order, in both modes
        val_set = load_index(store).splits["val"]
        val_recipe = recipes(DataConfig(source="shards", path=str(garbled)))[1]
        labels = []
        for by_piece, workers in ((False, 2), (True, 3)):
            stream = ShardStream(store, val_set, val_recipe, seed=0, world=2, rank=0, workers=workers, batch_size=2,
                                 buffer=8, gpu=False, by_piece=by_piece)
            labels.append([label for _, y in ShardLoader(stream, workers, pin=False) for label in y.tolist()])
        assert labels[0] == labels[1] == list(range(5))  # rank 0's 5 of 11, in batches of 2


def test_merging_parts_stops_with_its_reader_and_hands_it_a_workers_error(shards: Path) -> None:
    """The thread merging parts (object stores' mode) ends when the loop reading batches leaves
    early, and an error in a loader worker reaches that loop, not the thread."""
    import threading

    from runtime.data.batches import recipes
    from runtime.data.shards.store import open_store
    from runtime.data.shards.stream import ShardLoader, ShardStream
    from runtime.data.shards.tars import load_index

    store = open_store(str(shards))
    recipe = recipes(DataConfig(source="shards", path=str(shards), image_size=8))[0]

    def loader(stream_workers: int, loader_workers: int) -> ShardLoader:
        stream = ShardStream(store, load_index(store).splits["train"], recipe, seed=0, world=1, rank=0,
                             workers=stream_workers, batch_size=4, buffer=8, gpu=False, by_piece=True)
        return ShardLoader(stream, loader_workers, pin=False)

    def mergers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "shard-batch-merge"]

    for i, _ in enumerate(loader(2, 2)):
        assert mergers()
        if i == 1:
            break
    for t in mergers():
        t.join(30)  # a hang guard: it leaves at its next part or within parts.POLL_S
    assert not mergers()
    with pytest.raises(RuntimeError, match="ShardStream built for a different number of loader workers"):
        list(loader(3, 2))
    for t in mergers():
        t.join(30)  # it returns right after handing the error over
    assert not mergers()
