"""python elastic_job.py GCS_ADDRESS SHARED_DIR: the elastic training run the self-healing scenarios train through.

Runs on the lab's head as a Ray driver (tests/hosts/test_selfheal.py starts it). Ray Train V2,
`num_workers=(1, 2)`, one worker per lab worker (each asks for the `pool_a` resource the
inventory gives a worker node), a tiny linear model on CPU with gloo: what is under test is the
cluster around the run, not the model. The runtime's own trainer is not used here: it is being
restructured (runtime/train), and this loop records exactly what the scenarios measure. The
runtime's elastic callback is used as is: the test puts a copy of runtime/ on PYTHONPATH.

Rank 0 appends one JSON line per event to SHARED_DIR/progress.jsonl (the controller reads it,
the nodes share one clock with it): `start` (world size, the step resumed from), `step`,
`checkpoint` (`preempted` when it is the just-in-time one of a drain notice), `released` (rank 0
gave the drained node back to Ray after that checkpoint: runtime/train/drain.py). Each line names
its worker group (`group`, drawn by its rank 0 at the group's start) and rank 0's host (`node`), as
each checkpoint does: what a superseded group (one cut off from the cluster) wrote is told apart.
The run ends at the step written in SHARED_DIR/finish_at (the test writes it once the faults are
done). A fault lands at a known step: with a step in SHARED_DIR/hold_at, every rank waits at that
step's boundary (runtime.train.hold: SHARED_DIR/holds/<step>/held_<step>_rank<r>, until
SHARED_DIR/holds/<step>/release exists), with no collective in flight.

`python elastic_job.py --verify SHARED_DIR` checks the run's checkpoints against the same steps
trained once in one process (the model's start is seeded, each step's batch is seeded by its
step): a step trained twice into the history, or one lost, moves the weights by about a step
(printed), far beyond float32's summation order between sizes. Exit 0 when all match, 1 if not.

Checkpoints are resumed as the runtime resumes them (docs/checkpoints.md, "Newest in storage
wins"): rank 0 writes each one whole to SHARED_DIR/checkpoints before the next step (written
aside, then renamed into place), and every group starts from the newest one there. Ray Train's
own registry is not used: it registers a reported checkpoint at the controller's next poll, so a
node lost between the report and that poll resumed the interval before (12 steps redone with a
10-step interval in one CI run), which is Ray's lag, not the guarantee under test.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from runtime.train.hold import StepHold

GLOBAL_BATCH = 8  # 2 workers x 4 = 1 worker x 8: the same global batch at every size
CHECKPOINT_INTERVAL = 10  # steps; a hard node loss redoes at most this many (saves are whole before the next step)
STEP_PACE_S = 0.25  # a tiny step is ~ms: pace it so the run lasts through the scenarios on 2 shared cores
MODEL_SEED = 0  # the model's start, so that --verify can train the same steps again
HOLD_FILE = "hold_at"  # in SHARED_DIR: the step every rank waits at (the test's barrier)
# float32 sums in another order at 1 and 2 workers. Measured: 4.8e-7 apart at most, in an emulation
# of this run (1200 steps, sizes 2, 1, 2, 1, 2) and on the test hosts (2117 steps, 9 worker groups),
# where a step moved some weight by 2.3e-3 or more (less as the model converges, about as
# 1/sqrt(steps)); --verify also requires a step to move weights by more than 10 x the tolerance.
REPLAY_TOLERANCE = 1e-5


def _finish_at(shared: Path) -> int | None:
    try:
        return int((shared / "finish_at").read_text())
    except (OSError, ValueError):
        return None


def _hold(shared: Path) -> StepHold | None:
    """The step the test holds the run at, if any (read at every step by every rank: one small file)."""
    from runtime.train.hold import StepHold

    try:
        step = int((shared / HOLD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return StepHold(frozenset({step}), shared / "holds" / str(step))


def _model() -> torch.nn.Linear:
    import torch

    torch.manual_seed(MODEL_SEED)
    return torch.nn.Linear(16, 4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch trained after `step` steps: the same at any world size, and in --verify."""
    import torch

    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=generator)
    return x, x[:, :4].argmax(dim=1)


def _checkpoints(checkpoints: Path) -> list[Path]:
    """Every whole checkpoint, oldest step first (a name is only ever a complete file: see _save)."""
    return sorted(checkpoints.glob("step_*.pt"), key=lambda p: int(p.stem.removeprefix("step_")))


def _newest(checkpoints: Path) -> Path | None:
    found = _checkpoints(checkpoints)
    return found[-1] if found else None


