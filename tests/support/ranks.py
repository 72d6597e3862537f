"""Several real ranks without Ray: a function run on fresh processes joined in one gloo process group.

For tests where what is proven is the arithmetic across ranks (DDP, FSDP, sharded checkpoints),
not Ray: two processes that import torch once cost a fraction of a Ray Train run's start-up
(its controller, helper actors and queue). Light on imports, like ``tests.support``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import free_port


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` new processes in one gloo process group.

    ``fn`` must be importable (a module-level function) and writes what the test checks to files;
    a rank that raises fails the call with its traceback.
    """
    mp.spawn(_rank_main, args=(fn, world, free_port(), args), nprocs=world, join=True)


def _rank_main(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without the interpreter's teardown, where a C++ thread of torch's
    # (gloo, DCP) still joinable has aborted the process after every check had passed ("terminate
    # called without an active exception": twice in CI's S3 sharded test, after the writer already
    # destroyed its own group). A rank that raised never gets here: mp.spawn reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
