"""The remediation service as it runs (`python -m ops.remediation`, a real process on loopback),
attacked as a job on the cluster would attack it: forged and replayed posts, malformed bodies, a
`kill -9` to wipe its memory, connections held open to starve it. Its rules only replace (no Ray
here); the replacement is a real command that records which node it was run for.

Over 400 lines because every attack runs against the same real service process and its helpers
(start, post, metrics, the journal), which one file keeps in one place."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.conftest import ALERTMANAGER_BIN, ensure_alertmanager_tools
from tests.support import free_port, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0k3n-" + "x" * 40
APPEND = "import sys; open(sys.argv[2], 'a').write(sys.argv[1] + '\\n')"


@dataclass
class Service:
    """A running service, its files and a way to post to it."""

    tmp: Path
    policy: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    nofile: int | None = None  # the process's file-descriptor limit (systemd gives a unit a soft 1024)

    @property
    def record(self) -> Path:
        return self.tmp / "replaced"

    @property
    def log(self) -> Path:
        return self.tmp / "service.log"

    def replaced(self) -> list[str]:
        return self.record.read_text().split() if self.record.exists() else []

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ops.remediation", "--policy", str(self.policy)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=self._limit)
        wait_for(self._healthy, "the remediation service to listen", 60)

    def _limit(self) -> None:
        if self.nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def _healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            return self.request("GET", "/-/healthy")[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any] | str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            conn.endheaders(body)
            reply = conn.getresponse()
            text = reply.read().decode()
            try:
                return reply.status, json.loads(text)
            except ValueError:
                return reply.status, text
        finally:
            conn.close()

    def post(self, alerts: Any, token: str | None = TOKEN) -> tuple[int, Any]:
        body = json.dumps({"alerts": alerts}).encode()
        headers = {"Content-Length": str(len(body)), "Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return self.request("POST", "/alerts", body, headers)

    def metric(self, name: str, **labels: str) -> float:
        _, text = self.request("GET", "/metrics")
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in str(text).splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def decisions(self) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]
        return [e for e in lines if e["event"] == "decision"]


def _policy(tmp: Path, port: int, **change: Any) -> Path:
    token = tmp / "token"
    if not token.exists():
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
    policy = {
        "listen": f"127.0.0.1:{port}",
        "webhook": {"token_file": str(token)},
        "state_dir": str(tmp / "state"),
        "nodes": {f"gpu-{i}": f"10.0.0.{20 + i}:9100" for i in range(8)},
        "protected": ["10.0.0.11"],
        "limits": {"per_node_per_hour": 1, "total_per_hour": 3},
        "replace": {"command": [sys.executable, "-c", APPEND, "{node}", str(tmp / "replaced")], "timeout_s": 60},
        "rules": [{"alert": "NodeDown", "actions": ["replace"]}],
        **change,
    }
    path = tmp / "policy.yml"
    path.write_text(yaml.safe_dump(policy))
    return path


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    port = free_port()
    svc = Service(tmp_path, _policy(tmp_path, port), port)
    svc.start()
    yield svc
    if svc.proc is not None:
        stop_process(svc.proc)


def _firing(node: int, fingerprint: str = "f", starts: datetime | None = None) -> dict[str, Any]:
    began = starts or datetime.now(timezone.utc)
    return {"status": "firing", "labels": {"alertname": "NodeDown", "instance": f"10.0.0.{20 + node}:9100"},
            "fingerprint": fingerprint, "startsAt": began.strftime("%Y-%m-%dT%H:%M:%S.%f123Z")}


def _wait_replaced(svc: Service, count: int) -> None:
    """Until `count` replacements have finished (journalled: the node is no longer busy)."""
    def done() -> int:
        lines = [json.loads(line) for line in svc.log.read_text().splitlines() if line.startswith("{")]
        return sum(e["event"] == "action" for e in lines)
    wait_for(lambda: done() >= count, f"{count} replacements", 60)
    assert len(svc.replaced()) == count


#### Authentication ##############################################################

@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN[:-1], TOKEN + "x", f"{TOKEN} extra"])
def test_a_post_without_the_webhook_token_is_refused_and_acts_on_nothing(service: Service, token: str | None):
    status, body = service.post([_firing(1)], token=token)
    assert status == 401, body
    assert service.decisions() == [] and service.replaced() == []
    assert service.metric("remediation_actions_total", action="replace", result="started") == 0


def test_a_basic_auth_post_with_the_token_as_password_is_refused(service: Service):
    import base64

    body = json.dumps({"alerts": [_firing(1)]}).encode()
    basic = base64.b64encode(f"alertmanager:{TOKEN}".encode()).decode()
    status, _ = service.request("POST", "/alerts", body, {"Content-Length": str(len(body)),
                                                          "Authorization": f"Basic {basic}"})
    assert status == 401 and service.decisions() == []


def test_six_forged_alerts_no_longer_halt_remediation(service: Service):
    """Six posts from anyone who reaches the port used to spend the cluster's budget and halt it."""
    for node in range(6):
        assert service.post([_firing(node, f"forged{node}")], token=None)[0] == 401
        assert service.post([_firing(node, f"forged{node}")], token="guess" * 8)[0] == 401
    assert service.metric("remediation_halted", node="*") == 0
    status, body = service.post([_firing(7, "real")])
    assert status == 200 and [d["result"] for d in body["decisions"]] == ["started"], body
    _wait_replaced(service, 1)
    assert service.replaced() == ["gpu-7"]


