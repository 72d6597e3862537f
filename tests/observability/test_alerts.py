"""Alert rules in alerts/: required fields, runbook anchors, named thresholds,
and promtool's own checks and unit tests (real promtool from .tools) of the rules as rendered
(runbook links added by alerts/runbooks.py; the sources carry none).

Run: .venv/bin/python -m pytest tests/observability
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
import yaml

from alerts import runbooks
from runtime.observe.catalog import series_samples

ROOT = Path(__file__).resolve().parents[2]
ALERTS_DIR = ROOT / "alerts"
RULE_FILES = sorted(ALERTS_DIR.glob("*.rules.yml"))
TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.test.yml"))
RUNBOOK = (ALERTS_DIR / "runbook.md").read_text()
RUNBOOK_PATH = "alerts/runbook.md#"
EVALUATION_S = 60  # evaluation_interval of every alerts/tests/*.test.yml


def load_alerts() -> list[tuple[Path, dict]]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend((path, rule) for rule in group["rules"] if "alert" in rule)
    return out


ALERTS = load_alerts()
ALERT_NAMES = [rule["alert"] for _, rule in ALERTS]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    """alerts/ as every consumer gets it: rules and promtool tests with the runbook links added."""
    return runbooks.render_tree(tmp_path_factory.mktemp("rendered"))


def duration_s(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    total = sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", text))
    assert re.fullmatch(r"(\d+[smhd])+", text), f"unsupported duration {text!r}"
    return total


def runbook_anchors() -> set[str]:
    """GitHub-style anchors of the runbook's headings."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", RUNBOOK, flags=re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(anchor)
    return anchors


def test_the_expected_alerts_exist_once():
    expected = {
        "NodeDown",
        "RayNodeDown",
        "GpuTemperatureHigh",
        "GpuXidErrors",
        "GpuMemoryNearFull",
        "GpuUtilizationLow",
        "TrainingStalled",
        "TrainingThroughputDrop",
        "TrainingHighCommunicationShare",
        "TrainingBelowMaxWorkers",
        "TrainingStraggler",
        "CheckpointFailing",
        "CheckpointStale",
        "CheckpointStorageAlmostFull",
        "CheckpointFilesystemAlmostFull",
        "RemediationHalted",
        "RemediationFailed",
        "LogShippingStopped",
    }
    assert sorted(ALERT_NAMES) == sorted(expected)


@pytest.mark.parametrize("path,rule", ALERTS, ids=ALERT_NAMES)
def test_alert_has_for_severity_summary_and_description(path, rule):
    name = rule["alert"]
    assert duration_s(rule.get("for", "")) > 0, f"{name}: needs a non-zero `for`"
    assert rule["labels"]["severity"] in {"warning", "critical"}, name
    annotations = rule["annotations"]
    for key in ("summary", "description"):
        assert annotations.get(key, "").strip(), f"{name}: missing annotation {key}"


