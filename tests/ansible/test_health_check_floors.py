"""health_check.yml's floors of DDP's bucket size, run by Ansible on the controller: the tasks that pick
the scaling model's floors (vars/health_check_floors.yml) for a node's GPUs and hold nccl-tests' output
to them, taken from the playbook as written, with nvidia-smi's and all_reduce_perf's output given
(no GPU here). A node at the floor passes, below it fails naming the floor; GPUs the model does not
cover skip these two checks with a line saying how to give floors, and are held to floors given; the
1 GiB run keeps its fixed floor; the two-node run's command carries each node's address, its peer's
(the next worker, or the one named) and the floor. Eight playbook runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
FLOORS = yaml.safe_load((ANSIBLE_DIR / "playbooks" / "vars" / "health_check_floors.yml").read_text())
TASKS = ("Assert the all_reduce bus bandwidth is above the floor.",
         "Pick the scaling model's floors for the node's GPUs.", "Decide whether the node's GPUs have floors.",
         "Report GPUs the scaling model has no floors for.",
         "Record the floors of DDP's bucket size.",
         "Assert the all_reduce bus bandwidth at DDP's bucket size is above the model's floor.")
H100 = "\n".join(f"{i}, NVIDIA H100 80GB HBM3, 35, 0" for i in range(8))
A10G = "\n".join(f"{i}, NVIDIA A10G, 35, 0" for i in range(4))


def _gpu_play() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The GPU play's variables and the named tasks of its GPU block, as written there."""
    first = yaml.safe_load((ANSIBLE_DIR / "playbooks" / "health_check.yml").read_text())[0]
    block = next(t for t in first["tasks"] if "block" in t)["block"]
    found = [t for t in block if t["name"] in TASKS]
    assert [t["name"] for t in found] == list(TASKS), "the playbook's floor tasks were renamed or moved"
    return first["vars"], found


def _nccl_tests(busbw: float) -> dict[str, str]:
    """What all_reduce_perf ends its output with."""
    return {"stdout": f"# Out of bounds values : 0 OK\n# Avg bus bandwidth    : {busbw}\n#\n"}


def _run(tmp_path: Path, smi: str, gpus: int, busbw: float, extra: dict[str, Any] | None = None,
         busbw_1g: float = 200.0) -> str:
    play_vars, tasks = _gpu_play()
    play = [{"name": "The health gate's floor tasks.", "hosts": "localhost", "gather_facts": False,
             "vars_files": [str(ANSIBLE_DIR / "playbooks" / "vars" / "health_check_floors.yml")],
             "vars": {**play_vars, "_nvidia_driver_gpu_count": gpus,
                      "__health_smi": {"stdout": smi, "stdout_lines": smi.splitlines()},
                      "__health_nccl": _nccl_tests(busbw_1g), "__health_nccl_ddp": _nccl_tests(busbw)},
             "tasks": tasks}]
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump(play, sort_keys=False))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{PLAYBOOK.parent}:{os.environ['PATH']}")
    proc = subprocess.run([str(PLAYBOOK), "-i", "localhost,", "-c", "local", "-e",
                           json.dumps({"ansible_python_interpreter": sys.executable, **(extra or {})}), str(path)],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300, check=False)
    return ("ok " if proc.returncode == 0 else "failed ") + proc.stdout


@pytest.mark.parametrize("offset", [0.0, -0.01])
def test_an_h100_node_passes_at_the_models_floor_and_fails_below_it(tmp_path: Path, offset: float) -> None:
    floor = FLOORS["health_check_model_floors"]["p5"]["intra_node_min_busbw_gbps"]
    out = _run(tmp_path, H100, 8, round(floor + offset, 2))
    if offset == 0:
        assert out.startswith("ok "), out[-3000:]
    else:
        assert out.startswith("failed "), out[-3000:]
        assert (f"localhost: all_reduce bus bandwidth at {FLOORS['health_check_ddp_message_bytes']} bytes "
                f"{round(floor - 0.01, 2)} GB/s is below the scaling model's floor {floor} GB/s") in out


def test_the_1_gib_run_holds_its_fixed_floor(tmp_path: Path) -> None:
    out = _run(tmp_path, H100, 8, 100.0, busbw_1g=129.9)
    assert out.startswith("failed "), out[-3000:]
    assert "localhost: all_reduce bus bandwidth 129.9 GB/s is below 130 GB/s" in out


