"""How many spares a joining node is asked for (runtime.train.spares.workers_fitting)."""

from __future__ import annotations

from runtime.train.spares import workers_fitting


def test_a_node_holds_as_many_workers_as_its_scarcest_resource_allows() -> None:
    node = {"CPU": 96.0, "GPU": 8.0, "memory": 1e12}
    assert workers_fitting(node, {"CPU": 8, "GPU": 1}) == 8
    assert workers_fitting(node, {"CPU": 16, "GPU": 1}) == 6
    assert workers_fitting(node, {"CPU": 1, "GPU": 0.5}) == 16


def test_a_node_without_a_resource_the_workers_ask_for_holds_none() -> None:
    assert workers_fitting({"CPU": 2.0}, {"CPU": 1, "elastic_slot": 1}) == 0
    assert workers_fitting({"CPU": 2.0, "GPU": 0.0}, {"CPU": 1, "GPU": 1}) == 0
