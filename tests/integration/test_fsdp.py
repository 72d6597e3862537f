"""FSDP2 on the real local Ray cluster (CPU, gloo, 2 workers), as one trial of a Tune search: the
shipped language-model job, one of its workers SIGKILLed at a known step, restarted by Tune from the
newest sharded checkpoint and ending bit-identical to the same job never interrupted. The search keeps
its storage (Tune's state, the trial's folder and its sharded checkpoints) on ``gs://``, Google Cloud
Storage's emulator on 127.0.0.1 (gcp-storage-emulator), reached by the driver, the trial and its workers
through the job's ``checkpoint.endpoint_url``; the uninterrupted reference writes to a local folder. That
FSDP trains the same model as DDP and that their checkpoints interchange is the trainer's arithmetic:
tests/unit/train/test_data_parallel.py. One run proves three things a run each proved before: FSDP's
sharded resume, a whole search on an object store, and Tune restarting a trial that runs a Ray Train run.

The kill lands at a known step through the trainer's test barrier (runtime.train.hold), which the search
hands its trial (runtime.tune.trial.SearchContext): both ranks wait at step ``FSDP_HOLD``, the test
waits for the commit before it, kills one rank and releases the hold.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointReader, open_storage
from runtime.layout import search_paths, trial_checkpoints, trial_storage
from runtime.train.hold import HOLD_ENV
from tests.support import free_port, job
from tests.support.behaviours import Behaviours
from tests.support.cluster import train_worker_pids
from tests.support.held_run import fault_when_held
from tests.support.object_stores import start_gcs_emulator, stop
from tests.support.trainer import train_ranks

pytestmark = pytest.mark.slow

# The trial: the shipped gpt_small job (FSDP2 over 2 workers, the standard library's text as bytes,
# seq_len 128, batch 16, AdamW) with only what the test needs changed:
# - 2 blocks of width 128 instead of 4 of 256 (0.5M parameters, not 3.3M): a fifth of a step's CPU
#   (measured here: 7 steps and the validation, one process, 5.6 s against 26 s); the same code path.
# - bit-identical to the reference: deterministic kernels, a constant LR, one torch thread per rank in
#   both runs (Ray gives each worker OMP_NUM_THREADS=1; the reference's forked ranks would take every core).
# - a short run with a commit and a report every FSDP_INTERVAL steps; a dead peer fails the group at once.
FSDP_STEPS, FSDP_INTERVAL = 6, 2
FSDP_HOLD = 4  # held before step 4's save: the newest commit is step 2's, and steps 3-4 are redone
FSDP = ("tracking.mlflow=false", "tracking.prometheus=false", "model.transformer.layers=2",
        "model.transformer.dim=128", "train.deterministic=true", "train.torch_threads=1", "schedule.name=constant",
        "schedule.warmup_steps=0", f"train.max_steps={FSDP_STEPS}", f"train.log_every_steps={FSDP_INTERVAL}",
        f"checkpoint.interval_steps={FSDP_INTERVAL}", "distributed.timeout_s=30", "distributed.poll_interval_s=0.25")
UNIFORM_LOSS = math.log(256)  # a uniform guess over 256 bytes: 5.545 nats
BUCKET = "rt-fsdp"


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """Google Cloud Storage's emulator (gcp-storage-emulator) on loopback, its bucket made: the endpoint."""
    port = free_port()
    proc = start_gcs_emulator(port, BUCKET)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def _committed_on_store(trials: str, endpoint: str) -> list[int]:
    """Steps committed under a search's trial folders on an object store (a manifest is the commit marker)."""
    keys = open_storage(trials, endpoint_url=endpoint).list()
    return sorted(int(k.split("/")[-2].split("_")[1]) for k in keys
                  if k.endswith("/manifest.json") and "/checkpoints/step_" in k)


