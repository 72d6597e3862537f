"""The local cluster stops exactly what it started: real process groups stand in for Ray's head, its
extra raylets, MLflow, Prometheus and Redis (``sleep`` and ``sh``, some under the name ``gcs_server``),
and ``down``, ``remove_node`` and ``status`` act on them as on the real ones. No Ray starts here;
tests/integration/test_cluster_lifecycle.py and test_gcs_restart.py run the real services."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.cluster import ClusterError, down, load_state, ray_temp_dir, remove_node, status
from runtime.cluster.gcs_watchdog import GCS_FILE, gcs_pid, restart_gcs, write_gcs_pid
from runtime.cluster.nodes import _add_node, _listed, _started, auth_env
from runtime.cluster.processes import (
    _last_line,
    alive,
    descendants,
    group_members,
    http_ok,
    kill,
    kill_group_leftovers,
    port_open,
    running,
    spawn,
    venv_bin,
    wait_started,
    wait_until,
)
from runtime.cluster.state_file import STATE_FILE, save_state
from tests.support import ROOT, QuietHandler, free_port, serve, wait_for


class Group:
    """Process groups this test started, each led by ``spawn``'s child; every one is SIGKILLed at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.leaders: list[int] = []
        self.others: list[int] = []

    def start(self, script: str, name: str = "svc") -> int:
        pid = spawn(["sh", "-c", script], self.folder / f"{name}.log")
        self.leaders.append(pid)
        return pid

    def named(self, comm: str) -> int:
        """A ``sleep`` whose process name is ``comm`` (as ``ps`` and /proc/<pid>/comm show it), a session of its own."""
        exe = self.folder / "bin" / comm
        exe.parent.mkdir(exist_ok=True)
        exe.symlink_to("/bin/sleep")
        return self.other([str(exe), "300"])

    def other(self, argv: list[str]) -> int:
        pid = subprocess.Popen(argv, start_new_session=True, cwd=ROOT).pid  # cwd: `-m runtime...` is this tree's
        self.others.append(pid)
        return pid

    def close(self) -> None:
        for pid in self.leaders:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in [*self.leaders, *self.others]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Group]:
    group = Group(tmp_path)
    yield group
    group.close()


