"""A held-out matrix of bad input over every command, make target, agent and file format.

Each case is run as a user runs it (a subprocess: the CLI, ``make``, the agents) and classified:
``clear`` (one line naming the field, file or value, the documented non-zero exit), ``accepted``
(exit 0), ``traceback``, ``vague`` (a non-zero exit without the name or with the wrong code) or
``hang`` (no answer within the case's limit, a safety net only: every refusal here is immediate).
Nothing here starts Ray: ``RAY_ADDRESS`` names a closed port, so a case that wrongly got past its
checks fails at connecting (exit 3, classified vague), never by starting a cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CLOSED = "127.0.0.1:9"  # the discard port: nothing listens here on a test machine
HANG_LIMIT_S = 120  # a safety net that turns a hang into a classification, not a bound on speed
# ~120 CLI start-ups (about 2 CPU-minutes): make test runs them, make test-quick leaves them to the
# bad-input tests beside them.
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    """argv (``{w}`` is the world folder), the text the refusal must name, the exit codes allowed."""

    argv: list[str]
    names: str
    codes: tuple[int, ...] = (2,)
    env: dict[str, str] = field(default_factory=dict)
    not_created: str | None = None  # a file an injected command would have made


def rt(*args: str, **kw: object) -> Case:
    return Case([PY, "-m", "runtime", *args], **kw)  # type: ignore[arg-type]


def make(*args: str, **kw: object) -> Case:
    return Case(["make", "-s", "--no-print-directory", *args], **kw)  # type: ignore[arg-type]


def ops(module: str, *args: str, **kw: object) -> Case:
    return Case([PY, "-m", module, *args], **kw)  # type: ignore[arg-type]


def flow(*args: str, **kw: object) -> Case:
    env = {"METAFLOW_USER": "matrix"}  # as make flow sets it: Metaflow refuses to run without a user
    return Case([PY, "flows/train_flow.py", "run", *args], env=env, **kw)  # type: ignore[arg-type]


POLICY = """\
listen: 127.0.0.1:9105
webhook: {{token_file: {w}/token}}
state_dir: {w}/state
nodes: {{gpu-0: 10.0.1.21}}
limits: {{per_node_per_hour: 2, total_per_hour: 6}}
drain: {{gcs_address: 10.0.1.11:6379, deadline_s: 60, wait_s: 120}}
replace: {{command: [ansible-playbook, -e, "node={{node}}"], timeout_s: 1800}}
rules:
  - {{alert: NodeDown, instance_port: 9100, actions: [drain, replace]}}