def test_gpus_the_model_does_not_cover_skip_the_bucket_size_checks_saying_how_to_give_floors(tmp_path: Path) -> None:
    """Not a failed gate: the AWS example's own 4 x A10G pool would then fail it, replace_node.yml too."""
    out = _run(tmp_path, A10G, 4, 1.0)  # far below any floor: nothing holds it to one
    assert out.startswith("ok "), out[-3000:]
    flat = " ".join(out.split()).replace("''", "'")  # the YAML callback folds and quotes the line
    assert ("localhost: the scaling model has no floors for 4 x NVIDIA A10G (it covers A100, H100, 8 a node): "
            "skipping the all-reduces of DDP's bucket size; set health_check_system to one of p4d, p5, or "
            "health_check_nccl_ddp_min_busbw_gbps and health_check_pair_min_busbw_gbps, in the host's group_vars "
            "or with -e.") in flat
    floors = {"health_check_nccl_ddp_min_busbw_gbps": 40, "health_check_pair_min_busbw_gbps": 5}
    assert _run(tmp_path, A10G, 4, 50.0, floors).startswith("ok ")
    out = _run(tmp_path, A10G, 4, 39.9, floors)
    assert out.startswith("failed "), out[-3000:]
    assert "is below the scaling model's floor 40 GB/s" in out


@pytest.mark.parametrize(("peer", "expected"), [
    ("", {"gpu-0": "10.0.1.21", "gpu-1": "10.0.1.22", "gpu-2": "10.0.1.20"}),  # the next worker, wrapping round
    ("gpu-2", {"gpu-0": "10.0.1.22", "gpu-1": "10.0.1.22"}),
])
def test_the_two_node_run_pairs_each_node_with_its_peer_at_the_models_floor(
        tmp_path: Path, peer: str, expected: dict[str, str]) -> None:
    """The pair play's command as Ansible renders it for each node (a debug in place of the command:
    no Ray here; tests/integration/test_health_allreduce.py runs the check itself)."""
    pair = yaml.safe_load((ANSIBLE_DIR / "playbooks" / "health_check.yml").read_text())[-1]
    task = next(t for t in pair["tasks"] if t["name"] == "Run the all-reduce between the node and a peer.")
    assert task["become_user"] == "{{ ray_user | default('ray') }}" and task["throttle"] == 1
    cmd = task.pop("ansible.builtin.command")["cmd"]
    task["ansible.builtin.debug"] = {"msg": "RENDERED " + cmd}
    for key in ("become", "become_user", "register", "changed_when", "failed_when"):
        task.pop(key)
    play = [{**pair, "hosts": "gpu_workers", "tasks": [task],
             "vars_files": [str(ANSIBLE_DIR / "playbooks" / "vars" / "health_check_floors.yml")],
             "vars": {**pair["vars"], "health_check_pair_peer": peer, "nvidia_driver_gpu_present": True,
                      "_health_floored": True, "_health_pair_floor": 9.42}}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {"all": {"children": {
        "head": {"hosts": {"head-0": local}},
        "gpu_workers": {"hosts": {"gpu-0": {**local, "ray_node_ip_address": "10.0.1.20"},
                                  "gpu-1": {**local, "ray_node_ip_address": "10.0.1.21", "ansible_host": "192.0.2.9"},
                                  "gpu-2": {**local, "ray_node_ip_address": "10.0.1.22"}}}}}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(PLAYBOOK), "-i", str(tmp_path / "inventory.json"), "--limit",
                           ",".join([*expected, "head-0"]), str(tmp_path / "play.yml")], cwd=ANSIBLE_DIR, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rendered = sorted(" ".join(m.split()) for m in re.findall(r"RENDERED (.*?)'?\n\S", proc.stdout, re.S))
    assert rendered == sorted(
        "/usr/local/bin/ray-cluster-env /opt/ray/venv/bin/python /usr/local/lib/ray-health/allreduce_check.py "
        f"--address 127.0.0.1:6379 --node {_address(host)} --peer {address} --size 26214400 --device cuda "
        "--min-busbw-gbps 9.42" for host, address in expected.items()), proc.stdout[-3000:]


def _address(host: str) -> str:
    return {"gpu-0": "10.0.1.20", "gpu-1": "10.0.1.21", "gpu-2": "10.0.1.22"}[host]