def _gone(pid: int) -> bool:
    """Not running: gone, or a zombie its parent (this test) has not reaped yet."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return not running(pid)


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _children(pid: int, count: int = 1) -> list[int]:
    """The ``count`` processes the shell ``pid`` starts, once each has exec'd its program: a forked
    child runs the shell, under the shell's name, until it does (seen under load: a fake gcs_server
    still named ``sh``)."""
    shell = _exe(pid)

    def started() -> bool:
        kids = descendants(pid)
        return len(kids) >= count and all(_exe(k) not in (None, shell) for k in kids)

    wait_for(started, f"the children of {pid} to exec", timeout=30)
    return descendants(pid)


def _worker(marker: str) -> list[str]:
    """A process whose command line names ``marker``, as a Ray worker's names its cluster's Ray folder."""
    return [sys.executable, "-c", "import time; time.sleep(300)", marker]


# ------------------------------------------------------------------ processes


def test_spawn_starts_a_session_of_its_own_logging_to_its_file(tmp_path: Path, procs: Group) -> None:
    pid = procs.start("echo started; exec sleep 300", "svc")
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # a terminal's Ctrl+C never reaches it
    wait_for(lambda: (tmp_path / "svc.log").exists() and "started" in (tmp_path / "svc.log").read_text(), "the log")
    assert alive(pid) and not alive(2**22 + 1)  # above pid_max: no such process


def test_kill_stops_the_whole_group_and_sigkills_what_ignores_sigterm(procs: Group) -> None:
    pid = procs.start("trap '' TERM; sleep 300 & wait; sleep 300")
    (child,) = _children(pid)
    kill(pid, timeout=0.3)
    wait_for(lambda: _gone(pid) and _gone(child), "the group to die")
    kill(pid)  # a second stop of a stopped service is a no-op


def test_kill_of_the_leader_alone_leaves_its_group_to_kill_group_leftovers(procs: Group) -> None:
    pid = procs.start("sleep 300 & wait")
    (child,) = _children(pid)
    kill(pid, timeout=5, group=False)
    assert _gone(pid) and running(child)  # what `ray start --block` wants: it stops its own children
    kill_group_leftovers(pid)
    wait_for(lambda: _gone(child), "the leftover child")


def test_wait_until_returns_at_once_or_names_what_failed_with_the_logs_tail(tmp_path: Path) -> None:
    wait_until(lambda: True, "ready", 5)
    log = tmp_path / "svc.log"
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    with pytest.raises(ClusterError) as err:
        wait_until(lambda: False, "MLflow server", 0, log)
    lines = str(err.value).splitlines()
    assert lines[0] == "MLflow server did not come up within 0s"
    assert lines[1:] == [f"line {i}" for i in range(5, 20)]  # its last 15 lines


def test_http_ok_is_a_2xx_answer_and_nothing_else() -> None:
    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

    server = serve(Handler)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert http_ok(f"{base}/health") and not http_ok(f"{base}/-/ready")
        assert port_open("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
    assert not http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=1)


def test_console_scripts_come_from_this_interpreters_environment_first() -> None:
    assert venv_bin("python") == str(Path(sys.executable).parent / "python")
    assert venv_bin("sh-not-a-script") == "sh-not-a-script"  # neither there nor on PATH: the name itself


# ---------------------------------------------------------------------- local


def test_each_cluster_gets_a_short_ray_temp_dir_of_its_own(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    a, b = ray_temp_dir(deep), ray_temp_dir(tmp_path)
    assert a != b and a == ray_temp_dir(deep) and len(a) < 30  # Ray's socket paths must stay under ~107 bytes


def test_the_clusters_token_is_private_and_made_once(tmp_path: Path) -> None:
    env = auth_env(tmp_path / "c")
    token = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert env["RAY_AUTH_MODE"] == "token" and token.stat().st_mode & 0o777 == 0o600
    first = token.read_text()
    assert len(first) == 64 and set(first) <= set("0123456789abcdef")
    assert auth_env(tmp_path / "c") == env and token.read_text() == first


def test_a_start_up_names_its_logs_last_line_or_says_it_logged_nothing(tmp_path: Path) -> None:
    assert _last_line(tmp_path / "missing.log") == "(no log)"
    (tmp_path / "empty.log").write_text("\n  \n")
    assert _last_line(tmp_path / "empty.log") == "(nothing logged)"
    (tmp_path / "ray.log").write_text("starting\n  raylet up  \n\n")
    assert _last_line(tmp_path / "ray.log") == "raylet up"


def test_a_detached_start_whose_whole_group_exited_fails_at_once(tmp_path: Path) -> None:
    log = tmp_path / "head.log"
    pid = spawn(["sh", "-c", "echo 'ray start: the GCS failed'"], log)
    wait_for(lambda: _gone(pid), "the start-up to exit")
    with pytest.raises(ClusterError, match=r"^Ray head exited during start-up: ray start: the GCS failed"):
        wait_started(lambda: False, "Ray head", pid, log, leader_exits=True, stall_s=3600)


def test_a_start_up_past_its_ceiling_fails_even_while_it_works(tmp_path: Path, procs: Group) -> None:
    log = tmp_path / "svc.log"
    pid = procs.start("exec sleep 300", "svc")
    with pytest.raises(ClusterError, match=r"^Ray head did not come up within 0 s"):
        wait_started(lambda: False, "Ray head", pid, log, ceiling_s=0)


def test_a_raylet_joined_once_ray_start_says_so_after_the_logs_old_lines(tmp_path: Path) -> None:
    log = tmp_path / "ray-node1.log"
    assert not _started(log, 0)
    log.write_text("Ray runtime started.\n")  # an earlier start's line
    offset = log.stat().st_size
    assert not _started(log, offset)
    with log.open("a") as f:
        f.write("Local node IP: 127.0.0.1\nRay runtime started.\n")
    assert _started(log, offset)


def test_a_raylet_counts_once_the_head_lists_it_alive_with_resources_asked_with_the_token() -> None:
    summary = [{"raylet": {"nodeManagerPort": 1111, "state": "ALIVE", "resourcesTotal": {"CPU": 1.0}}},
               {"raylet": {"nodeManagerPort": 2222, "state": "ALIVE", "resourcesTotal": {}}},
               {"raylet": {"nodeManagerPort": 3333, "state": "DEAD", "resourcesTotal": {"CPU": 1.0}}}]
    seen: list[str] = []

    class Dashboard(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(self.headers.get("Authorization", ""))
            ok = self.path == "/nodes?view=summary" and self.headers.get("Authorization") == "Bearer s3cret"
            body = json.dumps({"data": {"summary": summary}}).encode() if ok else b"{}"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body)

    server = serve(Dashboard)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert _listed(url, "s3cret", 1111)
        assert not _listed(url, "s3cret", 2222) and not _listed(url, "s3cret", 3333)  # no resources; dead
        assert not _listed(url, "wrong", 1111)  # refused: not listed, not a traceback
    finally:
        server.shutdown()
    assert seen[0] == "Bearer s3cret"
    assert not _listed(f"http://127.0.0.1:{free_port()}", "s3cret", 1111)  # no dashboard


def test_a_node_cannot_join_without_a_head(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"^no local Ray head to join: run `make cluster-up` first$"):
        _add_node(tmp_path, 1, None)


def test_removing_a_node_that_is_not_there_names_the_state_file(tmp_path: Path) -> None:
    save_state({"nodes": [{"index": 1, "pid": 1}]}, tmp_path)
    with pytest.raises(ClusterError, match=f"no extra node 2 in {tmp_path / STATE_FILE}"):
        remove_node(2, tmp_path)


def test_a_lost_node_takes_every_process_below_it_even_in_other_sessions(tmp_path: Path, procs: Group) -> None:
    """A hard removal is a lost machine: its workers (sessions of their own under the raylet) die too."""
    raylet = procs.start("setsid sleep 300 & sleep 300 & wait")
    children = _children(raylet, 2)
    assert len(children) == 2 and any(os.getsid(c) != raylet for c in children)
    other = procs.start("exec sleep 300")
    save_state({"nodes": [{"index": 1, "pid": raylet}, {"index": 2, "pid": other}]}, tmp_path)
    remove_node(1, tmp_path)
    wait_for(lambda: all(_gone(p) for p in (raylet, *children)), "the node's processes to die")
    assert running(other) and [n["index"] for n in load_state(tmp_path)["nodes"]] == [2]
    remove_node(2, tmp_path, hard=False)  # a clean leave: SIGTERM to the raylet
    assert _gone(other) and load_state(tmp_path)["nodes"] == []


def test_down_stops_each_recorded_service_and_its_children_and_forgets_the_state(tmp_path: Path,
                                                                                 procs: Group) -> None:
    names = ("prometheus", "node_exporter", "mlflow", "ray", "redis")
    pids = {name: procs.start("sleep 300 & wait", name) for name in names}
    pids["node1"] = procs.start("sleep 300 & wait", "node1")
    children = {name: _children(pid) for name, pid in pids.items()}
    bystander = procs.start("exec sleep 300", "bystander")
    save_state({**{name: {"pid": pids[name]} for name in names}, "nodes": [{"index": 1, "pid": pids["node1"]}]},
               tmp_path)
    assert down(tmp_path) == ["node1", *names]
    for name, pid in pids.items():
        wait_for(lambda p=pid, c=children[name]: _gone(p) and all(_gone(x) for x in c), f"{name} to stop")
    assert running(bystander) and not (tmp_path / STATE_FILE).exists()
    assert down(tmp_path) == []  # nothing recorded: nothing stopped


def test_down_of_a_fault_tolerant_head_stops_watchdog_head_gcs_and_its_stray_workers(tmp_path: Path,
                                                                                    procs: Group) -> None:
    """A detached head (GCS_FT=1): the watchdog first, then the head's group, the GCS the watchdog
    started (a session of its own) and any worker whose command line names this cluster's Ray folder."""
    head = procs.start("sleep 300 & wait", "head")
    head_child = _children(head)
    watchdog = procs.start("exec sleep 300", "watchdog")
    gcs = procs.named("gcs_server")
    stray = procs.other(_worker(f"--temp-dir={ray_temp_dir(tmp_path)}"))
    other_cluster = procs.other(_worker(f"--temp-dir={ray_temp_dir(tmp_path / 'other')}"))
    write_gcs_pid(tmp_path, gcs, restarts=1)
    save_state({"ray": {"pid": head, "gcs_ft": True, "watchdog_pid": watchdog}}, tmp_path)
    assert gcs_pid(tmp_path) == gcs  # the one the watchdog started last
    assert down(tmp_path) == ["ray"]
    for pid in (watchdog, head, *head_child, gcs, stray):
        wait_for(lambda p=pid: _gone(p), f"process {pid} to stop")
    assert running(other_cluster) and not (tmp_path / GCS_FILE).exists()


