"""What every run records about what it ran: one config hash and one list of versions, the same
in MLflow's tags and in a checkpoint's meta.json."""

from __future__ import annotations

import platform

import pytest
import torch

from runtime import versions as versions_module
from runtime.checkpoint.format import meta_doc
from runtime.config import config_hash, load_job, with_overrides
from runtime.versions import versions


def test_a_checkpoint_given_only_the_config_records_the_jobs_own_hash() -> None:
    cfg = load_job("digits_smoke")
    doc = meta_doc(5, {"config": cfg.model_dump(mode="json")}, snap_time=0.0)
    assert doc["config_hash"] == cfg.config_hash()
    assert doc["versions"] == versions()


def test_the_config_hash_ignores_key_order_and_changes_with_any_value() -> None:
    cfg = load_job("digits_smoke")
    dump = cfg.model_dump(mode="json")
    assert config_hash(dict(reversed(list(dump.items())))) == cfg.config_hash()
    assert with_overrides(cfg, ["optimizer.lr=0.02"]).config_hash() != cfg.config_hash()


def test_versions_name_python_each_package_and_unknown_for_one_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(versions_module, "PACKAGES", ("torch", "rt-no-such-distribution"))
    assert versions() == {"python": platform.python_version(), "torch": torch.__version__,
                          "rt-no-such-distribution": "unknown"}
