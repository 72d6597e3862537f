"""Slow ranks named: the detector's windows, threshold and hysteresis (no Ray), and the per-rank
local times riding the boundary's one all-reduce on 2 real gloo ranks with one rank slowed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runtime.observe.host import Host
from runtime.observe.stragglers import StragglerDetector
from runtime.train.stats import SLOW_RANK_ENV, StepStats, gather_hosts
from tests.support.ranks import spawn_ranks

HOSTS = [Host("gpu-1", "10.0.0.1"), Host("gpu-2", "10.0.0.2"), Host("gpu-3", "10.0.0.3"), Host("gpu-4", "10.0.0.4")]
PACE = [0.10, 0.11, 0.10, 0.09]  # s/step of four healthy ranks
SLOW_3 = [0.10, 0.11, 0.10, 0.18]  # rank 3 at 1.8x the median of the others (0.10)


def detector(**kw: float) -> StragglerDetector:
    return StragglerDetector(HOSTS, **kw)  # type: ignore[arg-type]


def test_a_rank_is_named_with_its_host_and_ratio_after_the_configured_consecutive_windows() -> None:
    d = detector(threshold=1.5, windows=3)
    assert d.observe(10, PACE) == []
    assert d.observe(20, SLOW_3) == [] and d.observe(30, SLOW_3) == []
    (line,) = d.observe(40, SLOW_3)
    assert line.startswith("straggler: rank 3 on host gpu-4 (10.0.0.4) is 1.80x slower than the median")
    assert "at step 40" in line and "0.180 s vs 0.100 s" in line
    assert d.named == [3]
    assert d.observe(50, SLOW_3) == []  # named once, not at every window


def test_slow_windows_interrupted_by_a_fast_one_never_name_the_rank() -> None:
    d = detector(threshold=1.5, windows=3)
    for step in range(1, 21):
        assert d.observe(step, SLOW_3 if step % 3 else PACE) == []  # two slow, one fast, repeated
    assert d.named == []


def test_a_named_rank_is_cleared_only_after_as_many_fast_windows_and_once() -> None:
    d = detector(threshold=1.5, windows=2)
    d.observe(1, SLOW_3)
    assert d.observe(2, SLOW_3)
    assert d.observe(3, PACE) == [] and d.observe(4, SLOW_3) == []  # one fast window clears nothing
    assert d.observe(5, PACE) == []
    (line,) = d.observe(6, PACE)
    assert line.startswith("straggler cleared: rank 3 on host gpu-4 (10.0.0.4) is back to 0.90x") and "step 6" in line
    assert d.named == [] and d.observe(7, PACE) == []


def test_the_threshold_is_inclusive_and_just_below_it_is_not_slow() -> None:
    at, below = detector(threshold=1.5, windows=1), detector(threshold=1.5, windows=1)
    assert at.observe(1, [0.25, 0.25, 0.25, 0.375])  # 0.375 / 0.25 = 1.5 exactly
    assert below.observe(1, [0.25, 0.25, 0.25, 0.374]) == []


def test_a_window_where_a_rank_timed_nothing_neither_extends_nor_breaks_a_run() -> None:
    d = detector(threshold=1.5, windows=2)
    d.observe(1, SLOW_3)
    assert d.observe(2, [0.0, 0.11, 0.10, 0.18]) == []  # rank 0 had no timed step (e.g. its first)
    assert d.observe(3, SLOW_3)  # the second slow window of the run, not the third


def test_two_ranks_compare_each_to_the_other_so_the_gap_is_not_halved() -> None:
    d = StragglerDetector([Host("a"), Host("b")], threshold=1.5, windows=1)
    (line,) = d.observe(5, [0.1, 0.2])
    assert "rank 1 on host b is 2.00x" in line
    assert d.ratios == {0: 0.5, 1: 2.0}


def test_every_rank_gets_a_ratio_each_window_for_the_gauge_and_one_rank_alone_gets_none() -> None:
    d = detector(threshold=1.5, windows=3)
    d.observe(1, SLOW_3)
    assert sorted(d.ratios) == [0, 1, 2, 3] and d.ratios[3] == pytest.approx(1.8)
    alone = StragglerDetector([Host("a")])
    assert alone.observe(1, [0.5]) == [] and alone.ratios == {}


@pytest.mark.parametrize("kw,field", [({"threshold": 1.0}, "threshold"), ({"windows": 0}, "windows")])
def test_a_threshold_of_one_or_zero_windows_is_refused_naming_the_setting(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=f"straggler {field}"):
        detector(**kw)


# ------------------------------------------------------------------ 2 gloo ranks, one slowed

STEPS, LOG_EVERY, SLOW_FROM, SLOW_UNTIL = 24, 2, 7, 16  # rank 1 is slowed at steps 7..16
BASE_S, SLOW_S = 0.02, 0.08  # local work per step (the injected fault; no bound below reads a clock)


def _train_with_one_slow_rank(rank: int, world: int, out: str) -> None:
    """A DDP loop shaped like the trainer's: local work, then the synced backward, a boundary
    every LOG_EVERY steps; rank 1 sleeps longer in its local part over SLOW_FROM..SLOW_UNTIL."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = StepStats(torch.device("cpu"), rank=rank)
    hosts = gather_hosts(True, world)
    d = StragglerDetector(hosts, threshold=1.5, windows=3)
    events = []
    for step in range(1, STEPS + 1):
        stats.local_begin(step)
        slow = rank == 1 and SLOW_FROM <= step <= SLOW_UNTIL
        time.sleep(SLOW_S if slow else BASE_S)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        stats.local_end()
        loss.backward()  # the gradient all-reduce: rank 0 waits here for rank 1
        opt.step()
        opt.zero_grad()
        stats.add(loss.detach() * 4, torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0), 4, 4, step, 5)
        if step % LOG_EVERY == 0:
            b = stats.exchange((False, False, False), distributed=True, world=world, want_metrics=True)
            events += [(step, line) for line in d.observe(step, b.rank_local_s)]
    if rank == 0:
        Path(out).write_text(json.dumps({"events": events, "hosts": [str(h) for h in hosts]}))
    dist.barrier()


