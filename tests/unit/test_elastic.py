"""Elastic training without a cluster: the config's bounds, what a worker group of each size
trains with, where a resized run resumes in the epoch, and the controller callback's
bookkeeping (fed Ray Train's own state and decision objects)."""

from __future__ import annotations

import queue
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import config_from_dict
from runtime.data.loaders import ResumableSampler
from runtime.data.synthetic import SyntheticLoader
from runtime.errors import ConfigError
from runtime.launch.elastic import (
    ElasticWatch,
    MinWorkersTimeout,
    clear_drained_nodes,
    failure_reason,
    give_back,
    resize_line,
)
from runtime.launch.stream import ReportStream
from runtime.run import DrainNotice, Report, Resized, RunInfo
from runtime.train import drain
from runtime.train.loop_state import reshard_position
from runtime.train.setup import for_world
from tests.support import FakeClock


def _cfg(num_workers: Any, batch: int = 8, accum: int = 2, **elastic: Any) -> Any:
    return config_from_dict({"name": "t", "data": {"batch_size": batch}, "train": {"grad_accum_steps": accum},
                             "distributed": {"num_workers": num_workers, "elastic": elastic}})


@pytest.mark.parametrize(
    ("num_workers", "accum", "expected"),
    [
        ({"min": 3, "max": 2}, 1, ["distributed.num_workers", "min=3 must be <= max=2"]),
        ({"min": 0, "max": 2}, 1, ["distributed.num_workers", "min must be greater than or equal to 1"]),
        ({"min": 1, "max": 0}, 1, ["distributed.num_workers", "max must be greater than or equal to 1"]),
        ({"min": 1, "max": 5000}, 1, ["distributed.num_workers", "at most 4096"]),
        ({"min": 2}, 1, ["distributed.num_workers", "{min: N, max: M}", "['min']"]),
        ({"min": 1, "max": 2, "step": 1}, 1, ["distributed.num_workers", "'step'"]),
        ({"min": 1.5, "max": 2}, 1, ["distributed.num_workers", "whole number", "1.5"]),
        (0, 1, ["distributed.num_workers", "greater than or equal to 1"]),
        (True, 1, ["distributed.num_workers", "whole number"]),
        # 4 x 8 x 1 = 32 is not a whole number of 8-sample micro-batches at 3 workers.
        ({"min": 2, "max": 4}, 1, ["distributed.num_workers={min: 2, max: 4}", "keep=global_batch", "3 worker(s)",
                                   "train.grad_accum_steps a multiple of 3", "keep=per_worker_batch"]),
        # 3 x 8 x 1 = 24 fails at 2 workers; any multiple of 2 holds at 1, 2 and 3.
        ({"min": 1, "max": 3}, 1, ["at 2 worker(s)", "a multiple of 2"]),
    ],
)
def test_bad_worker_range_is_refused_naming_the_field(num_workers: Any, accum: int, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(num_workers, accum=accum)
    for text in expected:
        assert text in str(err.value)


def test_bad_elastic_settings_name_their_field() -> None:
    with pytest.raises(ConfigError, match="distributed.elastic.keep"):
        _cfg({"min": 1, "max": 2}, keep="everything")
    with pytest.raises(ConfigError, match="distributed.elastic.resize_check_interval_s"):
        _cfg({"min": 1, "max": 2}, resize_check_interval_s=0)


def test_per_worker_batch_accepts_ranges_global_batch_cannot_hold() -> None:
    cfg = _cfg({"min": 2, "max": 4}, accum=1, keep="per_worker_batch")
    assert (cfg.distributed.min_workers, cfg.distributed.max_workers, cfg.distributed.is_elastic) == (2, 4, True)


def test_keep_global_batch_sets_accumulation_per_size_so_the_global_batch_holds() -> None:
    cfg = _cfg({"min": 1, "max": 3}, batch=8, accum=2)
    assert cfg.global_batch_size() == 48  # stated at max: 3 workers x 8 x 2
    for world, accum in ((3, 2), (2, 3), (1, 6)):
        sized = for_world(cfg, world)
        assert sized.train.grad_accum_steps == accum
        assert world * sized.data.batch_size * sized.train.grad_accum_steps == 48
        assert sized.optimizer.lr == cfg.optimizer.lr


def test_keep_per_worker_batch_scales_the_learning_rate_with_the_workers() -> None:
    cfg = _cfg({"min": 1, "max": 4}, accum=1, keep="per_worker_batch")
    assert for_world(cfg, 4).optimizer.lr == pytest.approx(cfg.optimizer.lr)
    assert for_world(cfg, 2).optimizer.lr == pytest.approx(cfg.optimizer.lr / 2)
    assert for_world(cfg, 1).train.grad_accum_steps == 1


def test_a_fixed_size_job_runs_as_configured_and_a_size_outside_the_range_is_refused() -> None:
    fixed = _cfg(3)
    assert for_world(fixed, 3) is fixed and fixed.global_batch_size() == 3 * 8 * 2
    with pytest.raises(ConfigError, match="outside"):
        for_world(_cfg({"min": 2, "max": 3}, accum=6), 1)


def _synthetic_ids(world: int, start_index: int, batches: int | None, n: int = 240, b: int = 4) -> list[list[int]]:
    """Per rank, the sample ids of batches [start_index, start_index + batches) of epoch 0."""
    out = []
    for rank in range(world):
        loader = SyntheticLoader(n, world, rank, b, seed=7, shuffle=True, pin=False)
        loader.set_position(0, start_index)
        ids = [int(i) for x, _ in loader for i in x]
        out.append(ids[: batches * b] if batches is not None else ids)
    return out


def _sampler_ids(world: int, start_batch: int, batches: int, n: int = 240, b: int = 4) -> list[list[int]]:
    data = list(range(n))
    out = []
    for rank in range(world):
        sampler = ResumableSampler(data, world, rank, shuffle=True, seed=7)  # type: ignore[arg-type]
        sampler.set_position(0, start_batch * b)
        out.append(list(sampler)[: batches * b])
    return out


@pytest.mark.parametrize("source", ["synthetic", "map-style sampler"])
@pytest.mark.parametrize(("old", "new", "done"), [(3, 2, 5), (2, 3, 7), (3, 1, 4), (1, 3, 10)])
def test_a_resized_run_continues_the_epoch_without_skipping_and_repeats_under_one_batch_per_worker(
    source: str, old: int, new: int, done: int
) -> None:
    b = 4
    take = _synthetic_ids if source == "synthetic" else _sampler_ids
    before = [i for ids in take(old, 0, done) for i in ids]  # k = done batches per rank at `old` workers
    index, repeated = reshard_position(done, b, old, new)
    after = [i for ids in take(new, index, 6) for i in ids]
    reference = [i for ids in take(1, 0, (done * old + 6 * new + b) // 1) for i in ids]  # one rank: the order itself
    seen = set(before) | set(after)
    prefix = reference[: len(before)]
    assert set(prefix) == set(before)  # ranks consume the epoch's order as a prefix, whatever their number
    assert set(reference[: index * b * new + 6 * b * new]) == seen  # no hole: nothing skipped
    assert len(before) + len(after) - len(seen) == repeated < b * new


def test_keep_global_batch_resumes_exactly_at_the_step_boundary() -> None:
    # 12 steps at 3 workers x 8 x 2 = 48 samples each; the same 576 samples at 2 workers x 8 x 3.
    index, repeated = reshard_position(12 * 2, 8, 3, 2)
    assert (index, repeated) == (12 * 3, 0)


def test_failure_reason_names_the_lost_node() -> None:
    text = ("Training failed due to worker errors:\n[Rank 1]\nray.exceptions.ActorDiedError: The actor died "
            "unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\nThe actor died because its "
            "node has died. Node Id: fd9b2301c972d0697bab0074a8bd6a213b3fab5eba9b9b5afe8c5f40\n")
    assert failure_reason(text) == "node fd9b2301c972 lost"
    assert failure_reason("Training failed due to controller error:\nThe worker group startup timed out") == (
        "The worker group startup timed out")
    assert resize_line(Resized(3, 2, "node fd9b2301c972 lost", at=0.0), 120) == (
        "resized 3 -> 2 workers at step 120: node fd9b2301c972 lost")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310 (loopback)
        return str(r.read().decode())


def test_controller_callback_counts_resizes_not_restarts_and_exports_them(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.train.v2._internal.execution.controller.state import ResizingState, RestartingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    monkeypatch.setenv("RT_METRICS_BIND", "127.0.0.1")
    monkeypatch.setenv("RT_METRICS_HOST", "127.0.0.1")
    watch = ElasticWatch("j1", 1, 3, min_wait_s=60, progress=None, sd_dir=str(tmp_path))
    watch.after_controller_start(None)
    sd_file = tmp_path / "training-j1-controller.json"
    assert sd_file.exists()
    port = watch.metrics.port

    def start(n: int) -> None:
        watch.before_controller_execute_resize_decision(ResizeDecision(num_workers=n, resources_per_worker={}))
        watch.after_controller_state_update(None, RunningState())

    start(3)  # the first start: not a resize
    lost = RestartingState(WorkerGroupError("The actor died because its node has died. Node Id: abcdef0123456789",
                                            {}))
    watch.after_controller_state_update(RunningState(), lost)
    assert 'rt_train_workers{job_id="j1"} 0.0' in _scrape(port)  # no group trains while it restarts
    start(2)
    assert watch.reason is None
    restart = RestartingState(WorkerGroupError("worker 1 raised ValueError", {}))
    watch.after_controller_state_update(RunningState(), restart)
    start(2)  # a restart at the same size: not a resize
    grow = ResizingState(ResizeDecision(num_workers=3, resources_per_worker={}))
    watch.after_controller_state_update(RunningState(), grow)
    start(3)
    text = _scrape(port)
    assert 'rt_train_resizes_total{job_id="j1"} 2.0' in text
    assert 'rt_train_workers{job_id="j1"} 3.0' in text and 'rt_train_workers_max{job_id="j1"} 3.0' in text
    watch.after_controller_finish(None)
    assert not sd_file.exists()


def test_a_restart_for_a_drain_names_the_drained_node_as_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
    from ray.train.v2.api.exceptions import PreemptionError
    from ray.train.v2.api.preemption import PreemptionInfo

    watch = ElasticWatch("j3", 1, 3, min_wait_s=60)
    watch.before_controller_execute_resize_decision(ResizeDecision(num_workers=3, resources_per_worker={}))
    drained = PreemptionError(PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"5f2c0a1b9d8e7f60": [2]}))
    watch.after_controller_state_update(RunningState(), RestartingState(drained))
    watch.before_controller_execute_resize_decision(ResizeDecision(num_workers=2, resources_per_worker={}))
    assert "resizing 3 -> 2 workers: node 5f2c0a1b9d8e drained" in caplog.text
    assert clear_drained_nodes(None) == []  # a restart for another cause: nothing to clear


def test_a_raylet_port_that_accepts_is_reachable_and_one_that_refuses_is_not() -> None:
    import socket

    from runtime.launch.elastic import _unreachable

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()  # the kernel accepts even if nothing ever calls accept()
        port = listening.getsockname()[1]
        assert not _unreachable("127.0.0.1", port)
    assert _unreachable("127.0.0.1", port)  # closed now: refused, as a killed raylet's port


def test_a_run_that_cannot_reach_min_workers_fails_after_min_wait_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.train.v2._internal.execution.controller.state import InitializingState, RunningState

    from runtime.launch import elastic

    clock = FakeClock(1000.0)  # the callback's clock moves only when the test says
    monkeypatch.setattr(elastic, "time", clock.as_time_module())
    watch = ElasticWatch("j2", 2, 3, min_wait_s=60)
    waiting = InitializingState()
    watch.after_controller_state_update(waiting, waiting)  # the wait starts
    clock.sleep(59.9)
    watch.after_controller_state_update(waiting, waiting)  # still within min_wait_s
    watch.after_controller_state_update(waiting, RunningState())  # a group started: the wait is over
    watch.after_controller_state_update(RunningState(), waiting)  # a new wait starts from here
    clock.sleep(59.9)
    watch.after_controller_state_update(waiting, waiting)
    clock.sleep(0.1)
    with pytest.raises(MinWorkersTimeout, match=r"min=2 workers .*distributed.elastic.min_wait_s"):
        watch.after_controller_state_update(waiting, waiting)


def test_synthetic_shards_are_strided_slices_of_one_permutation() -> None:
    # The property reshard_position relies on, checked on the loader itself.
    order = torch.randperm(240, generator=torch.Generator().manual_seed(7)).tolist()
    ranks = _synthetic_ids(3, 0, None)
    assert ranks[1][:4] == order[1:12:3]


# ------------------------------------------------------------------ a drain's hand-back, driver side

NODE = "5f2c9a01" + "0" * 48


class _Fed(ReportStream):
    """A run whose rank 0 streams ``reports`` onto the driver's queue, as StreamingFit's does."""

    def __init__(self, tmp_path: Path, reports: list[Report]) -> None:
        super().__init__(RunInfo("r", "j", str(tmp_path / "c"), str(tmp_path)), queue.Queue())
        self.to_send = reports

    def _fit(self) -> None:
        for report in self.to_send:
            self._queue.put(report)


def test_the_driver_gives_a_drained_node_back_only_once_the_report_of_its_commit_is_in_hand(tmp_path: Path) -> None:
    drained = Report({"step": 12}, 0.0, notices=("micro-batch halved",), drain=DrainNotice((NODE,), 12, None))
    fit = _Fed(tmp_path, [Report({"step": 11}, 0.0), drained])
    seen: list[tuple[Any, ...]] = []

    def release(nodes: Any, grace_s: float) -> tuple[list[str], str]:
        # The queue is empty: the report of the drain's commit has left it for the driver.
        seen.append(("release", list(nodes), fit._queue.qsize()))
        return list(nodes), ""

    fit.release = release
    for report in fit.stream():
        seen.append(("report", report.step, report.notices))
    assert seen == [
        ("report", 11, ()),  # no release before the drain's report arrives
        ("release", [NODE], 0),
        ("report", 12, ("micro-batch halved", "node 5f2c9a01 is being drained: checkpoint committed at step 12; "
                        "node released: Ray restarts the run on the other nodes now")),
    ], seen


def test_a_drained_node_the_driver_cannot_give_back_keeps_its_deadline_and_the_line_says_why(tmp_path: Path) -> None:
    from runtime.launch import elastic

    clock = FakeClock(1000.0)
    deadline_ms = int((clock() + 117.6) * 1000)
    report = Report({"step": 30}, 0.0, drain=DrainNotice((NODE,), 30, deadline_ms))
    grace: list[float] = []

    def refused(nodes: Any, grace_s: float) -> tuple[list[str], str]:
        grace.append(grace_s)
        return [], "node 5f2c9a01 also runs job(s) 02000000"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(elastic, "time", clock.as_time_module())
        shown = give_back(report, refused)
    assert shown.notices == ("node 5f2c9a01 is being drained: checkpoint committed at step 30; waiting for Ray to "
                             "restart the run on the other nodes at the deadline (118 s): node 5f2c9a01 also runs "
                             "job(s) 02000000",), shown.notices
    assert grace == [drain.RELEASE_GRACE_S] and shown.flat()["drained_at_step"] == 30
    assert give_back(Report({"step": 31}, 0.0), refused).notices == () and len(grace) == 1  # no drain: no release
