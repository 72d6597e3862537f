"""Every bad input a user can give the CLI is refused with exit 2, a message naming the problem, no
traceback, a bounded amount of output, and nothing started (no Ray, no MLflow) or written.

The CLI runs in-process (``runtime.cli.main``) so ~100 cases take seconds; a few run as real
subprocesses to prove the same holds for ``python -m runtime`` and through ``make``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.config import RUNTIME_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
MAX_OUTPUT_LINES = 40
MAX_OUTPUT_CHARS = 6000

LATIN1 = "optimizer: {lr: 0.1}\n# caf\xe9 au lait\n".encode("latin-1")
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
) + "description: *i\n"
MANY_ERRORS = "".join(f"field_{i}: {i}\n" for i in range(5000))


@dataclass
class Case:
    """One bad input: the command line, what the job file holds, the environment, what must be said."""

    argv: list[str]
    expect: list[str]
    job: str | bytes | None = None  # written to <tmp>/job.yaml; "{job}" in argv names it
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # extra folders/files under <tmp>/data
    code: int = 2
    absent: list[str] = field(default_factory=list)


def v(job: str | bytes, *expect: str, cmd: str = "validate", absent: tuple[str, ...] = ()) -> Case:
    return Case([cmd, "{job}"], list(expect), job=job, absent=list(absent))


FILE_CASES = {
    "empty file": v("", "job.yaml", "empty"),
    "comments only": v("# nothing here yet\n", "empty"),
    "duplicate key": v("optimizer:\n  lr: 0.1\n  lr: 0.2\n", "job.yaml:3", "duplicate key 'optimizer.lr'"),
    "duplicate section": v("data: {batch_size: 8}\ndata: {batch_size: 9}\n", "duplicate key 'data'",
                           cmd="train"),
    "latin-1 byte": v(LATIN1, "not UTF-8", "0xe9", "offset 26", "job.yaml:2"),
    "yaml syntax": v("model: {name: [unclosed\n", "job.yaml:2", "not valid YAML"),
    "tab indentation": v("model:\n\tname: resnet50\n", "not valid YAML"),
    "python tag": v("model: !!python/object:os.system {}\n", "not valid YAML"),
    "list at top": v("- just\n- a list\n", "expected a mapping of sections", "list"),
    "scalar at top": v("resnet50\n", "expected a mapping of sections"),
    "alias bomb": v(BOMB, "expands to more than 100,000 values"),
    "5000 unknown fields": v(MANY_ERRORS, "unknown field", "and 4,980 more"),
    "huge value": v("description: [" + ", ".join(["x" * 50] * 2000) + "]\n", "description", "characters"),
    "oversized file": v("description: '" + "x" * (1 << 20) + "'\n", "too large for a job file"),
    "infinite lr": v("optimizer: {lr: .inf}\n", "optimizer.lr", "finite", "job.yaml:1"),
    "nan momentum": v("optimizer: {momentum: .nan}\n", "optimizer.momentum", "finite"),
    "infinite clip": v("train: {clip_grad_norm: -.inf}\n", "train.clip_grad_norm", "finite", cmd="train"),
    "bool batch size": v("data: {batch_size: true}\n", "data.batch_size", "not a boolean"),
    "bool lr": v("optimizer: {lr: yes}\n", "optimizer.lr", "not a boolean"),
    "bool resource": v("distributed: {resources_per_worker: {efa: true}}\n", "resources_per_worker", "boolean"),
    "bool crop": v("data: {crop_scale: [true, 1.0]}\n", "data.crop_scale", "boolean"),
    "batch of a billion": v("data: {batch_size: 1000000000}\n", "data.batch_size", "cannot fit",
                            "grad_accum_steps"),
    "ten billion samples": v("data: {num_samples: 10000000000}\n", "data.num_samples", "in memory"),
    "million classes+": v("data: {num_classes: 2000000}\n", "data.num_classes", "classifier"),
    "storage without bucket": v("checkpoint: {storage: 's3://'}\n", "checkpoint.storage", "bucket name"),
    "storage empty bucket": v("checkpoint: {storage: 's3:///runs'}\n", "needs a bucket name"),
    "uppercase bucket": v("checkpoint: {storage: 's3://My_Bucket/runs'}\n", "'My_Bucket'", "lowercase"),
    "short bucket": v("checkpoint: {storage: 's3://ab/runs'}\n", "'ab'", "3 to 63"),
    "ip bucket": v("checkpoint: {storage: 's3://192.168.1.10/runs'}\n", "IP address"),
    "dotted bucket": v("checkpoint: {storage: 's3://a..b/runs'}\n", "'..'"),
    "unknown storage scheme": v("checkpoint: {storage: 'hdfs://bucket/x'}\n", "checkpoint.storage", "s3://bucket/prefix"),
    "blank storage": v("checkpoint: {storage: ' '}\n", "checkpoint.storage", "empty"),
    "shards bad bucket": v("data: {source: shards, path: 's3://Bad_Bucket/x'}\n", "data.path", "lowercase"),
    "cifar10 without path": v("data: {source: cifar10}\n", "data.path is required"),
    "path not a folder": v("data: {source: imagefolder, path: /no/such/dir}\n", "not a directory"),
    "tokens for resnet": v("data: {source: tokens}\n", "needs model.name=gpt"),
    "gpt on images": v("model: {name: gpt}\n", "token sequences", "data.source=tokens"),
    "text with small vocab": v("model: {name: gpt, transformer: {vocab_size: 100}}\ndata: {source: text}\n",
                               "vocab_size must be >= 256"),
    "dim not multiple of heads": v("model: {transformer: {dim: 100, heads: 3}}\n", "multiple of heads"),
    "learning_rate": v("optimizer: {learning_rate: 0.1}\n", "optimizer.learning_rate", "did you mean 'lr'"),
    "lr at the top": v("lr: 0.1\n", "did you mean 'optimizer.lr'"),
    "optimiser": v("optimiser: {lr: 0.1}\n", "did you mean 'optimizer'"),
    "misspelled field": v("data: {batchsize: 8}\n", "did you mean 'batch_size'"),
    "resnet51": v("model: {name: resnet51}\n", "model.name", "did you mean 'resnet50'", "job.yaml:1"),
    "use_gpu maybe": v("distributed: {use_gpu: maybe}\n", "distributed.use_gpu", "'auto' or a valid boolean",
                       absent=("literal[",)),
    "loader_workers words": v("data: {loader_workers: many}\n", "data.loader_workers", "'auto'",
                              absent=("literal[", "int.")),
    "name with a space": v("name: my job\n", "name:", "letters, digits", absent=("pattern", "^[")),
    "name climbing out": v("name: ../../etc\n", "letters, digits", absent=("pattern",), cmd="train"),
    "crop above one": v("data: {crop_scale: [0.5, 2.0]}\n", "crop_scale"),
    "eval at step zero": v("train: {eval_at_steps: [0]}\n", "train.eval_at_steps.0"),
    "checkpoint at step zero": v("checkpoint: {at_steps: [0]}\n", "checkpoint.at_steps.0"),
    "no length": v("train: {max_steps: null, epochs: null}\n", "train.max_steps or train.epochs"),
    "lr in words": v("optimizer: {lr: fast}\n", "optimizer.lr", "number"),
    "negative resources": v("distributed: {resources_per_worker: {efa: -1}}\n", "> 0"),
    "fp16 on cpu": v("precision: {dtype: fp16}\ndistributed: {use_gpu: false}\n", "fp16 needs GPUs"),
    "syncbn on cpu": v("model: {sync_batchnorm: true}\ndistributed: {use_gpu: false}\n", "SyncBatchNorm",
                       cmd="train"),
    "gpu decode on cpu": v("data: {decode: gpu}\ndistributed: {use_gpu: false}\n", "data.decode=gpu"),
    "tune junk in a training job": v("tune: {frobnicate: 1, space: {optimizer.lr: {uniform: [0.1, 0.2]}}}\n",
                                     "tune.frobnicate", "unknown field"),
    "tune not a mapping": v("tune: 5\n", "tune", "dictionary"),
    "tune bad distribution": v("tune: {space: {optimizer.lr: {gaussian: [0, 1]}}}\n", "unknown distribution"),
    "tune infinite bound": v("tune: {space: {optimizer.lr: {loguniform: [1.0e-4, .inf]}}}\n", "finite"),
    "tune metric typo": v("tune: {metric: val/acc, space: {optimizer.lr: {uniform: [0.1, 0.2]}}}\n",
                          "did you mean 'val/accuracy'", cmd="tune"),
    "tune space makes a bad job": v("tune: {space: {data.batch_size: {choice: [0, 8]}}}\n",
                                    "tune.space.data.batch_size"),
    "unknown user's home": v("data: {source: imagefolder, path: '~no-such-user-here/x'}\n", "home folder"),
    "number as a key": v("1: 2\n", "Keys should be strings"),
    "tune key not text": v("tune: {space: {1: {choice: [1]}}}\n", "tune.space.1", "string"),
    "tune space empty": v("tune: {space: {}}\n", "space is empty"),
    "tune without a section": v("train: {max_steps: 5}\n", "has no tune: section", cmd="tune"),
}

SET_CASES = {
    "--set without =": Case(["validate", "resnet50", "--set", "optimizer.lr"], ["bad override", "dotted.key=value"]),
    "--set without key": Case(["validate", "resnet50", "--set", "=3"], ["bad override"]),
    "--set empty level": Case(["train", "resnet50", "--set", "optimizer..lr=3"], ["bad override"]),
    "--set broken yaml": Case(["validate", "resnet50", "--set", "optimizer.lr=[1, 2"], ["not valid YAML"]),
    "--set unknown field": Case(["validate", "resnet50", "--set", "optimizer.learning_rate=0.1"],
                                ["did you mean 'lr'", "[from --set 'optimizer.learning_rate=0.1']"]),
    "--set bad value": Case(["train", "resnet50", "--set", "data.batch_size=0"],
                            ["data.batch_size", "[from --set 'data.batch_size=0']"]),
    "--set into a value": Case(["validate", "resnet50", "--set", "optimizer.lr.x=1"], ["optimizer.lr"]),
    "--set long value": Case(["validate", "resnet50", "--set", "description=" + "y" * 5000], ["at most 4,096"]),
    "--set infinite": Case(["validate", "resnet50", "--set", "optimizer.lr=.inf"], ["finite"]),
    "--set bool": Case(["validate", "resnet50", "--set", "train.max_steps=true"], ["not a boolean"]),
    "--set bad name": Case(["validate", "resnet50", "--set", "name=two words"], ["letters, digits"]),
    "--sets open quote": Case(["validate", "resnet50", "--sets", "description='open"], ["--sets", "quote"]),
    "--sets bad item": Case(["train", "resnet50", "--sets", "optimizer.lr=0.1 batch"], ["bad override 'batch'"]),
}

ENV_CASES = {
    "single underscore": Case(["validate", "resnet50"], ["RT_OPTIMIZER_LR", "did you mean RT_OPTIMIZER__LR"],
                              env={"RT_OPTIMIZER_LR": "0.1"}),
    "unknown RT_ variable": Case(["train", "resnet50"], ["RT_FROBNICATE", "RT_SECTION__FIELD"],
                                 env={"RT_FROBNICATE": "1"}),
    "bad value from env": Case(["validate", "resnet50"], ["data.batch_size", "[from RT_DATA__BATCH_SIZE]"],
                               env={"RT_DATA__BATCH_SIZE": "0"}),
    "unknown field from env": Case(["tune", "digits_tune"], ["did you mean 'lr'", "RT_OPTIMIZER__LEARNING_RATE"],
                                   env={"RT_OPTIMIZER__LEARNING_RATE": "0.1"}),
    "bool from env": Case(["validate", "resnet50"], ["train.max_steps", "not a boolean"],
                          env={"RT_TRAIN__MAX_STEPS": "on"}),
    "words from env": Case(["validate", "resnet50"], ["train.max_steps", "integer", "[from RT_TRAIN__MAX_STEPS]"],
                           env={"RT_TRAIN__MAX_STEPS": "lots"}),
    "env into a value": Case(["validate", "resnet50"], ["RT_OPTIMIZER__LR__X"], env={"RT_OPTIMIZER__LR__X": "1"}),
}

COMMAND_CASES = {
    "unknown command": Case(["trian", "resnet50"], ["invalid choice"]),
    "train without a job": Case(["train"], ["job"]),
    "unknown job": Case(["train", "resnet5"], ["unknown job 'resnet5'", "did you mean 'resnet50'"]),
    "job file in another folder": Case(["validate", "resnet50.yaml"], ["`validate resnet50`"]),
    "missing job file": Case(["validate", "{tmp}/nope.yaml"], ["nope.yaml", "does not exist"]),
    "job file is a folder": Case(["validate", "{tmp}/data.yaml"], ["is a folder"], files={"data.yaml/x": ""}),
    "run name climbing out": Case(["train", "resnet50", "--run-name", "../../x"], ["--run-name", "'../../x'"]),
    "run name with a space": Case(["tune", "digits_tune", "--run-name", "a b"], ["--run-name"]),
    "empty run name": Case(["train", "resnet50", "--run-name", ""], ["--run-name"]),
    "long run name": Case(["train", "resnet50", "--run-name", "r" * 500], ["--run-name", "1-128 letters"]),
    "unknown option": Case(["validate", "resnet50", "--frobnicate"], ["unrecognized arguments"]),
    "cluster bad action": Case(["cluster", "sideways"], ["invalid choice"]),
    "checkpoints list missing folder": Case(["checkpoints", "list", "{tmp}/runs/typo"], ["does not exist"]),
    "checkpoints verify missing folder": Case(["checkpoints", "verify", "{tmp}/runs/typo"], ["does not exist"]),
    "checkpoints prune keep 0": Case(["checkpoints", "prune", "{tmp}", "--keep", "0"], ["--keep must be >= 1"]),
    "checkpoints unknown subcommand": Case(["checkpoints", "frobnicate", "{tmp}"], ["invalid choice"]),
    "checkpoints gcs": Case(["checkpoints", "list", "gs://b/p"], ["gs://"]),
    "checkpoints without arguments": Case(["checkpoints"], ["list,verify,prune"]),
    "data unknown subcommand": Case(["data", "frobnicate"], ["invalid choice"]),
    "checkpoints verify a regular file": Case(["checkpoints", "verify", "{tmp}/model.pt"],
                                              ["model.pt is a file, not a checkpoint folder"],
                                              files={"model.pt": "x"}, absent=["does not exist"]),
    "checkpoints list a regular file": Case(["checkpoints", "list", "{tmp}/model.pt"], ["is a file"],
                                            files={"model.pt": "x"}, absent=["does not exist"]),
    "data pack missing source": Case(["data", "pack", "{tmp}/nope", "{tmp}/out"], ["nope does not exist"],
                                     absent=["no train/ folder"]),
    "data pack source is a file": Case(["data", "pack", "{tmp}/photos.zip", "{tmp}/out"],
                                       ["photos.zip is a file, not a folder"], files={"photos.zip": "x"},
                                       absent=["no train/ folder"]),
    "data pack onto a file": Case(["data", "pack", "{tmp}/src", "{tmp}/out.tar"],
                                  ["out.tar exists and is not a folder"], files={"out.tar": "x", "src/train/a/x": ""}),
    "report on a history with no readable line": Case(["report", "{tmp}/run"],
                                                      ["history.jsonl: no readable report", "line 1: not JSON"],
                                                      files={"run/history.jsonl": "\x00garbage\n"}),
}

ALL_CASES = {**FILE_CASES, **SET_CASES, **ENV_CASES, **COMMAND_CASES}


def test_there_are_at_least_80_bad_inputs() -> None:
    assert len(ALL_CASES) >= 80


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No stray RT_ overrides from the developer's shell; no reachable cluster; cwd is an empty folder."""
    for k in list(os.environ):
        if k.startswith("RT_") and k not in RUNTIME_SETTINGS:
            monkeypatch.delenv(k)
    monkeypatch.setenv("RT_CLUSTER_DIR", str(tmp_path / "no-cluster"))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # were anything to slip through, it fails fast
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", ALL_CASES.values(), ids=ALL_CASES.keys())
def test_bad_input_exits_2_naming_the_problem_and_starts_nothing(
    case: Case, clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = clean_env
    if case.job is not None:
        job = work / "job.yaml"
        job.write_bytes(case.job if isinstance(case.job, bytes) else case.job.encode())
    for rel, text in case.files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    for k, val in case.env.items():
        monkeypatch.setenv(k, val)
    argv = [a.replace("{job}", str(work / "job.yaml")).replace("{tmp}", str(work)) for a in case.argv]
    before = _tree(work)
    imported = {m for m in ("ray", "mlflow") if m in sys.modules}

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()

    assert code == case.code, (code, out, err)
    text = out + err
    for fragment in case.expect:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    for fragment in case.absent:
        assert fragment not in text, f"{fragment!r} in:\n{text}"
    assert "Traceback" not in text
    assert len(text.splitlines()) <= MAX_OUTPUT_LINES and len(text) <= MAX_OUTPUT_CHARS, text[:2000]
    assert _tree(work) == before, "bad input wrote files"
    for m in ("ray", "mlflow"):  # nothing started: not even imported, where it was not already
        assert m in imported or m not in sys.modules, f"{m} was imported for bad input"
    if "ray" in sys.modules:
        import ray

        assert not ray.is_initialized()


def test_validate_show_prints_the_resolved_config_and_each_override_with_its_origin(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RT_OPTIMIZER__LR", "0.02")
    code = main(["validate", "digits_smoke", "--show", "--set", "train.max_steps=7",
                 "--sets", "description='two words' optimizer.lr=0.03"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    applied = lines[lines.index("overrides applied (later wins):") + 1:lines.index("resolved configuration:")]
    assert applied == [
        "  optimizer.lr = 0.02  (RT_OPTIMIZER__LR)",
        "  train.max_steps = 7  (--set 'train.max_steps=7')",
        "  description = 'two words'  (--set 'description=two words')",
        "  optimizer.lr = 0.03  (--set 'optimizer.lr=0.03')",
    ]
    assert "  lr: 0.03" in lines and "description: two words" in lines and "  max_steps: 7" in lines


def test_validate_warns_when_workers_outnumber_this_machines_cpus(
    clean_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workers = (os.cpu_count() or 1) + 1
    assert main(["validate", "digits_smoke", "--set", f"distributed.num_workers={workers}"]) == 0
    err = capsys.readouterr().err
    assert f"warning: distributed: {workers} workers x 1 CPU need {workers} CPUs" in err


def test_warmup_longer_than_the_run_is_a_warning_naming_both_fields(
    clean_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A few steps of a big job are a legitimate smoke run, so this warns rather than refuses."""
    assert main(["validate", "digits_smoke", "--set", "train.max_steps=3"]) == 0
    err = capsys.readouterr().err
    assert "warning: schedule.warmup_steps=5 is longer than the run (train.max_steps=3)" in err


def _run(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env})


def test_latin1_job_file_is_a_message_not_a_traceback_from_python_m_runtime(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_bytes(LATIN1)
    r = _run("train", str(job), cwd=tmp_path, RAY_ADDRESS="127.0.0.1:1")
    assert r.returncode == 2
    assert "not UTF-8" in r.stderr and "offset 26" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_checkpoints_help_names_its_subcommands() -> None:
    r = _run("checkpoints", "--help")
    assert r.returncode == 0
    for sub in ("list", "verify", "prune"):
        assert f"    {sub} " in r.stdout, r.stdout


def test_make_validate_passes_set_values_with_spaces(tmp_path: Path) -> None:
    """SET="description='two words' ..." reaches the CLI as two overrides (make word-split it before)."""
    r = subprocess.run(
        ["make", "-s", "--no-print-directory", "validate", "JOB=digits_smoke", "SHOW=1",
         "SET=description='two words here' optimizer.lr=0.05", f"PY={sys.executable}", "SETUP_STAMP=/dev/null"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "description: two words here" in r.stdout.splitlines()
    assert "  lr: 0.05" in r.stdout.splitlines()
