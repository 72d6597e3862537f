"""Command line: ``python -m runtime <command>``.

    python -m runtime train jobs/resnet50.yaml --set optimizer.lr=0.05
    python -m runtime tune jobs/digits_tune.yaml [--resume]
    python -m runtime validate resnet50 [--show]     # every check train/tune make; nothing starts
    python -m runtime validate gpt_10b --gpu-memory-gb 80   # ... and the per-GPU memory budget
    python -m runtime checkpoints list|verify|prune <storage>
    python -m runtime data pack|inspect ...
    python -m runtime cluster up|down|status
    python -m runtime report <run folder or name> [--sync]
    python -m runtime models list|show|promote|register ...   # the MLflow Model Registry

Overrides: ``--set a.b=c`` (repeatable), ``--sets "a.b=c d.e='two words'"`` (shell-quoted, what
``make ... SET=...`` passes) and ``RT_A__B=c`` environment variables; ``--set`` wins over RT_*.

Exit codes: 0 ok (a run that trained to its end, even when MLflow missed some of it: the summary
says what, and ``report <run> --sync`` uploads it), 1 the run failed (tune: no trial reported the
metric), 2 bad input (nothing was started), 3 no cluster or required service to run on (no Ray
cluster; MLflow unreachable with tracking.required, or for ``report --sync``), 4 train: the run
reached cost.budget_usd and stopped or paused at a committed checkpoint (docs/cost.md; raise the
budget and run again with the same --run-name to continue), 5 train: the run ended past its newest
committed checkpoint (its final save failed: the summary names the steps not committed), 6 train:
another driver holds the run (its lock names it; --take-over for a lock another host left), 7
validate --gpu-memory-gb: the job's per-GPU memory budget is over what a GPU of that size leaves
usable (the line names the budget, its largest term and the size; docs/fsdp.md), 130
interrupted: tune's search (resume with --resume), train's run by Ctrl+C at a committed checkpoint
(resume with the same --run-name).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import Any

from runtime.errors import ConfigError

EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_CLUSTER = 3
EXIT_BUDGET = 4
EXIT_UNCOMMITTED = 5
EXIT_RUN_LOCKED = 6
EXIT_NO_FIT = 7
EXIT_INTERRUPTED = 130
MAX_LINE = 1000  # characters of one error line: a value echoed in it is cut, never megabytes of it


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 too; keep the message format ours
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m runtime", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in ("train", "validate", "tune"):
        s = sub.add_parser(name, help=f"{name} a job (a name from jobs/ or a YAML path)")
        s.add_argument("job")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, e.g. --set optimizer.lr=0.05 (repeatable)")
        s.add_argument("--sets", dest="set_list", default="", metavar="'K=V K=V'",
                       help="several overrides in one shell-quoted string (how `make ... SET=...` passes "
                            "them: SET=\"description='two words' optimizer.lr=0.05\")")
        if name == "validate":
            s.add_argument("--show", action="store_true",
                           help="print the resolved configuration and the overrides that were applied")
            s.add_argument("--gpu-memory-gb", type=_gigabytes, default=None, metavar="G",
                           help="also check that a model.name=gpt job's per-GPU memory budget (parameters, "
                                "gradients, optimizer state, gathered blocks, activations; docs/fsdp.md) fits "
                                "a GPU of G GB (1e9 bytes); exit 7 when it does not")
        if name in ("train", "tune"):
            s.add_argument("--run-name", help="name of the run; reuse one to resume it")
            s.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
            s.add_argument("--verbose", action="store_true",
                           help="also show Ray's output from the workers and the Train controller")
        if name == "train":
            s.add_argument("--take-over", action="store_true",
                           help="start even though the run's lock names a driver on another host (one that is gone)")
        if name == "tune":
            s.add_argument("--resume", action="store_true", help="resume an interrupted search (Tuner.restore)")
    # These two parse their own arguments (and their own --help, which names their subcommands).
    c = sub.add_parser("checkpoints", help="list, verify or prune checkpoints in a storage URI", add_help=False)
    c.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("data", help="pack an ImageFolder into tar shards, inspect a data set",
                   add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("models", help="list, show, promote or register models in the MLflow Model Registry",
                   add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    r = sub.add_parser("report", help="print a run's summary table and regenerate its plots")
    r.add_argument("run", help="a run folder, or a run name under ./runs")
    r.add_argument("--sync", action="store_true",
                   help="first upload to MLflow what it missed of the run (idempotent; exit 3 while unreachable)")
    cl = sub.add_parser("cluster", help="the local embedded cluster")
    cl.add_argument("action", choices=["up", "down", "status"])
    cl.add_argument("--num-cpus", type=int, default=None)
    cl.add_argument("--no-mlflow", action="store_true")
    cl.add_argument("--no-prometheus", action="store_true")
    cl.add_argument("--nodes", type=int, default=1, help="up: raylets on this machine, head included (elastic tests)")
    return p


def _gigabytes(value: str) -> float:
    """``--gpu-memory-gb``: a positive number of GB (argparse turns the ValueError into one line, exit 2)."""
    try:
        gb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GB, e.g. 80, got {value!r}") from None
    if not 0 < gb <= 100_000:
        raise argparse.ArgumentTypeError(f"expected GB in (0, 100000], got {value}")
    return gb


def _cluster(args: argparse.Namespace) -> int:
    from runtime import cluster
    from runtime.config import check_settings

    try:  # up: a bad RT_<SERVICE>_PORT found after Ray and MLflow started would leave them running;
        # status reads the ports too (down reads none: it must stop what runs whatever the settings)
        if args.action != "down":
            check_settings(os.environ)
        for option, value in (("--num-cpus", args.num_cpus), ("--nodes", args.nodes)):
            if args.action == "up" and value is not None and value < 1:
                raise ConfigError(f"{option} must be >= 1, got {value}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.action == "up":
        state = cluster.up(num_cpus=args.num_cpus, with_mlflow=not args.no_mlflow,
                           with_prometheus=not args.no_prometheus, nodes=args.nodes)
        print("local cluster is up:")
        print(f"  Ray:        {state['ray']['address']}   dashboard {state['ray']['dashboard']}")
        if state.get("nodes"):
            print(f"  nodes:      head + {len(state['nodes'])} raylets on this machine")
        if "mlflow" in state:
            print(f"  MLflow:     {state['mlflow']['url']}")
        if "prometheus" in state:
            print(f"  Prometheus: {state['prometheus']['url']}")
        else:
            print("  Prometheus: not started (run `make prometheus-tools` to fetch the binary)")
        return 0
    if args.action == "down":
        stopped = cluster.down()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return 0
    for name, st in cluster.status().items():
        print(f"{name:11s} {st}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "logs":  # a run's lines from every node and rank, time-ordered; its own --help
        from runtime.observe.logs import main as logs_main

        return logs_main(argv[1:])
    if argv and argv[0] in ("checkpoints", "data", "models"):  # they parse their own arguments, --help included
        if argv[0] == "models":
            from runtime.models.cli import main as models_main

            return models_main(argv[1:])
        if argv[0] == "checkpoints":
            from runtime.checkpoint.cli import main as ckpt_main

            return int(ckpt_main(argv[1:]))
        from runtime.data.cli import main as data_main

        return data_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "cluster":
        return _cluster(args)
    if args.command == "report":
        from runtime.observe.run_summary import main as report_main
        from runtime.train.export import save_final_model

        return report_main(args.run, sync=args.sync, export_model=save_final_model)
    try:
        cfg = _checked_job(args)
        if args.command == "validate":
            return 0 if args.gpu_memory_gb is None else _check_memory(cfg, args.job, args.gpu_memory_gb)
        if args.command == "tune":
            from runtime.tune import parse_tune

            if args.verbose:  # tune() connects too; connecting first is what makes it verbose
                from runtime.cluster import ClusterError
                from runtime.launch.driver import connect

                parse_tune(cfg)  # bad input is still refused before Ray is touched

                try:
                    connect(verbose=True)
                except ClusterError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return EXIT_NO_CLUSTER
            return _tune(cfg, args)
        return _train(cfg, args)
    except ConfigError as e:
        print(f"error: {bounded(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT


def bounded(message: str) -> str:
    """An error message as printed: each line at most MAX_LINE characters, whatever value it echoes."""
    return "\n".join(line if len(line) <= MAX_LINE else f"{line[:MAX_LINE - 30]}... ({len(line):,} characters)"
                     for line in message.splitlines())


def _checked_job(args: argparse.Namespace) -> Any:
    """Everything `train` and `tune` refuse, refused here: before Ray, MLflow or any file is touched."""
    from runtime.config import check_settings, job_warnings, load_job, planned_device, preflight, validate_run_name
    from runtime.config.base import short

    if getattr(args, "run_name", None) is not None:
        validate_run_name(args.run_name)
    overrides = list(args.overrides)
    if args.set_list:
        try:
            overrides += shlex.split(args.set_list)
        except ValueError as e:
            raise ConfigError(f"--sets {short(args.set_list)}: {e} (quote values with spaces: "
                              "SET=\"description='two words'\")") from None
    applied: list[str] = []
    origins: dict[tuple[str, ...], str] = {}  # where each key was set: parse_tune's errors name it
    cfg = load_job(args.job, overrides, environ=os.environ, applied=applied, origins=origins)
    check_settings(os.environ)
    _before_ray(cfg)
    use_gpu, why = planned_device(cfg)
    if args.command == "validate" or cfg.distributed.use_gpu != "auto":
        preflight(cfg, use_gpu)  # with use_gpu=auto, train checks again once it knows the cluster
    if cfg.tune is not None or args.command == "tune":
        from runtime.tune import parse_tune

        parse_tune(cfg, origins)  # a training job's tune: section is checked too: junk there is a typo somewhere
    for w in job_warnings(cfg):
        print(f"warning: {w}", file=sys.stderr)
    if args.command == "validate":
        device = "GPU" if use_gpu else "CPU"
        print(f"{args.job}: OK ({cfg.name}, global batch {cfg.global_batch_size()}, {device}: {why})")
        if args.show:
            import yaml

            print("overrides applied (later wins):" if applied else "overrides applied: none")
            for line in applied:
                print(f"  {line}")
            print("resolved configuration:")
            print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False).rstrip())
    return cfg


def _check_memory(cfg: Any, job: str, gpu_gb: float) -> int:
    """``validate --gpu-memory-gb G``: the per-GPU budget of the job at its smallest size (fewest
    data-parallel shards), one line either way; EXIT_NO_FIT when it is over what G leaves usable."""
    from runtime.parallelism.memory import GB, GPTShape, check_fits, memory_budget

    if cfg.model.name != "gpt":
        raise ConfigError(f"--gpu-memory-gb: the memory budget is worked out for model.name=gpt (got "
                          f"{cfg.model.name}); drop the flag for this job")
    d, t = cfg.distributed, cfg.model.transformer
    tp = d.tp_size
    dp = d.min_workers // tp
    # A tensor-parallel group computes one data-parallel rank's micro-batch together.
    micro = cfg.data.micro_batch if isinstance(cfg.data.micro_batch, int) else cfg.data.batch_size
    budget = memory_budget(GPTShape(layers=t.layers, dim=t.dim, heads=t.heads, seq_len=t.seq_len,
                                    vocab_size=t.vocab_size),
                           dp=dp, tp=tp, micro_batch=micro, checkpointed=cfg.model.gradient_checkpointing)
    gpu = int(gpu_gb * GB)
    why = check_fits(budget, gpu, job)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return EXIT_NO_FIT
    terms = ", ".join(f"{k} {v / GB:.1f}" for k, v in budget.terms().items())
    print(f"{job}: fits: {budget.total / GB:.1f} GB per GPU ({terms}) at dp={dp} x tp={tp} on a {gpu_gb:g} GB GPU")
    return 0


def _before_ray(cfg: Any) -> None:
    """What the driver and the workers would refuse only after Ray started, refused for `validate`,
    `train` and `tune` alike: the price table and instance type, the S3 encryption settings, a
    local shard set's index."""
    from runtime.config.base import short
    from runtime.config.values import parse_storage
    from runtime.observe.cost.prices import price_source

    price_source(cfg.cost)  # an unreadable table or an instance type it lacks: ConfigError naming the field
    sse, kms = os.environ.get("RT_S3_SSE"), os.environ.get("RT_S3_SSE_KMS_KEY_ID")
    if sse or kms:
        from runtime.checkpoint.s3 import SSE_CHOICES

        if sse and sse not in SSE_CHOICES:
            raise ConfigError(f"environment: RT_S3_SSE={short(sse)} is not one of {', '.join(SSE_CHOICES)}")
        if kms and not (sse or "").startswith("aws:kms"):
            raise ConfigError("environment: RT_S3_SSE_KMS_KEY_ID needs RT_S3_SSE=aws:kms (or aws:kms:dsse)")
    if cfg.data.source == "shards" and not parse_storage(cfg.data.path).remote:
        # S3 shard sets are read by the workers: asking S3 here could wait out an unreachable endpoint.
        from runtime.data.shards.store import open_store
        from runtime.data.shards.stream import load_index

        store = open_store(cfg.data.path, cfg.data.endpoint_url)
        if store.read_index() is not None:
            load_index(store)  # parses index.json and checks each entry: no shard is read
        elif not store.list_tars("train"):
            raise ConfigError(f"data.path: no shards under {store.where}/train/ (expected train/000000.tar ...; "
                              "write them with `python -m runtime data pack <imagefolder> <out>`)")


