"""Recovery end to end on a real local Ray cluster: real signals, corrupt checkpoints. (S3:
test_checkpoint_s3.py; a full disk: tests/unit/checkpoint/test_checkpoint_disk_full.py.)

Every run is a small 2-worker MLP on digits so the file stays within a few minutes on 2 cores.
``log_every_steps=1`` makes the report history show every step, which is how steps redone
and steps lost are counted: a restarted worker group's first report carries ``resumed_from_step``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointManager, step_name
from runtime.launch.driver import TrainOutcome, train
from tests.support import ROOT, job, wait_for
from tests.support.cluster import WorkerGroupKiller, committed_steps, oldest_allowed_resume
from tests.support.trainer import train_in_process, train_ranks

pytestmark = pytest.mark.slow

MAX_STEPS = 200  # steps take ~20 ms here: long enough that every kill lands mid-run
INTERVAL = 10
# Small, fast and deterministic: 2 workers x 32 per worker = 64 samples per step.
BASE = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=1",
        "train.deterministic=true", "distributed.timeout_s=10", "schedule.warmup_steps=0",
        # Ray Train notices dead workers (and registers checkpoints) at its poll period.
        "distributed.poll_interval_s=0.25"]


def ckpt_dir(storage: str, run: str) -> Path:
    return Path(storage) / run / "checkpoints"


def restarts(history: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(last step reported before the restart, step resumed from, time of the first report after)."""
    out, last = [], 0
    for h in history:
        if "resumed_from_step" in h and last:
            out.append((last, h["resumed_from_step"], h["_time"]))
        last = h.get("step", last)
    return out


def final_model(uri: str, endpoint_url: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    with CheckpointManager(uri, endpoint_url=endpoint_url) as mgr:
        ref, payload, warnings = mgr.load_latest()
    assert ref is not None and payload is not None and not warnings, warnings
    return ref.step, payload["model"]


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TrainOutcome:
    """The uninterrupted run every interrupted Ray run must match bit for bit: the same trainer on
    2 gloo ranks of its own (what is proven is Ray's recovery, not this run)."""
    out = train_ranks("digits_smoke", tmp_path_factory.mktemp("reference"), *BASE, f"train.max_steps={MAX_STEPS}")
    assert out.metrics["step"] == MAX_STEPS
    return out


def test_worker_kills_resume_from_the_last_commit_before_the_kill_and_end_bit_identical(
        cluster: dict, storage: str, reference: TrainOutcome) -> None:
    """SIGKILL twice, then SIGTERM, to one worker each time; a dead peer fails in seconds, not a hang.

    Ray 2.60 workers exit on SIGTERM through Ray's own handler (the train function runs off the main
    thread and cannot install one), so a worker SIGTERM is a restart from the newest committed
    checkpoint, like a kill. The spot-notice path with an emergency checkpoint is the driver's SIGTERM.
    """
    run = "kills"
    cfg = job("digits_smoke", storage, *BASE, f"train.max_steps={MAX_STEPS}",
              f"checkpoint.interval_steps={INTERVAL}", "checkpoint.max_failures=5")
    # Each kill hits a new worker group once it has committed a checkpoint, so its restart shows in the history.
    with WorkerGroupKiller(ckpt_dir(storage, run), (signal.SIGKILL, signal.SIGKILL, signal.SIGTERM)) as killer:
        out = train(cfg, run, show_progress=False)
    kills = killer.kills
    assert len(kills) == 3, kills
    assert not out.error and out.metrics["step"] == MAX_STEPS and out.metrics["final"]
    seen = restarts(out.history)
    assert len(seen) == 3, seen
    for (killed_at, committed, sig), (last, resumed, first_after) in zip(kills, seen):
        # The exact guarantee (docs/checkpoints.md, "What a kill costs"): the newest commit before
        # the kill, and never older than the save before the newest one started (that one may have
        # been in flight and lost): fewer than INTERVAL steps redone, or up to 2 x INTERVAL - 1.
        assert resumed >= committed, f"resumed from {resumed}, but {committed} was committed before the kill"
        oldest = oldest_allowed_resume(last, committed, INTERVAL)
        assert resumed >= oldest, (f"redid {last - resumed} steps after {signal.Signals(sig).name} at step "
                                   f"{last}: resumed from {resumed}, older than {oldest}")
        assert first_after - killed_at < 60, f"{first_after - killed_at:.0f}s from kill to the next step"
    # Every step of the schedule ran once on the surviving timeline; the result equals no interruption.
    digests = out.metrics["rank_param_digests"]
    assert digests == reference.metrics["rank_param_digests"], (digests, reference.metrics["rank_param_digests"])
    assert_same_model(final_model(out.checkpoint_uri)[1], final_model(reference.checkpoint_uri)[1])


def test_driver_sigterm_commits_emergency_checkpoint_and_resume_loses_no_steps(
        cluster: dict, storage: str, reference: TrainOutcome) -> None:
    run = "preempted"
    sets = [*BASE, f"train.max_steps={MAX_STEPS}", "checkpoint.interval_steps=25", f"checkpoint.storage={storage}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--no-progress", "--run-name", run]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The run has reported step 25 once its checkpoint commits; stop it a few steps later.
        wait_for(lambda: 25 in committed_steps(ckpt_dir(storage, run)) or proc.poll() is not None, "checkpoint 25")
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-4000:]
    assert "PREEMPTED" in stdout and f"--run-name {run}" in stdout, stdout[-4000:]
    preempted_at = committed_steps(ckpt_dir(storage, run))[-1]
    assert 25 < preempted_at < MAX_STEPS, f"emergency checkpoint at {preempted_at}"
    with CheckpointManager(str(ckpt_dir(storage, run))) as mgr:
        assert mgr.list()[0][1] == "valid"
    assert f"step={preempted_at}" in stdout

    out = train(job("digits_smoke", storage, *sets), run, show_progress=False)
    first = out.history[0]
    assert first["resumed_from_step"] == preempted_at and first["step"] == preempted_at + 1, first
    assert out.metrics["step"] == MAX_STEPS and not out.preempted
    steps = [h["step"] for h in out.history if not h.get("final")]
    assert steps == list(range(preempted_at + 1, MAX_STEPS + 1))  # 0 steps lost, none run twice
    assert out.metrics["rank_param_digests"] == reference.metrics["rank_param_digests"]
    assert_same_model(final_model(out.checkpoint_uri)[1], final_model(reference.checkpoint_uri)[1])