"""


def policy(w: Path, name: str, old: str, new: str) -> str:
    """A copy of the valid policy with one line changed; its path."""
    text = POLICY.format(w=w)
    assert old in text, old
    (w / name).write_text(text.replace(old, new, 1))
    return str(w / name)


def build_world(w: Path) -> None:
    """Every bad file the cases name, under one folder."""
    (w / "state").mkdir()
    (w / "token").write_text("t" * 40)
    (w / "token").chmod(0o644)  # readable by others: refused
    (w / "a_file").write_text("not a folder\n")
    (w / "a_dir").mkdir()
    (w / "garbage.yaml").write_bytes(os.urandom(2048))
    (w / "empty.yaml").write_text("")
    (w / "list.yaml").write_text("- model\n- data\n")
    (w / "tabs.yaml").write_text("model:\n\tname: mlp\n")
    (w / "dup.yaml").write_text("model: {name: mlp}\nmodel: {name: resnet50}\ndata: {source: synthetic}\n")
    (w / "latin1.yaml").write_bytes("description: caf\xe9\nmodel: {name: mlp}\n".encode("latin-1"))
    (w / "pyobj.yaml").write_text("model: !!python/object/apply:os.system ['true']\n")
    (w / "deep.yaml").write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    (w / "bomb.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "model: *i\n")
    (w / "unknown.yaml").write_text("model: {name: mlp}\nmodle: {name: mlp}\n")
    (w / "prices_garbage.yaml").write_bytes(b"\x00\xff" * 100)
    (w / "prices_neg.yaml").write_text("instances:\n  local-cpu: {on_demand: -1.0, spot: 0.0, gpus: 0}\n")
    (w / "prices_str.yaml").write_text("instances:\n  local-cpu: {on_demand: cheap, spot: 0.0, gpus: 0}\n")
    (w / "prices_none.yaml").write_text("currency: USD\n")
    # Run folders for report / models register.
    for name, mlflow_json, history in (
        ("run_badhist", None, "{not json\n"),
        ("run_badmlflow", "{truncated", '{"step": 1, "loss": 1.0}\n'),
        ("run_listmlflow", '{"run_id": [1, 2]}', '{"step": 1, "loss": 1.0}\n'),
        ("run_nohist", None, None),
        ("run_binhist", None, "\x00\x01\x02"),
    ):
        d = w / "runs" / name
        d.mkdir(parents=True)
        if history is not None:
            (d / "history.jsonl").write_text(history)
        if mlflow_json is not None:
            (d / "mlflow.json").write_text(mlflow_json)
    os.mkfifo(w / "runs" / "run_fifo_hist_history")
    d = w / "runs" / "run_fifohist"
    d.mkdir()
    os.mkfifo(d / "history.jsonl")
    d = w / "runs" / "run_fifostate"
    d.mkdir()
    (d / "history.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    os.mkfifo(d / "mlflow.json")
    # Checkpoint storages.
    step = w / "ckpt_badmanifest" / "step_000000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{not json")
    step = w / "ckpt_escape" / "step_000000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"step": 10, "files": {"../../../../etc/passwd": "00"}}')
    # Data sets.
    (w / "shards_badindex").mkdir()
    (w / "shards_badindex" / "index.json").write_text("[1, 2")
    (w / "shards_badtar" / "train").mkdir(parents=True)
    (w / "shards_badtar" / "train" / "000000.tar").write_bytes(os.urandom(4096))
    (w / "notempty").mkdir()
    (w / "notempty" / "x").write_text("x")
    (w / "imgs" / "train" / "cat").mkdir(parents=True)
    (w / "imgs" / "train" / "cat" / "0.jpg").write_bytes(b"not a jpeg")


def job(name: str, *sets: str, cmd: str = "validate", **kw: object) -> Case:
    args = [cmd, name]
    for s in sets:
        args += ["--set", s]
    return rt(*args, **kw)


CASES: dict[str, Case] = {
    # --- job files -------------------------------------------------------------------------------
    "job_is_a_folder": job("{w}/a_dir", names="a_dir"),
    "job_garbage_bytes": job("{w}/garbage.yaml", names="garbage.yaml"),
    "job_empty_file": job("{w}/empty.yaml", names="empty.yaml"),
    "job_top_level_list": job("{w}/list.yaml", names="list.yaml"),
    "job_tab_indent": job("{w}/tabs.yaml", names="tabs.yaml"),
    "job_duplicate_key": job("{w}/dup.yaml", names="model"),
    "job_latin1_bytes": job("{w}/latin1.yaml", names="latin1.yaml"),
    "job_python_tag": job("{w}/pyobj.yaml", names="pyobj.yaml"),
    "job_nested_5000_deep": job("{w}/deep.yaml", names="deep.yaml"),
    "job_alias_bomb": job("{w}/bomb.yaml", names="bomb.yaml"),
    "job_misspelt_section": job("{w}/unknown.yaml", names="modle"),
    "job_name_path_escape": job("../../etc/passwd", names="passwd"),
    "job_fifo": job("{w}/runs/run_fifo_hist_history", names="run_fifo_hist_history"),
    # --- overrides -------------------------------------------------------------------------------
    "set_lr_nan": job("digits_smoke", "optimizer.lr=nan", names="optimizer.lr"),
    "set_lr_negative": job("digits_smoke", "optimizer.lr=-1", names="optimizer.lr"),
    "set_steps_bool": job("digits_smoke", "train.max_steps=true", names="train.max_steps"),
    "set_steps_float": job("digits_smoke", "train.max_steps=12.5", names="train.max_steps"),
    "set_batch_zero": job("digits_smoke", "data.batch_size=0", names="data.batch_size"),
    "set_workers_zero": job("digits_smoke", "distributed.num_workers=0", names="distributed.num_workers"),
    "set_workers_min_above_max": job("digits_smoke", "distributed.num_workers={min: 4, max: 2}",
                                     names="num_workers"),
    "set_storage_no_bucket": job("digits_smoke", "checkpoint.storage=s3://", names="checkpoint.storage"),
    "set_storage_bad_bucket": job("digits_smoke", "checkpoint.storage=s3://Bad_Bucket/x",
                                  names="checkpoint.storage"),
    "set_storage_is_file": job("digits_smoke", "checkpoint.storage={w}/a_file", names="checkpoint.storage"),
    "set_mlflow_uri_ftp": job("digits_smoke", "tracking.mlflow_uri=ftp://x", names="tracking.mlflow_uri"),
    "set_endpoint_broken_ipv6": job("digits_smoke", "checkpoint.endpoint_url=http://[::1",
                                    names="checkpoint.endpoint_url"),
    "set_seed_negative": job("digits_smoke", "train.seed=-1", names="train.seed"),
    "set_seed_huge": job("digits_smoke", "train.seed=100000000000000000000", names="train.seed"),
    "set_unknown_field": job("digits_smoke", "train.max_stepz=5", names="max_stepz"),
    "set_no_equals": job("digits_smoke", "optimizer.lr", names="optimizer.lr"),
    "set_empty_key": job("digits_smoke", "=5", names="=5"),
    "set_model_unknown": job("digits_smoke", "model.name=resnet9000", names="model.name"),
    "set_interval_zero": job("digits_smoke", "checkpoint.interval_steps=0", names="checkpoint.interval_steps"),
    "set_accum_negative": job("digits_smoke", "train.grad_accum_steps=-2", names="train.grad_accum_steps"),
    "set_timeout_inf": job("digits_smoke", "distributed.timeout_s=inf", names="distributed.timeout_s"),
    "set_imagefolder_missing": job("digits_smoke", "data.source=imagefolder", "data.path={w}/nope",
                                   names="data.path"),
    "set_shards_empty": job("digits_smoke", "data.source=shards", "data.path={w}/a_dir", names="data.path"),
    "set_price_table_garbage": job("digits_smoke", "cost.price_table={w}/prices_garbage.yaml",
                                   names="prices_garbage.yaml"),
    "set_price_table_negative": job("digits_smoke", "cost.price_table={w}/prices_neg.yaml", names="on_demand"),
    "set_price_table_string": job("digits_smoke", "cost.price_table={w}/prices_str.yaml", names="on_demand"),
    "set_price_table_no_instances": job("digits_smoke", "cost.price_table={w}/prices_none.yaml",
                                        names="instances"),
    "set_price_table_folder": job("digits_smoke", "cost.price_table={w}/a_dir", names="a_dir"),
    "set_price_table_fifo": job("digits_smoke", "cost.price_table={w}/runs/run_fifo_hist_history",
                                names="cost.price_table"),
    "sets_unbalanced_quote": rt("validate", "digits_smoke", "--sets", "description='two words",
                                names="--sets"),
    "env_lr_text": job("digits_smoke", names="RT_OPTIMIZER__LR", env={"RT_OPTIMIZER__LR": "abc"}),
    "env_unknown_field": job("digits_smoke", names="RT_TRAIN__MAX_STEPZ", env={"RT_TRAIN__MAX_STEPZ": "5"}),
    "env_sse_bogus": job("digits_smoke", names="RT_S3_SSE", env={"RT_S3_SSE": "rot13"}),
    "env_instance_unknown": job("digits_smoke", names="p9.huge", env={"RT_INSTANCE_TYPE": "p9.huge"}),
    # --- train / tune refuse before Ray ----------------------------------------------------------
    "train_run_name_escape": rt("train", "digits_smoke", "--run-name", "../escape", names="../escape"),
    "train_run_name_empty": rt("train", "digits_smoke", "--run-name", "", names="run"),
    "train_bad_set": job("digits_smoke", "optimizer.lr=0", cmd="train", names="optimizer.lr"),
    "tune_no_tune_section": rt("tune", "digits_smoke", names="tune"),
    "tune_samples_zero": job("digits_tune", "tune.num_samples=0", cmd="tune", names="tune.num_samples"),
    "train_unknown_option": rt("train", "digits_smoke", "--frobnicate", names="--frobnicate"),
    # --- checkpoints -----------------------------------------------------------------------------
    "ckpt_list_missing": rt("checkpoints", "list", "{w}/nope", names="nope"),
    "ckpt_list_file": rt("checkpoints", "list", "{w}/a_file", names="a_file"),
    "ckpt_verify_bad_manifest": rt("checkpoints", "verify", "{w}/ckpt_badmanifest", names="manifest",
                                   codes=(1, 2)),
    "ckpt_verify_manifest_escape": rt("checkpoints", "verify", "{w}/ckpt_escape", names="step_000000010",
                                      codes=(1, 2)),
    "ckpt_prune_keep_zero": rt("checkpoints", "prune", "{w}/a_dir", "--keep", "0", names="--keep"),
    "ckpt_prune_keep_text": rt("checkpoints", "prune", "{w}/a_dir", "--keep", "abc", names="--keep"),
    "ckpt_endpoint_not_url": rt("checkpoints", "list", "s3://bucket/p", "--endpoint-url", "notaurl",
                                names="notaurl"),
    "ckpt_endpoint_closed": rt("checkpoints", "list", "s3://bucket/p", "--endpoint-url", f"http://{CLOSED}",
                               names=CLOSED, codes=(3,), env={"AWS_ACCESS_KEY_ID": "x",
                                                              "AWS_SECRET_ACCESS_KEY": "x"}),
    "ckpt_unknown_action": rt("checkpoints", "frobnicate", "{w}/a_dir", names="frobnicate"),
    # --- data ------------------------------------------------------------------------------------
    "data_inspect_missing": rt("data", "inspect", "{w}/nope", names="nope"),
    "data_inspect_file": rt("data", "inspect", "{w}/a_file", names="a_file"),
    "data_inspect_samples_negative": rt("data", "inspect", "{w}/imgs", "--samples", "-1", names="--samples"),
    "data_inspect_bad_index": rt("data", "inspect", "{w}/shards_badindex", names="index.json"),
    "data_inspect_bad_tar": rt("data", "inspect", "{w}/shards_badtar", names="000000.tar"),
    "data_pack_missing_src": rt("data", "pack", "{w}/nope", "{w}/out1", names="nope"),
    "data_pack_shard_size_zero": rt("data", "pack", "{w}/imgs", "{w}/out2", "--shard-size", "0",
                                    names="--shard-size"),
    "data_pack_out_not_empty": rt("data", "pack", "{w}/imgs", "{w}/notempty", names="notempty"),
    # --- models ----------------------------------------------------------------------------------
    "models_show_no_name": rt("models", "show", names="name"),
    "models_uri_bad_scheme": rt("models", "--mlflow-uri", "htp:/x", "list", names="htp:/x"),
    "models_server_closed": rt("models", "--mlflow-uri", f"http://{CLOSED}", "list", names=CLOSED, codes=(3,)),
    "models_register_missing_run": rt("models", "--mlflow-uri", f"http://{CLOSED}", "register", "--name", "m",
                                      "{w}/nope", names="nope", codes=(2, 3)),
    "models_promote_bad_mode": rt("models", "promote", "m", "1", "--mode", "sideways", names="--mode"),
    # --- report ----------------------------------------------------------------------------------
    "report_missing": rt("report", "{w}/nope", names="nope"),
    "report_bad_history": rt("report", "{w}/runs/run_badhist", names="history.jsonl"),
    "report_binary_history": rt("report", "{w}/runs/run_binhist", names="history.jsonl"),
    "report_no_history": rt("report", "{w}/runs/run_nohist", names="run_nohist"),
    "report_fifo_history": rt("report", "{w}/runs/run_fifohist", names="history.jsonl"),
    "report_file": rt("report", "{w}/a_file", names="a_file"),
    "report_sync_fifo_mlflow_json": rt("report", "{w}/runs/run_fifostate", "--sync", names="mlflow.json",
                                       env={"MLFLOW_TRACKING_URI": f"http://{CLOSED}"}),
    "models_register_fifo_history": rt("models", "--mlflow-uri", f"http://{CLOSED}", "register", "--name", "m",
                                       "{w}/runs/run_fifohist", names="history.jsonl"),
    "report_sync_bad_mlflow_json": rt("report", "{w}/runs/run_badmlflow", "--sync", names="mlflow.json",
                                      env={"MLFLOW_TRACKING_URI": f"http://{CLOSED}"}),
    "report_sync_list_run_id": rt("report", "{w}/runs/run_listmlflow", "--sync", names="mlflow.json",
                                  env={"MLFLOW_TRACKING_URI": f"http://{CLOSED}"}),
    # --- cluster ---------------------------------------------------------------------------------
    "cluster_nodes_zero": rt("cluster", "up", "--nodes", "0", names="--nodes"),
    "cluster_cpus_text": rt("cluster", "up", "--num-cpus", "many", names="--num-cpus"),
    "cluster_unknown_action": rt("cluster", "restart", names="restart"),
    "cluster_port_env_bad": rt("cluster", "up", names="RT_MLFLOW_PORT", env={"RT_MLFLOW_PORT": "99999"}),
    # --- flow ------------------------------------------------------------------------------------
    "flow_unknown_job": flow("--job", "nosuch", names="nosuch"),
    "flow_budget_text": flow("--job", "digits_tune", "--budget", "abc", names="budget"),
    "flow_unbalanced_set": flow("--job", "digits_tune", "--set", "a='x", names="--set"),
    "flow_job_without_tune": flow("--job", "digits_smoke", names="tune"),
    # --- remediation service policy --------------------------------------------------------------
    "policy_listen_everywhere": ops("ops.remediation", "--check", "--policy", "P:listen: 127.0.0.1:9105|"
                                    "listen: 0.0.0.0:9105", names="listen"),
    "policy_port_99999": ops("ops.remediation", "--check", "--policy", "P:127.0.0.1:9105|127.0.0.1:99999",
                             names="listen"),
    "policy_limit_bool": ops("ops.remediation", "--check", "--policy", "P:per_node_per_hour: 2|"
                             "per_node_per_hour: true", names="per_node_per_hour"),
    "policy_wait_inf": ops("ops.remediation", "--check", "--policy", "P:wait_s: 120|wait_s: .inf",
                           names="wait_s"),
    "policy_unknown_action": ops("ops.remediation", "--check", "--policy", "P:actions: [drain, replace]|"
                                 "actions: [drain, reboot]", names="actions"),
    "policy_bad_node_ip": ops("ops.remediation", "--check", "--policy", "P:10.0.1.21|10.0.1.300", names="gpu-0"),
    "policy_command_no_node": ops("ops.remediation", "--check", "--policy", 'P:"node={node}"|"node=x"',
                                  names="command"),
    "policy_token_relative": ops("ops.remediation", "--check", "--policy", "P:{w}/token|token", names="token_file"),
    "policy_state_dir_file": ops("ops.remediation", "--check", "--policy", "P:{w}/state|{w}/a_file",
                                 names="state_dir"),
    "policy_garbage": ops("ops.remediation", "--check", "--policy", "{w}/garbage.yaml", names="garbage.yaml"),
    "policy_folder": ops("ops.remediation", "--check", "--policy", "{w}/a_dir", names="a_dir"),
    "policy_token_world_readable": ops("ops.remediation", "--policy", "P:rules:|rules:", names="token"),
    # --- spot agent ------------------------------------------------------------------------------
    "spot_interval_zero": ops("ops.remediation.spot", "--gcs-address", "10.0.0.1:6379", "--node-address",
                              "10.0.0.2", "--interval", "0", names="--interval"),
    "spot_interval_nan": ops("ops.remediation.spot", "--gcs-address", "10.0.0.1:6379", "--node-address",
                             "10.0.0.2", "--interval", "nan", names="--interval"),
    "spot_gcs_no_port": ops("ops.remediation.spot", "--gcs-address", "head", "--node-address", "10.0.0.2",
                            names="--gcs-address"),
    "spot_imds_file_url": ops("ops.remediation.spot", "--gcs-address", "10.0.0.1:6379", "--node-address",
                              "10.0.0.2", "--imds", "file:///etc/passwd", names="--imds"),
    "spot_node_port_99999": ops("ops.remediation.spot", "--gcs-address", "10.0.0.1:6379", "--node-address",
                                "10.0.0.2:99999", names="--node-address"),
    # --- make: every variable reaches the shell as one word, bad values are refused ---------------
    "make_validate_job_injection": make("validate", "JOB=x;touch {w}/pwned1", names="x;touch",
                                        not_created="pwned1"),
    "make_cloud_injection": make("cluster-up", "CLOUD=x||touch {w}/pwned2", names="CLOUD",
                                 not_created="pwned2"),
    "make_models_args_injection": make("models", "ARGS=--mlflow-uri htp:/x list||touch {w}/pwned3",
                                       names="list||touch", not_created="pwned3"),
    "make_validate_set_unbalanced": make("validate", "JOB=digits_smoke", "SET=description='x", names="SET"),
    "make_train_unknown_job": make("train", "JOB=nosuch", names="nosuch"),
    "make_train_run_escape": make("train", "JOB=digits_smoke", "RUN=../x", names="../x"),
    "make_tune_no_tune_section": make("tune", "JOB=digits_smoke", names="tune"),
    "make_flow_unknown_job": make("flow", "JOB=nosuch", names="nosuch"),
    "make_flow_budget_text": make("flow", "JOB=digits_tune", "BUDGET=lots", names="budget"),
    "make_cloud_unknown": make("cluster-up", "CLOUD=gcp", names="CLOUD"),
    "make_cloud_down_injection": make("cluster-down", "CLOUD=aws;touch {w}/pwned4", names="CLOUD",
                                      not_created="pwned4"),
    "make_bench_unknown": make("bench", "BENCH=nosuch", names="nosuch"),
}


def expand(value: str, w: Path) -> str:
    """``{w}`` -> the world folder; ``P:old|new`` -> a policy file with one edit."""
    value = value.replace("{w}", str(w))
    if value.startswith("P:"):
        old, new = value[2:].split("|", 1)
        return policy(w, f"policy_{abs(hash(value))}.yml", old.replace("{w}", str(w)), new)
    return value


def classify(rc: int | None, out: str, case: Case) -> str:
    """The category of one run's outcome (rc None: it did not end within the safety net)."""
    if rc is None:
        return "hang"
    if "Traceback (most recent call last)" in out:
        return "traceback"
    if rc == 0:
        return "accepted"
    lines = [line for line in out.splitlines() if line.strip()]
    named = any(case.names in line for line in lines[-2:])  # argparse: usage line, then the error
    return "clear" if named and rc in case.codes else "vague"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("world")
    build_world(w)
    return w


