"""Bad input to the remediation service's policy and the spot agent's command line, fed for real:
the file written, the entry point run as a subprocess. Each is refused with exit 2 and one line on
stderr naming the field (or file) and what was expected; no traceback, no hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = {
    "webhook": {"token_file": "/etc/remediation/webhook-token"},
    "state_dir": "/var/lib/remediation/state",
    "nodes": {"gpu-0": "10.0.0.21"},
    "replace": {"command": ["true", "{node}"]},
    "rules": [{"alert": "NodeDown", "instance_port": 9100, "actions": ["drain", "replace"]}],
}


def _one_line_refusal(argv: list[str]) -> str:
    """Run `argv`; assert exit 2 and exactly one stderr line without a traceback; return that line."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def _check(path: Path) -> str:
    return _one_line_refusal(["-m", "ops.remediation", "--policy", str(path), "--check"])


def test_the_good_policy_of_these_cases_passes(tmp_path: Path) -> None:
    """Control: every refusal below comes from its one change."""
    (tmp_path / "p.yml").write_text(yaml.safe_dump(GOOD))
    done = subprocess.run([sys.executable, "-m", "ops.remediation", "--policy", str(tmp_path / "p.yml"), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("change", "field", "says"), [
    ({"limits": {"per_node_per_hour": True}}, "limits.per_node_per_hour", "valid integer (got True)"),
    ({"limits": {"total_per_hour": 2.5}}, "limits.total_per_hour", "valid integer"),
    ({"drain": {"deadline_s": False}}, "drain.deadline_s", "valid integer"),
    ({"drain": {"wait_s": True}}, "drain.wait_s", "valid number"),
    ({"drain": {"wait_s": float("inf")}}, "drain.wait_s", "finite number"),
    ({"drain": {"wait_s": 1e9}}, "drain.wait_s", "less than or equal to 3600"),
    ({"replace": {"command": ["true", "{node}"], "timeout_s": float("nan")}}, "replace.timeout_s", "finite"),
    ({"replace": {"command": ["true", "{node}"], "timeout_s": 0}}, "replace.timeout_s", "greater than 0"),
    ({"replace": {"command": ["true", "{node}"], "timeout_s": -5}}, "replace.timeout_s", "greater than 0"),
    ({"webhook": {"token_file": "/t", "max_alert_age_s": float("inf")}}, "webhook.max_alert_age_s", "finite"),
    ({"webhook": {"token_file": "token"}}, "webhook.token_file", "absolute path"),
    ({"listen": "127.0.0.1:99999"}, "listen", "port in 1-65535"),
    ({"listen": "127.0.0.1:0"}, "listen", "port in 1-65535"),
    ({"listen": "0.0.0.0:9105"}, "listen", "not every interface"),
    ({"listen": "0:9105"}, "listen", "not every interface"),
    ({"listen": "[::]:9105"}, "listen", "not every interface"),
    # inet_aton reads these as 0.0.0.0 too: Python would bind every interface.
    ({"listen": "0.0:9105"}, "listen", "not every interface"),
    ({"listen": "0x0:9105"}, "listen", "not every interface"),
    ({"listen": "[::ffff:0.0.0.0]:9105"}, "listen", "not every interface"),
    ({"drain": {"gcs_address": "10.0.0.11"}}, "drain.gcs_address", "host:port"),
    ({"rules": [{"alert": "NodeDown", "instance_port": True, "actions": ["drain"]}]}, "rules.0.instance_port",
     "valid integer"),
    ({"rules": [{"alert": "NodeDown", "instance_port": 70000, "actions": ["drain"]}]}, "rules.0.instance_port",
     "65535"),
    ({"dry_run": "yes"}, "dry_run", "valid boolean"),
    ({"alertmanager": {"url": "file:///etc/passwd"}}, "alertmanager.url", "http:// or https://"),
    ({"alertmanager": {"url": "http://10.0.0.11:9093", "user": "am"}}, "alertmanager", "go together"),
    ({"alertmanager": {"url": "http://10.0.0.11:9093", "timeout_s": True}}, "alertmanager.timeout_s", "valid number"),
])
def test_a_bad_policy_value_is_refused_naming_its_field(tmp_path: Path, change: dict[str, Any], field: str,
                                                         says: str) -> None:
    path = tmp_path / "policy.yml"
    path.write_text(yaml.safe_dump({**GOOD, **change}))
    line = _check(path)
    assert f"{path}: {field}: " in line and says in line, line


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"), "not UTF-8 text"),
    (lambda p: p.write_bytes(b"listen: \xe9\n"), "not UTF-8 text"),
    (lambda p: p.mkdir(), "must be a regular file, not a directory"),
    (lambda p: os.mkfifo(p), "must be a regular file, not a special file"),
    (lambda p: None, "cannot read the policy file: No such file or directory"),
    (lambda p: p.write_text("rules: [unclosed\n"), "not YAML"),
    (lambda p: p.write_text("- a list\n"), "expected a mapping"),
    (lambda p: p.write_text("x" * (2 << 20)), "more than 1048576"),
])
def test_a_policy_file_that_is_not_one_is_refused_in_one_line(tmp_path: Path, make: Any, says: str) -> None:
    path = tmp_path / "policy.yml"
    make(path)
    line = _check(path)
    assert str(path) in line and says in line, line


SPOT = ["-m", "ops.remediation.spot"]
SPOT_GOOD = {"--gcs-address": "10.0.0.11:6379", "--node-address": "10.0.0.21", "--imds": "http://127.0.0.1:1",
             "--interval": "5"}


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--interval", "0", "above 0"),
    ("--interval", "-1", "above 0"),
    ("--interval", "inf", "finite"),
    ("--interval", "nan", "finite"),
    ("--interval", "3600", "at most 60"),
    ("--interval", "soon", "number of seconds"),
    ("--imds", "file:///etc/passwd", "http:// or https://"),
    ("--imds", "169.254.169.254", "http:// or https://"),
    ("--imds", "http://169.254.169.254:99999", "http(s) URL"),
    ("--gcs-address", "10.0.0.11:99999", "port in 1-65535"),
    ("--gcs-address", "10.0.0.11", "host:port"),
    ("--node-address", "worker-1", "IP address"),
    ("--node-address", "10.0.0.21:0", "1-65535"),
])
def test_a_bad_spot_agent_argument_is_refused_naming_it(option: str, value: str, says: str) -> None:
    args = {**SPOT_GOOD, option: value}
    line = _one_line_refusal([*SPOT, *[part for item in args.items() for part in item]])
    assert option in line and says in line, line


def test_a_missing_spot_agent_argument_is_one_line() -> None:
    line = _one_line_refusal([*SPOT, "--node-address", "10.0.0.21"])
    assert "--gcs-address" in line, line
