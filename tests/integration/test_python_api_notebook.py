"""Every runnable example of docs/python-api.md, in order, as a notebook would run them: load and
validate a job, train it on the session's local cluster (20 steps of the digits job, 1 worker), list its
checkpoints. The tune example is compiled only (tests/integration/test_tune.py runs tune())."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_python_api_docs import run_blocks


@pytest.mark.slow
def test_python_api_doc_examples_train_and_list_checkpoints_on_a_cluster(
    cluster: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the examples' runs/ folder lands here
    for k in [k for k in os.environ if k.startswith("RT_") and "__" in k]:
        monkeypatch.delenv(k)
    # A notebook's environment has no Ray token settings: train() finds the local cluster's token itself.
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    ns = run_blocks(("unit", "cluster"))
    outcome: Any = ns["outcome"]
    assert Path(outcome.run_dir).resolve().is_relative_to(tmp_path.resolve())
    assert (tmp_path / "runs" / "notebook-run" / "checkpoints").is_dir()
