"""A rotated grafana_admin_password takes effect on a Grafana that already started (it reads
GF_SECURITY_ADMIN_PASSWORD only at first start), on stdin, and a re-run changes nothing.

Runs the role's admin-password tasks on the controller against a stand-in for Grafana's /api/user
that checks basic auth against the password its database holds, with a stand-in CLI that writes
what it reads on stdin there (Grafana itself is not installed here; the test hosts run the role).
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
TASK = "TASK [grafana : Set the admin password in Grafana's database.]"
NEW = "rotated-password-2026"


@pytest.fixture
def grafana(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A stand-in Grafana on loopback whose admin password is in `database`; yields (port, database)."""
    database = tmp_path / "admin-password"
    database.write_text("first-start-password")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            expected = base64.b64encode(f"admin:{database.read_text()}".encode()).decode()
            ok = self.path == "/api/user" and self.headers.get("Authorization") == f"Basic {expected}"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(b'{"login": "admin"}' if ok else b'{"message": "invalid username or password"}')

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], database
    finally:
        server.shutdown()
        server.server_close()


def _run(tmp_path: Path, port: int, database: Path) -> subprocess.CompletedProcess:
    cli = tmp_path / "grafana-cli"
    cli.write_text(f"#!{sys.executable}\nimport sys, json, pathlib\n"
                   f"pathlib.Path({str(database)!r}).write_text(sys.stdin.readline().rstrip('\\n'))\n"
                   f"with open({str(tmp_path / 'argv.jsonl')!r}, 'a') as log:\n"
                   "    log.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    cli.chmod(0o755)
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"ansible.builtin.include_role": {"name": "grafana", "tasks_from": "admin_password"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    extra = {"ansible_python_interpreter": sys.executable, "grafana_http_addr": "127.0.0.1", "grafana_http_port": port,
             "grafana_admin_password": NEW, "grafana_cli": str(cli), "grafana_user": pwd.getpwuid(os.geteuid()).pw_name}
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles"), PATH=f"{PLAYBOOK.parent}:{os.environ['PATH']}")
    return subprocess.run([str(PLAYBOOK), "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
                           str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(os.geteuid() != 0, reason="runuser -u needs root (the role runs as root on the host)")
def test_a_rotated_admin_password_reaches_a_running_grafana_once(
        tmp_path: Path, grafana: tuple[int, Path]) -> None:
    port, database = grafana
    first = _run(tmp_path, port, database)
    assert first.returncode == 0, first.stdout[-3000:]
    assert database.read_text() == NEW
    calls = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert calls == [["admin", "reset-admin-password", "--password-from-stdin"]]
    assert NEW not in first.stdout
    assert "changed=1" in first.stdout, first.stdout[-2000:]

    again = _run(tmp_path, port, database)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "changed=0" in again.stdout and TASK in again.stdout, again.stdout[-2000:]
    assert len((tmp_path / "argv.jsonl").read_text().splitlines()) == 1
