"""``make bench BENCH=selfheal``: the self-healing loop's figures on the nspawn test hosts.

Runs tests/hosts/test_selfheal.py (a fresh lab: site.yml on a head and two workers, an elastic run
on the workers, the remediation service on the controller) ``SELFHEAL_ROUNDS`` times (default 1: a
round is a quarter of an hour, most of it the alerts' 2-minute ``for:`` and the replacement
playbook). Each round's figures are the ones the test prints under "nspawn lab timings", read from
the JSON its conftest writes (``LAB_TIMINGS_JSON``): per fault, seconds to the first step on fewer
workers and at full size again, the seconds until Ray's GCS declared the node dead (Ray's part
of the shrink; the rest is Ray Train's restart), the playbook's seconds and the steps redone. Goals:
fault -> fewer workers <= 30 s, fault -> full size <= 300 s, steps redone <= one checkpoint interval
(10) for a lost host and 0 for a spot notice.

Needs root and systemd-nspawn (tests/hosts/lab.py says what is missing); elsewhere it is skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"lost": "(a) worker host lost", "xid": "(b) GPU XID", "spot": "(c) spot notice"}
FIGURES = {"dead_s": "fault -> node declared dead (s)", "fewer_s": "fault -> fewer workers (s)",
           "full_s": "fault -> full size (s)",
           "playbook_s": "replace_node.yml (s)", "redone_shrink": "steps redone at the shrink",
           "redone_growth": "steps redone at the growth"}
GOALS = {"fewer_s": 30.0, "full_s": 300.0}
# Figures of one scenario. A GPU XID reaches the service through GpuXidErrors' `for: 1m`, so its
# shrink goal is counted from the service's drain, the part the platform decides.
EXTRA = {"xid_alert_s": "selfheal (b) GPU XID: XID -> the service drains (s)",
         "xid_drain_to_fewer_s": "selfheal (b) GPU XID: drain -> fewer workers (s)",
         "spot_notice_to_checkpoint_s": "selfheal (c) spot notice: notice -> just-in-time checkpoint (s)"}


def _lab_reason() -> str | None:
    sys.path.insert(0, str(ROOT / "tests" / "hosts"))
    import lab

    return lab.can_run_nspawn()


def _round(results_dir: Path, index: int) -> dict[str, float]:
    """One pytest run of the scenarios on a fresh lab; its timings, or an error with the log's tail."""
    timings = results_dir / f"selfheal.round{index}.timings.json"
    log = results_dir / f"selfheal.round{index}.log"
    timings.unlink(missing_ok=True)
    env = {**os.environ, "LAB_TIMINGS_JSON": str(timings), "HOSTS_PYTEST_ARGS": "-k test_selfheal"}
    with log.open("w") as out:
        code = subprocess.call(["make", "--no-print-directory", "test-hosts"], cwd=ROOT, env=env,
                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0 or not timings.exists():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"round {index}: make test-hosts exited {code} ({log}):\n" + "\n".join(tail))
    return json.loads(timings.read_text())


def summarise(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Each round's lab timings -> per fault and figure: the values, their median, the goal met."""
    result: dict[str, Any] = {"rounds": len(samples)}
    names = {f"{short}_{key}": f"selfheal {label}: {figure}"
             for short, label in SCENARIOS.items() for key, figure in FIGURES.items()} | EXTRA
    for key, name in names.items():
        values = [s[name] for s in samples if name in s]
        if len(values) != len(samples):
            raise RuntimeError(f"{len(samples) - len(values)} round(s) have no {name!r} in the lab timings")
        result[key] = values
        result[f"{key}_median"] = statistics.median(values)
    for short in SCENARIOS:
        for key, goal in GOALS.items():
            figure = "xid_drain_to_fewer_s" if (short, key) == ("xid", "fewer_s") else f"{short}_{key}"
            result[f"{short}_{key}_goal_met"] = result[f"{figure}_median"] <= goal
    result["lab"] = samples
    return result


def run(results_dir: Path) -> dict[str, Any]:
    reason = _lab_reason()
    if reason:
        msg = f"skipped: the nspawn test hosts cannot run here ({reason})"
        print(msg)
        return {"skipped": msg}
    rounds = int(os.environ.get("SELFHEAL_ROUNDS", "1"))
    samples = [_round(results_dir, i) for i in range(rounds)]
    return {"description": (__doc__ or "").split("\n\n")[0], **summarise(samples)}
