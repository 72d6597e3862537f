"""``python flows/train_flow.py run --job digits_tune`` (or ``make flow JOB=digits_tune``): from a
search to a served model, as a Metaflow flow over the platform's Python API.

    start     load and validate the job: a config error fails here, before anything starts
    tune      the search on the Ray cluster (runtime.tune.tune), ``--budget`` trials
    train     the best configuration, longer (runtime.launch.driver.train); its run name is fixed at
              start, so a ``resume`` after a failure here continues from its newest checkpoint
    evaluate  held-out metrics of the final checkpoint (runtime.models.evaluate)
    register  the run's model as a new version in the MLflow Model Registry, promoted to ``--alias``
              when it beats the holder on ``--promote-metric`` (runtime.observe.registry)

A failure in a late step (the registry down) is finished with ``python flows/train_flow.py resume``:
Metaflow re-runs only the failed step and what follows; the trained run uploads what MLflow missed
before registering. Runs on Metaflow's local runtime and datastore unless Metaflow is configured for
S3 (METAFLOW_DEFAULT_DATASTORE=s3, METAFLOW_DATASTORE_SYSROOT_S3).

Ray: the steps reach the platform's existing cluster by address (``make cluster-up`` state or
RAY_ADDRESS) and authenticate as the CLI does, in the runtime's connect (runtime.cluster.authenticate).
Outerbounds' ``metaflow-ray`` (@metaflow_ray) gang-schedules Metaflow tasks and starts a Ray cluster
of its own across them; it does not attach to a running cluster, so it is not used.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from metaflow import FlowSpec, Parameter, card, current, step

DEFAULT_JOB = "digits_tune"
EXIT_BAD_INPUT = 2  # the CLI's: a job, override or search space refused before anything starts


class TrainFlow(FlowSpec):
    """Tune, train, evaluate and register one job of the platform."""

    job = Parameter("job", default=DEFAULT_JOB, help="a tuning job: a name from jobs/ or a YAML path")
    budget = Parameter("budget", default=0, type=int, help="trials in the search (0: the job's tune.num_samples)")
    train_steps = Parameter("train_steps", default=0, type=int,
                            help="steps of the final training (0: 3x the trials' train.max_steps)")
    model_name = Parameter("model_name", default="", help="registered model name (default: the job's name)")
    promote_metric = Parameter("promote_metric", default="eval/accuracy",
                               help="the version must beat the alias's holder on this metric to be promoted")
    alias = Parameter("alias", default="champion", help="the alias promotion moves")
    overrides = Parameter("set", default="", help="shell-quoted overrides, as make's SET: \"optimizer.lr=0.05\"")

    @step
    def start(self) -> None:
        """Load and validate the job (and its search space) before anything starts."""
        from runtime.tune import parse_tune

        cfg = self._job()
        parse_tune(cfg)
        self.job_name = cfg.name
        self.registered_name = self.model_name or cfg.name
        # Fixed here, kept by `resume`: a re-run train step finds its run folder and checkpoints.
        self.search_name = f"{cfg.name}-flow{current.run_id}-tune"
        self.train_name = f"{cfg.name}-flow{current.run_id}"
        self.next(self.tune)

    @card(type="blank", id="search")
    @step
    def tune(self) -> None:
        """The search; its best configuration goes on to training."""
        from metaflow.cards import Markdown, Table

        from runtime.layout import search_paths, storage_filesystem
        from runtime.tune import tune

        cfg = self._job()
        if self.budget:
            cfg = cfg.model_copy(update={"tune": {**(cfg.tune or {}), "num_samples": self.budget}})
        from ray import tune as rt

        search_dir = search_paths(cfg, self.search_name)[1]
        out = tune(cfg, self.search_name, job=self.job, show_progress=False,
                   resume=rt.Tuner.can_restore(search_dir, storage_filesystem=storage_filesystem(cfg)))
        if out.best is None:
            raise RuntimeError(f"search {out.name}: no trial reported {out.metric}; see {out.search_dir}")
        self.best_params: dict[str, Any] = dict(out.best.params)
        self.search = {"name": out.name, "dir": out.search_dir, "metric": out.metric, "mode": out.mode,
                       "best": out.best.best, "trials": len(out.trials)}
        self.trials = [{"trial": t.trial_id, "status": t.status, **t.params, out.metric: t.best, "steps": t.steps}
                       for t in out.trials]
        current.card["search"].append(Markdown(f"## Search {out.name}: {len(out.trials)} trials, "
                                               f"best {out.metric} = {out.best.best:.4g}"))
        columns = list(self.trials[0])
        current.card["search"].append(Table([[_cell(t.get(c)) for c in columns] for t in self.trials],
                                            headers=columns))
        self.next(self.train)

    @card(type="blank", id="training")
    @step
    def train(self) -> None:
        """The best configuration, longer; resumes from its checkpoints when this step is re-run."""
        from metaflow.cards import Image, Markdown

        from runtime.launch.driver import train

        cfg = self._train_config()
        outcome = train(cfg, self.train_name, show_progress=False)
        if outcome.error:
            raise RuntimeError(f"training {outcome.run_name} failed: {outcome.error}")
        self.best_config = cfg.model_dump(mode="json")
        self.run_dir, self.checkpoint_uri = outcome.run_dir, outcome.checkpoint_uri
        self.outcome = {k: v for k, v in outcome.metrics.items() if isinstance(v, (int, float, str))}
        self.mlflow_run_id, self.tracking_gap = outcome.mlflow_run_id, outcome.tracking_gap
        current.card["training"].append(Markdown(f"## Training {outcome.run_name}"))
        for plot in outcome.plots:
            with open(plot, "rb") as f:
                current.card["training"].append(Image(f.read(), label="training curves"))
        self.next(self.evaluate)

    @step
    def evaluate(self) -> None:
        """Held-out metrics of the final checkpoint."""
        from runtime.config import JobConfig
        from runtime.models.evaluate import evaluate_checkpoint

        self.metrics = evaluate_checkpoint(self.checkpoint_uri, JobConfig.model_validate(self.best_config))
        print("  ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))
        self.next(self.register)

    @step
    def register(self) -> None:
        """A new registry version (run's final metrics and this evaluation as tags); promoted if better."""
        from pathlib import Path

        from runtime.config import JobConfig
        from runtime.observe.mlflow_http import bound_mlflow_http, configured_uri
        from runtime.observe.mlflow_sync import register_run
        from runtime.observe.registry import PromotionRefused, promote
        from runtime.train.export import save_final_model

        bound_mlflow_http()
        # The server the trained config names (else the cluster's), never the one in the run folder's mlflow.json.
        uri = configured_uri(self.best_config["tracking"]["mlflow_uri"])
        # Its checkpoint from the trained config's storage too, never one the run folder's config names.
        storage = JobConfig.model_validate(self.best_config).checkpoint
        done = register_run(Path(self.run_dir), uri, self.registered_name, save_final_model, self.metrics, storage)
        self.registry_uri, self.version, self.mlflow_run_id = uri, done.version, done.run_id
        version = done.version
        try:
            p = promote(uri, self.registered_name, version, alias=self.alias, metric=self.promote_metric)
            self.promoted, self.promotion = True, p.reason
        except PromotionRefused as e:
            self.promoted, self.promotion = False, str(e)
        print(f"{self.registered_name} version {version}: "
              + (f"@{self.alias} ({self.promotion})" if self.promoted else self.promotion))
        self.next(self.end)

    @step
    def end(self) -> None:
        """Where the model is and how to load it."""
        print(f"models:/{self.registered_name}/{self.version} at {self.registry_uri}"
              + (f" is @{self.alias}" if self.promoted else ""))

    def _job(self) -> Any:
        from runtime.config import load_job

        return load_job(self.job, shlex.split(self.overrides), environ=os.environ)

    def _train_config(self) -> Any:
        """The job without its search, the best trial's values applied, trained ``train_steps``."""
        from runtime.tune.config import apply_params

        base = self._job().model_dump(mode="json")
        base["tune"] = None
        steps = self.train_steps or 3 * base["train"]["max_steps"]
        return apply_params(base, {**self.best_params, "train.max_steps": steps})


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def datastore_root(environ: os._Environ[str] | dict[str, str]) -> str:
    """Where Metaflow keeps this flow's artifacts, as Metaflow's own settings say."""
    if environ.get("METAFLOW_DEFAULT_DATASTORE", "local") == "s3":
        return environ.get("METAFLOW_DATASTORE_SYSROOT_S3", "")
    return environ.get("METAFLOW_DATASTORE_SYSROOT_LOCAL") or os.path.join(os.getcwd(), ".metaflow")


def check_datastore(storage: str, root: str) -> None:
    """Refuse a Metaflow datastore where a job can write: inside the job's checkpoint storage, or on
    an object store anywhere under the storage's first-level prefix (the example's node roles write
    all of ``ray/``, every job's storage included). ``resume`` unpickles the datastore's artifacts
    on the operator's machine: a job could plant one there and run code as the operator."""
    from runtime.config.values import parse_storage
    from runtime.errors import ConfigError

    if not root:
        return
    ds, st = parse_storage(root), parse_storage(storage)
    if ds.remote != st.remote:
        return
    if ds.remote:
        scheme, _, rest = st.uri.rstrip("/").partition("://")
        bucket, _, path = rest.partition("/")
        writable = f"{scheme}://{bucket}/{path.split('/')[0]}/" if path else f"{scheme}://{bucket}/"
        if f"{ds.uri.rstrip('/')}/".startswith(writable):
            raise ConfigError(f"the Metaflow datastore {root} is under {writable}, which the workers write "
                              f"(checkpoint.storage {storage} is there too; resume would unpickle what a job "
                              "planted): put METAFLOW_DATASTORE_SYSROOT_S3 under another prefix")
    elif Path(ds.uri).resolve().is_relative_to(Path(st.uri).resolve()):
        raise ConfigError(f"the Metaflow datastore {root} is inside checkpoint.storage {storage}, which every "
                          "worker writes (resume would unpickle what a job planted there): put "
                          "METAFLOW_DATASTORE_SYSROOT_S3/_LOCAL outside it")


def preflight(argv: list[str]) -> int | None:
    """``run``'s job, overrides and search space checked before Metaflow starts, and for ``run`` and
    ``resume`` the datastore's place: a bad one is one line and exit 2, as from the CLI, not a failed
    start step under Metaflow's traceback. None: go on."""
    command = next((c for c in ("run", "resume") if c in argv), None)
    if command is None:
        return None
    from runtime.config import load_job
    from runtime.errors import ConfigError
    from runtime.tune import parse_tune

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--job", default=DEFAULT_JOB)
    p.add_argument("--set", default="")
    args, _ = p.parse_known_args(argv[argv.index(command) + 1:])
    try:
        cfg = load_job(args.job, shlex.split(args.set), environ=os.environ)
        check_datastore(cfg.checkpoint.storage, datastore_root(os.environ))
        if command == "run":
            parse_tune(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as e:  # shlex: an unbalanced quote in --set
        print(f"error: --set {args.set!r}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return None


if __name__ == "__main__":
    if (code := preflight(sys.argv[1:])) is not None:
        sys.exit(code)
    TrainFlow()
