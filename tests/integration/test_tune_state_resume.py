"""A search's state planted or changed in storage is refused on the driver, on the real local cluster.

The pickle planted here would create a marker file when unpickled; each test checks it is never
created. A resume of a sealed search still works: test_tune.py's interrupted-search test.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.cluster import largest_node_cpus


class _Payload:
    """What an attacker with write access to storage would plant: unpickling runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_resume_refuses_a_planted_tuner_pickle_and_never_runs_it(cluster: dict[str, Any], storage: str,
                                                                 tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    search = Path(storage) / "planted"
    search.mkdir(parents=True)
    (search / "tuner.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    cmd = [sys.executable, "-m", "runtime", "tune", "digits_tune", "--no-progress", "--run-name", "planted",
           "--set", f"checkpoint.storage={storage}", "--resume"]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    assert f"{search}/tuner.pkl has no seal" in out.stdout + out.stderr
    assert not marker.exists()


def test_tune_itself_refuses_state_changed_after_the_driver_sealed_it(cluster: dict[str, Any], storage: str,
                                                                     tmp_path: Path) -> None:
    from ray import tune
    from ray.tune import ExperimentAnalysis, Stopper

    from runtime.tune.sealed_state import SearchStateError, sealed_filesystem, verify_sealed

    def _trainable(config: dict[str, Any]) -> None:  # local: pickled by value, as workers cannot import tests
        for i in range(2):
            tune.report({"m": config["x"] * i})

    search = f"{storage}/sealed"

    class _StopAtOnce(Stopper):  # after Tune's first step, which made both trials and asked for their resources
        def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
            return False

        def stop_all(self) -> bool:
            return True

    # What is sealed is the search's state, which Tune writes whether or not a trial ran: each trial asks
    # for more CPUs than any node has, so Tune creates both and starts no process.
    starved = largest_node_cpus() + 1
    fs = sealed_filesystem(storage, search, None)
    tune.Tuner(tune.with_resources(_trainable, {"CPU": starved}), param_space={"x": tune.grid_search([1, 2])},
               tune_config=tune.TuneConfig(metric="m", mode="max"),
               run_config=tune.RunConfig(name="sealed", storage_path=storage, storage_filesystem=fs,
                                         stop=_StopAtOnce(), verbose=0)).fit()
    assert len(ExperimentAnalysis(search, storage_filesystem=fs).trials) == 2  # sealed state reads back

    # A storage writer swaps the newest experiment state for one whose trial carries a pickle (the
    # JSON's cloudpickle fallback): the report of an interrupted search and --resume both read it.
    marker = tmp_path / "payload-ran"
    (state,) = Path(search).glob("experiment_state-*.json")
    doc = json.loads(state.read_text())
    doc["trial_data"][0][0] = json.dumps({"_type": "CLOUDPICKLE_FALLBACK",
                                          "value": pickle.dumps(_Payload(marker)).hex()})
    state.write_text(json.dumps(doc))
    with pytest.raises(SearchStateError, match="does not match its seal"):
        ExperimentAnalysis(search, storage_filesystem=fs)
    with pytest.raises(SearchStateError, match=f"{state.name} does not match its seal"):
        verify_sealed(fs)  # what tune --resume runs before Tuner.restore
    assert not marker.exists()
