"""``python -m runtime models list|show|promote|register``: the MLflow Model Registry for operators.

    python -m runtime models list
    python -m runtime models show digits [champion|latest|3]
    python -m runtime models promote digits 3 --metric val/accuracy [--alias champion] [--mode max] [--force]
    python -m runtime models register runs/<run> --name digits      # a run that did not register (MLflow was down)

The server is ``--mlflow-uri``, else MLFLOW_TRACKING_URI, else the local cluster's (`make
cluster-up`), else the local store; ``register`` never sends to the server a run folder names.

Exit codes: 0 ok, 1 promotion refused (the version does not beat the alias's holder), 2 bad input
(unknown model, version or alias; a metric the version lacks; a damaged run folder; a value MLflow
refused), 3 MLflow unreachable.
"""

from __future__ import annotations

import argparse
import sys

from runtime.cluster import ClusterError
from runtime.errors import ConfigError
from runtime.observe.registry import DEFAULT_ALIAS, PromotionRefused, Version, models, promote, resolve, versions

EXIT_REFUSED, EXIT_BAD_INPUT, EXIT_NO_SERVICE = 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m runtime models", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlflow-uri", help="registry server (default: the local cluster's, MLFLOW_TRACKING_URI, "
                                        "else the local store)")
    sub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    sub.add_parser("list", help="registered models, their aliases and latest version")
    s = sub.add_parser("show", help="a model's versions, or one version (number, alias or latest) in full")
    s.add_argument("name")
    s.add_argument("version", nargs="?")
    pr = sub.add_parser("promote", help="point an alias at a version if it beats the current holder")
    pr.add_argument("name")
    pr.add_argument("version", help="a version number, an alias or latest")
    pr.add_argument("--alias", default=DEFAULT_ALIAS)
    pr.add_argument("--metric", help="compare this metric (a version's metric.<name> tag), e.g. val/accuracy")
    pr.add_argument("--mode", choices=["max", "min"], help="which way is better (default: min for losses, "
                                                          "errors and times, else max)")
    pr.add_argument("--force", action="store_true", help="promote without comparing")
    r = sub.add_parser("register", help="register a run folder's model (logging it first if needed)")
    r.add_argument("run", help="a run folder, or a run name under ./runs")
    r.add_argument("--name", required=True, help="the registered model's name")
    return p


def _version_lines(v: Version) -> list[str]:
    lines = [f"{v.name} version {v.version}" + (f"  @{', @'.join(v.aliases)}" if v.aliases else ""),
             f"  source     {v.source}", f"  run        {v.run_id or '-'}",
             f"  load with  mlflow.pytorch.load_model('models:/{v.name}/{v.version}')"]
    lines += [f"  {k:<10s} {val}" for k, val in sorted(v.tags.items())]
    return lines


def _run(args: argparse.Namespace, uri: str) -> int:
    if args.action == "list":
        rows = models(uri)
        if not rows:
            print(f"no registered models at {uri}")
        for name, aliases, latest in rows:
            held = " ".join(f"@{a}={v}" for a, v in sorted(aliases.items())) or "no aliases"
            print(f"{name:30s} latest {latest or '-':>4s}  {held}")
        return 0
    if args.action == "show":
        if args.version:
            print("\n".join(_version_lines(resolve(uri, args.name, args.version))))
            return 0
        for v in versions(uri, args.name):
            metrics = " ".join(f"{k}={val:.4g}" for k, val in sorted(v.metrics().items()))
            held = f"@{',@'.join(v.aliases)}" if v.aliases else ""
            print(f"{v.version:>4s} {held:18s} {v.tags.get('run_name', '-'):32s} {metrics}")
        return 0
    if args.action == "promote":
        p = promote(uri, args.name, args.version, alias=args.alias, metric=args.metric, mode=args.mode,
                    force=args.force)
        before = f" (was version {p.previous.version})" if p.previous else ""
        print(f"{args.name}@{args.alias} -> version {p.version.version}{before}: {p.reason}")
        return 0
    from runtime.observe.mlflow_sync import register_run
    from runtime.observe.mlflow_upload import STATE_FILE
    from runtime.observe.run_summary import HISTORY_FILE, find_run, refuse_special_files
    from runtime.train.export import save_final_model

    run_dir = find_run(args.run)
    refuse_special_files(run_dir, (HISTORY_FILE, STATE_FILE))
    done = register_run(run_dir, uri, args.name, save_final_model)
    print(f"{args.name} version {done.version} (MLflow run {done.run_id} at {uri}); promote with "
          f"`python -m runtime models promote {args.name} {done.version} --metric val/accuracy`")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from mlflow.exceptions import MlflowException

    from runtime.observe.history import ReportError
    from runtime.observe.mlflow_http import bound_mlflow_http, configured_uri, first_line

    bound_mlflow_http()
    uri = configured_uri(args.mlflow_uri)
    try:
        return _run(args, uri)
    except PromotionRefused as e:
        print(f"refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (ConfigError, ReportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_SERVICE
    except MlflowException as e:  # a value the server refused (a bad model name, an invalid alias)
        print(f"error: MLflow at {uri} refused it: {first_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a run folder or file that cannot be read
        print(f"error: {e.filename or 'the run folder'}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
