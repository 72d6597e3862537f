"""``make gpu-check``: everything only a GPU can prove, in one command on a CUDA host.

1. Refuses to run without CUDA (exit 1): a CPU torch that skips every GPU test must not pass.
2. Runs tests/gpu (the sync-free step under ``sync_debug``, compiled vs eager, nvJPEG decode
   through the trainer, FSDP on NCCL, prefetch with a slow consumer, ...).
3. Runs ``benchmarks.run gpu`` (every part of benchmarks/bench_gpu.py unless
   ``BENCH_GPU_PARTS`` narrows it, ``recovery`` included: a compiled job's worker SIGKILLed, on the
   throwaway Ray below), which writes ``benchmarks/results/gpu/<device>.json`` and ``.md``; the
   test outcome is added to that JSON.
4. Measures DDP's per-bucket gradient-ready times from a real backward (ResNet-50 and GPT,
   ``benchmarks.scaling_model measure``) into ``benchmarks/results/gpu/<device>_grad_ready_<model>.json``,
   the scaling model's ``--ready-times`` input (docs/scaling.md).

On a lent machine with no package registry, ``shared/device/gpu-env.sh BUNDLE make gpu-check
GPU_PY=python3`` installs the offline bundle next to the host's CUDA torch first.
``GPU_CHECK_SKIP_TESTS=1`` / ``GPU_CHECK_SKIP_BENCH=1`` / ``GPU_CHECK_SKIP_SCALING=1`` leave a
part out. Exit status: 0 only if every part run succeeded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _tests() -> dict[str, int]:
    report = RESULTS / "gpu-tests.xml"
    rc = subprocess.call([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={report}"], cwd=ROOT)
    suite = ET.parse(report).getroot()  # noqa: S314 (pytest wrote it, just now)
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["exit_status"] = rc
    return counts


def _ray_address() -> None:
    """A throwaway local Ray unless a cluster is named or running (a lent GPU host has none)."""
    if os.environ.get("RAY_ADDRESS"):
        return
    from runtime.cluster.connect import ray_address
    from runtime.cluster.state_file import ClusterError

    try:
        ray_address()
    except ClusterError:
        os.environ["RAY_ADDRESS"] = "local"


def _grad_ready(device: str) -> int:
    """The scaling model's GPU input: when each DDP bucket is ready in backward, one file per model."""
    rc = 0
    for model, batch in (("resnet50", "256"), ("gpt_small", "16")):
        out = RESULTS / "gpu" / f"{device.replace(' ', '_')}_grad_ready_{model}.json"
        rc |= subprocess.call([sys.executable, "-m", "benchmarks.scaling_model", "measure", "--model", model,
                               "--batch", batch, "--out", str(out)], cwd=ROOT)
    return rc


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to this Python (torch "
              f"{torch.__version__}); run it on a GPU host, e.g. through shared/device/gpu-env.sh", file=sys.stderr)
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    print(f"gpu-check on {device}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    tests = None if os.environ.get("GPU_CHECK_SKIP_TESTS") else _tests()
    bench_rc = 0
    if not os.environ.get("GPU_CHECK_SKIP_BENCH"):
        _ray_address()
        bench_rc = subprocess.call([sys.executable, "-m", "benchmarks.run", "gpu"], cwd=ROOT)
    if not os.environ.get("GPU_CHECK_SKIP_SCALING"):
        bench_rc |= _grad_ready(device)
    path = RESULTS / "gpu" / f"{device.replace(' ', '_')}.json"
    if tests is not None and path.is_file():
        doc = json.loads(path.read_text())
        doc["tests_gpu"] = tests
        path.write_text(json.dumps(doc, indent=2, sort_keys=True))
    failed = tests is not None and (tests["exit_status"] != 0 or tests["failures"] or tests["errors"])
    print(f"gpu-check: tests {tests}, benchmarks exit {bench_rc}; results in {path.parent}", flush=True)
    return 1 if failed or bench_rc else 0


if __name__ == "__main__":
    sys.exit(main())
