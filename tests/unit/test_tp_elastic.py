"""Elastic tensor-parallel runs start whole TP groups only: Ray Train's own elastic policy, sized by
runtime.launch.elastic.WholeGroupsPolicy, fed a resource snapshot as its coordinator would give it;
and the loop's guard for a world size that is not a whole number of groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision
from ray.train.v2._internal.execution.worker_group import WorkerGroupState
from ray.train.v2.api.config import ScalingConfig
from torch import nn

from runtime.config import FSDPConfig, config_from_dict
from runtime.errors import ConfigError
from runtime.launch.elastic import WholeGroupsPolicy, WholeGroupsTrainer
from runtime.train.parallel import apply_fsdp, data_parallel_rank, tp_groups
from runtime.train.setup import for_world


class _Snapshot:
    """The policy's input, a per-node view of the resources reserved for the run (the
    AutoscalingCoordinator's answer, read here from ``reserved``); the decisions are Ray's code."""

    reserved: dict[str, dict[str, float]]

    def _maybe_send_resource_request(self) -> None:
        """The request to the coordinator: there is none to ask in a unit test."""

    def _get_reserved_resources(self) -> dict[str, dict[str, float]]:
        return self.reserved


class WholeGroups(_Snapshot, WholeGroupsPolicy):
    pass


class RaysOwn(_Snapshot, ElasticScalingPolicy):
    pass


def _policy(cls: type, low: int, high: int, cpus: list[int], group: int | None = None) -> Any:
    # One CPU per worker; resizes considered at every poll (the interval is Ray's, not under test).
    config = ScalingConfig(num_workers=(low, high), resources_per_worker={"CPU": 1},
                           elastic_resize_monitor_interval_s=0)
    policy = cls(config) if group is None else cls(config, group)
    policy.reserved = {f"node{i}": {"CPU": float(n)} for i, n in enumerate(cpus)}
    return policy


def _running(n: int) -> WorkerGroupState:
    # The policy reads only the group's size and start time.
    return WorkerGroupState(start_time=0.0, placement_group_handle=None, workers=[None] * n,  # type: ignore[arg-type,list-item]
                            sync_actor=None)  # type: ignore[arg-type]


def _start(policy: Any) -> int | None:
    decision = policy.make_decision_for_non_running_worker_group()
    return decision.num_workers if isinstance(decision, ResizeDecision) else None


def _resize(policy: Any, running: int) -> int | None:
    decision = policy.make_decision_for_running_worker_group(_running(running), None)
    if isinstance(decision, NoopDecision):
        return None
    return int(decision.num_workers)


@pytest.mark.parametrize(
    ("low", "high", "cpus", "tp", "starts"),
    [
        (2, 6, [5], 2, 4),  # room for 5 at tp_size 2: two whole groups
        (2, 6, [3, 2], 2, 4),  # counted over the nodes, as Ray counts: 5, then rounded
        (4, 8, [7], 4, 4),
        (2, 8, [3], 2, 2),
        (4, 6, [3], 2, None),  # 3 rounds to 2, below min 4: wait, as for too few workers
        (4, 8, [3], 4, None),  # below one group: wait
        (2, 6, [9], 2, 6),  # capped at max (a multiple of tp_size), as Ray caps
        (1, 6, [5], 1, 5),  # tp_size 1: any count, as Ray's own policy
    ],
)
def test_a_group_starts_with_the_whole_tp_groups_that_fit_or_waits_below_min(
        low: int, high: int, cpus: list[int], tp: int, starts: int | None) -> None:
    assert _start(_policy(WholeGroups, low, high, cpus, tp)) == starts


def test_at_tp_size_1_the_policy_decides_as_rays_own() -> None:
    for cpus in ([1], [3], [5], [2, 3], [9]):
        for running in (1, 3, 4, 6):
            ours, rays = _policy(WholeGroups, 1, 6, cpus, 1), _policy(RaysOwn, 1, 6, cpus)
            assert (_start(ours), _resize(ours, running)) == (_start(rays), _resize(rays, running)), (cpus, running)


@pytest.mark.parametrize(
    ("cpus", "running", "resized"),
    [
        ([5], 4, None),  # one worker's room came back: not a group's, no restart at the same size
        ([6], 4, 6),  # a whole group came back: grow
        ([3, 3], 4, 6),
        ([5], 6, 4),  # a worker's room went: shrink to the whole groups that remain
        ([1], 4, None),  # below min: Ray never resizes a running group under it
    ],
)
def test_a_running_group_is_resized_only_to_another_whole_number_of_groups(
        cpus: list[int], running: int, resized: int | None) -> None:
    assert _resize(_policy(WholeGroups, 2, 6, cpus, 2), running) == resized


def test_rays_own_policy_would_start_a_group_the_tp_mesh_cannot_use() -> None:
    """What the policy is for: Ray sizes by workers, not groups."""
    assert _start(_policy(RaysOwn, 2, 6, [5])) == 5
    assert _resize(_policy(RaysOwn, 2, 6, [5]), 4) == 5


def _loop(config: dict[str, Any]) -> None:
    """A train loop for the trainer's construction; never run."""