def test_the_heads_gcs_is_found_below_ray_start_or_in_its_group(tmp_path: Path, procs: Group) -> None:
    assert gcs_pid(tmp_path) is None  # no cluster recorded
    fake = tmp_path / "bin" / "gcs_server"
    fake.parent.mkdir()
    fake.symlink_to("/bin/sleep")
    head = procs.start(f"'{fake}' 300 & wait")
    (gcs,) = _children(head)
    save_state({"ray": {"pid": head}}, tmp_path)
    assert gcs_pid(tmp_path) == gcs  # `ray start --block`'s child
    save_state({"ray": {"pid": head, "gcs_ft": True}}, tmp_path)
    assert gcs_pid(tmp_path) == gcs and group_members(head, "gcs_server") == [gcs]  # no gcs.json yet: its group


def test_restarting_the_gcs_needs_fault_tolerance_and_a_gcs(tmp_path: Path, procs: Group) -> None:
    with pytest.raises(ClusterError, match=r"restart_gcs needs GCS fault tolerance: `make cluster-up GCS_FT=1`"):
        restart_gcs(tmp_path)
    head = procs.start("exec sleep 300")
    save_state({"ray": {"pid": head, "gcs_ft": True}}, tmp_path)
    with pytest.raises(ClusterError, match=f"no GCS running for the cluster in {tmp_path}"):
        restart_gcs(tmp_path)


