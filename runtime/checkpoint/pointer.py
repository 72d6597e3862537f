"""The pointer file older runs handed Ray Train (``ray.train.report(checkpoint=...)``): a
folder holding only the verified checkpoint's uri, step and name. Ray is handed no checkpoint now
(it copied each one to its storage_path, and a copy failing in a storage outage failed the run);
a restarted worker still reads the pointer Ray's registry may hold for such a run resumed now.

Its own module because neither the writer nor the reader of checkpoints uses it: it is Ray's side.
"""

from __future__ import annotations

import json
import logging
import os

from runtime.checkpoint.format import CheckpointRef, is_int, step_name

log = logging.getLogger("runtime.checkpoint")

POINTER = "checkpoint_pointer.json"


def read_pointer(directory: str) -> CheckpointRef | None:
    """The CheckpointRef in a pointer directory (ray.train.get_checkpoint of an older run);
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
