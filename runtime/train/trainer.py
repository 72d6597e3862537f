"""The trainer core (runs inside each Ray Train worker): what happens when.

``Trainer.__init__`` composes the parts (device, data, model, optimizer) and the components
that own a cadence: ``Checkpointer`` (when to save), ``Evaluator`` (when to evaluate),
``StopPolicy`` (when to end) and ``MetricsAssembler`` (when to report, and what). ``fit`` reads
top to bottom: ``while not done: step; ask each component; at a boundary: evaluate, exchange,
checkpoint, report``; cleanup in ``close``. The same code runs on CPU (gloo) and GPU (NCCL).
Every rank computes; rank 0 writes DDP checkpoints (with FSDP every rank writes its own shards
and rank 0 commits) and publishes. How one optimizer step is computed (accumulation,
micro-batches, the non-finite skip) is ``train.step``'s ``OptimizerStep``, which ``Trainer``
extends; what decides a micro-batch's size lives in ``train.microbatch``, the worker entry
points in ``train.worker``.

Where the host waits for the device (see docs/performance.md): never inside a steady-state
step. Statistics stay on the device; the non-finite skip is decided on the device (fused
optimizers' ``found_inf``); the ranks exchange statistics and control flags once per
*boundary* — a step that reports (``train.log_every_steps``), checkpoints
(``checkpoint.interval_steps``) or evaluates — in one all-reduce and one read.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import ray.train
import torch
import torch.distributed as dist
from torch import nn

from runtime.config import JobConfig
from runtime.data import DEVICE_RESIDENT, build_loaders
from runtime.errors import ConfigError
from runtime.observe.cost.watch import build_cost_watch
from runtime.observe.stragglers import StragglerDetector
from runtime.run import PREEMPTED, DrainNotice, RunInfo, StopReason
from runtime.train.checkpointer import Checkpointer
from runtime.train.device_input import DevicePrefetcher, host_batches, make_stage
from runtime.train.evaluator import Evaluator
from runtime.train.hangwatch import HangWatch, process_group_store
from runtime.train.hold import StepHold
from runtime.train.loop_state import Stateful, TrainState, load_merged, merged_state
from runtime.train.metrics_assembler import MetricsAssembler
from runtime.train.microbatch import MicroBatcher, describe
from runtime.train.model_zoo import build_model
from runtime.train.parallel import apply_ddp, apply_fsdp, data_parallel_rank, full_tensor
from runtime.train.reporter import Reporter, build_gauges
from runtime.train.resume import Trainables, build_checkpoint_manager, build_payload, restore_latest
from runtime.train.sample_log import SampleLog
from runtime.train.setup import (
    CommTimer,
    Placement,
    build_optimizer,
    compile_enabled,
    for_world,
    lr_lambda,
    maybe_compile,
    register_comm_hook,
    resolve_precision,
    seed_everything,
)
from runtime.train.stats import Boundary, StepStats, gather_hosts
from runtime.train.step import OptimizerStep, sync_checked
from runtime.train.stop_policy import StopPolicy, total_steps, watches_drains
from runtime.train.timeline import first_step_done, worker_timeline

log = logging.getLogger("runtime.train")


class Trainer(OptimizerStep):
    """One rank's training state and loop."""

    def __init__(self, cfg: JobConfig, run: RunInfo, progress: Any = None, lockstep: bool = False,
                 placement: Placement | None = None, report_fn: Callable[..., None] | None = None,
                 on_first_step: Callable[[], None] | None = None, cancel: threading.Event | None = None) -> None:
        self.t_start = time.time()
        self.in_ray = placement is None
        where = placement or Placement.from_ray()
        self.rank, self.world, self.device = where.rank, where.world, where.device
        # An elastic run adapts accumulation (or the learning rate) to the size Ray started it at.
        cfg = for_world(cfg, self.world)
        self.cfg, self.run = cfg, run
        tc = cfg.train
        if tc.torch_threads:
            torch.set_num_threads(tc.torch_threads)
        seed_everything(tc.seed + self.rank, tc.deterministic)
        self.distributed = self.world > 1 and dist.is_initialized()
        if cfg.model.sync_batchnorm and self.world > 1 and self.device.type != "cuda":
            raise ConfigError(
                "model.sync_batchnorm=true needs CUDA devices: torch's SyncBatchNorm does not run on CPU/gloo; "
                "set model.sync_batchnorm=false or distributed.use_gpu=true"
            )
        self.amp_dtype = resolve_precision(cfg.precision.dtype, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        self.memory_format = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
        # train.sync_debug: steady-state steps raise on any host sync (CUDA only).
        self.sync_debug = tc.sync_debug and self.device.type == "cuda"

        # Data: each data-parallel rank reads its own shard (the ranks of a tensor-parallel group
        # share one); batches reach the device one step ahead.
        self.dp_rank, self.dp_world = data_parallel_rank(self.rank, self.world, cfg.distributed.tp_size)
        self.loaders, train_stage, val_stage = build_loaders(cfg, self.dp_world, self.dp_rank, self.device)
        bundle = self.loaders.bundle
        self.train_stage = make_stage(self.device, bundle, self.memory_format, train_stage)
        self.val_stage = make_stage(self.device, bundle, self.memory_format, val_stage)
        self.total_steps = total_steps(tc, self.loaders.batches_per_epoch)

        # Model: identical init on every rank (DDP also broadcasts rank 0's weights).
        torch.manual_seed(tc.seed)
        self.raw_model = build_model(cfg.model, bundle.num_classes, bundle.in_channels, bundle.image_size)
        self.is_fsdp = cfg.distributed.strategy == "fsdp"
        self.compiled = compile_enabled(cfg.model, self.device)
        if self.is_fsdp:  # FSDP2, applied here: Ray's prepare_model would use the FSDP1 wrapper
            model = apply_fsdp(self.raw_model.to(self.device), cfg.distributed.fsdp, self.amp_dtype, self.device,
                               self.world, compile_mode=cfg.model.compile_mode if self.compiled else None,
                               tp_size=cfg.distributed.tp_size)
        else:
            model = apply_ddp(self.raw_model, self.device, self.distributed)
        self.is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # DDP all-reduces and FSDP reduce-scatters gradients: every rank then sees the same grad norm.
        self.grads_synced = self.is_ddp or self.is_fsdp
        self.comm: CommTimer | None = None
        self.averager: Any = None
        if self.is_ddp:
            self.comm, self.averager = register_comm_hook(model, cfg)
        # FSDP compiled its blocks one by one above; DDP is compiled whole (DDPOptimizer splits
        # the graph at bucket boundaries so all-reduce still overlaps backward).
        self.model = model if self.is_fsdp else maybe_compile(model, cfg.model, self.device)
        torch.manual_seed(tc.seed + self.rank)
        optimizer = build_optimizer(cfg, self.model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, self.total_steps))
        self.trainables = Trainables(self.raw_model, optimizer, scheduler, self.scaler)
        self.loss_fn = nn.CrossEntropyLoss()

        self.state = TrainState(world=self.world)
        # The device batch: the loader batch, or data.micro_batch's size, halved on out-of-memory.
        self.micro = MicroBatcher(cfg.data.micro_batch, cfg.data.batch_size, self.device, self.rank, self.world,
                                  self.distributed, cfg.distributed.strategy)
        self.micro.inject_into(self.raw_model, lambda: self.state.global_step + 1)
        self.micro.guard_collectives(self.raw_model, cfg.distributed.tp_size)  # FSDP: agreement points
        self._held = []  # this step's loader batches (a redo reuses them: train.step)
        self.stats = StepStats(self.device, rank=self.rank, copies=cfg.distributed.tp_size)
        # Rank 0 names a rank slower than its peers from the exchange's per-rank slots (observe.stragglers).
        self.hosts = gather_hosts(self.distributed, self.world)  # every rank: one collective at start-up
        self.stragglers = (StragglerDetector(self.hosts, tc.stragglers.ratio, tc.stragglers.windows)
                           if self.rank == 0 and self.world > 1 else None)
        # What a resume continues besides the trainables: each keeps its own state (train.loop_state).
        self.stateful: tuple[Stateful, ...] = (self.state, self.stats, self.micro)
        self.gauges = build_gauges(cfg, run, self.rank, self.world)
        self.checkpoints = build_checkpoint_manager(cfg, run, self.gauges)
        self.reporter = Reporter(self.rank, self.world, run, progress, lockstep, self.gauges, self.checkpoints,
                                 report_fn or ray.train.report, report_all=not self.in_ray)
        # Every rank publishes where it is in its step; rank 0 names one its peers wait for (observe.hangs).
        warn_s, store = cfg.distributed.hang_warning_s(), process_group_store() if self.distributed else None
        self.hang_watch = (HangWatch(store, self.rank, self.world, self.hosts, warn_s, lambda: self.stats.progress,
                                     self.reporter.hang).start()
                           if store is not None and self.world > 1 and warn_s > 0 else None)
        # The components: each decides its own cadence; fit asks them after every step.
        self.stop = StopPolicy(tc, self.total_steps, run.run_dir, build_cost_watch(cfg, run, self.rank, self.world),
                               checkpoint_at=cfg.checkpoint.at_steps, cancel=cancel,
                               drain_notice=ray.train.get_preemption_info if self.in_ray and watches_drains(cfg)
                               else None)
        self.checkpointer = Checkpointer(
            self.checkpoints, cfg, run, rank=self.rank, world=self.world, distributed=self.distributed,
            sharded=self.is_fsdp, device=self.device, classes=bundle.classes, gauges=self.gauges,
            payload=lambda: build_payload(self.trainables, merged_state(self.stateful), self.distributed,
                                          self.world, sharded=self.is_fsdp),
            on_failure=self.stop.request)
        self.evaluator = Evaluator(
            self.model, self.loaders.val, self.val_stage, device=self.device, amp_dtype=self.amp_dtype,
            batch_size=cfg.data.batch_size, pad_to_batch=self.compiled, memory_format=self.memory_format,
            distributed=self.distributed, at_steps=tc.eval_at_steps, every_epochs=tc.eval_every_epochs,
            micro_batch=lambda: self.micro.size)
        comm = self.comm
        self.metrics = MetricsAssembler(
            cfg, self.device, self.world, self.total_steps,
            learning_rate=lambda: scheduler.get_last_lr()[0],
            comm_seconds=lambda: comm.seconds if comm else 0.0,
            # Files the loader could not read, plus images the GPU decoder could not (data.decode=gpu).
            skipped_samples=lambda: self.loaders.train.skipped + getattr(self.loaders.device_stage, "failed", 0))
        self.on_first_step = on_first_step  # e.g. spare processes for the next group (train.spares)
        self.hold = StepHold.from_env()  # tests only: every rank waits at a named boundary (train.hold)
        # Tests only: the sample ids each step trained on, one line per step (train.sample_log).
        self.samples = SampleLog.from_env(cfg.data.source, self.rank, self.world)
        self.recovered = False
        self._nonfinite_exported = 0
        self._recovery_noted = False

    # ------------------------------------------------------------- checkpoint

    def restore(self) -> None:
        """Resume from the newest checkpoint that verifies, even if Ray's registry is behind."""
        if self.checkpoints is None:
            return
        from runtime.checkpoint import read_pointer

        restore_start = time.time()  # the restart's timeline: read + verify + load from here
        pointer_step = None
        ray_ckpt = ray.train.get_checkpoint() if self.in_ray else None
        if ray_ckpt is not None:
            with ray_ckpt.as_directory() as d:
                pointed = read_pointer(d)
            pointer_step = pointed.step if pointed else None
        saved, facts = restore_latest(self.checkpoints.reader, self.trainables, self.cfg, self.rank, self.world,
                                      pointer_step, sharded=self.is_fsdp, trainer=merged_state(self.stateful))
        self.metrics.note({**facts, "timeline": worker_timeline(self.t_start, restore_start)})
        if saved is None:
            return
        load_merged(self.stateful, saved)
        self.checkpointer.restored_step = self.state.global_step
        self._reshard()
        self.recovered = True
        if self.gauges:
            self.gauges.recoveries.inc()

    def _reshard(self) -> None:
        """Continue the epoch at the same sample after the world size changed (an elastic resize)."""
        state = self.state
        resized = state.reshard(self.world, self.cfg.data.batch_size)
        if resized is None:
            return
        old, repeated = resized
        self.metrics.note({"resized_from": old, "resize_repeated_samples": repeated})
        if self.rank == 0:
            log.warning("resumed on %d workers (checkpoint written by %d): epoch %d continues at batch %d per "
                        "rank, %d sample(s) repeated; accumulation %d", self.world, old, state.epoch,
                        state.batch_in_epoch, repeated, self.cfg.train.grad_accum_steps)

    # ------------------------------------------------------------------ loop

    def fit(self) -> None:
        """Train until the stop policy says done; every step asks the components whether it is a boundary."""
        batches = self._start()
        first_step = self.state.global_step + 1
        while not self.stop.done(self.state):
            with sync_checked(self.sync_debug and self.state.global_step >= first_step):
                self.train_step(batches)
            step = self.state.global_step
            if step == first_step:
                self._first_step_done()
            evaluate, log_step = self.evaluator.due(step), self.metrics.should_log(step)
            commit, save = self.checkpointer.commit_due(step), self.checkpointer.interval_due(step)
            if not (evaluate or log_step or save or commit):
                continue  # a steady-state step: nothing waits for the device
            if self.hold is not None:
                self.hold.wait(step, self.rank)
            extra: dict[str, Any] = self._timed(self.evaluator.run) if evaluate else {}
            if commit:  # committed before the exchange: this report carries it
                self._timed(self.checkpointer.save, step, True)
            b = self.exchange(want_metrics=log_step or evaluate or commit)
            if b.preempt:
                return self._preempted(extra, saved=commit)
            if self.stop.drain is not None:
                self._drained(extra, saved=commit)
            if save:
                self._timed(self.checkpointer.save, step)
            if b.metrics:  # a commit waits for the next report: it stays unregistered until then
                self.report(b, extra, announce=b.commit)
            if self.stop.stopping:
                break
        self._finish()

    def _first_step_done(self) -> None:
        """The group is up: stamp the restart's timeline, start steady-state statistics, tell the caller."""
        self.stats.first_step_done()
        self.metrics.note({"timeline": first_step_done(self.metrics.noted("timeline"))})
        if self.on_first_step is not None:
            self.on_first_step()

    def _start(self) -> DevicePrefetcher:
        """Batches from where the state left off, on the device one step ahead (a producer thread,
        closed in close()); with ``data.micro_batch=auto`` and no size kept from a checkpoint, the probe."""
        source = host_batches(self.loaders.train, self.loaders.batches_per_epoch, self.state.epoch,
                              self.state.batch_in_epoch)
        if self.samples is not None:
            source = self.samples.tap(source)
        batches = self.prefetcher = DevicePrefetcher(
            source, self.train_stage, self.device, threaded=self.cfg.data.source not in DEVICE_RESIDENT)
        if self.micro.needs_probe() and not self.stop.done(self.state):
            self.probe(batches)
        elif self.micro.guarded:
            self.metrics.note(describe(None, self.micro))
        return batches

    def _preempted(self, extra: dict[str, Any], saved: bool) -> None:
        """All ranks agreed on rank 0's preemption: commit this step (unless just done), report, stop."""
        if not saved:
            self.checkpointer.save(self.state.global_step, blocking=True)
        self.report(self.exchange(want_metrics=True), extra, final=True, preempted=True)
        self.stop.request(PREEMPTED)

    def _drained(self, extra: dict[str, Any], saved: bool) -> NoReturn:
        """A node of the run is being drained: commit this step (unless just done) and report it with
        the notice; the driver, holding that report, gives the node back to Ray
        (runtime.launch.elastic.give_back). Then train nothing the restart would redo. Never returns
        (a rank that returns ends the run): Ray tears the group down at the drain's deadline, which
        the driver brings forward, and restarts it on the nodes left, from this commit, under its
        preemption budget rather than ``checkpoint.max_failures``."""
        step = self.state.global_step
        if not saved:
            self.checkpointer.save(step, blocking=True)
        info = self.stop.drain
        notice = DrainNotice(tuple(info.preempted_node_ids), step, info.deadline_ms or None)
        self.report(self.exchange(want_metrics=True), extra, announce=True, drain=notice)
        while True:
            time.sleep(1.0)

    def _finish(self) -> None:
        """End of training: evaluate, commit a final checkpoint, report with it."""
        extra = self.evaluator.run()
        self.checkpointer.finish(self.state.global_step)
        stop = self.stop.reason  # read before the exchange: the report says why training ended
        b = self.exchange(want_metrics=True)
        if self.hang_watch is not None:  # every rank is here: a hang named before is over
            self.hang_watch.all_arrived()
        self.report(b, extra, final=True, stop=stop)

    def _kept(self) -> int | None:
        """The final report's ``committed_step``: rank 0's newest commit (-1: none); None with checkpoints off."""
        if self.checkpoints is None or self.rank != 0:
            return None
        kept = self.checkpointer.kept_step()
        return -1 if kept is None else kept

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run evaluation or a checkpoint, keeping its time out of training throughput."""
        return self.stats.timed_out(lambda: fn(*args))

    # --------------------------------------------------------------- boundary

    def exchange(self, want_metrics: bool) -> Boundary:
        """All ranks at the same step: agree on rank 0's flags, read the window (one sync)."""
        self.stop.check_drain()  # every rank: Ray's call is a barrier
        flags = (False, False, False)
        if self.rank == 0:
            self.stop.check_cost()
            self.stop.check_cancel()
            flags = (self.stop.preempted(), self.stop.reason is not None,
                     self.reporter.unregistered_commit() is not None)
        b = self.stats.exchange(flags, self.distributed, self.world, want_metrics)
        if self.gauges and b.nonfinite_total > self._nonfinite_exported:
            self.gauges.nonfinite.inc(b.nonfinite_total - self._nonfinite_exported)
            self._nonfinite_exported = b.nonfinite_total
        self.stop.agree(b, self.state.global_step)
        return b

    def report(self, b: Boundary, extra: dict[str, Any] | None = None, final: bool = False, *,
               announce: bool = False, stop: StopReason | None = None, drain: DrainNotice | None = None,
               preempted: bool = False) -> None:
        """All ranks call this together, after an exchange. ``stop``: why training ended early (final only);
        ``drain``: this report carries a drain's commit; ``preempted``: the final report of a preemption."""
        self.metrics.notify(*self.micro.notices)  # console lines rank 0's report carries to the driver
        if self.stragglers is not None and b.rank_local_s:
            self.metrics.notify(*self.stragglers.observe(self.state.global_step, b.rank_local_s))
            if self.gauges:
                self.gauges.straggler_ratios(self.stragglers.ratios, self.hosts)
        self.micro.notices = []
        metrics = self.metrics.assemble(b, self.state, extra)
        if final:
            digest = self.param_digest()
            metrics["param_digest"] = digest
            if self.distributed:  # every rank's digest, to prove data parallelism kept them equal
                digests: list[Any] = [None] * self.world
                dist.all_gather_object(digests, digest)
                metrics["rank_param_digests"] = digests
            else:
                metrics["rank_param_digests"] = [digest]
        self.reporter.publish(metrics, final, announce, self.comm.seconds if self.comm else 0.0, stop=stop,
                              notices=self.metrics.take_notices(), drain=drain,
                              committed_step=self._kept() if final else None, preempted=preempted)

    def param_digest(self) -> str:
        """sha256 of this rank's parameters: equal on every rank when data parallelism is correct."""
        h = hashlib.sha256()
        for p in self.raw_model.parameters():  # FSDP: gathered whole on every rank (a collective)
            h.update(full_tensor(p.detach()).float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        watch = getattr(self, "hang_watch", None)  # None until built, and when off
        if watch is not None:
            watch.stop()
        if getattr(self, "prefetcher", None) is not None:  # fit() ran: stop its producer thread
            self.prefetcher.close()
        self.checkpointer.close()
        if self.gauges is not None:
            self.gauges.close(linger_s=self.cfg.tracking.prometheus_linger_s)