def test_status_says_up_only_for_what_answers(tmp_path: Path, procs: Group, monkeypatch: pytest.MonkeyPatch) -> None:
    class Health(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    server = serve(Health)
    try:
        mlflow = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("RT_RAY_PORT", str(server.server_address[1]))  # something listens there
        node = procs.start("exec sleep 300")
        save_state({"ray": {"address": "127.0.0.1:6379", "dashboard": "http://127.0.0.1:8265"},
                    "nodes": [{"index": 1, "pid": node}, {"index": 2, "pid": 2**22 + 1}],
                    "mlflow": {"url": mlflow}, "prometheus": {"url": mlflow}}, tmp_path)
        assert status(tmp_path) == {"ray": "up at 127.0.0.1:6379 (dashboard http://127.0.0.1:8265)",
                                    "nodes": "head + 1 more on this machine", "mlflow": f"up at {mlflow}",
                                    "prometheus": "down"}  # it answers /health, not Prometheus's /-/ready
    finally:
        server.shutdown()
        server.server_close()  # refused from now on, as a stopped service's port
    monkeypatch.setenv("RT_RAY_PORT", str(free_port()))
    assert status(tmp_path)["ray"] == "down" and status(tmp_path)["mlflow"] == "down"


def test_restart_gcs_crashes_the_gcs_and_returns_the_one_the_watchdog_starts(tmp_path: Path, procs: Group,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With SIGKILL (a crash) and SIGTERM (a stop), on a stand-in GCS the real watchdog restarts."""
    import socket

    gcs = procs.named("gcs_server")
    (tmp_path / "logs").mkdir()
    watchdog = procs.other([sys.executable, "-m", "runtime.cluster.gcs_watchdog", str(tmp_path), str(gcs)])
    save_state({"ray": {"pid": procs.start("exec sleep 300"), "gcs_ft": True, "watchdog_pid": watchdog}}, tmp_path)
    with socket.socket() as head:  # the GCS's port answers (the restarted one's, as far as the wait can tell)
        head.bind(("127.0.0.1", 0))
        head.listen()
        monkeypatch.setenv("RT_RAY_PORT", str(head.getsockname()[1]))
        wait_for(lambda: gcs_pid(tmp_path) == gcs, "the watchdog to record the GCS", timeout=60)
        restarted: list[int] = []
        try:
            for sig in (signal.SIGKILL, signal.SIGTERM):
                old = gcs_pid(tmp_path)
                assert old is not None
                new = restart_gcs(tmp_path, sig=sig, timeout=60)
                restarted.append(new)
                assert new not in (0, old) and running(new)
                wait_for(lambda o=old: _gone(o), "the old GCS to be gone")
                assert Path(f"/proc/{new}/comm").read_text().strip() == "gcs_server"
            assert json.loads((tmp_path / GCS_FILE).read_text())["restarts"] == 2
            assert down(tmp_path) == ["ray"]  # the watchdog first (SIGTERM), then the GCS it started last
            wait_for(lambda: _gone(watchdog) and _gone(restarted[-1]), "the watchdog and its GCS to stop")
        finally:
            for pid in restarted:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
