"""The edges of one run, as a user meets them: Ctrl+C, a second Ctrl+C, a spot notice's SIGTERM, a final
save the disk could not take, a pause while the spot price is above the run's limit, then a resume that
must end bit-identical to the run never interrupted (workers killed: test_recovery.py).

One run name, five drivers in turn (four real ``python -m runtime train`` drivers on the session's local
cluster, then ``train()`` in process), its storage on a real 16 MiB tmpfs. Each fault (a signal, the disk
filled, the spot price raised) is injected while the trainer's test barrier (runtime.train.hold) holds
every rank at a known boundary, so nothing is raced against wall time. Each behaviour is checked by name
(tests.support.behaviours): one broken behaviour does not hide the others.

Six Ray Train runs of one worker each: one per driver, and the last driver's second attempt after the
price pause (runtime.launch.attempts: the driver itself waits, with no workers, and resumes). What
they prove is the driver's, so one worker does (the final model is compared with a one-rank
reference); that every rank stops at the boundary rank 0 read a stop marker at is proven on 2 gloo
ranks in tests/unit/train/test_stop_agreement.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from runtime.checkpoint import CheckpointReader
from runtime.launch.driver import TrainOutcome, train
from runtime.launch.runlock import LOCK_FILE
from runtime.observe.cost.meter import LEDGER_FILE, PRICE_PAUSE_REASON, CostLedger
from runtime.observe.history import read_history
from runtime.observe.run_summary import summary_table
from runtime.run import PREEMPT_FILE
from runtime.train.hold import HOLD_ENV, RELEASE_FILE, held_file
from tests.support import job, tmpfs, wait_for
from tests.support.behaviours import Behaviours
from tests.support.cluster import committed_steps
from tests.support.held_run import finish, start, wait_held
from tests.support.recovery import BASE, MAX_STEPS, assert_matches_reference

pytestmark = pytest.mark.slow

# No interval commit before the last signal (step 40): every commit until then is one a signal made. The
# first interval commit (50) is the one the full disk leaves newest. keep=3 holds 20, 40 and 50: no
# rotation frees room once the disk is filled, so every later save finds none.
SETS = [*BASE, "checkpoint.interval_steps=50", "checkpoint.keep=3", "distributed.num_workers=1"]
RANKS = 1

# The last driver's spot price (docs/cost.md): a price table the run re-reads when it changes (what a
# deployment's own price feed would write), raised while every rank is held at PAUSE_STEP (no interval
# commit there: the pause's own commit is the one resumed from), lowered once the driver is paused.
PAUSE_STEP = 75
LIMIT = 1.0  # USD per instance-hour
PRICE_TTL_S = 0.1  # cost.price_ttl_s (its floor): how long rank 0 reuses a price it read


def priced(table: Path) -> list[str]:
    """The last driver's cost rules and its MLflow run (where the pause is recorded)."""
    return ["tracking.mlflow=true", "cost.pricing=spot", "cost.instance_type=g5.xlarge", f"cost.price_table={table}",
            f"cost.price_ttl_s={PRICE_TTL_S}", f"cost.pause_above_usd_per_hour={LIMIT}", "cost.price_poll_s=0.2"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs (root only): a disk that fills up. The run needs well under 1 MiB of it (three
    ~100 KB digits-MLP checkpoints, the history of ~400 one-step reports, the lock and the curves)."""
    with tmpfs(tmp_path / "disk", 16) as mount:
        yield mount


def fill(disk: Path) -> None:
    """Write until the disk refuses (ENOSPC)."""
    with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left for close to flush
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass


def set_spot_price(path: Path, usd_per_hour: float) -> None:
    """Rewrite the table atomically (the run may read it at any moment)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"instances:\n  g5.xlarge: {{on_demand: 1.006, spot: {usd_per_hour}}}\n")
    os.replace(tmp, path)


def ledger_state(run_dir: Path) -> str | None:
    try:
        return CostLedger.load(run_dir).state
    except ValueError:  # read while being written
        return None