def test_a_replayed_post_is_a_duplicate_even_with_a_new_fingerprint(service: Service):
    alert = _firing(1, "first")
    assert [d["result"] for d in service.post([alert])[1]["decisions"]] == ["started"]
    _wait_replaced(service, 1)
    replayed = service.post([alert])[1]["decisions"] + service.post([{**alert, "fingerprint": "fresh"}])[1]["decisions"]
    assert [d["result"] for d in replayed] == ["duplicate", "duplicate"]
    assert service.replaced() == ["gpu-1"]


def test_an_alert_that_is_too_old_or_in_the_future_is_not_acted_on(service: Service):
    now = datetime.now(timezone.utc)
    old, future = _firing(1, "old", now - timedelta(hours=7)), _firing(2, "future", now + timedelta(hours=1))
    status, body = service.post([old, future])
    assert status == 200 and [d["result"] for d in body["decisions"]] == ["expired", "future"], body
    assert service.replaced() == []


#### Malformed requests ##########################################################

@pytest.mark.parametrize(("headers", "status"), [
    ({}, 411),
    ({"Content-Length": "-1"}, 400),
    ({"Content-Length": "ten"}, 400),
    ({"Content-Length": str(2 << 20)}, 413),
])
def test_a_bad_content_length_is_refused_before_the_body_is_read(service: Service, headers: dict[str, str],
                                                                  status: int):
    got, body = service.request("POST", "/alerts", None, {"Authorization": f"Bearer {TOKEN}", **headers})
    assert got == status, body
    assert service.proc is not None and service.proc.poll() is None


@pytest.mark.parametrize(("bad", "field"), [
    ("NodeDown", "alerts[1]: expected an object"),
    ({"status": "firing", "labels": {"alertname": "NodeDown"}}, "alerts[1].startsAt"),
    ({**_firing(1), "startsAt": "2026-13-40T25:00:00Z"}, "alerts[1].startsAt"),
    ({**_firing(1), "labels": {"alertname": ["NodeDown"]}}, "alerts[1].labels"),
    ({**_firing(1), "status": None}, "alerts[1].status"),
])
def test_a_malformed_alert_refuses_the_whole_notification_naming_the_field(service: Service, bad: Any, field: str):
    """A good alert before the bad one is not acted on either: the post is checked whole first."""
    status, reply = service.post([_firing(2, "good"), bad])
    assert status == 400 and field in reply["error"], reply
    assert service.decisions() == [] and service.replaced() == []


