"""What a warm spare has imported (runtime.train.spares.warm_imports): a restarted worker that was a
spare builds, restores and steps without importing the heavy modules torch loads lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

# In a fresh interpreter: the hook, then the trainer on one rank twice in the folder argv[1] (the second
# restores the first's checkpoint, as a restarted group does); prints the modules the runs imported.
RESTART_AFTER_WARM = """
import json, sys
from pathlib import Path
from runtime.train.spares import warm_imports
from tests.support import job
from tests.support.trainer import train_in_process

warm_imports()
before = set(sys.modules)
folder = Path(sys.argv[1])
common = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "checkpoint.interval_steps=2"]
train_in_process(job("digits_smoke", str(folder), *common, "train.max_steps=2"), folder)
_, reports = train_in_process(job("digits_smoke", str(folder), *common, "train.max_steps=4"), folder)
print(json.dumps({"imported": sorted(set(sys.modules) - before),
                  "resumed_from": [r["resumed_from_step"] for r in reports if "resumed_from_step" in r]}))
"""

# What torch imports on its own the first time an optimizer is built or a state dict is read through
# torch.distributed.checkpoint: seconds of CPU each, on a restart's critical path if the spare left them.
LAZY_HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.checkpoint.state_dict")


def test_a_warmed_process_builds_restores_and_steps_without_importing_dynamo_or_dcp_state_dict(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", RESTART_AFTER_WARM, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["resumed_from"] == [2], out["resumed_from"]
    late = [m for m in out["imported"] if m.startswith(LAZY_HEAVY)]
    assert not late, f"imported after the hook: {sorted({'.'.join(m.split('.')[:2]) for m in late})}"