def test_resume_skips_corrupt_checkpoints_and_says_why(cluster: dict, storage: str) -> None:
    """Manifest missing / truncated / one byte flipped / one file deleted: each newer one skipped, named."""
    run = "corrupt"
    cfg = job("digits_smoke", storage, *BASE, "train.max_steps=25", "checkpoint.interval_steps=5",
              "checkpoint.keep=5")
    # The checkpoints to corrupt come from the trainer in this process (Ray is not what makes them
    # valid or not); the resume below is a real 2-worker run on the cluster.
    train_in_process(cfg, Path(storage) / run)
    d = ckpt_dir(storage, run)
    assert committed_steps(d) == [5, 10, 15, 20, 25]
    (d / step_name(25) / "manifest.json").unlink()
    model = d / step_name(20) / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    opt = d / step_name(15) / "optimizer.pt"
    blob = bytearray(opt.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    opt.write_bytes(bytes(blob))
    (d / step_name(10) / "trainer.pt").unlink()

    out = train(cfg, run, show_progress=False)
    first = out.history[0]
    assert first["resumed_from_step"] == 5 and first["step"] == 6, first
    warnings = first["restore_warnings"]
    expected = [(25, "manifest.json missing"), (20, "model.pt size"), (15, "optimizer.pt sha256 mismatch"),
                (10, "trainer.pt missing")]
    assert len(warnings) == len(expected), warnings
    for w, (step, why) in zip(warnings, expected):
        assert w.startswith(step_name(step)) and why in w and w.endswith(f"using {step_name(5)}"), w
    assert out.metrics["step"] == 25
    assert final_model(str(d))[0] == 25  # the re-saved step_25 replaced the uncommitted folder