def test_an_fsdp_trial_on_gs_whose_worker_dies_is_restarted_by_tune_and_ends_bit_identical(
        cluster: dict[str, Any], storage: str, gcs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped gpt_small job under FSDP2 on 2 Ray Train workers, as one trial of a search whose storage is
    ``gs://`` (the emulator, reached by the driver, the trial and its workers through
    ``checkpoint.endpoint_url``). A worker is SIGKILLed while both ranks are held at step ``FSDP_HOLD``
    (runtime.train.hold, handed to the trial by the search), after the sharded commit of the step before:
    Tune restarts the trial once, it resumes exactly from that commit, and its final checkpoint equals
    the same job trained without a kill, tensor for tensor. That FSDP trains the same model as DDP and
    their checkpoints interchange is the trainer's arithmetic (tests/unit/train/test_data_parallel.py)."""
    seen = Behaviours("an FSDP trial on gs://, a worker killed at a held step")
    # The uninterrupted run it must match: the same trainer on 2 gloo ranks of its own, on a local folder.
    reference = train_ranks("gpt_small", Path(storage) / "gpt-reference", *FSDP)
    assert reference.metrics["step"] == FSDP_STEPS, reference.metrics
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, f"{FSDP_HOLD}:{hold}")  # the search hands it to its trial (SearchContext)
    store = f"gs://{BUCKET}/searches"
    cfg = job("gpt_small", store, *FSDP, f"checkpoint.endpoint_url={gcs}", "tune.method=random",
              "tune.metric=train/loss", "tune.mode=min", "tune.num_samples=1", "tune.max_concurrent_trials=1",
              "tune.space={optimizer.lr: {choice: [0.001]}}")  # the job's own rate: the reference's
    trials = trial_storage(search_paths(cfg, "fsdp-kill")[1])
    before = FSDP_HOLD - FSDP_INTERVAL
    from runtime.tune import tune

    t, killed = fault_when_held(hold, FSDP_HOLD, 2, before, lambda: _committed_on_store(trials, gcs),
                                lambda: os.kill(train_worker_pids()[-1], signal.SIGKILL))
    out = tune(cfg, "fsdp-kill", show_progress=False)
    t.join(timeout=5)
    (trial,) = out.trials
    seen.check("the trial trains every step through a Ray Train run and ends",
               trial.status == "TERMINATED" and trial.runner == "train" and trial.steps == FSDP_STEPS,
               (trial.status, trial.runner, trial.steps))
    seen.check(f"a worker was killed while held at step {FSDP_HOLD}, step {before} the newest commit",
               killed[-1:] and killed[-1][-1:] == [before], killed)
    rows = trial.history
    since = [int(r["iterations_since_restore"]) for r in rows]  # Tune's count, from 1 again in each attempt
    restarts = [i for i in range(1, len(rows)) if since[i] <= since[i - 1]]
    # A report every FSDP_INTERVAL steps: the restarted attempt's first one is the first after the step it
    # resumed from (step 2 had reported before the kill; the held step 4 had not).
    seen.check("Tune restarted the trial once, from the newest commit before the kill",
               len(restarts) == 1 and int(rows[restarts[0]]["step"]) == before + FSDP_INTERVAL,
               [(r.get("step"), r.get("iterations_since_restore")) for r in rows])
    ckpts = trial_checkpoints(out.search_dir, out.name, trial.trial_id)
    seen.check("its checkpoints are on the emulator's bucket", ckpts.startswith(f"gs://{BUCKET}/"), ckpts)
    reader = CheckpointReader(ckpts, endpoint_url=gcs)
    seen.check("the newest checkpoint is sharded (manifest kind dcp)",
               reader.manifest(reader.candidates()[0])["kind"] == "dcp", reader.candidates())
    (a_step, a), (b_step, b) = _final_model(reference.checkpoint_uri), _final_model(ckpts, gcs)
    seen.check("the final checkpoint equals the uninterrupted run's, tensor for tensor",
               a_step == b_step == FSDP_STEPS and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
               (a_step, b_step, sorted(set(a) ^ set(b))))
    # The shipped job trains: a throughput in every report that times steps, a loss below a guess.
    rates = [r["train/tokens_per_s"] for r in rows if isinstance(r.get("train/tokens_per_s"), (int, float))]
    seen.check("tokens/s above 0 in every rate report", bool(rates) and all(r > 0 for r in rates), rates)
    val = rows[-1].get("val/loss")
    seen.check(f"val/loss below a uniform guess over 256 bytes ({UNIFORM_LOSS:.3f})",
               isinstance(val, float) and 0 < val < UNIFORM_LOSS, val)
    seen.verify()


def _final_model(checkpoints: str, endpoint: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    ref, payload, _ = CheckpointReader(checkpoints, endpoint_url=endpoint).load_latest()
    assert ref is not None and payload is not None
    return ref.step, payload["model"]
