"""``make bench BENCH=compile_restart``: what a restarted rank's first compiled step costs, cold
against warm torch.compile caches (runtime.train.worker.use_compile_cache).

Each arm is a fresh Python process, as a restarted rank or a spare is: it points the caches at a
folder (``use_compile_cache``), builds the runtime's GPT (small, so a CPU compiles it), compiles
it and times its first training step (compile + forward + backward + optimizer step) and its
second (the steady step). Per round, in this order:

- ``cold``: an empty cache folder (a new node, or torch's default /tmp emptied by a reboot);
  it also saves ``torch.compiler.save_cache_artifacts()`` to a file.
- ``warm``: the same folder again (a restarted rank or a spare on the same node).
- ``portable``: another empty folder, primed with ``torch.compiler.load_cache_artifacts()`` from
  the cold arm's file (what a replacement node would get from artifacts kept beside the checkpoint).

Each arm also reports torch's own counters (FX graph and AOTAutograd cache hits and misses), so
a warm arm that compiled again shows as misses, not only as seconds. Seconds on 2 shared cores
are noisy: medians over ``BENCH_ROUNDS`` rounds and the warm/cold ratio per round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
ROOT = Path(__file__).resolve().parent.parent
GPT = {"layers": 2, "dim": 64, "heads": 2, "seq_len": 32, "vocab_size": 256}
BATCH = 8


def cache_counters() -> dict[str, int]:
    """torch's compile-cache counters in this process, under short names."""
    from torch._dynamo.utils import counters

    return {"fx_hit": counters["inductor"]["fxgraph_cache_hit"], "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def child(cache_base: str, load: str | None, save: str | None) -> dict[str, Any]:
    """One arm, in its own process: first and second compiled step, the cache counters after them."""
    import torch

    from runtime.config import ModelConfig
    from runtime.config.schema import TransformerConfig
    from runtime.train.model_zoo import build_model
    from runtime.train.worker import use_compile_cache

    use_compile_cache("bench", base=cache_base)
    t0 = time.perf_counter()
    if load:
        torch.compiler.load_cache_artifacts(Path(load).read_bytes())
    loaded_s = time.perf_counter() - t0
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt", transformer=TransformerConfig(**GPT)), 0, 0, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    tokens = torch.randint(GPT["vocab_size"], (BATCH, GPT["seq_len"]))

    def step() -> float:
        t = time.perf_counter()
        logits = compiled(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    first, second = step(), step()
    out: dict[str, Any] = {"first_step_s": first, "second_step_s": second, "load_artifacts_s": loaded_s,
                           **cache_counters()}
    if save:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            raise RuntimeError("torch.compiler.save_cache_artifacts() returned nothing after a compiled step")
        Path(save).write_bytes(artifacts[0])
        out["artifact_bytes"] = len(artifacts[0])
    return out


def _arm(cache_base: Path, load: Path | None = None, save: Path | None = None) -> dict[str, Any]:
    """Run one arm in a fresh interpreter; its process wall time includes importing torch."""
    args = json.dumps({"cache_base": str(cache_base), "load": load and str(load), "save": save and str(save)})
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_compile_restart", args], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"compile_restart arm failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t
    return result


def run(results_dir: Path) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": [], "portable": []}
    with tempfile.TemporaryDirectory(prefix="bench-compile-", dir=results_dir) as tmp:
        for i in range(ROUNDS):
            node, other, artifacts = Path(tmp) / f"node{i}", Path(tmp) / f"other{i}", Path(tmp) / f"artifacts{i}.bin"
            rounds["cold"].append(_arm(node, save=artifacts))
            rounds["warm"].append(_arm(node))
            rounds["portable"].append(_arm(other, load=artifacts))
    first = {n: [r["first_step_s"] for r in rs] for n, rs in rounds.items()}
    med = {n: statistics.median(v) for n, v in first.items()}
    return {
        "description": f"runtime GPT {GPT}, batch {BATCH}, AdamW, CPU inductor; each arm a fresh process; "
                       "first step = compile + forward + backward + optimizer step",
        "cold_first_step_s": first["cold"], "warm_first_step_s": first["warm"],
        "portable_first_step_s": first["portable"],
        "cold_first_step_s_median": round(med["cold"], 3), "warm_first_step_s_median": round(med["warm"], 3),
        "portable_first_step_s_median": round(med["portable"], 3),
        "warm_over_cold": round(med["warm"] / med["cold"], 3),
        "warm_over_cold_per_round": [round(w / c, 3) for w, c in zip(first["warm"], first["cold"], strict=True)],
        "portable_over_cold": round(med["portable"] / med["cold"], 3),
        "steady_step_s_median": round(statistics.median(r["second_step_s"] for rs in rounds.values() for r in rs), 4),
        "artifact_bytes": rounds["cold"][0].get("artifact_bytes"),
        "counters": {n: [{k: r[k] for k in ("fx_hit", "fx_miss", "aot_hit", "aot_miss")} for r in rs]
                     for n, rs in rounds.items()},
        "rounds": rounds,
    }


if __name__ == "__main__":
    opts = json.loads(sys.argv[1])
    print(json.dumps(child(opts["cache_base"], opts["load"], opts["save"])))