@pytest.mark.parametrize(
    ("num_workers", "group", "whole_groups"),
    [((2, 4), 2, True), ((1, 4), 1, False), (4, 2, False)],
)
def test_the_trainer_hands_the_controller_the_whole_groups_policy_only_for_elastic_tp(
        num_workers: Any, group: int, whole_groups: bool) -> None:
    """An elastic TP run's controller gets WholeGroupsPolicy; the rest keep what Ray's fit builds."""
    from ray.train.v2._internal.execution.scaling_policy import create_scaling_policy

    config = ScalingConfig(num_workers=num_workers)
    trainer = WholeGroupsTrainer(_loop, group_size=group, scaling_config=config)
    rays = create_scaling_policy(config)
    chosen = trainer.scaling_policy(rays)
    if whole_groups:
        assert isinstance(chosen, WholeGroupsPolicy) and chosen.group_size == group
        assert chosen.scaling_config is config
    else:
        assert chosen is rays


@pytest.mark.parametrize(("world", "tp"), [(3, 2), (6, 4), (2, 4)])
def test_a_world_that_is_not_whole_tp_groups_fails_at_set_up_naming_tp_size_and_the_world(world: int,
                                                                                            tp: int) -> None:
    expected = f"distributed.tp_size={tp} does not divide the world size {world}"
    with pytest.raises(ConfigError, match=expected) as err:
        data_parallel_rank(0, world, tp)  # the loop's first use of the world size
    assert "\n" not in str(err.value)
    # apply_fsdp refuses it before any mesh is built: no process group is up here.
    with pytest.raises(ConfigError, match=expected):
        apply_fsdp(nn.Linear(4, 4), FSDPConfig(), None, torch.device("cpu"), world, tp_size=tp)


@pytest.mark.parametrize(("world", "tp", "groups"), [(4, 2, 2), (8, 4, 2), (3, 1, 3), (2, 2, 1)])
def test_whole_groups_give_the_data_parallel_size(world: int, tp: int, groups: int) -> None:
    assert tp_groups(world, tp) == groups
    assert data_parallel_rank(world - 1, world, tp) == (groups - 1, groups)


def test_keep_global_batch_counts_tp_groups_as_the_data_parallel_ranks() -> None:
    # max 4 workers at tp_size 2 = 2 groups x 8 x 2 accumulation = 32 samples per step:
    # 2 groups keep accumulation 2, 1 group (2 workers) accumulates 4.
    cfg = config_from_dict({"name": "t", "model": {"name": "gpt"}, "data": {"batch_size": 8, "source": "tokens"},
                            "train": {"grad_accum_steps": 2},
                            "distributed": {"strategy": "fsdp", "tp_size": 2, "num_workers": {"min": 2, "max": 4}}})
    assert cfg.global_batch_size() == 32
    assert [for_world(cfg, w).train.grad_accum_steps for w in (4, 2)] == [2, 4]
