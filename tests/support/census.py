"""What a pytest session started, counted from evidence the processes leave (tests/conftest.py prints it).

The suite's cost is start-ups (docs/performance.md): Train runs, Train workers, Tune trial processes,
Ray clusters and nodes, driver and CLI processes. Those counts do not change with the host's hour
the way wall time does, so the session prints them at its end:

- Ray nodes and clusters: a thread reads /proc every 2 s for raylet processes that carry this
  session's marker in their environment (``MARKER``, set by tests/conftest.py and inherited by every
  process the tests start unless a test replaces the environment). A raylet's command line names its
  session folder: one folder per cluster, one raylet per node. Other sessions' clusters on the same
  machine carry another marker, or none, and are not counted.
- Ray actors, by class: each worker process writes ``:actor_name:<Class>`` to its own
  ``logs/worker-*.out`` when an actor is created in it (Ray's log prefix, read by its log monitor),
  one actor per process. ``TrainController`` is one Ray Train run, ``RayTrainWorker`` one Train
  worker, ``run_trial`` one Tune trial process. A trial's process writes two names (its class,
  ``ImplicitFunc``, at creation, then its repr, the function's name) and, with ``reuse_actors``, hosts
  many trials: names are counted once per process, so the count is of processes, not trials.
- By test file: each ``worker-*.out`` is credited to the test file that was running when a poll
  first saw it (``current``, set by tests/conftest.py as each test starts), so the report says which
  files the start-ups come from. A session fixture's processes count for the first test that used it.
- Driver and CLI processes: the subprocesses the pytest process itself starts, from Python's audit
  hook on ``subprocess.Popen`` (exact, whatever environment the test gives them); those a CLI starts
  in turn are counted by what they start on Ray. Ansible playbook runs are one kind of them: the
  ``ansible-playbook`` commands the tests start (site.yml on the lab, a role's tasks on the
  controller); the runs the lab's remediation service starts on the head are its own, not counted.
- Under pytest-xdist (``make test-quick``'s unit tests) each worker process counts for itself and
  hands its evidence to the controller (``evidence``/``add``), which prints the sum.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One of the runtime's settings (runtime.config.load.RUNTIME_SETTINGS), so a CLI that inherits it
# does not read it as a job override.
MARKER = "RT_TEST_CENSUS"
# Ray's actor classes for what docs/performance.md counts (Ray 2.60, Train V2, Tune's function trainable).
TRAIN_RUN, TRAIN_WORKER = "TrainController", "RayTrainWorker"
# A trial's actor writes its repr: Tune's function trainable (ImplicitFunc) answers with the function's
# name, runtime.tune.trial.run_trial.
TRIAL_CLASSES = ("run_trial", "ImplicitFunc")


def _python(argv0: str) -> bool:
    name = os.path.basename(argv0)
    return argv0 == sys.executable or name.startswith("python")


@dataclass
class Census:
    """Counts for one session; ``start()`` once, ``report()`` at the end."""

    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    interval_s: float = 2.0  # a raylet lives for seconds at least; a scan costs ~10 ms of CPU
    sessions: set[str] = field(default_factory=set)
    raylets: set[str] = field(default_factory=set)  # node ids
    subprocesses: Counter[str] = field(default_factory=Counter)
    current: str = "(before the first test)"  # the test file running now
    owners: dict[Path, str] = field(default_factory=dict)  # worker log -> test file running when first seen
    _seen: set[tuple[int, str]] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        os.environ[MARKER] = self.marker
        sys.addaudithook(self._audit)
        self._thread = threading.Thread(target=self._poll_loop, name="census", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- evidence

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        """subprocess.Popen's audit event: (executable, args, cwd, env)."""
        if event != "subprocess.Popen":
            return
        argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
        if argv and os.path.basename(argv[0]) == "ansible-playbook":
            self.subprocesses["ansible-playbook (playbook runs)"] += 1
        elif not argv or not _python(argv[0]):
            self.subprocesses["other programs"] += 1
        elif argv[1:3] == ["-m", "runtime"]:
            self.subprocesses["python -m runtime (the CLI)"] += 1
        else:
            self.subprocesses["other Python (drivers, helpers)"] += 1

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """Record the raylets of this session that started since the last poll."""
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    start_ticks = f.read().rsplit(b")", 1)[1].split()[19].decode()  # field 22: start time
                key = (int(entry.name), start_ticks)
                if key in self._seen:
                    continue
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
                # A Python process may be the child `ray start` forked before it became a raylet
                # (until exec it shows its parent's command line): look again at the next poll.
                if not _python(argv[0]):
                    self._seen.add(key)
                if not argv[0].endswith("/raylet"):
                    continue
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if f"{MARKER}={self.marker}".encode() not in f.read().split(b"\0"):
                        continue
            except (OSError, IndexError):  # gone meanwhile, or not ours to read
                continue
            opts = dict(a.split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
            if "--session_dir" in opts:
                self.sessions.add(opts["--session_dir"])
                self.raylets.add(opts.get("--node_id", entry.name))
        for session in self.sessions:
            for out in Path(session, "logs").glob("worker-*.out"):
                self.owners.setdefault(out, self.current)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()

    # ------------------------------------------------------------- xdist workers

    def evidence(self) -> dict[str, Any]:
        """What a pytest-xdist worker sends its controller (plain data: execnet pickles nothing else)."""
        return {"sessions": sorted(self.sessions), "raylets": sorted(self.raylets),
                "subprocesses": dict(self.subprocesses), "owners": {str(k): v for k, v in self.owners.items()}}

    def add(self, evidence: dict[str, Any]) -> None:
        """Count a worker's evidence with this process's own."""
        self.sessions.update(evidence["sessions"])
        self.raylets.update(evidence["raylets"])
        self.subprocesses.update(evidence["subprocesses"])
        for out, owner in evidence["owners"].items():
            self.owners.setdefault(Path(out), owner)

    # ------------------------------------------------------------- the report

    def actors(self) -> dict[Path, set[str]]:
        """Actor classes each worker process of this session's clusters hosted; a Tune trial's
        process counts as ``TRIAL_CLASSES[0]`` whichever of its names it wrote."""
        found: dict[Path, set[str]] = {}
        for session in self.sessions:
            for out in Path(session, "logs").glob("worker-*.out"):
                try:
                    with out.open(errors="replace") as f:
                        names = {line[len(":actor_name:"):].strip() for line in f if line.startswith(":actor_name:")}
                except OSError:
                    continue
                if names & set(TRIAL_CLASSES):
                    names = (names - set(TRIAL_CLASSES)) | {TRIAL_CLASSES[0]}
                found[out] = names
        return found

    def lines(self) -> list[str]:
        hosted = self.actors()
        actors = Counter(name for names in hosted.values() for name in names)
        workers = len(hosted)
        out = [f"Ray Train runs         {actors[TRAIN_RUN]:5d}   ({TRAIN_RUN} actors)",
               f"Ray Train workers      {actors[TRAIN_WORKER]:5d}   ({TRAIN_WORKER} actors)",
               f"Tune trial processes   {actors[TRIAL_CLASSES[0]]:5d}   (processes with a {TRIAL_CLASSES[0]} actor)",
               f"Ray clusters started   {len(self.sessions):5d}   (session folders)",
               f"Ray nodes started      {len(self.raylets):5d}   (raylets)",
               f"Ray worker processes   {workers:5d}   (every worker, actor or task, idle ones too)",
               f"subprocesses by tests  {sum(self.subprocesses.values()):5d}"]
        out += [f"  {kind:<36} {n:5d}" for kind, n in sorted(self.subprocesses.items())]
        others = {k: n for k, n in actors.items() if k not in (TRAIN_RUN, TRAIN_WORKER, *TRIAL_CLASSES)}
        if others:
            ranked = sorted(others.items(), key=lambda kv: -kv[1])
            out.append("other actors: " + ", ".join(f"{k} {n}" for k, n in ranked))
        return out + self._by_file(hosted)

    def _by_file(self, hosted: dict[Path, set[str]]) -> list[str]:
        """Train runs, Train workers and trial processes per test file, the costliest first."""
        kinds = (TRAIN_RUN, TRAIN_WORKER, TRIAL_CLASSES[0])
        per_file: dict[str, Counter[str]] = {}
        for out, names in hosted.items():
            for name in names & set(kinds):
                per_file.setdefault(self.owners.get(out, self.current), Counter())[name] += 1
        if not per_file:
            return []
        ranked = sorted(per_file.items(), key=lambda kv: (-kv[1][TRAIN_WORKER], -kv[1][TRIAL_CLASSES[0]], kv[0]))
        return ["by test file (first seen while it ran)    runs  workers  trials",
                *(f"  {name:<40} {c[TRAIN_RUN]:4d} {c[TRAIN_WORKER]:8d} {c[TRIAL_CLASSES[0]]:7d}"
                  for name, c in ranked)]
