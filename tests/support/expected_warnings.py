"""Warnings some tests cause on purpose, filtered by their exact message where that is the point."""

from __future__ import annotations

import pytest

# More DataLoader workers than this machine's 2 cores, which DataLoader warns about.
LOADER_WORKERS_BEYOND_CORES = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
# Sharded checkpoints saved and loaded by one process without a process group, which dcp warns about.
DCP_WITHOUT_PROCESS_GROUP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
