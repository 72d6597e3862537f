"""The engine's memory across restarts: budget windows, halts, replay keys and replacement times.

A restarted service (a crash, an upgrade, a `kill -9` by anyone who can) must come back exactly as
careful as it was: a halt a human has not cleared stays, spent budget stays spent, an alert already
acted on is still a duplicate. One JSON file, replaced atomically (write, fsync, rename, fsync the
folder) after every change, so a kill at any instant leaves the old state or the new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .inputs import InputError, read_text_file
from .policy import PolicyError

MAX_STATE_BYTES = 16 << 20  # replay keys for max_alert_age_s of alerts; far above any real cluster's

VERSION = 1
FILE_NAME = "state.json"


class StateError(PolicyError):
    """The state file exists but cannot be trusted; the service refuses to start rather than forget a halt."""


@dataclass
class State:
    """Times are epoch seconds (wall clock: they must mean the same after a restart)."""

    total: list[float] = field(default_factory=list)  # starts of every remediation in the window
    per_node: dict[str, list[float]] = field(default_factory=dict)
    halted: list[str] = field(default_factory=list)  # nodes (or "*") halted until an operator clears them
    seen: dict[str, float] = field(default_factory=dict)  # replay key -> the alert's startsAt
    replaced: dict[str, float] = field(default_factory=dict)  # node -> when its last replacement finished


class StateFile:
    """`<state_dir>/state.json`; the folder is created private (0700) if missing."""

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / FILE_NAME

    def load(self) -> State:
        """The saved state, or an empty one if none was saved; StateError naming the file if it is damaged."""
        if not self.path.exists():
            return State()
        try:
            raw = json.loads(read_text_file(self.path, "state file", MAX_STATE_BYTES))
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')!r}, expected {VERSION}")
            state = State(total=[float(t) for t in raw["total"]],
                          per_node={str(k): [float(t) for t in v] for k, v in raw["per_node"].items()},
                          halted=[str(n) for n in raw["halted"]],
                          seen={str(k): float(v) for k, v in raw["seen"].items()},
                          replaced={str(k): float(v) for k, v in raw["replaced"].items()})
        except InputError as err:
            raise StateError(str(err)) from err
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise StateError(f"{self.path}: damaged state file ({type(err).__name__}: {err}); move it away to "
                             "start afresh (every halt and spent budget is then forgotten)") from err
        return state

    def save(self, state: State) -> None:
        """Replace the file atomically with `state`."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".state-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"version": VERSION, **asdict(state)}, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
