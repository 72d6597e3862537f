"""The pointer file Ray Train persists instead of a checkpoint: ``ray.train.report(checkpoint=...)``
gets a folder holding only the verified checkpoint's uri, step and name, so Ray copies kilobytes,
not a second copy of the weights (rank 0's reporter writes it; a restarted worker reads it back).

Its own module because neither the writer nor the reader of checkpoints uses it: it is Ray's side.
"""

from __future__ import annotations

import json
import logging
import os

from runtime.checkpoint.format import CheckpointRef, is_int, step_name

log = logging.getLogger("runtime.checkpoint")

POINTER = "checkpoint_pointer.json"


def write_pointer(ref: CheckpointRef, directory: str) -> str:
    """Write a tiny pointer file for ``ray.train.report(checkpoint=Checkpoint.from_directory(d))``.

    Ray then persists kilobytes instead of a second copy of the weights; the real data
    stays in our verified storage.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, POINTER)
    with open(path, "w") as f:
        json.dump({"uri": ref.uri, "step": ref.step, "name": ref.name}, f)
    return path


def read_pointer(directory: str) -> CheckpointRef | None:
    """The CheckpointRef in a directory written by write_pointer (e.g. ray.train.get_checkpoint);
    None when there is none or it is malformed (with a warning)."""
    path = os.path.join(directory, POINTER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
        if not (isinstance(d, dict) and isinstance(d.get("uri"), str) and is_int(d.get("step"))
                and d.get("name") == step_name(d["step"])):
            raise ValueError(f"expected {{uri, step, name}}, got {d!r:.200}")
    except ValueError as exc:  # the pointer is advisory: a bad one must not stop a resume
        log.warning("ignoring checkpoint pointer %s: %s", path, exc)
        return None
    return CheckpointRef(uri=d["uri"], step=d["step"], name=d["name"])
