"""Planted tar shards whose members are not plain sample bytes are refused, naming the member: a
sparse member (200 MiB read from a few KiB of file), a symlink, a hard link, a device, a FIFO and a
header declaring more than a sample's member may hold. Folder entries are skipped, as before."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from runtime.data.shards.store import LocalStore
from runtime.data.shards.tars import MAX_MEMBER_BYTES, load_index, read_shard
from runtime.errors import ConfigError


def _plain(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _special(name: str, kind: bytes, **attrs: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


def _shard(root: Path, extra: tarfile.TarInfo | None) -> Path:
    """train/000000.tar: a good sample, the planted member, another good sample."""
    (root / "train").mkdir(parents=True)
    with tarfile.open(root / "train" / "000000.tar", "w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(_special("s0", tarfile.DIRTYPE))  # a folder entry, as `tar cf` writes: skipped
        _plain(tf, "s0/a.cls", b"0")
        if extra is not None:
            tf.addfile(extra)
        _plain(tf, "s2.cls", b"2")
    return root


def _sparse_shard(root: Path) -> Path:
    """A shard GNU tar packs with --sparse: a 200 MiB file of holes stored in a few KiB."""
    src = root / "src"
    src.mkdir()
    (src / "s1.jpg").write_bytes(b"")
    os.truncate(src / "s1.jpg", 200 << 20)
    (root / "train").mkdir()
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(root / "train" / "000000.tar"), "-C", str(src),
                    "s1.jpg"], check=True)
    assert (root / "train" / "000000.tar").stat().st_size < 64 << 10
    return root


PLANTED = {
    "symlink": (_special("s1.jpg", tarfile.SYMTYPE, linkname="/etc/shadow"), "'s1.jpg' is a link"),
    "hardlink": (_special("s1.jpg", tarfile.LNKTYPE, linkname="s0/a.cls"), "'s1.jpg' is a link"),
    "device": (_special("s1.jpg", tarfile.CHRTYPE, devmajor=1, devminor=8), "'s1.jpg' is a device or FIFO"),
    "fifo": (_special("s1.jpg", tarfile.FIFOTYPE), "'s1.jpg' is a device or FIFO"),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_link_device_or_fifo_member_refuses_the_shard_naming_it(tmp_path: Path, kind: str) -> None:
    member, says = PLANTED[kind]
    store = LocalStore(str(_shard(tmp_path, member)))
    with pytest.raises(tarfile.ReadError, match=says):
        list(read_shard(store, "train/000000.tar", lambda _: True))
    with pytest.raises(ConfigError, match=rf"shard .*000000\.tar cannot be read \(member {says[:9]}"):
        load_index(store)  # no index.json: counting the samples reads the headers, and refuses too


def test_a_sparse_member_is_refused_before_it_reads_as_200_mib(tmp_path: Path) -> None:
    store = LocalStore(str(_sparse_shard(tmp_path)))
    with pytest.raises(tarfile.ReadError, match="member 's1.jpg' is a sparse file, not a regular file"):
        list(read_shard(store, "train/000000.tar", lambda _: True))


def test_a_member_declaring_more_than_a_sample_may_hold_is_refused_before_reading(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    header = tarfile.TarInfo("s1.jpg")
    header.size = MAX_MEMBER_BYTES + 1
    # The header alone, no data: a refusal that read first would say "truncated" instead.
    (tmp_path / "train" / "000000.tar").write_bytes(header.tobuf(tarfile.GNU_FORMAT))
    with pytest.raises(tarfile.ReadError, match=rf"'s1.jpg' declares {MAX_MEMBER_BYTES + 1} bytes, over the"):
        list(read_shard(LocalStore(str(tmp_path)), "train/000000.tar", lambda _: True))


def test_folder_entries_are_skipped_and_plain_members_read(tmp_path: Path) -> None:
    store = LocalStore(str(_shard(tmp_path, None)))
    samples = list(read_shard(store, "train/000000.tar", lambda _: True))
    assert samples == [(0, "s0/a", {"cls": b"0"}), (1, "s2", {"cls": b"2"})]