def _train(cfg: Any, args: argparse.Namespace) -> int:
    from pathlib import Path

    from runtime.cluster import ClusterError
    from runtime.launch.driver import default_run_name, outcome_summary, train
    from runtime.launch.runlock import RunLocked
    from runtime.layout import storage_paths
    from runtime.observe.run_summary import logs_command
    from runtime.run import StopKind

    run_name = args.run_name or default_run_name(cfg)  # named here: a failure's summary names its logs
    try:
        outcome = train(cfg, run_name, show_progress=not args.no_progress, verbose=args.verbose,
                        take_over=args.take_over)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_CLUSTER
    except RunLocked as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUN_LOCKED
    except KeyboardInterrupt:  # Ctrl+C before the workers started or after they ended: nothing to commit
        print("interrupted (Ctrl+C) while the run was starting or ending, not while it trained", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError:
        raise
    except Exception as e:  # the run failed; its failures were printed one line each as they happened
        if args.verbose:
            raise
        lines = str(e).strip().splitlines()
        print(f"error: the run failed: {lines[0] if lines else type(e).__name__} (--verbose shows the traceback)",
              file=sys.stderr)
        print(f"  what happened: {logs_command(Path(storage_paths(cfg, run_name)[2]), e)}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(outcome_summary(outcome))
    stop = outcome.stop
    budget = stop is not None and stop.kind is StopKind.BUDGET
    if outcome.error or stop is not None and stop.kind not in (StopKind.PREEMPTED, StopKind.BUDGET):
        return EXIT_RUN_FAILED
    if outcome.uncommitted_steps() is not None:
        return EXIT_UNCOMMITTED
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_BUDGET if budget else 0


def _tune(cfg: Any, args: argparse.Namespace) -> int:
    """``tune <job> [--resume] [--run-name NAME]``: 0 ok, 1 no trial succeeded, 130 interrupted
    (resume with --resume), 3 no cluster. Bad input raises ConfigError (exit 2)."""
    from pathlib import Path

    from runtime.cluster import ClusterError
    from runtime.tune import parse_tune, tune

    parse_tune(cfg)  # bad spaces fail here, before Ray is touched
    try:
        out = tune(cfg, args.run_name, job=args.job, resume=args.resume, show_progress=not args.no_progress)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_CLUSTER
    print(f"search {out.name}: {len(out.trials)} trials in {out.wall_seconds:.0f} s -> {out.search_dir}")
    print(Path(out.report_files["md"]).read_text())
    if out.parent_run_id:
        print(f"MLflow: {out.mlflow_uri} (parent run {out.parent_run_id})")
    if out.interrupted:
        resume = f"make tune JOB={args.job} RESUME=1" + (f" RUN={args.run_name}" if args.run_name else "")
        print(f"search interrupted; continue it with: {resume}")
        return EXIT_INTERRUPTED
    if out.best is None:
        print("no trial reported the metric; see the trial logs in the search folder")
        return 1
    print("best configuration, ready to run:")
    print(f"  {out.override_line(args.job)}")
    return 0