def _save(checkpoints: Path, state: dict[str, Any], step: int) -> None:
    """Written under a temporary name, flushed, then renamed: a reader sees the whole file or none."""
    import torch

    checkpoints.mkdir(parents=True, exist_ok=True)
    part = checkpoints / f".step_{step:09d}.pt.part"
    with open(part, "wb") as out:
        torch.save(state, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(part, checkpoints / f"step_{step:09d}.pt")


def train_loop(config: dict[str, Any]) -> None:
    """Every rank: resume from the newest checkpoint, train, checkpoint every interval and on a drain notice."""
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    torch.set_num_threads(1)
    shared = Path(config["shared"])
    checkpoints = shared / "checkpoints"
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # Who wrote what: this group's rank 0 and its host (a group cut off may outlive its successor's start).
    group, node = uuid.uuid4().hex[:12], socket.gethostname()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    newest = _newest(checkpoints)
    if newest is not None:
        state = torch.load(newest, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    ddp = prepare_model(model)
    per_worker = GLOBAL_BATCH // world

    def record(event: str, **fields: Any) -> None:
        if rank == 0:  # rank 0 writes the timeline; every rank trains
            with open(shared / "progress.jsonl", "a") as out:
                out.write(json.dumps({"t": time.time(), "event": event, "step": step, "world": world,
                                      "per_worker_batch": per_worker, "group": group, "node": node,
                                      **fields}) + "\n")

    record("start")
    while True:
        finish = _finish_at(shared)
        if finish is not None and step >= finish:
            break
        # The global batch of this step, the same at any world size; each rank trains on its slice.
        x, y = _batch(step)
        mine = slice(rank * per_worker, (rank + 1) * per_worker)
        loss = torch.nn.functional.cross_entropy(ddp(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        record("step")
        # A barrier across ranks: every rank learns of a drain notice (a spot reclaim) at the same step.
        notice = ray.train.get_preemption_info()
        preempted = notice is not None
        if step % CHECKPOINT_INTERVAL == 0 or preempted:
            if rank == 0:
                _save(checkpoints, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                    "group": group, "node": node}, step)
            ray.train.report({"step": step, "loss": float(loss)})  # every rank past the save together
            record("checkpoint", preempted=preempted)
        if preempted:
            # Nothing trained after the just-in-time checkpoint is lost: give the node back to Ray (the
            # drain's deadline a few seconds away, as the runtime's trainer does) and wait for Ray Train
            # to restart the group without it.
            if rank == 0:
                from runtime.train.drain import release

                released, why = release(notice.preempted_node_ids, grace_s=2.0)
                record("released", nodes=released, why=why)
            record("waiting_for_preemption")
            while True:
                time.sleep(1)
        held = _hold(shared)
        if held is not None:  # the test's barrier: every rank between two steps, no collective in flight
            held.wait(step, rank)
        time.sleep(STEP_PACE_S)
    record("finished")


def verify(checkpoints: Path) -> dict[str, Any]:
    """Each checkpoint against the same steps trained once, in this process, on the whole batch.

    Per checkpoint: its step, writer (group, node) and the largest difference of any weight from
    the replay's at that step; `step_apart`: the smallest a step moves a weight by, over the
    checkpoints' last steps (what a step trained twice, or one lost, would show).
    """
    import torch

    torch.set_num_threads(1)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    found, step, apart = [], 0, float("inf")
    for path in _checkpoints(checkpoints):
        state = torch.load(path, weights_only=True)
        named = int(path.stem.removeprefix("step_"))
        before = [p.detach().clone() for p in model.parameters()]
        while step < named:
            before = [p.detach().clone() for p in model.parameters()]
            x, y = _batch(step)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        if named > 0:
            apart = min(apart, max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before)))
        diff = max(float((state["model"][name] - p.detach()).abs().max()) for name, p in model.named_parameters())
        found.append({"step": named, "saved_step": int(state["step"]), "group": state.get("group"),
                      "node": state.get("node"), "diff": diff})
    return {"checkpoints": found, "step_apart": apart, "tolerance": REPLAY_TOLERANCE}


def main() -> int:
    if sys.argv[1:2] == ["--verify"]:
        if len(sys.argv) != 3 or not (Path(sys.argv[2]) / "checkpoints").is_dir():
            print("usage: elastic_job.py --verify SHARED_DIR (a folder with checkpoints/)", file=sys.stderr)
            return 2
        verdict = verify(Path(sys.argv[2]) / "checkpoints")
        print(json.dumps(verdict))
        good = all(c["diff"] <= REPLAY_TOLERANCE and c["saved_step"] == c["step"] for c in verdict["checkpoints"])
        return 0 if good and verdict["checkpoints"] and verdict["step_apart"] > 10 * REPLAY_TOLERANCE else 1

    import ray
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchConfig
    from ray.train.v2.api.config import ScalingConfig

    # The runtime's own elastic controller callback (what `make train` adds to an elastic run): it
    # waits for Ray to mark a lost node dead and refreshes Ray's 20-s capacity view, so that a
    # restart is sized on the cluster as it is (runtime/launch/elastic.py).
    from runtime.launch.elastic import ElasticWatch

    # The runtime's trainer too: no Ray Data actor at each of the run's group starts.
    from runtime.launch.torch_trainer import LeanTorchTrainer
    from runtime.train.timeline import PhaseClock

    gcs_address, shared = sys.argv[1], Path(sys.argv[2])
    pythonpath = os.environ.get("PYTHONPATH", "")
    ray.init(address=gcs_address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    trainer = LeanTorchTrainer(
        train_loop,
        train_loop_config={"shared": str(shared)},
        # A dead peer fails the collective in 20 s, not gloo's default 30 minutes.
        torch_config=TorchConfig(backend="gloo", timeout_s=20),
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1, "pool_a": 1},
                                     elastic_resize_monitor_interval_s=3),
        run_config=RunConfig(name="selfheal", storage_path=str(shared / "storage"),
                             failure_config=FailureConfig(max_failures=-1),
                             # PhaseClock: the controller's timeline.jsonl on the shared folder, where a
                             # shrink's seconds go (Ray's verdict, Ray Train's restart, the new group's start).
                             # First, as in the runtime's driver: a state is stamped when Ray Train enters it,
                             # before ElasticWatch's wait for Ray's verdict on the same state.
                             callbacks=[PhaseClock(str(shared)),
                                        ElasticWatch("selfheal", 1, 2, min_wait_s=900, check_interval_s=3)]),
    )
    result = trainer.fit()
    print(json.dumps({"finished": True, "metrics": result.metrics}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
