"""The job's runtime_env (readable through Ray's Jobs API) carries settings, never AWS secrets."""

from __future__ import annotations

import os

import pytest

from runtime.launch.setup import _run_worker_env, _worker_env, current_test_hooks, use_test_hooks
from runtime.train.hold import HOLD_ENV
from runtime.train.sample_log import SAMPLES_ENV

SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIASENTINEL",
    "AWS_SECRET_ACCESS_KEY": "secret-sentinel",
    "AWS_SESSION_TOKEN": "token-sentinel",
    "AWS_SECURITY_TOKEN": "legacy-token-sentinel",
}
SETTINGS = {
    "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
    "AWS_DEFAULT_REGION": "eu-west-1",
    "RT_S3_SSE": "aws:kms",
    "RT_S3_SSE_KMS_KEY_ID": "alias/ckpt",
}


def test_worker_env_forwards_endpoint_region_and_encryption_but_no_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {**SECRETS, **SETTINGS}.items():
        monkeypatch.setenv(key, value)
    env = _worker_env()
    assert not set(SECRETS) & set(env)
    assert not set(SECRETS.values()) & set(env.values())
    assert {k: env[k] for k in SETTINGS} == SETTINGS


def test_a_tests_step_barrier_goes_with_each_run_not_with_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process fixes its job's runtime_env at its first connect: a hold set after it reaches the next
    run's workers only through that run's own runtime_env, and a run without one carries none."""
    monkeypatch.setenv(HOLD_ENV, "60@1:/tmp/hold")
    assert HOLD_ENV not in _worker_env()
    assert _run_worker_env()["env_vars"][HOLD_ENV] == "60@1:/tmp/hold"
    monkeypatch.delenv(HOLD_ENV)
    assert HOLD_ENV not in _run_worker_env()["env_vars"]


def test_a_trial_process_takes_its_searchs_test_hooks_and_no_earlier_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial process has the job's environment, not the driver's: the search hands its hooks over, and a
    process Tune reuses for the next search's trial keeps none of the last search's."""
    monkeypatch.setenv(HOLD_ENV, "30:/tmp/earlier")
    monkeypatch.setenv(SAMPLES_ENV, "/tmp/earlier-samples")  # restored (unset) by monkeypatch whatever happens
    use_test_hooks({SAMPLES_ENV: "/tmp/samples", "PATH": "/nowhere"})
    assert os.environ[SAMPLES_ENV] == "/tmp/samples" and HOLD_ENV not in os.environ
    assert os.environ["PATH"] != "/nowhere"  # only the hooks' own names
    assert _run_worker_env()["env_vars"][SAMPLES_ENV] == "/tmp/samples"
    use_test_hooks({})
    assert not current_test_hooks()