def market(prices: Path, hold: Path, run_dir: Path, seen: dict[str, Any]) -> None:
    """The spot price above the limit while every rank is held at PAUSE_STEP; back below it once the
    driver has been paused a while. Whatever happens, the ranks are released and the price falls:
    a failure here is reported by the test, not a run waiting for ever."""
    try:
        wait_for(lambda: all(held_file(hold, PAUSE_STEP, r).exists() for r in range(RANKS)),
                 f"every rank held at step {PAUSE_STEP}")
        set_spot_price(prices, 5.0)
        # Rank 0 last read the price at step 74's boundary, before it was held: one TTL on, its read at
        # this boundary is the file's, so the pause lands on PAUSE_STEP itself.
        time.sleep(PRICE_TTL_S)
        seen["raised"] = True
        (hold / RELEASE_FILE).touch()
        wait_for(lambda: ledger_state(run_dir) == "paused", "the pause")
        time.sleep(0.5)  # paused for a while: that time must not be billed
    except Exception as e:  # noqa: BLE001 - reported by the test's named check
        seen["error"] = repr(e)
    finally:
        (hold / RELEASE_FILE).touch()
        set_spot_price(prices, 0.8)


def _carrying(name: str, value: str) -> set[int]:
    """PIDs of the processes whose environment sets ``name`` to ``value`` (a run's hold reaches its
    workers through their runtime_env: launch.setup)."""
    found = set()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(name) == value:
                found.add(p.pid)
    return found


def _since_resume(run_dir: Path) -> list[dict[str, Any]]:
    """The run's reports from its newest resume on (a resumed driver's first report names its commit)."""
    reports = [r for r in read_history(run_dir) if not r.get("final")]
    starts = [i for i, r in enumerate(reports) if "resumed_from_step" in r]
    return reports[starts[-1]:] if starts else []


def _held_driver(storage: Path, run: str, hold: Path, step: int) -> subprocess.Popen[str]:
    proc = start(storage, run, SETS, (step, hold))
    wait_held(proc, step, hold, RANKS)
    return proc


