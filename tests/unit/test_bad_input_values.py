"""Values users type (storage locations, URLs, ports, seeds, the runtime's RT_* settings) fed for real
through ``python -m runtime``: each is refused with exit 2, one line on stderr naming the field and
what was expected, no traceback, and nothing written. ``train`` is refused before it touches Ray:
RAY_ADDRESS points at a closed port, so a run that got as far as connecting would exit 3 instead;
``cluster up`` before it starts anything: its state folder (RT_CLUSTER_DIR) stays unmade.

``validate`` makes every check ``train`` makes before Ray: the parity cases run both commands.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runtime.cli import EXIT_BAD_INPUT

ROOT = Path(__file__).resolve().parents[2]
BOMB = "[&a [1,1,1,1,1,1,1,1,1]," + ",".join(
    f"&{n} [{','.join(['*' + p] * 9)}]" for p, n in zip("abcde", "bcdef", strict=True)) + "]"


@dataclass
class Case:
    """A command line (``{tmp}`` is the test's folder), its environment and what its one line must say."""

    args: list[str]
    expect: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text, made before the run
    code: int = EXIT_BAD_INPUT


def s(*overrides: str, expect: tuple[str, ...], **kw: object) -> Case:
    args = ["validate", "digits_smoke"]
    for o in overrides:
        args += ["--set", o]
    return Case(args, list(expect), **kw)  # type: ignore[arg-type]


BAD_INDEX = json.dumps({"splits": {"train": [{"name": "../../etc/x.tar", "samples": 1}]}})
SHARD_JOB = ("data.source=shards", "model.name=resnet18", "data.path={tmp}/shards")

CASES = {
    # storage locations and URLs
    "s3 with one slash": s("checkpoint.storage=s3:/bucket/runs",
                           expect=("checkpoint.storage", "missing a slash", "'s3://bucket/runs'")),
    "s3 without slashes": s("checkpoint.storage=s3:bucket", expect=("checkpoint.storage", "'s3://bucket'")),
    "storage is a file": s("checkpoint.storage={tmp}/model.pt", files={"model.pt": "x"},
                           expect=("checkpoint.storage", "is a file", "expected a folder")),
    "storage under a file": s("checkpoint.storage={tmp}/model.pt/runs", files={"model.pt": "x"},
                              expect=("checkpoint.storage", "lies under", "model.pt", "is a file")),
    "unknown storage scheme": s("checkpoint.storage=hdfs://bucket/runs", expect=("checkpoint.storage", "hdfs://", "s3://bucket")),
    "mlflow uri typo": s("tracking.mlflow_uri=htp:/x", expect=("tracking.mlflow_uri", "http(s)://host", "'htp:/x'")),
    "mlflow uri without host": s("tracking.mlflow_uri=http:/x", expect=("tracking.mlflow_uri", "http://host")),
    "endpoint without scheme": s("checkpoint.endpoint_url=localhost:9000",
                                 expect=("checkpoint.endpoint_url", "did you mean http://localhost:9000")),
    "endpoint port too big": s("checkpoint.endpoint_url=http://127.0.0.1:99999",
                               expect=("checkpoint.endpoint_url", "port from 1 to 65535")),
    "endpoint port words": s("data.endpoint_url=http://minio:port", expect=("data.endpoint_url", "port")),
    "endpoint garbage": s("checkpoint.endpoint_url=not a url", expect=("checkpoint.endpoint_url", "without spaces")),
    "endpoint broken ipv6": s("checkpoint.endpoint_url=http://[::1", expect=("checkpoint.endpoint_url", "valid URL")),
    "shards with one slash": s("data.source=shards", "model.name=resnet18", "data.path=s3:/datasets/x",
                               expect=("data.path", "missing a slash")),
    "imagefolder on s3": s("data.source=imagefolder", "model.name=resnet18", "data.path=s3://datasets/x",
                           expect=("data.path", "local folder", "imagefolder")),
    # values torch (and numpy) cannot take
    "seed of 10**30": s("train.seed=1000000000000000000000000000000", expect=("train.seed", "between 0 and")),
    "negative data seed": s("data.seed=-1", expect=("data.seed", "between 0 and")),
    "seed past 32 bits": s(f"train.seed={2**32}", expect=("train.seed", "2**32 - 1")),
    "boolean seed": s("train.seed=true", expect=("train.seed", "not a boolean")),
    "boolean timeout": s("distributed.timeout_s=yes", expect=("distributed.timeout_s", "not a boolean")),
    "zero poll interval": s("distributed.poll_interval_s=0", expect=("distributed.poll_interval_s", "greater than 0")),
    "infinite s3 retry": s("checkpoint.s3_retry_s=.inf", expect=("checkpoint.s3_retry_s", "finite")),
    "collective timeout of 10**14 s": s("distributed.timeout_s=100000000000000",
                                        expect=("distributed.timeout_s", "less than or equal to 604800")),
    "negative linger": s("tracking.prometheus_linger_s=-1", expect=("tracking.prometheus_linger_s", "greater than")),
    "vit with 40-pixel images": Case(["train", "vit_b_16", "--set", "data.image_size=40"],
                                     ["model.name=vit_b_16", "multiple of 16", "40"]),
    "vit on greyscale digits": s("model.name=vit_b_16", "data.image_size=32", expect=("vit_b_16", "3-channel")),
    # the runtime's own settings
    "port 99999": Case(["validate", "digits_smoke"], ["RT_MLFLOW_PORT", "'99999'", "1 to 65535"],
                       env={"RT_MLFLOW_PORT": "99999"}),
    "port in words": Case(["train", "digits_smoke"], ["RT_RAY_PORT", "port number"], env={"RT_RAY_PORT": "six"}),
    "negative metrics port": Case(["validate", "digits_smoke"], ["RT_METRICS_PORT", "0 to 65535"],
                                  env={"RT_METRICS_PORT": "-1"}),
    "cluster up with port 99999": Case(["cluster", "up", "--no-mlflow"], ["RT_PROMETHEUS_PORT", "1 to 65535"],
                                       env={"RT_PROMETHEUS_PORT": "99999"}),
    "cluster up with no nodes": Case(["cluster", "up", "--nodes", "0"], ["--nodes must be >= 1"]),
    "cluster up with -2 CPUs": Case(["cluster", "up", "--num-cpus", "-2"], ["--num-cpus must be >= 1"]),
    # echoed values stay short
    "alias bomb through --set": s(f"train.seed={BOMB}", expect=("train.seed", "characters")),
    "a 100,000-character job name": Case(["validate", "j" * 100_000], ["job 'jjjj", "File name too long"]),
    "--sets with an open quote, long": Case(["validate", "digits_smoke", "--sets", "description='" + "w" * 50_000],
                                            ["--sets", "quote"]),
}

PARITY = {  # what train refused before Ray (or only in its workers) and validate did not check
    "unknown instance type": (["--set", "cost.instance_type=g9.nonesuch"], {}, ["cost.instance_type", "g9.nonesuch"]),
    "price table not a table": (["--set", "cost.price_table={tmp}/prices.yaml"], {"prices.yaml": "- a list\n"},
                                ["cost.price_table", "instances"]),
    "server-side encryption typo": (["--set", "train.max_steps=2"], {}, ["RT_S3_SSE", "'aes'", "AES256"]),
    "kms key without kms": (["--set", "train.max_steps=2"], {}, ["RT_S3_SSE_KMS_KEY_ID", "aws:kms"]),
    "shard index out of its folder": ([a for o in SHARD_JOB for a in ("--set", o)],
                                      {"shards/index.json": BAD_INDEX}, ["index.json", "splits.train[0].name"]),
    "shard index classes not names": ([a for o in SHARD_JOB for a in ("--set", o)],
                                      {"shards/index.json": json.dumps({"classes": 5, "splits": {"train": [
                                          {"name": "train/000000.tar", "samples": 1}]}})},
                                      ["index.json", "classes must be a list"]),
    "shard folder without tars": ([a for o in SHARD_JOB for a in ("--set", o)], {"shards/train/README": "x"},
                                  ["data.path", "no shards under"]),
}
PARITY_ENV = {"server-side encryption typo": {"RT_S3_SSE": "aes"},
              "kms key without kms": {"RT_S3_SSE_KMS_KEY_ID": "arn:aws:kms:key"}}

DATA = {
    "pack under a file": Case(["data", "pack", "{tmp}/src", "{tmp}/model.pt/out"], ["cannot pack into", "model.pt"],
                              files={"model.pt": "x", "src/train/a/1.png": ""}, code=1),
    "inspect endpoint garbage": Case(["data", "inspect", "s3://datasets/x", "--endpoint-url", "garbage"],
                                     ["--endpoint-url 'garbage'", "http://"]),
    "inspect s3 with one slash": Case(["data", "inspect", "s3:/datasets/x"], ["path", "'s3://datasets/x'"]),
    "inspect negative samples": Case(["data", "inspect", "{tmp}", "--samples", "-1"], ["--samples", ">= 0"]),
    "inspect index classes a number": Case(
        ["data", "inspect", "{tmp}/shards"], ["classes must be a list", "got 5"],
        files={"shards/index.json": json.dumps({"classes": 5, "splits": {"train": [
            {"name": "train/000000.tar", "samples": 1}]}})}),
}


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _prepare(tmp: Path, files: dict[str, str]) -> None:
    (tmp / "cwd").mkdir()
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    if (tmp / "shards").is_dir():  # one real shard: only the index (or its absence) is wrong
        (tmp / "shards" / "train").mkdir(exist_ok=True)
        if "shards/train/README" not in files:
            with tarfile.open(tmp / "shards" / "train" / "000000.tar", "w") as tf:
                for name, payload in (("00000000.cls", b"0"), ("00000000.png", b"x")):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tf.addfile(info, io.BytesIO(payload))


def _run(tmp: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    work = tmp / "cwd"
    argv = [a.replace("{tmp}", str(tmp)) for a in args]
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp),
            "RT_CLUSTER_DIR": str(tmp / "no-cluster"), "RAY_ADDRESS": "127.0.0.1:1"}
    return subprocess.run([sys.executable, "-m", "runtime", *argv], cwd=work, capture_output=True, text=True,
                          timeout=300, env={**base, **env})


