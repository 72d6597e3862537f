"""A forked loader worker never frees the parent's garbage (with CUDA tensors in it, that aborts the worker)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from torch.utils.data import DataLoader, Dataset

from runtime.data.batches import Batches


class Trap:
    """Garbage in a reference cycle whose destructor records which process ran it (as ~TensorImpl would call CUDA)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.me = folder, self

    def __del__(self) -> None:
        (self.folder / str(os.getpid())).touch()


class Collecting(Dataset[int]):
    """Runs the collector inside the worker, as a long-lived worker eventually does."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


def test_garbage_cycles_are_freed_in_the_parent_not_in_a_forked_loader_worker(tmp_path: Path) -> None:
    gc.collect()
    gc.disable()  # keep the cycle uncollected until the loader starts its workers
    try:
        Trap(tmp_path)
        batches = list(Batches(DataLoader(Collecting(), batch_size=2, num_workers=1,
                                          multiprocessing_context="fork")))
    finally:
        gc.enable()
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3]]
    assert [p.name for p in tmp_path.iterdir()] == [str(os.getpid())]  # freed once, here
