"""Several real ranks without Ray: a function run on fresh processes joined in one gloo process group.

For tests where what is proven is the arithmetic across ranks (DDP, FSDP, sharded checkpoints),
not Ray: two processes that import torch once cost a fraction of a Ray Train run's start-up
(its controller, helper actors and queue). Light on imports, like ``tests.support``.

The ranks fork from Python's fork server, which imports torch and the trainer once per test
process: with ``mp.spawn`` each rank was a fresh interpreter importing them again (23 ranks of
9.7 CPU-s each in a fresh-clone ``make test``). A forked rank gets the caller's environment,
working folder and ``sys.path`` of the moment, as a spawned one did.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import free_port

# Imported once in the fork server (before its first fork), so every rank starts with them.
PRELOAD = ["torch", "torch.distributed", "runtime.train.trainer"]


def in_background(call: Callable[..., Any], *args: Any) -> tuple[threading.Thread, list[Any]]:
    """``call(*args)`` (ranks, usually) on a thread, so the test can release or signal them meanwhile;
    the list gets its result, or its failure, for the test to check after joining."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call(*args))
        except BaseException as err:  # reported by the test's own thread
            outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` new processes in one gloo process group.

    ``fn`` must be importable (a module-level function) and writes what the test checks to files;
    a rank that raises fails the call with its traceback.
    """
    multiprocessing.set_forkserver_preload(PRELOAD)
    here = (dict(os.environ), os.getcwd(), list(sys.path))
    mp.start_processes(_rank_main, args=(fn, world, free_port(), here, args), nprocs=world, join=True,
                       start_method="forkserver")


def _rank_main(rank: int, fn: Callable[..., None], world: int, port: int,
               here: tuple[dict[str, str], str, list[str]], args: tuple[Any, ...]) -> None:
    env, cwd, path = here  # the caller's, not the fork server's from when it started
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
    sys.path[:] = path
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without the interpreter's teardown, where a C++ thread of torch's
    # (gloo, DCP) still joinable has aborted the process after every check had passed ("terminate
    # called without an active exception": twice in CI's S3 sharded test, after the writer already
    # destroyed its own group). A rank that raised never gets here: mp reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