def run_case(case: Case, w: Path) -> tuple[str, int | None, str]:
    env = {**os.environ, "RAY_ADDRESS": CLOSED, "NO_COLOR": "1", **case.env}
    env.pop("MLFLOW_TRACKING_URI", None) if "MLFLOW_TRACKING_URI" not in case.env else None
    argv = [expand(a, w) for a in case.argv]
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, errors="replace",
                           timeout=HANG_LIMIT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "hang", None, ""
    out = p.stdout + p.stderr
    return classify(p.returncode, out, case), p.returncode, out


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_in_one_line(name: str, world: Path) -> None:
    case = CASES[name]
    kind, rc, out = run_case(case, world)
    assert kind == "clear", f"{name}: {kind} (exit {rc})\n{out[-3000:]}"
    if case.not_created:
        assert not (world / case.not_created).exists(), f"{name}: the injected command ran"


def test_the_matrix_covers_every_subcommand_and_agent() -> None:
    """The held-out set keeps its breadth: each command, make target and agent has cases."""
    heads = {(c.argv[3] if c.argv[1:3] == ["-m", "runtime"] else c.argv[2] if c.argv[0] == "make"
              else c.argv[2] if c.argv[1] == "-m" else "flow") for c in CASES.values()}
    wanted = {"validate", "train", "tune", "checkpoints", "data", "models", "report", "cluster", "flow",
              "ops.remediation", "ops.remediation.spot"}
    assert wanted <= heads, wanted - heads
    assert len(CASES) >= 80


if __name__ == "__main__":  # the classification counts: python tests/unit/test_held_out_matrix.py
    import collections
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        build_world(Path(tmp))
        counts: collections.Counter[str] = collections.Counter()
        for n in sorted(n for n in CASES if not sys.argv[1:] or any(a in n for a in sys.argv[1:])):
            k, code, text = run_case(CASES[n], Path(tmp))
            if CASES[n].not_created and (Path(tmp) / CASES[n].not_created).exists():
                k = "accepted (injection ran)"
            counts[k] += 1
            tail = " | ".join(text.strip().splitlines()[-2:])[:300]
            print(f"{k:10s} {n:34s} rc={code} {tail}", flush=True)
        print(dict(counts))
    shutil.rmtree(tmp, ignore_errors=True)
