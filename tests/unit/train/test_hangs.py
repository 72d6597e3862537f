"""A hung rank is named, with its host and where it is, before the collective timeout fails the step.

The verdicts on rank 0's clock (runtime.observe.hangs.HangDetector, fed by hand), and the whole
path on 2 real gloo ranks (tests.support.ranks, no Ray): each rank's StepStats marks its progress,
its HangWatch thread publishes it to the process group's store, and rank 0 names rank 1 while
rank 0 itself waits in the boundary's all-reduce: first rank 1 held in its local part (released
only once the line is there), then rank 1 frozen by SIGSTOP (continued once named).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from runtime.observe.hangs import HangDetector, Point, Progress
from runtime.observe.host import Host
from runtime.train.hangwatch import KEY, HangWatch, process_group_store
from runtime.train.hold import HOLD_ENV, RELEASE_FILE, held_file
from runtime.train.stats import StepStats
from tests.support import wait_for
from tests.support.calibration import scaled
from tests.support.ranks import in_background, spawn_ranks
from tests.support.trainer import REPORTS_FILE, train_job

HOSTS = [Host("gpu-1", "10.0.0.1"), Host("gpu-2", "10.0.0.2"), Host("gpu-3", "10.0.0.3")]


def _at(seq: int, step: int, point: Point, age: float = 0.0) -> Progress:
    return Progress(seq, step, point, age)


def test_a_rank_behind_is_named_once_its_peers_have_waited_warn_s_and_cleared_once_it_catches_up() -> None:
    d = HangDetector(HOSTS, warn_s=60)
    assert d.observe(100.0, {0: _at(1, 41, Point.SYNC), 1: _at(1, 41, Point.LOCAL, age=5),
                             2: _at(1, 41, Point.SYNC)}) == []
    assert d.observe(159.0, {0: _at(2, 41, Point.SYNC, 59), 1: _at(2, 41, Point.LOCAL, 64),
                             2: _at(2, 41, Point.SYNC, 59)}) == []  # 59 s of waiting: not yet
    assert d.observe(160.0, {0: _at(3, 41, Point.SYNC, 60), 1: _at(3, 41, Point.LOCAL, 65),
                             2: _at(3, 41, Point.SYNC, 60)}) == [
        "hang: rank 1 on host gpu-2 (10.0.0.2) is still in its own part of step 41 (data, forward, backward "
        "before the gradient sync) after 65 s; ranks 0, 2 have waited 60 s in the gradient sync, optimizer, "
        "evaluation or commit of step 41"]
    assert d.observe(170.0, {0: _at(4, 41, Point.SYNC), 1: _at(4, 41, Point.LOCAL),
                             2: _at(4, 41, Point.SYNC)}) == []  # the same verdict is not repeated
    assert d.observe(171.0, {0: _at(5, 42, Point.LOCAL), 1: _at(5, 42, Point.LOCAL),
                             2: _at(5, 42, Point.LOCAL)}) == ["hang over: rank 1 moved on"]


def test_a_verdict_no_observation_saw_clear_is_settled_once_every_rank_reached_the_last_exchange() -> None:
    """Under load the run can end (every rank through its last exchange, a collective) before the watch
    has a turn to see the named rank move: the trainer settles the verdict then, once; none is left."""
    d = HangDetector(HOSTS[:2], warn_s=10)
    assert d.observe(0.0, {0: _at(1, 8, Point.EXCHANGE), 1: _at(1, 8, Point.AFTER)}) == []
    [named] = d.observe(10.0, {0: _at(2, 8, Point.EXCHANGE), 1: _at(1, 8, Point.AFTER)})
    assert named.startswith("hang: rank 1 "), named
    assert d.settle() == ["hang over: rank 1 moved on"]
    assert d.settle() == []


def test_after_every_rank_arrived_the_watch_judges_no_more(tmp_path: Path) -> None:
    """What a rank published before the end (rank 1's last, stale position) names nobody afterwards."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 2)
    lines: list[str] = []
    watch = HangWatch(store, 0, 2, HOSTS[:2], warn_s=10, progress=lambda: (12, Point.AFTER, time.monotonic() - 60),
                      emit=lines.append, interval_s=0.05)
    store.set(KEY.format(rank=1), Progress(1, 8, Point.AFTER, 60.0).encode())
    watch.all_arrived()
    watch.start()
    wait_for(lambda: watch._seq >= 5, "five turns of the watch", scaled(30))
    watch.stop()
    assert lines == []


def test_a_rank_whose_publications_stop_is_named_silent_with_where_it_was_last() -> None:
    d = HangDetector(HOSTS[:2], warn_s=10)
    assert d.observe(0.0, {0: _at(1, 7, Point.EXCHANGE), 1: _at(1, 7, Point.AFTER)}) == []
    assert d.observe(10.0, {0: _at(2, 7, Point.EXCHANGE), 1: _at(1, 7, Point.AFTER)}) == [
        "hang: rank 1 on host gpu-2 (10.0.0.2) has published no progress for 10 s (stopped or frozen; last in "
        "the save or report after step 7's boundary)"]


def test_a_rank_that_closed_its_loop_is_never_named_while_rank_0_goes_on_alone() -> None:
    """Rank 0 exports the model after the last report while rank 1 has closed: no hang."""
    d = HangDetector(HOSTS[:2], warn_s=10)
    assert d.observe(0.0, {0: _at(1, 120, Point.AFTER), 1: _at(1, 120, Point.DONE)}) == []
    assert d.observe(100.0, {0: _at(9, 120, Point.AFTER, 100), 1: _at(1, 120, Point.DONE)}) == []


def test_every_rank_waiting_in_the_boundary_all_reduce_names_the_collective_and_slow_work_is_no_hang() -> None:
    d = HangDetector(HOSTS[:2], warn_s=10)
    long_eval = {0: _at(1, 7, Point.SYNC, 30), 1: _at(1, 7, Point.SYNC, 30)}  # both evaluating for 30 s
    assert d.observe(0.0, long_eval) == []
    assert d.observe(10.0, {0: _at(2, 7, Point.EXCHANGE, 10), 1: _at(2, 7, Point.EXCHANGE, 10)}) == [
        "hang: every rank has waited 10 s in the boundary all-reduce of step 7: the collective itself does not "
        "complete (the network, or a peer outside the group)"]


def test_a_progress_survives_the_store_as_text() -> None:
    p = Progress(12, 4711, Point.EXCHANGE, 1.25)
    assert Progress.decode(p.encode()) == p


def test_a_garbled_progress_planted_in_the_store_is_left_out_and_the_watch_goes_on(tmp_path: Path) -> None:
    """torch's store has no authentication: a value planted under a rank's key is not a progress,
    and rank 0's watch reads the others as before (no exception, no verdict from it)."""
    from tests.support import free_port

    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    store.set(KEY.format(rank=1), "rm -rf / 999999 9 x")
    store.set(KEY.format(rank=2), b"\xff\xfe")
    store.set(KEY.format(rank=3), Progress(1, 7, Point.LOCAL, 0.5).encode())
    watch = HangWatch(store, 0, 4, HOSTS, warn_s=10, progress=lambda: (7, Point.EXCHANGE, time.monotonic()),
                      emit=lambda line: None)
    watch._publish()
    assert watch._read() == {0: Progress(1, 7, Point.EXCHANGE, watch._read()[0].age_s),
                             3: Progress(1, 7, Point.LOCAL, 0.5)}


def _held_then_frozen(rank: int, world: int, folder: Path, warn_s: float) -> None:
    """Both ranks train steps 1 and 2 as the loop marks them; rank 1 is held in step 1's local part
    until the test releases it, and stops itself (SIGSTOP) in step 2's until the test continues it."""
    stats = StepStats(torch.device("cpu"), rank=rank)

    def emit(line: str) -> None:
        with (folder / "lines").open("a") as f:
            f.write(line + "\n")

    watch = HangWatch(process_group_store(), rank, world, HOSTS[:2], warn_s=warn_s,
                      progress=lambda: stats.progress, emit=emit).start()
    store = process_group_store()
    for step in (1, 2):
        stats.local_begin(step)
        if rank == 1 and step == 1:
            while not (folder / "release").exists():
                time.sleep(0.05)
        if rank == 1 and step == 2:
            wait_for(lambda: store.get(KEY.format(rank=1)).decode().split()[1:3] == ["2", str(int(Point.LOCAL))],
                     "rank 1 to publish step 2's local part", 60)
            (folder / "pid").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        stats.local_end()
        stats.exchange((False, False, False), distributed=True, world=world, want_metrics=False)
    if rank == 0:
        wait_for(lambda: (folder / "lines").read_text().count("hang over: rank 1 moved on\n") == 2,
                 "rank 0's hang-over line", 60)
    torch.distributed.barrier()
    watch.stop()


@pytest.mark.slow  # make test-quick: the same path runs in its Ray Train run (test_training.py)
def test_two_gloo_ranks_name_a_held_rank_then_a_frozen_one_while_rank_0_waits_in_the_all_reduce(
        tmp_path: Path) -> None:
    lines = tmp_path / "lines"
    # A publisher this load keeps off the CPU for warn_s would read as silent: warn_s is
    # stretched by the host's slowness (the verdicts do not depend on its value).
    runner, outcome = in_background(spawn_ranks, _held_then_frozen, 2, tmp_path, scaled(2.0))
    try:
        wait_for(lambda: lines.exists() and "hang: rank 1" in lines.read_text(), "the held rank named", 120)
        (tmp_path / "release").touch()
        wait_for(lambda: "has published no progress" in lines.read_text(), "the frozen rank named", 120)
    finally:
        (tmp_path / "release").touch()
        if (tmp_path / "pid").exists():
            os.kill(int((tmp_path / "pid").read_text()), signal.SIGCONT)
    runner.join(timeout=300)
    assert not runner.is_alive() and outcome == [None], outcome
    seen = lines.read_text().splitlines()
    assert seen[0] == (f"hang: rank 1 on host {HOSTS[1]} is still in its own part of step 1 (data, forward, "
                       f"backward before the gradient sync) after {seen[0].split(' after ')[1].split(' s;')[0]} s; "
                       f"rank 0 has waited {seen[0].split('has waited ')[1].split(' s in')[0]} s in the boundary "
                       "all-reduce of step 1")
    assert seen[1] == "hang over: rank 1 moved on"
    frozen = [ln for ln in seen[2:] if "has published no progress" in ln]
    assert frozen and frozen[0].startswith(f"hang: rank 1 on host {HOSTS[1]} has published no progress for ")
    assert frozen[0].endswith("last in its own part of step 2 (data, forward, backward before the gradient sync))")
    assert seen[-1] == "hang over: rank 1 moved on"


def _logged_trainer_rank(rank: int, world: int, folder: Path, overrides: tuple[str, ...]) -> None:
    """The real trainer as one rank, its ``runtime.train`` log lines in rank<r>.log."""
    handler = logging.FileHandler(folder / f"rank{rank}.log")
    logging.getLogger("runtime.train").addHandler(handler)
    try:
        reports = train_job("digits_smoke", folder, rank, world, *overrides)
    finally:
        logging.getLogger("runtime.train").removeHandler(handler)
        handler.close()
    if rank == 0:
        (folder / REPORTS_FILE).write_text(json.dumps(reports))


@pytest.mark.slow
def test_the_trainer_names_a_rank_held_at_a_boundary_while_rank_0_waits_in_its_all_reduce(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 alone is held at step 8's boundary (``RT_TEST_HOLD=8@1:...``), after its step; rank 0
    goes on into the boundary's all-reduce. The hold is released only once rank 0 has named rank 1."""
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, f"8@1:{hold}")
    sets = ("model.name=mlp", "train.max_steps=12", "train.log_every_steps=4", "checkpoint.interval_steps=100",
            "tracking.mlflow=false", "tracking.prometheus=false", f"distributed.hang_warn_s={scaled(2.0):.1f}")
    log0 = tmp_path / "rank0.log"
    runner, outcome = in_background(spawn_ranks, _logged_trainer_rank, 2, tmp_path, sets)
    try:
        wait_for(lambda: log0.exists() and "hang: rank 1" in log0.read_text(), "rank 0 to name rank 1", 180)
        assert held_file(hold, 8, 1).exists() and not held_file(hold, 8, 0).exists()
    finally:
        hold.mkdir(exist_ok=True)
        (hold / RELEASE_FILE).touch()
    runner.join(timeout=300)
    assert not runner.is_alive() and outcome == [None], outcome
    lines = [ln for ln in log0.read_text().splitlines() if ln.startswith("hang")]
    assert lines[0].startswith(f"hang: rank 1 on host {Host.here()} is still in the gradient sync, optimizer, "
                               "evaluation or commit of step 8 after ")
    assert lines[0].endswith("in the boundary all-reduce of step 8") and "rank 0 has waited" in lines[0]
    assert lines[1:] == ["hang over: rank 1 moved on"]
    reports = json.loads((tmp_path / REPORTS_FILE).read_text())
    assert reports[-1]["step"] == 12  # the run went on to its end once released
    assert not (tmp_path / "rank1.log").read_text().count("hang:")  # only rank 0 judges
