"""A run paused by the spot price and resumed when it falls, end to end on the session's Ray cluster.

The price source is a price-table file the run re-reads when it changes (cost.price_table, what
a deployment's own price feed would write); the test raises the price once the run has reported
and lowers it once the driver says the run is paused. One digits run on one worker, two attempts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from runtime.launch.driver import train
from runtime.observe.cost.meter import LEDGER_FILE, PRICE_PAUSE_REASON, CostLedger
from runtime.observe.history import HISTORY_FILE
from runtime.observe.run_summary import summary_table
from tests.support import job, wait_for

pytestmark = pytest.mark.slow
MAX_STEPS = 200
LIMIT = 1.0  # USD per instance-hour


def set_spot_price(path: Path, usd_per_hour: float) -> None:
    """Rewrite the table atomically (the run may read it at any moment)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"instances:\n  g5.xlarge: {{on_demand: 1.006, spot: {usd_per_hour}}}\n")
    os.replace(tmp, path)


def reported_steps(run_dir: Path) -> list[int]:
    try:
        lines = (run_dir / HISTORY_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(ln).get("step", 0) for ln in lines if ln.strip()]


def ledger_state(run_dir: Path) -> str | None:
    try:
        return CostLedger.load(run_dir).state
    except ValueError:
        return None


def test_a_spot_price_above_the_limit_pauses_the_run_and_it_resumes_from_its_checkpoint_when_it_falls(
        cluster: dict, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    storage, prices, run = tmp_path / "runs", tmp_path / "spot.yaml", "spot-pause"
    set_spot_price(prices, 0.5)
    cfg = job("digits_smoke", str(storage), "distributed.num_workers=1", f"train.max_steps={MAX_STEPS}",
              "train.log_every_steps=5", "checkpoint.interval_steps=50", "cost.pricing=spot",
              "cost.instance_type=g5.xlarge", f"cost.price_table={prices}", "cost.price_ttl_s=0.1",
              f"cost.pause_above_usd_per_hour={LIMIT}", "cost.price_poll_s=0.2")
    run_dir = storage / run
    seen: dict[str, float] = {}

    def market() -> None:
        wait_for(lambda: any(s >= 5 for s in reported_steps(run_dir)), "the first report", timeout=120)
        set_spot_price(prices, 5.0)
        seen["raised"] = time.time()
        wait_for(lambda: ledger_state(run_dir) == "paused", "the pause", timeout=60)
        time.sleep(0.5)  # paused for a while: that time must not be billed
        set_spot_price(prices, 0.8)

    watcher = threading.Thread(target=market, daemon=True)
    watcher.start()
    t0 = time.time()
    out = train(cfg, run, show_progress=False)
    ended = time.time()
    wall = ended - t0
    watcher.join(timeout=5)

    # The run finished its length after one pause, resuming from the checkpoint the pause committed.
    assert "raised" in seen, "the run ended before the price rose"
    assert out.metrics["step"] == MAX_STEPS and not out.preempted and "stop_reason" not in out.metrics, out.metrics
    paused = [h for h in out.history if str(h.get("stop_reason", "")).startswith(PRICE_PAUSE_REASON)]
    assert len(paused) == 1 and "5 USD/h" in paused[0]["stop_reason"], paused
    at = paused[0]["step"]
    resumed = [h for h in out.history if "resumed_from_step" in h]
    assert resumed and resumed[0]["resumed_from_step"] == at and resumed[0]["step"] > at, resumed
    steps = [h["step"] for h in out.history if not h.get("final")]
    assert steps == sorted(steps) and at < MAX_STEPS  # no step run twice, none lost

    # The ledger (what `runtime report` shows): one pause, not billed; the spend counts both attempts.
    ledger = CostLedger.load(run_dir)
    assert ledger.state == "ended" and len(ledger.pauses) == 1 and ledger.pauses[0]["step"] == at
    assert ledger.paused_s >= 0.5 and ledger.billed_s + ledger.paused_s <= wall + 1
    # The final report's spend already holds the first attempt's; the ledger bills on to the attempt's
    # end (Ray Train's shutdown after that report: nodes are still up), at the report's rate.
    final = out.history[-1]
    assert final.get("final") and final["cost/estimated_dollars"] == out.metrics["cost/estimated_dollars"]
    after_report = ledger.spent_usd - final["cost/estimated_dollars"]
    assert 0 <= after_report <= final["cost/usd_per_hour"] * (ended - final["_time"]) / 3600, (
        ledger.spent_usd, final, ended)
    lines = summary_table(out.history, run_dir)
    assert "paused       1 time(s)" in "\n".join(lines) and (run_dir / LEDGER_FILE).exists()

    # The console said so, one line each way.
    err = capfd.readouterr().err
    assert err.count(f"[runtime] {PRICE_PAUSE_REASON}") == 1 and err.count("resuming after") == 1, err[-3000:]

    # MLflow: one run, the pause as a metric going 1 then 0, the state as a tag, the spend as metrics.
    client = MlflowClient(tracking_uri=out.mlflow_uri)
    assert [m.value for m in client.get_metric_history(out.mlflow_run_id, "cost/paused")] == [1.0, 0.0]
    tags = client.get_run(out.mlflow_run_id).data.tags
    assert tags["cost.state"] == "running" and tags["cost.last_pause"].startswith("spot price 0.8 USD/h")
    assert client.get_metric_history(out.mlflow_run_id, "cost/projected_dollars")