def test_a_client_that_stops_sending_is_cut_off_and_others_are_served(service: Service):
    """A post that promises more body than it sends holds one thread until the socket timeout
    (SOCKET_TIMEOUT_S), not for ever; meanwhile and afterwards the service answers."""
    with socket.create_connection(("127.0.0.1", service.port), timeout=120) as stalled:
        stalled.sendall(f"POST /alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                        "Content-Length: 1000\r\n\r\n{\"alerts\": [".encode())
        assert service.request("GET", "/-/healthy")[0] == 200
        assert stalled.recv(4096) == b"", "the server closes the stalled connection"
    assert service.decisions() == [] and "Traceback" not in service.log.read_text()
    assert service.post([_firing(1)])[0] == 200


class Trickle:
    """Up to `count` connections to the service, each opened once the one before it is established
    (as fast as the service takes them; one not established within 3 s, a SYN resent twice, is given
    up, and three in a row end the opening: the service takes no more). From the moment it is
    established each sends a request line, then one byte of a header every half second, never
    finishing it (the slowest client the socket timeout allows). ``connected`` counts those
    established, ``open`` those not cut yet."""

    def __init__(self, port: int, count: int) -> None:
        self.socks: list[socket.socket] = []
        self.alive: list[bool] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._thread.start()
        failed = 0
        while len(self.socks) < count and failed < 3:
            sock = socket.socket()
            sock.settimeout(3)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError:
                sock.close()
                failed += 1
                continue
            failed = 0
            sock.setblocking(False)
            with self._lock:
                self.socks.append(sock)
                self.alive.append(True)
        self.connected = len(self.socks)

    def _send(self) -> None:
        first = b"POST /alerts HTTP/1.1\r\nHost: x\r\nX-Slow: "
        started: set[int] = set()
        while not self._stop.wait(0.5):
            with self._lock:
                socks = list(enumerate(self.socks))
            for i, sock in socks:
                if not self.alive[i]:
                    continue
                try:
                    sock.send(b"a" if i in started else first)
                    started.add(i)
                    if sock.recv(1, socket.MSG_PEEK) == b"":
                        self.alive[i] = False  # the server shut it down
                except BlockingIOError:
                    pass  # nothing to read: still held
                except OSError:
                    self.alive[i] = False

    def open(self) -> int:
        return sum(self.alive)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


def test_connections_that_send_a_byte_at_a_time_cannot_starve_an_alertmanager_post(tmp_path: Path):
    """More trickling connections than the service has file descriptors (a limit of 256 here, as
    systemd's soft 1024 scaled down), opened before Alertmanager's post: the post is read and acted
    on, every trickling connection was taken, and the service cut all but MAX_WAITING_CONNECTIONS of
    them for newer ones. Before, each held a thread and a descriptor for as long as it trickled:
    once they ran out accept() failed, and the post was never read (its request timed out)."""
    from ops.remediation.service import MAX_WAITING_CONNECTIONS

    nofile, flooded = 256, 300
    port = free_port()
    svc = Service(tmp_path, _policy(tmp_path, port), port, nofile=nofile)
    svc.start()
    flood = Trickle(port, flooded)
    try:
        assert svc.post([_firing(1)])[0] == 200  # the newest connection: nothing cuts it
        _wait_replaced(svc, 1)
        assert flood.connected > nofile  # more than the service could ever hold at once
        wait_for(lambda: svc.metric("remediation_webhook_connections_cut_total")
                 >= flood.connected - MAX_WAITING_CONNECTIONS, "the service's count of cut connections", 60)
        wait_for(lambda: flood.open() <= MAX_WAITING_CONNECTIONS, "the trickling clients to see the cuts", 60)
    finally:
        flood.close()
        assert svc.proc is not None
        alive = svc.proc.poll() is None
        stop_process(svc.proc)
    assert alive and "Traceback" not in svc.log.read_text()


def test_a_body_that_is_not_json_is_a_400_not_a_traceback(service: Service):
    body = b"\xff\xfe{not json"
    status, reply = service.request("POST", "/alerts", body, {"Authorization": f"Bearer {TOKEN}",
                                                              "Content-Length": str(len(body))})
    assert status == 400 and "not JSON" in reply["error"]
    assert "Traceback" not in service.log.read_text()


#### Memory across restarts ######################################################

def test_a_killed_service_comes_back_with_its_halts_budget_and_replay_memory(service: Service):
    """kill -9 (what any process of the service's user could do) used to restart it with a fresh budget."""
    first = _firing(1, "a")
    results = [d["result"] for a in (first, _firing(2, "b")) for d in service.post([a])[1]["decisions"]]
    _wait_replaced(service, 2)
    _, again = service.post([_firing(1, "c", datetime.now(timezone.utc) + timedelta(seconds=1))])
    assert results + [d["result"] for d in again["decisions"]] == ["started", "started", "halted"]  # 1 per hour
    assert service.proc is not None
    service.proc.send_signal(signal.SIGKILL)
    service.proc.wait()
    service.start()
    assert service.metric("remediation_halted", node="gpu-1") == 1, "the halt is back before any alert"
    after = [d["result"] for a in (_firing(1, "d"), first, _firing(3, "e"), _firing(4, "f"))
             for d in service.post([a])[1]["decisions"]]
    # gpu-1 still halted; the first alert still a duplicate; the cluster's budget (3) is spent by gpu-3.
    assert after == ["halted", "duplicate", "started", "halted"]
    _wait_replaced(service, 3)
    assert sorted(service.replaced()) == ["gpu-1", "gpu-2", "gpu-3"]


def test_clear_halts_lifts_the_halts_but_not_the_spent_budget(service: Service):
    service.post([_firing(1, "a")])
    _wait_replaced(service, 1)
    _, again = service.post([_firing(1, "b", datetime.now(timezone.utc) + timedelta(seconds=1))])
    assert [d["result"] for d in again["decisions"]] == ["halted"]
    assert service.proc is not None
    stop_process(service.proc)
    done = subprocess.run([sys.executable, "-m", "ops.remediation", "--policy", str(service.policy), "--clear-halts"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "cleared halts: gpu-1" in done.stdout, done.stdout + done.stderr
    service.start()
    assert service.metric("remediation_halted", node="gpu-1") == 0
    status, body = service.post([_firing(2, "c")])
    assert [d["result"] for d in body["decisions"]] == ["started"], body


#### Refusing to start ###########################################################

def _start_refused(policy: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "ops.remediation", "--policy", str(policy)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


@pytest.mark.parametrize(("setup", "says"), [
    (lambda t: t.unlink(), "cannot read the webhook token file"),
    (lambda t: t.write_text("short"), "at least 32 characters"),
    (lambda t: t.chmod(0o644), "others may read"),
    (lambda t: t.chmod(0o620), "others may read"),
    (lambda t: t.write_bytes(b"\xff" * 40), "not UTF-8"),
])
def test_the_service_refuses_to_start_with_a_bad_token_file(tmp_path: Path, setup: Any, says: str):
    policy = _policy(tmp_path, free_port())
    setup(tmp_path / "token")
    line = _start_refused(policy)
    assert str(tmp_path / "token") in line and says in line, line


def test_the_service_refuses_to_start_with_a_damaged_state_file(tmp_path: Path):
    policy = _policy(tmp_path, free_port())
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text('{"version": 1, "halted": ')
    line = _start_refused(policy)
    assert "state.json: damaged state file" in line and "move it away" in line, line


def test_check_validates_the_policy_without_the_token_file(tmp_path: Path):
    """The installer validates the policy before the service's credentials are in place."""
    policy = _policy(tmp_path, free_port())
    (tmp_path / "token").unlink()
    done = subprocess.run([sys.executable, "-m", "ops.remediation", "--policy", str(policy), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and ": ok (" in done.stdout, done.stdout + done.stderr


#### Confirmation by Alertmanager's API ##########################################

@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager on loopback that routes nowhere: what the service asks about alerts."""
    ensure_alertmanager_tools()
    port = free_port()
    (tmp_path / "am.yml").write_text(yaml.safe_dump({"route": {"receiver": "none"}, "receivers": [{"name": "none"}]}))
    with (tmp_path / "am.log").open("wb") as out:
        proc = subprocess.Popen([str(ALERTMANAGER_BIN), f"--config.file={tmp_path / 'am.yml'}",
                                 f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--cluster.listen-address="],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "am.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False

    try:
        wait_for(ready, "Alertmanager to be ready", 60)
        yield url
    finally:
        stop_process(proc)


def _raise_in(alertmanager: str, alert: dict[str, Any]) -> dict[str, Any]:
    """Post `alert` to Alertmanager as Prometheus does; return it as Alertmanager holds it."""
    body = json.dumps([{"labels": alert["labels"], "startsAt": alert["startsAt"]}]).encode()
    req = urllib.request.Request(f"{alertmanager}/api/v2/alerts", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()
    with urllib.request.urlopen(f"{alertmanager}/api/v2/alerts", timeout=10) as reply:
        [held] = [a for a in json.loads(reply.read()) if a["labels"] == alert["labels"]]
    return {**alert, "startsAt": held["startsAt"]}


def test_with_confirmation_only_alerts_alertmanager_holds_are_acted_on(tmp_path: Path, alertmanager: str):
    """A holder of the webhook token (or a replay of an old post) cannot invent an alert."""
    port = free_port()
    svc = Service(tmp_path, _policy(tmp_path, port, alertmanager={"url": alertmanager}), port)
    svc.start()
    try:
        real = _raise_in(alertmanager, _firing(1, "real"))
        forged = _firing(2, "forged")
        status, body = svc.post([forged, real])
        assert status == 200 and [(d["node"], d["result"]) for d in body["decisions"]] == [
            ("gpu-2", "unconfirmed"), ("gpu-1", "started")], body
        _wait_replaced(svc, 1)
        assert svc.replaced() == ["gpu-1"]
    finally:
        assert svc.proc is not None
        stop_process(svc.proc)


def test_with_confirmation_an_unreachable_alertmanager_confirms_nothing(tmp_path: Path):
    port = free_port()
    svc = Service(tmp_path, _policy(tmp_path, port, alertmanager={"url": f"http://127.0.0.1:{free_port()}"}), port)
    svc.start()
    try:
        status, body = svc.post([_firing(1)])
        [decision] = body["decisions"]
        assert decision["result"] == "unconfirmed" and "did not answer" in decision["reason"], body
        assert svc.replaced() == []
    finally:
        assert svc.proc is not None
        stop_process(svc.proc)
