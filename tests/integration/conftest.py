"""One real local cluster for the whole integration session.

Ray head (4 logical CPUs on 2 cores: tune trials and 2-worker runs overlap),
MLflow server (sqlite) and Prometheus scraping the workers' file_sd targets, on
ports of their own so a developer's `make cluster-up` cluster is left alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import local_cluster, own_cluster_env
from tests.support.object_stores import AZURITE_ENV

# Decided at import, before any test module imports Ray: Ray reads its authentication
# settings once per process, so the test cluster's token path must be in the environment first.
CLUSTER_DIR = Path(tempfile.mkdtemp(prefix="rt-test-cluster-"))
os.environ.update(own_cluster_env(CLUSTER_DIR))
os.environ.pop("MLFLOW_TRACKING_URI", None)
# The drivers the tests start seal Tune state with a key of their own, not the developer's (runtime.tune.sealed_state).
os.environ["RT_TUNE_STATE_KEY_FILE"] = str(CLUSTER_DIR / "tune_state.key")
# Ray Train's own metrics and JSON logs (its dashboard's Train view) are on in the product, off here: no
# test reads them, and they cost every Train run ~3.4 of its ~24 CPU-seconds (median of 3 runs each, digits).
os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING", "0")
# Spare worker processes (runtime.train.spares) trade idle CPU for a faster restart: on the suite's two
# cores most runs never restart and each group's spares would import torch for nothing. Off here; on
# in test_run_logs_and_traces.py's traced run, which proves a restart is given them, and in the recovery
# and elastic benchmarks.
os.environ.setdefault("RT_TRAIN_SPARES", "0")
# The jobs the CLI and Tune load here, as tests.support.job's: no drain watcher (NO_DRAIN_WATCH).
os.environ.setdefault("RT_CHECKPOINT__ON_NODE_DRAIN", "ignore")


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[dict[str, Any]]:
    """Start the embedded cluster once; every integration test drives it through RAY_ADDRESS.
    Prometheus scrapes the training exporters every 2 s (5 s by default; the scrape timeout is the
    interval, so not 1 s on 2 busy cores): a short run then spans several scrapes (test_observability)
    without training or lingering for 5-s ones. No test's driver asks for its workers' output
    (log_to_driver is `--verbose`, proven on a cluster of its own in test_cluster_lifecycle.py): the
    head's log monitor, which re-reads the session's ever-growing log folder, is left out (~1
    CPU-minute of the suite).
    --ray-only-cluster (make test-quick): Ray alone, for tests that need neither MLflow nor Prometheus
    (the MLflow server alone takes ~30 s to answer)."""
    ray_only = pytestconfig.getoption("--ray-only-cluster")
    # Azurite's public development account (accepted by Azurite alone) in the nodes' environment, where an
    # operator puts Azure credentials (docs/storage.md): an az:// run's workers open the store with it, and
    # the drivers here hold no key (test_recovery.py's run on az://).
    with local_cluster(CLUSTER_DIR, node_env=AZURITE_ENV, num_cpus=4, training_scrape_s=2, log_monitor=False,
                       with_mlflow=not ray_only, with_prometheus=not ray_only) as state:
        yield {**state, "dir": CLUSTER_DIR}


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run (tests.support.recovery) every interrupted recovery scenario must match bit
    for bit: made once for the workers killed (test_recovery.py) and the driver's signals (test_run_edges.py)."""
    from tests.support.recovery import reference_run

    return reference_run(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def reference_one_rank(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same uninterrupted run on one rank, for the driver's signals (test_run_edges.py): what they
    prove is the driver's, on one worker; the ranks' agreement on a stop is test_stop_agreement.py's."""
    from tests.support.recovery import reference_run

    return reference_run(tmp_path_factory.mktemp("reference-1"), world=1)


@pytest.fixture(scope="session")
def digits(cluster: dict[str, Any], pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shipped digits job trained once (tests.support.digits_run): test_training.py,
    test_observability.py and test_model_registry.py each check their behaviours on this one run."""
    from tests.support.digits_run import digits_run

    return digits_run(tmp_path_factory.mktemp("digits"), tracked=not pytestconfig.getoption("--ray-only-cluster"))


@pytest.fixture
def storage(tmp_path: Path) -> str:
    return str(tmp_path / "runs")
