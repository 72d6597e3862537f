"""Fixtures for the nspawn test hosts: one lab (netns + bridge + 3 nodes) per session.

The golden image and the offline apt repository / wheelhouse are cached under
.cache/hosts/; the lab itself (netns, nodes, overlays) is torn down in the
fixture's finalizer whatever the tests did, and also when the run is stopped:
SIGTERM and SIGHUP (a CI timeout, a killed make) and SIGINT (which a shell leaves
ignored for a command it started in the background) interrupt it as Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import lab as labmod  # noqa: E402

ANSIBLE_DIR = labmod.ROOT / "ansible"
OPS_BIN = Path(sys.executable).parent
TIMINGS: dict[str, float] = {}  # seconds, and counts (steps redone, group starts) as ints
NOTES: dict[str, str] = {}  # what a figure alone does not say (why a step took the path it took)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("nspawn lab timings")
        for key, value in TIMINGS.items():
            terminalreporter.write_line(f"{key:<40} {value:7d}" if isinstance(value, int) else
                                        f"{key:<40} {value:7.1f} s")
        for key, note in NOTES.items():
            terminalreporter.write_line(f"{key}: {note}")
        # For `make bench BENCH=selfheal` (benchmarks/bench_selfheal.py), which reads them back.
        if os.environ.get("LAB_TIMINGS_JSON"):
            Path(os.environ["LAB_TIMINGS_JSON"]).write_text(json.dumps(TIMINGS, indent=1))


class Ansible:
    def __init__(self, lab: labmod.Lab, inventory: Path):
        self.lab = lab
        self.inventory = inventory

    def playbook(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ,
                   ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
                   ANSIBLE_SSH_CONTROL_PATH_DIR=str(self.lab.workdir / "cp"),
                   ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1", ANSIBLE_CALLBACK_RESULT_FORMAT="json",
                   PATH=f"{OPS_BIN}:{os.environ['PATH']}")
        cmd = [str(OPS_BIN / "ansible-playbook"), "-i", str(self.inventory),
               str(ANSIBLE_DIR / "playbooks" / name), *args]
        proc = subprocess.run(cmd, env=env, cwd=ANSIBLE_DIR, capture_output=True, text=True)
        log = self.lab.workdir / "ansible.log"
        with open(log, "a") as fh:
            fh.write(f"\n\n### {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        if check and proc.returncode != 0:
            raise AssertionError(f"{name} failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}")
        return proc


def recap(stdout: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines -> {host: {ok: n, changed: n, ...}}."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", stdout, re.M):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Time each test's own work, not the session's set-up it happens to pay for.

    The first test's set-up builds the golden image and offline repository (cold in a fresh clone),
    applies the AWS example on moto, boots the lab and runs site.yml: 851 s of it was the image and
    repository alone in a fresh clone beside the Python suites and two busy loops, and the 900-s
    guard meant for one test's work failed all 42 tests at set-up. Each of those steps ends by
    itself (a subprocess that finishes or fails, SSH that answers within its own wait), and the CI
    job's limit bounds a hang; each test keeps its own guard (pyproject's, or its module's)."""
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = (marker.args[0] if marker and marker.args else marker.kwargs.get("timeout") if marker else None)
        if seconds is None:
            seconds = float(item.config.getini("timeout") or 0)
        item.add_marker(pytest.mark.timeout(seconds, func_only=True))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@pytest.fixture(scope="session")
def lab():
    reason = labmod.can_run_nspawn()
    if reason:
        pytest.skip(f"nspawn test hosts cannot run on this machine: {reason}")
    # A stopped run still reaches the finalizer below: nodes left running hold the lab's mounts and netns.
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _interrupt)
    t0 = time.monotonic()
    image = labmod.build_image()
    TIMINGS["golden image (build or cache hit)"] = time.monotonic() - t0
    t0 = time.monotonic()
    offline = labmod.build_artifacts(image)
    TIMINGS["offline apt repo + wheelhouse"] = time.monotonic() - t0
    name = f"lab-{os.getpid()}"
    workdir = labmod.CACHE / "run" / name
    t0 = time.monotonic()
    the_lab = labmod.new_lab(name, image, offline, workdir)
    TIMINGS["AWS example applied on moto"] = time.monotonic() - t0
    try:
        t0 = time.monotonic()
        the_lab.up()
        for node in the_lab.addresses:
            the_lab.start_node(node)
        for node in the_lab.nodes.values():
            the_lab.wait_ssh(node)
        TIMINGS["3 nodes booted and SSH-reachable"] = time.monotonic() - t0
        yield the_lab
    finally:
        the_lab.down()
        if os.environ.get("KEEP_LAB_LOGS"):
            labmod.log(f"lab logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def inventory(lab) -> Path:
    """Terraform's rendered inventory (hosts.yml), the lab's group_vars beside it."""
    return labmod.write_lab_vars(lab)


@pytest.fixture(scope="session")
def ansible(lab, inventory) -> Ansible:
    return Ansible(lab, inventory)


@pytest.fixture(scope="session")
def site_run(ansible) -> subprocess.CompletedProcess:
    """site.yml applied once to the bare head and two workers."""
    t0 = time.monotonic()
    proc = ansible.playbook("site.yml")
    TIMINGS["site.yml on 3 bare hosts"] = time.monotonic() - t0
    return proc


@pytest.fixture(scope="session")
def ssh_config(lab) -> Path:
    path = lab.workdir / "ssh_config"
    path.write_text(
        "Host *\n  User root\n"
        f"  IdentityFile {lab.ssh_key()}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        "  ConnectTimeout 10\n")
    return path


@pytest.fixture(scope="session")
def hosts(lab, ssh_config, site_run):
    import testinfra

    def get(name: str):
        address = labmod.node_address(lab, name)
        return testinfra.get_host(f"ssh://root@{address}", ssh_config=str(ssh_config))
    return get


def cluster_state(host) -> dict:
    out = host.check_output("/usr/local/bin/ray-cluster-state")
    return json.loads(out.strip().splitlines()[-1])


def main_pid(host: Any, unit: str) -> int:
    """The unit's main process on `host` (a testinfra host)."""
    pid = int(host.check_output(f"systemctl show -p MainPID --value {unit}"))
    assert pid > 0, f"{unit} has no main process"
    return pid


def environ_of(host: Any, pid: int) -> dict[str, str]:
    """The process's environment, read as root."""
    raw = host.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")
    return dict(line.split("=", 1) for line in raw.splitlines() if "=" in line)


def in_the_service(host: Any, pid: int, command: str) -> Any:
    """Run a shell command as the service `pid` runs: its account, its mount namespace (ProtectSystem=strict,
    PrivateTmp, its credentials folder), its exact environment and working directory."""
    environ = environ_of(host, pid)
    uid = host.check_output(f"stat -c %u /proc/{pid}")
    gid = host.check_output(f"stat -c %g /proc/{pid}")
    cwd = host.check_output(f"readlink /proc/{pid}/cwd")
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in environ.items())
    return host.run(f"nsenter -t {pid} -m -S {uid} -G {gid} -- env -i {env} "
                    f"/bin/sh -c {shlex.quote(f'cd {shlex.quote(cwd)} && {command}')}")