def test_every_rendered_alert_carries_its_runbook_link_to_an_existing_anchor(rendered):
    rules, _ = rendered
    anchors = runbook_anchors()
    linked = {rule["alert"]: rule["annotations"]["runbook_url"]
              for path in rules for group in yaml.safe_load(path.read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    assert sorted(linked) == sorted(ALERT_NAMES)
    for name, url in linked.items():
        assert url == runbooks.BASE_URL + RUNBOOK_PATH + name.lower(), url
        assert url.rpartition("#")[2] in anchors, f"{name}: runbook.md has no section #{url.rpartition('#')[2]}"


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_runbook_section_covers_meaning_impact_diagnosis_and_fix(name):
    match = re.search(rf"^## {name}\n(.*?)(?=^## |\Z)", RUNBOOK, flags=re.MULTILINE | re.DOTALL)
    assert match, f"runbook.md lacks '## {name}'"
    for part in ("**Meaning.**", "**Impact.**", "**Diagnosis.**", "**Fix.**"):
        assert part in match.group(1), f"{name}: runbook section lacks {part}"


def test_node_down_runbooks_give_the_replace_node_command():
    for name in ("NodeDown", "RayNodeDown"):
        section = re.search(rf"^## {name}\n(.*?)(?=^## |\Z)", RUNBOOK, flags=re.MULTILINE | re.DOTALL).group(1)
        assert "ansible-playbook -i <inventory> ansible/playbooks/replace_node.yml -e node=<name>" in section
        assert "make replace-node NODE=<name>" in section
        assert "docs/operations.md" in section


def test_rendering_keeps_every_rule_and_expectation_and_adds_only_the_link(rendered):
    rules, tests = rendered
    for source, out in zip([*RULE_FILES, *TEST_FILES], [*rules, *tests], strict=True):
        lines = out.read_text().splitlines(keepends=True)
        stripped = "".join(line for line in lines if not line.lstrip().startswith("runbook_url:"))
        assert yaml.safe_load(stripped) == yaml.safe_load(source.read_text()), out.name


def test_a_new_base_moves_every_link():
    data = yaml.safe_load((ALERTS_DIR / "training.rules.yml").read_text())
    rebased = runbooks.link_rules(data, "training.rules.yml", base="https://runbooks.example/")
    urls = [r["annotations"]["runbook_url"] for g in rebased["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(u == f"https://runbooks.example/alerts/runbook.md#{u.rpartition('#')[2]}" for u in urls)


def test_a_source_carrying_a_runbook_link_is_refused_naming_the_file_and_alert():
    linked = runbooks.link_rules(yaml.safe_load((ALERTS_DIR / "nodes.rules.yml").read_text()), "nodes.rules.yml")
    with pytest.raises(ValueError, match=r"^x\.rules\.yml: NodeDown carries runbook_url; remove it"):
        runbooks.link_rules(linked, "x.rules.yml")
    tests = runbooks.link_tests(yaml.safe_load((ALERTS_DIR / "tests" / "nodes.test.yml").read_text()), "t")
    with pytest.raises(ValueError, match=r"^y\.test\.yml: NodeDown carries runbook_url"):
        runbooks.link_tests(tests, "y.test.yml")
    with pytest.raises(ValueError, match=r"^z\.yml: expected a rule file with a top-level `groups` list"):
        runbooks.link_rules({"annotations": {}}, "z.yml")


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_every_runtime_series_an_alert_rule_reads_is_declared_in_the_catalog(path):
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            # rt_* names standing alone (a recording rule's job_id:rt_...:sum is not an exported series)
            for metric in re.findall(r"(?<![\w:])rt_[a-z0-9_]+(?![\w:])", rule["expr"]):
                assert metric in series_samples(), f"{path.name}: {metric} is not in runtime/observe/catalog.py"


def declared_thresholds(path: Path) -> dict[str, str]:
    """`#   NAME = value` lines of a rule file's header comment."""
    return dict(
        re.findall(
            r"^#\s+([A-Z][A-Z0-9_]+) = (\"[^\"]*\"|[0-9.]+)",
            path.read_text(),
            flags=re.MULTILINE,
        )
    )


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_every_literal_in_an_alert_expression_is_a_named_threshold(path):
    declared = declared_thresholds(path)
    used = set()
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            for line in rule["expr"].splitlines():
                code, _, comment = line.partition("#")
                names = re.findall(r"[A-Z][A-Z0-9_]+", comment)
                # Numbers outside strings, range selectors and label lists.
                bare = re.sub(r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]', " ", code)
                numbers = re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", bare)
                strings = re.findall(r'"((?:[^"\\]|\\.)*)"', code)
                if numbers:
                    assert names, f"{rule['alert']}: literal {numbers} without a `# NAME` comment: {line!r}"
                for name in names:
                    assert name in declared, f"{rule['alert']}: {name} is not declared in {path.name}'s header"
                    value = declared[name]
                    if value.startswith('"'):
                        assert value.strip('"') in strings, f"{rule['alert']}: {name}={value} not in {line!r}"
                    else:
                        assert float(value) in [float(n) for n in numbers], (
                            f"{rule['alert']}: {name}={value} not in {line!r}"
                        )
                    used.add(name)
    assert used == set(declared), f"{path.name}: declared but unused thresholds {set(declared) - used}"


def test_promtool_check_rules_accepts_every_rendered_rule_file(promtool, rendered):
    rules, _ = rendered
    done = subprocess.run(
        [str(promtool), "check", "rules", *map(str, rules)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(RULE_FILES)


def test_promtool_unit_tests_pass_on_the_rendered_rules(promtool, rendered):
    _, tests = rendered
    done = subprocess.run(
        [str(promtool), "test", "rules", *map(str, tests)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def alert_test_evaluations() -> dict[str, list[tuple[int, int, bool]]]:
    """alertname -> (test group index, eval seconds, fires?) from alerts/tests."""
    out: dict[str, list] = {}
    for path in TEST_FILES:
        spec = yaml.safe_load(path.read_text())
        for i, test in enumerate(spec["tests"]):
            for case in test.get("alert_rule_test", []):
                out.setdefault(case["alertname"], []).append(
                    (
                        f"{path.name}#{i}",
                        duration_s(case["eval_time"]),
                        bool(case.get("exp_alerts")),
                    )
                )
    return out


def test_alert_unit_tests_evaluate_every_minute():
    for path in TEST_FILES:
        spec = yaml.safe_load(path.read_text())
        assert duration_s(spec["evaluation_interval"]) == EVALUATION_S, path.name


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_every_alert_is_tested_not_firing_then_firing_one_evaluation_apart(name):
    evaluations = alert_test_evaluations().get(name, [])
    pairs = [
        (quiet, fire)
        for group, quiet, fires in evaluations
        if not fires
        for group2, fire, fires2 in evaluations
        if fires2 and group2 == group and fire - quiet == EVALUATION_S
    ]
    assert pairs, f"{name}: no promtool test shows it quiet one evaluation before it fires"


def _mutated_for(promtool: Path, tmp_path: Path, name: str, delta_s: int) -> subprocess.CompletedProcess:
    """Copy alerts/ to tmp with `name`'s `for` moved by delta_s, run promtool tests."""
    work = tmp_path / f"{name}{delta_s:+d}"
    shutil.copytree(ALERTS_DIR, work)
    for path in work.glob("*.rules.yml"):
        text = path.read_text()
        pattern = re.compile(rf"(- alert: {name}\n(?:.*\n)*?\s+for: )(\w+)")
        match = pattern.search(text)
        if match:
            new = f"{duration_s(match.group(2)) + delta_s}s"
            path.write_text(text[: match.start(2)] + new + text[match.end(2) :])
    tests = [p for p in sorted((work / "tests").glob("*.test.yml")) if f"alertname: {name}\n" in p.read_text()]
    assert tests, f"no promtool test for {name}"
    return subprocess.run(
        [str(promtool), "test", "rules", *map(str, tests)],
        check=False,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_promtool_tests_catch_a_shorter_or_longer_for_window(name, tmp_path, promtool):
    """The unit tests pin each `for` window from both sides: one evaluation
    interval (1m) shorter fires too early, one longer fires too late."""
    shorter = _mutated_for(promtool, tmp_path, name, -EVALUATION_S)
    assert shorter.returncode != 0 and name in shorter.stdout, f"{name}: a 1m shorter `for` went unnoticed"
    longer = _mutated_for(promtool, tmp_path, name, EVALUATION_S)
    assert longer.returncode != 0 and name in longer.stdout, f"{name}: a 1m longer `for` went unnoticed"


def test_a_real_prometheus_loads_and_evaluates_every_rule_without_errors(prometheus_factory, node_exporter,
                                                                        rendered):
    """Rules loaded by Prometheus itself (as cluster-up and the Ansible role do),
    evaluated every second against a real node exporter's series."""
    server = prometheus_factory(
        rule_files=[str(p) for p in rendered[0]],
        scrape_configs=[{"job_name": "node", "static_configs": [{"targets": [node_exporter]}]}],
    )
    server.wait_for('count_over_time(up{job="node"}[1m]) >= 3', timeout_s=30)
    groups = requests.get(f"{server.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert sorted(r["name"] for r in rules if r["type"] == "alerting") == sorted(ALERT_NAMES)
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
    # The node exporter is up, so NodeDown is inactive.
    node_down = next(r for r in rules if r["name"] == "NodeDown")
    assert node_down["state"] == "inactive"