def test_a_slowed_gloo_rank_is_named_after_three_reports_and_cleared_after_three_more(tmp_path: Path) -> None:
    out = tmp_path / "events.json"
    spawn_ranks(_train_with_one_slow_rank, 2, str(out))
    got = json.loads(out.read_text())
    host = got["hosts"][1]
    # Slow windows are steps 7-8, 9-10, 11-12, ...: the third ends at step 12. Fast again from 17:
    # 17-18, 19-20, 21-22.
    assert [(step, line.split(" is ")[0]) for step, line in got["events"]] == [
        (12, f"straggler: rank 1 on host {host}"),
        (22, f"straggler cleared: rank 1 on host {host}"),
    ]


def test_a_malformed_slow_rank_setting_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOW_RANK_ENV, "1@7:0.5")
    with pytest.raises(ValueError, match=f"{SLOW_RANK_ENV}='1@7:0.5': expected RANK@FIRST-LAST:SECONDS"):
        StepStats(torch.device("cpu"), rank=1)


def test_the_slow_rank_setting_slows_only_that_rank_in_the_local_part_of_the_named_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOW_RANK_ENV, "1@2-3:0.05")
    slowed, other = StepStats(torch.device("cpu"), rank=1), StepStats(torch.device("cpu"), rank=0)
    assert (slowed.slowed, other.slowed) == ((2, 3, 0.05), None)
    for step in (1, 2, 3, 4):
        slowed.local_begin(step)
        slowed.local_end()
    assert slowed.local_steps == 4 and slowed.local_s >= 2 * 0.05  # time.sleep never returns early
    slowed.add(torch.tensor(1.0), torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0), 1, 1, 4, 5)
    b = slowed.exchange((False, False, False), distributed=False, world=2, want_metrics=True)
    assert b.rank_local_s[0] == 0.0  # rank 0's slot is rank 0's to fill
    assert b.rank_local_s[1] >= 2 * 0.05 / 4  # rank 1's: its local seconds per step (4 steps, 2 slowed)
    assert slowed.local_steps == 0  # the window was reset with the metrics


def test_a_lead_of_a_few_milliseconds_is_scheduling_noise_not_a_straggler() -> None:
    d = StragglerDetector([Host("a"), Host("b"), Host("c")], threshold=1.5, windows=1)
    assert d.observe(10, [0.009, 0.004, 0.004]) == []  # 2.25x, but 5 ms: what a loaded CPU host does
    assert d.named == []
    assert len(d.observe(11, [0.109, 0.004, 0.004])) == 1 and d.named == [0]