def test_ctrl_c_twice_sigterm_full_disk_and_price_pause_commit_or_stop_as_documented_and_the_resume_is_bit_identical(
        cluster: dict, tmp_path: Path, small_disk: Path, reference_one_rank: TrainOutcome,
        monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """1. Ctrl+C at step 20: a commit at the boundary it reached, exit 130, the lock given back.
    2. Ctrl+C twice at step 30: the driver ends while its rank is still held, exit 130, the
       rank ends with it, nothing newer committed (the next driver resumes from 20), the lock file left
       naming it.
    3. The driver's SIGTERM (a spot notice) at step 40: it takes over the abandoned lock, commits an
       emergency checkpoint at 40, exit 0, PREEMPTED.
    4. The next driver resumes from 40; held at 55 after the commit of 50, the disk fills: its saves to
       the end fail, and a final save lost is not a clean finish: exit 5, the summary names the steps not
       committed and the commit it resumes from, no traceback, the newest commit still 50.
    5. The disk freed, the last driver resumes from 50. The spot price rises above its limit while its
       ranks are held at 75: rank 0 pauses the run there (a commit, the workers released); when the price
       falls the driver resumes it from 75, in the same outcome, ledger and MLflow run. The run loses no
       step, runs none twice and ends bit-identical to the uninterrupted run."""
    from mlflow.tracking import MlflowClient

    storage, run = small_disk / "runs", "signals"
    run_dir, checkpoints = storage / run, storage / run / "checkpoints"
    seen = Behaviours("driver signals")

    hold = tmp_path / "hold-20"
    proc = _held_driver(storage, run, hold, 20)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl+C does
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    seen.check("Ctrl+C exits 130 and says how to resume", proc.returncode == 130
               and f"INTERRUPTED by Ctrl+C (resume with --run-name {run})" in console, console)
    seen.check("Ctrl+C prints no traceback and loses no step", "Traceback" not in console
               and "NOT committed" not in console, console)
    seen.check("Ctrl+C commits at the boundary it reached (20)", committed_steps(checkpoints)[-1:] == [20],
               committed_steps(checkpoints))
    seen.check("Ctrl+C's driver gives its lock back", (run_dir / LOCK_FILE).read_text() == "",
               (run_dir / LOCK_FILE).read_text())

    hold = tmp_path / "hold-30"
    proc = _held_driver(storage, run, hold, 30)  # commits nothing: off the model's lineage
    try:
        ranks = _carrying(HOLD_ENV, f"30:{hold}") - {proc.pid}  # what its run started with this hold
        os.killpg(proc.pid, signal.SIGINT)
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=600)  # a hang guard; the rank stays held: the driver ends without it
        ended_while_held = not (hold / RELEASE_FILE).exists()
        # Released only once they are gone: a rank still alive would commit step 30 at its boundary (the
        # first Ctrl+C's marker is there), after the check below, into the next driver's resume.
        try:
            wait_for(lambda: not any(psutil.pid_exists(p) for p in ranks), "the second driver's ranks to end")
            ranks_gone = True
        except TimeoutError:
            ranks_gone = False
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    aborted = proc.pid
    seen.check("the second driver resumed from Ctrl+C's commit", "resuming from step_000000020" in console, console)
    seen.check("a second Ctrl+C stops at once, exit 130, its ranks still held", proc.returncode == 130
               and ended_while_held and f"second Ctrl+C: stopped at once; run again with --run-name {run}" in console,
               console)
    seen.check("a second Ctrl+C's ranks end with its driver, never released", bool(ranks) and ranks_gone, ranks)
    seen.check("a second Ctrl+C commits nothing newer", committed_steps(checkpoints)[-1:] == [20],
               committed_steps(checkpoints))
    left = json.loads((run_dir / LOCK_FILE).read_text() or "{}")
    seen.check("an abrupt end leaves the lock file naming its driver", left.get("pid") == aborted, left)

    hold = tmp_path / "hold-40"
    proc = _held_driver(storage, run, hold, 40)
    try:
        proc.send_signal(signal.SIGTERM)  # a spot notice reaches the driver alone
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    seen.check("the next driver resumes from Ctrl+C's commit (20): the second Ctrl+C's committed nothing",
               "resuming from step_000000020" in console, console)
    seen.check("the next driver takes over the lock an abrupt end left", f"took over the lock of pid {aborted} on host"
               in console, console)
    seen.check("SIGTERM exits 0, PREEMPTED, and says how to resume", proc.returncode == 0 and "PREEMPTED" in console
               and f"--run-name {run}" in console, console)
    seen.check("SIGTERM commits an emergency checkpoint at the held step (40)",
               committed_steps(checkpoints)[-1:] == [40] and "step=40" in console, (committed_steps(checkpoints),
                                                                                      console))
    newest = CheckpointReader(str(checkpoints)).list()[0]
    seen.check("the emergency checkpoint verifies", newest[1] == "valid", newest)

    hold = tmp_path / "hold-55"
    proc = _held_driver(storage, run, hold, 55)
    try:
        wait_for(lambda: 50 in committed_steps(checkpoints), "the commit of step 50")
        # Rank 0 reported 54 before its hold: the driver has it once its history does.
        wait_for(lambda: [r.get("step") for r in _since_resume(run_dir)][-1:] == [54], "the report of step 54")
        resumed = _since_resume(run_dir)
        fill(small_disk)
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    seen.check("the resume starts at the step after the emergency commit",
               "resuming from step_000000040" in console and resumed[0].get("resumed_from_step") == 40
               and [r.get("step") for r in resumed] == list(range(41, 55)), (resumed[:1], console))
    seen.check("a final save lost to a full disk exits 5: finished, but its last steps are NOT in a checkpoint",
               proc.returncode == 5 and f"run {run}: finished, but its last steps are NOT in a checkpoint" in console,
               console)
    seen.check("a final save lost to a full disk names the steps not committed and where the run resumes",
               f"checkpoint:   steps 51-{MAX_STEPS} NOT committed (the final save failed: see the lines above); the "
               f"newest committed checkpoint is step 50, where --run-name {run} resumes" in console, console)
    seen.check("a final save lost to a full disk prints no traceback", "Traceback" not in console, console)
    seen.check("a full disk leaves the newest commit at 50", committed_steps(checkpoints)[-1:] == [50],
               committed_steps(checkpoints))

    (small_disk / "filler").unlink()
    prices, hold = tmp_path / "spot.yaml", tmp_path / f"hold-{PAUSE_STEP}"
    prices_seen: dict[str, Any] = {}
    set_spot_price(prices, 0.5)
    monkeypatch.setenv(HOLD_ENV, f"{PAUSE_STEP}:{hold}")  # each attempt's workers get it (launch.setup)
    watcher = threading.Thread(target=market, args=(prices, hold, run_dir, prices_seen), daemon=True)
    watcher.start()
    capfd.readouterr()  # the console from here on is the last driver's
    t0 = time.time()
    out = train(job("digits_smoke", str(storage), *SETS, *priced(prices)), run, show_progress=False)
    ended = time.time()
    watcher.join(timeout=5)
    err = capfd.readouterr().err

    first = out.history[0]
    seen.check("the disk freed, the resume starts at the step after the newest commit (50)",
               first.get("resumed_from_step") == 50 and first.get("step") == 51, first)
    steps = [h["step"] for h in out.history if not h.get("final")]
    seen.check("the resume loses no step and runs none twice, across the pause",
               steps == list(range(51, MAX_STEPS + 1)), steps)
    seen.check("the resume finishes clean", out.metrics["step"] == MAX_STEPS and not out.preempted
               and "stop_reason" not in out.metrics and out.uncommitted_steps() is None
               and committed_steps(checkpoints)[-1] == MAX_STEPS,
               (out.metrics.get("step"), out.preempted, out.metrics.get("stop_reason"), committed_steps(checkpoints)))
    try:
        assert_matches_reference(out, reference_one_rank)
        seen.check("the signalled and paused run ends bit-identical to the uninterrupted one", True)
    except AssertionError as e:
        seen.check("the signalled and paused run ends bit-identical to the uninterrupted one", False, e)

    seen.check(f"the spot price rose while every rank was held at {PAUSE_STEP}",
               prices_seen.get("raised") is True and "error" not in prices_seen, prices_seen)
    paused = [h for h in out.history if str(h.get("stop_reason", "")).startswith(PRICE_PAUSE_REASON)]
    seen.check(f"a spot price above the limit pauses the run once, at the held step ({PAUSE_STEP}), naming the price",
               len(paused) == 1 and "5 USD/h" in paused[0]["stop_reason"] and paused[0]["step"] == PAUSE_STEP, paused)
    resumes = [(h.get("resumed_from_step"), h.get("step")) for h in out.history if "resumed_from_step" in h]
    seen.check(f"the price fallen, the driver resumes the run from the pause's commit ({PAUSE_STEP})",
               resumes == [(50, 51), (PAUSE_STEP, PAUSE_STEP + 1)], resumes)
    ledger = CostLedger.load(run_dir)
    seen.check("the ledger: one pause, at its step, and the run ended",
               ledger.state == "ended" and len(ledger.pauses) == 1 and ledger.pauses[0]["step"] == PAUSE_STEP, ledger)
    wall = ended - t0
    seen.check("paused time is not billed: billed and paused time add up to no more than the driver's",
               ledger.paused_s >= 0.5 and ledger.billed_s + ledger.paused_s <= wall + 1,
               (ledger.paused_s, ledger.billed_s, wall))
    # The final report's spend already holds the first attempt's; the ledger bills on to the attempt's
    # end (Ray Train's shutdown after that report: nodes are still up), at the report's rate.
    final = out.history[-1]
    final_spend = final.get("cost/estimated_dollars", float("nan"))
    after_report = ledger.spent_usd - final_spend
    seen.check("the final report's spend is the outcome's, and the ledger bills on to the attempt's end at its rate",
               bool(final.get("final")) and final_spend == out.metrics.get("cost/estimated_dollars")
               and 0 <= after_report <= final.get("cost/usd_per_hour", 0.0) * (ended - final["_time"]) / 3600,
               (ledger.spent_usd, final, ended))
    lines = "\n".join(summary_table(out.history, run_dir))
    seen.check("the run's summary counts the pause, from the ledger file",
               "paused       1 time(s)" in lines and (run_dir / LEDGER_FILE).exists(), lines)
    seen.check("the console says so, one line each way",
               err.count(f"[runtime] {PRICE_PAUSE_REASON}") == 1 and err.count("resuming after") == 1, err[-3000:])
    client, mlflow_run = MlflowClient(tracking_uri=out.mlflow_uri), str(out.mlflow_run_id)
    paused_metric = [m.value for m in client.get_metric_history(mlflow_run, "cost/paused")]
    tags = client.get_run(mlflow_run).data.tags
    seen.check("MLflow: one run, the pause as a metric going 1 then 0, the state and last pause as tags",
               paused_metric == [1.0, 0.0] and tags.get("cost.state") == "running"
               and tags.get("cost.last_pause", "").startswith("spot price 0.8 USD/h"), (paused_metric, tags))
    projected = client.get_metric_history(mlflow_run, "cost/projected_dollars")
    seen.check("MLflow: the projected spend", bool(projected), projected)
    seen.verify()