def _assert_one_line(r: subprocess.CompletedProcess[str], code: int, expect: list[str]) -> None:
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert len(lines[0]) <= 1000, f"{len(lines[0]):,} characters"
    for fragment in expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("case", [*CASES.values(), *DATA.values()], ids=[*CASES, *DATA])
def test_bad_value_is_one_line_naming_it_and_writes_nothing(case: Case, tmp_path: Path) -> None:
    _prepare(tmp_path, case.files)
    before = _tree(tmp_path)
    r = _run(tmp_path, case.args, case.env)
    _assert_one_line(r, case.code, case.expect)
    assert _tree(tmp_path) == before, "bad input wrote files"


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("name", PARITY)
def test_validate_refuses_what_train_refuses_before_ray(name: str, command: str, tmp_path: Path) -> None:
    args, files, expect = PARITY[name]
    _prepare(tmp_path, files)
    r = _run(tmp_path, [command, "digits_smoke", *args], PARITY_ENV.get(name, {}))
    _assert_one_line(r, EXIT_BAD_INPUT, expect)
    assert not (tmp_path / "cwd" / "runs").exists()


def test_settings_with_no_effect_are_one_warning_line_each(tmp_path: Path) -> None:
    _prepare(tmp_path, {})
    r = _run(tmp_path, ["validate", "digits_smoke", "--sets",
                        "distributed.elastic.min_wait_s=5 schedule.gamma=0.5 model.transformer.layers=2 "
                        "checkpoint.endpoint_url=http://127.0.0.1:9000 data.path=/srv/data"], {})
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "warning: distributed.elastic.min_wait_s has no effect: distributed.num_workers=2 is a fixed size "
        "(elastic: {min: N, max: M})",
        "warning: model.transformer.layers has no effect: model.name is small_cnn, not gpt",
        "warning: schedule.gamma has no effect: schedule.name is cosine, not step",
        "warning: checkpoint.endpoint_url has no effect: checkpoint.storage is a local folder",
        "warning: data.path has no effect: data.source is digits, which reads no files",
    ]


def test_the_repository_jobs_give_no_no_effect_warning() -> None:
    """The warnings name real mistakes only: none of the jobs we ship sets a field nothing reads."""
    from runtime.config import available_jobs, load_job
    from runtime.config.checks import no_effect

    warned = {job: no_effect(load_job(job, environ={})) for job in available_jobs()}
    assert warned and not any(warned.values()), warned
