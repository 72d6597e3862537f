"""Static checks over the Terraform code, parsed with python-hcl2: `make tf-check` runs them.

They hold the security and style promises that `terraform validate` cannot:
cluster ports never open to the internet, a private and encrypted checkpoint
bucket, IMDSv2, least-privilege node IAM, and the module conventions
(four standard files, every variable described and typed, bool switches).

Over 400 lines because every check reads the same parsed HCL through the helpers at the top,
and each promise of the modules is one short test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 lives in .venv-tf: run `make tf-check`")

TERRAFORM = Path(__file__).resolve().parents[2] / "terraform"
MODULES = sorted(p for p in (TERRAFORM / "modules").iterdir() if p.is_dir())
EXAMPLES = sorted(p for p in (TERRAFORM / "examples").iterdir() if p.is_dir())
CONFIGS = MODULES + EXAMPLES
STANDARD_FILES = ("main.tf", "variables.tf", "outputs.tf", "versions.tf")

# Ports that only cluster members may reach: Ray GCS/dashboard/client,
# Prometheus, node exporter, DCGM exporter, the runtime's exporters, MLflow.
PROTECTED_PORTS = {6379, 8265, 10001, 9090, 9100, 9400, 5000} | set(range(8000, 8101))
INTERNET = {"0.0.0.0/0", "::/0"}


# --------------------------------------------------------------------------- helpers


def _unquote(value: Any) -> Any:
    """python-hcl2 8 keeps HCL quotes on labels and strings; strip them, drop markers."""
    if isinstance(value, dict):
        return {_unquote(k): _unquote(v) for k, v in value.items() if k != "__is_block__"}
    if isinstance(value, list):
        return [_unquote(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def parse_text(text: str) -> dict[str, Any]:
    return _unquote(hcl2.loads(text))


def parse_dir(directory: Path) -> dict[str, list[dict[str, Any]]]:
    merged: dict[str, list[dict[str, Any]]] = {}
    for tf in sorted(directory.glob("*.tf")):
        for key, blocks in parse_text(tf.read_text()).items():
            merged.setdefault(key, []).extend(blocks)
    return merged


def resources(parsed: dict[str, Any], rtype: str | None = None) -> Iterator[tuple[str, str, dict]]:
    for block in parsed.get("resource", []):
        for kind, named in block.items():
            for name, body in named.items():
                if rtype is None or kind == rtype:
                    yield kind, name, body


def only(parsed: dict[str, Any], rtype: str, name: str) -> dict[str, Any]:
    found = [body for kind, n, body in resources(parsed, rtype) if n == name]
    assert len(found) == 1, f"expected exactly one {rtype}.{name}, found {len(found)}"
    return found[0]


def blocks(body: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = body.get(name, [])
    return value if isinstance(value, list) else [value]


def variables(parsed: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: body for block in parsed.get("variable", []) for name, body in block.items()}


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _port_range(rule: dict[str, Any]) -> set[int] | None:
    """Ports a rule opens, or None when they are not literal (then: assume all)."""
    protocol = str(rule.get("ip_protocol", rule.get("protocol", "tcp")))
    if protocol in ("-1", "all"):
        return set(range(0, 65536))
    try:
        return set(range(int(rule["from_port"]), int(rule["to_port"]) + 1))
    except (KeyError, TypeError, ValueError):
        return None


def internet_exposures(parsed: dict[str, Any]) -> list[str]:
    """Every ingress rule that opens a protected port to 0.0.0.0/0 or ::/0."""
    exposures = []
    candidates: list[tuple[str, dict]] = []
    for kind, name, body in resources(parsed):
        if kind == "aws_vpc_security_group_ingress_rule":
            candidates.append((f"{kind}.{name}", body))
        elif kind == "aws_security_group_rule" and body.get("type") == "ingress":
            candidates.append((f"{kind}.{name}", body))
        elif kind == "aws_security_group":
            candidates += [(f"{kind}.{name} ingress", rule) for rule in blocks(body, "ingress")]
    for where, rule in candidates:
        cidrs = {
            str(c)
            for key in ("cidr_ipv4", "cidr_ipv6", "cidr_blocks", "ipv6_cidr_blocks")
            for c in _as_list(rule.get(key))
        }
        if not cidrs & INTERNET:
            continue
        ports = _port_range(rule)
        if ports is None or ports & PROTECTED_PORTS:
            exposures.append(where)
    return exposures


# --------------------------------------------------------------------------- layout and style


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_module_and_example_has_the_four_standard_files(config: Path) -> None:
    missing = [f for f in STANDARD_FILES if not (config / f).is_file()]
    assert not missing, f"{config.relative_to(TERRAFORM)} lacks {missing}"


def test_examples_use_the_local_modules() -> None:
    for example in EXAMPLES:
        sources = [body["source"] for block in parse_dir(example).get("module", []) for body in block.values()]
        assert sources, f"{example.name} composes no module"
        assert all(s.startswith("../../modules/") for s in sources), sources


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_variable_has_description_and_type(config: Path) -> None:
    undocumented = {
        name: [k for k in ("description", "type") if not body.get(k)]
        for name, body in variables(parse_dir(config)).items()
        if not body.get("description") or not body.get("type")
    }
    assert not undocumented, f"variables lacking description/type: {undocumented}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_switches_are_non_nullable_bools(config: Path) -> None:
    bad = [
        name
        for name, body in variables(parse_dir(config)).items()
        if re.match(r"^(create|enable)_", name) and (body.get("type") != "${bool}" and body.get("type") != "bool" or body.get("nullable") is not False)
    ]
    assert not bad, f"create_*/enable_* switches must be `type = bool, nullable = false`: {bad}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_tags_merge_a_name_into_the_caller_tags(config: Path) -> None:
    bad = [
        f"{kind}.{name}"
        for kind, name, body in resources(parse_dir(config))
        if "tags" in body and not re.search(r"merge\(\{Name = .*var\.tags\)|^\$\{local\.tags\}$", str(body["tags"]))
    ]
    assert not bad, f"tags must be merge({{ Name = ... }}, var.tags): {bad}"


# --------------------------------------------------------------------------- network


def test_internet_exposure_check_flags_a_ray_port_open_to_the_world() -> None:
    """Negative control: the checker below must catch the mistake it exists for."""
    bad = parse_text(
        'resource "aws_vpc_security_group_ingress_rule" "oops" {\n'
        '  ip_protocol = "tcp"\n  from_port = 6000\n  to_port = 6500\n  cidr_ipv4 = "0.0.0.0/0"\n}\n'
        'resource "aws_security_group" "legacy" {\n'
        '  ingress {\n    protocol = "tcp"\n    from_port = 5000\n    to_port = 5000\n    cidr_blocks = ["0.0.0.0/0"]\n  }\n}\n'
    )
    assert internet_exposures(bad) == [
        "aws_vpc_security_group_ingress_rule.oops",
        "aws_security_group.legacy ingress",
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_no_ingress_rule_opens_ray_metrics_or_mlflow_ports_to_the_internet(config: Path) -> None:
    assert internet_exposures(parse_dir(config)) == []


def test_cluster_port_rules_admit_only_the_cluster_security_group_itself() -> None:
    network = parse_dir(TERRAFORM / "modules" / "network")
    for name in ("cluster", "efa"):
        rule = only(network, "aws_vpc_security_group_ingress_rule", name)
        assert rule["referenced_security_group_id"] == "${aws_security_group.this.id}", name
        assert not {"cidr_ipv4", "cidr_ipv6"} & rule.keys(), name


def test_admin_ingress_comes_only_from_admin_cidrs_which_reject_the_internet() -> None:
    network = parse_dir(TERRAFORM / "modules" / "network")
    rule = only(network, "aws_vpc_security_group_ingress_rule", "admin")
    assert rule["security_group_id"] == "${aws_security_group.admin.id}"
    assert rule["cidr_ipv4"] == "${each.value.cidr}"
    conditions = " ".join(v["condition"] for v in variables(network)["admin_cidrs"]["validation"])
    assert '!endswith(c, "/0")' in conditions, "admin_cidrs must reject /0 networks"


@pytest.mark.parametrize("module", ["network", "cluster_spec"])
def test_admin_cidrs_are_checked_by_prefix_length_against_a_configured_minimum(module: str) -> None:
    # 0.0.0.0/1 + 128.0.0.0/1 is the whole internet without a literal /0: only a
    # prefix-length floor catches it (cluster_spec's terraform test runs the cases).
    parsed = parse_dir(TERRAFORM / "modules" / module)
    conditions = " ".join(v["condition"] for v in variables(parsed)["admin_cidrs"]["validation"])
    assert 'tonumber(split("/", c)[1]) >= var.admin_cidr_min_prefix_length' in conditions
    assert variables(parsed)["admin_cidr_min_prefix_length"]["default"] == 8


def test_admin_security_group_opens_only_ssh_by_default() -> None:
    # Dashboards (Ray 8265, Grafana, MLflow, Prometheus) are reached by SSH tunnel.
    network = parse_dir(TERRAFORM / "modules" / "network")
    assert variables(network)["admin_ports"]["default"] == {"ssh": 22}


def _variable_block(path: Path, name: str) -> str:
    """The source of one `variable` block, braces matched, to run its validation alone."""
    text = path.read_text()
    start = text.index(f'variable "{name}" {{')
    depth = 0
    for end in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end + 1] + "\n"
    raise AssertionError(f"unbalanced braces in {path}")


def _plan_with(tmp_path: Path, block: str, var: str) -> subprocess.CompletedProcess:
    """`terraform plan` of a module holding only `block`: runs its validation, needs no provider."""
    (tmp_path / "main.tf").write_text(block)
    env = dict(os.environ, TF_DATA_DIR=str(tmp_path / ".terraform"))
    return subprocess.run([sys.executable, str(TERRAFORM / "tools" / "tf.py"), f"-chdir={tmp_path}", "plan",
                           "-input=false", "-no-color", "-var", var],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("port", [6379, 8265, 10001, 15000, 8076, 52365, 8080, 8100, 5000, 9090, 9093, 3000, 9100,
                                  9400])
def test_no_cluster_service_port_can_be_made_an_admin_port(tmp_path: Path, port: int) -> None:
    block = _variable_block(TERRAFORM / "modules" / "network" / "variables.tf", "admin_ports")
    proc = _plan_with(tmp_path, block, f"admin_ports={{ssh=22, opened={port}}}")
    assert proc.returncode != 0, proc.stdout[-2000:]
    message = " ".join(proc.stderr.split())  # Terraform wraps the message at 80 columns
    assert "admin_ports values must be TCP ports 1-65535 other than the cluster's service ports" in message, message


def test_ssh_and_other_ports_are_valid_admin_ports(tmp_path: Path) -> None:
    block = _variable_block(TERRAFORM / "modules" / "network" / "variables.tf", "admin_ports")
    proc = _plan_with(tmp_path, block, "admin_ports={ssh=22, https=443, vpn=51820}")
    assert proc.returncode == 0, proc.stderr[-2000:]


# --------------------------------------------------------------------------- storage


def test_checkpoint_bucket_blocks_all_public_access() -> None:
    storage = parse_dir(TERRAFORM / "modules" / "storage")
    block = only(storage, "aws_s3_bucket_public_access_block", "this")
    flags = ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets")
    assert {f: block.get(f) for f in flags} == dict.fromkeys(flags, True)
    assert block["bucket"] == "${aws_s3_bucket.this.id}"


def test_checkpoint_bucket_is_encrypted_and_versioned() -> None:
    storage = parse_dir(TERRAFORM / "modules" / "storage")
    sse = only(storage, "aws_s3_bucket_server_side_encryption_configuration", "this")
    default = sse["rule"][0]["apply_server_side_encryption_by_default"][0]
    assert default["sse_algorithm"] == "${var.sse_algorithm}"
    algorithm = variables(storage)["sse_algorithm"]
    assert algorithm["default"] == "aws:kms"
    assert 'contains(["aws:kms", "AES256"], var.sse_algorithm)' in algorithm["validation"][0]["condition"]
    versioning = only(storage, "aws_s3_bucket_versioning", "this")
    assert versioning["versioning_configuration"][0]["status"] == "Enabled"


def test_checkpoint_bucket_policy_denies_insecure_transport() -> None:
    storage = parse_dir(TERRAFORM / "modules" / "storage")
    documents = [b["aws_iam_policy_document"]["bucket"] for b in storage["data"] if "aws_iam_policy_document" in b]
    statement = documents[0]["statement"][0]
    assert statement["effect"] == "Deny"
    assert statement["condition"][0] == {"test": "Bool", "variable": "aws:SecureTransport", "values": ["false"]}


def test_checkpoint_bucket_expires_old_noncurrent_versions() -> None:
    storage = parse_dir(TERRAFORM / "modules" / "storage")
    lifecycle = only(storage, "aws_s3_bucket_lifecycle_configuration", "this")
    rule = lifecycle["rule"][0]
    assert rule["status"] == "Enabled"
    assert rule["noncurrent_version_expiration"][0]["noncurrent_days"] == "${var.noncurrent_version_expiration_days}"


def test_shared_file_systems_are_encrypted_and_reachable_only_from_cluster_nodes() -> None:
    storage = parse_dir(TERRAFORM / "modules" / "storage")
    assert only(storage, "aws_efs_file_system", "this")["encrypted"] is True
    nfs = only(storage, "aws_vpc_security_group_ingress_rule", "efs")
    assert nfs["referenced_security_group_id"] == "${var.client_security_group_id}"
    assert (nfs["from_port"], nfs["to_port"]) == (2049, 2049)
    assert variables(storage)["create_fsx_lustre"]["default"] is False


def test_cluster_nodes_may_open_connections_to_the_shared_file_systems() -> None:
    # The cluster group's egress is closed but to members and 80/443: NFS and Lustre need their own rules.
    storage = parse_dir(TERRAFORM / "modules" / "storage")
    nfs = only(storage, "aws_vpc_security_group_egress_rule", "efs_clients")
    assert nfs["security_group_id"] == "${var.client_security_group_id}"
    assert nfs["referenced_security_group_id"] == "${aws_security_group.efs[0].id}"
    assert (nfs["from_port"], nfs["to_port"], nfs["ip_protocol"]) == (2049, 2049, "tcp")
    lustre = only(storage, "aws_vpc_security_group_egress_rule", "fsx_clients")
    assert lustre["security_group_id"] == "${var.client_security_group_id}"
    assert lustre["referenced_security_group_id"] == "${aws_security_group.fsx[0].id}"


# --------------------------------------------------------------------------- GPU node pool


def test_launch_template_requires_imdsv2() -> None:
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    metadata = only(pool, "aws_launch_template", "this")["metadata_options"][0]
    assert metadata["http_tokens"] == "required"
    assert metadata["http_endpoint"] == "enabled"
    assert metadata["http_put_response_hop_limit"] == 1


def test_launch_template_root_volume_is_encrypted() -> None:
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    ebs = only(pool, "aws_launch_template", "this")["block_device_mappings"][0]["ebs"][0]
    assert ebs["encrypted"] is True


def test_node_iam_policy_allows_only_the_pools_own_bucket_prefixes() -> None:
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    documents = {name: body for b in pool["data"] for kind, named in b.items()
                 if kind == "aws_iam_policy_document" for name, body in named.items()}
    statements = documents["checkpoint"]["statement"]
    granted = {(a, r) for s in statements for a in s["actions"] for r in s["resources"]}
    objects = "${[for p in var.s3_prefixes : \"${var.checkpoint_bucket_arn}/${p}*\"]}"
    # Pruning aborts the multipart uploads a killed save left (runtime/checkpoint/s3.py).
    assert {a for a, _ in granted} == {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                       "s3:ListBucketMultipartUploads", "s3:AbortMultipartUpload",
                                       "s3:ListMultipartUploadParts"}
    # Listing is limited to the prefixes, object access to keys under them: never bucket-wide.
    uploads = next(s for s in statements if s["actions"] == ["s3:ListBucketMultipartUploads"])
    assert uploads["resources"] == ["${var.checkpoint_bucket_arn}"]
    listing = next(s for s in statements if s["actions"] == ["s3:ListBucket"])
    assert listing["resources"] == ["${var.checkpoint_bucket_arn}"]
    assert listing["condition"][0]["variable"] == "s3:prefix"
    object_statement = next(s for s in statements if "s3:GetObject" in s["actions"])
    assert object_statement["resources"] in (objects, [objects]), object_statement["resources"]
    assert "${var.checkpoint_bucket_arn}/*" not in {r for _, r in granted}
    assert {"s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"} <= set(object_statement["actions"])
    # The only other grant is the bucket's own KMS key, when it has one.
    kms = documents["checkpoint"]["dynamic"][0]["statement"]["content"][0]
    assert kms["actions"] == ["kms:Decrypt", "kms:GenerateDataKey"] and kms["resources"] == ["${statement.value}"]


def test_no_node_role_reaches_mlflow_artifacts_only_the_mlflow_user_does() -> None:
    # Every job on the head can use the head's role, so mlflow/ goes to MLflow's own IAM user.
    example = parse_dir(TERRAFORM / "examples" / "aws_cluster")
    modules = {name: body for block in example["module"] for name, body in block.items()}
    assert modules["head"]["s3_prefixes"] == ["ray/"]
    assert modules["pool"]["s3_prefixes"] == ["ray/"]
    documents = {name: body for b in example["data"] for kind, named in b.items()
                 if kind == "aws_iam_policy_document" for name, body in named.items()}
    statements = documents["mlflow_artifacts"]["statement"]
    listing = next(s for s in statements if s["actions"] == ["s3:ListBucket"])
    assert listing["resources"] == ["${module.storage.bucket_arn}"]
    assert listing["condition"][0]["variable"] == "s3:prefix"
    assert listing["condition"][0]["values"] == ["mlflow/", "mlflow/*"]
    objects = next(s for s in statements if "s3:GetObject" in s["actions"])
    assert set(objects["actions"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                       "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"}
    assert objects["resources"] == ["${module.storage.bucket_arn}/mlflow/*"]
    assert len(statements) == 2
    users = {name: body for _, name, body in resources(example, "aws_iam_user")}
    assert list(users) == ["mlflow_artifacts"]
    attached = {name: body for _, name, body in resources(example, "aws_iam_user_policy")}
    assert attached["mlflow_artifacts"]["user"] == "${aws_iam_user.mlflow_artifacts.name}"
    assert attached["mlflow_artifacts"]["policy"] == "${data.aws_iam_policy_document.mlflow_artifacts.json}"
    # The operator makes the key and vaults it: a Terraform key would put its secret in the state.
    assert not list(resources(example, "aws_iam_access_key"))


def test_only_the_head_gets_a_public_address_and_the_admin_group() -> None:
    example = parse_dir(TERRAFORM / "examples" / "aws_cluster")
    modules = {name: body for block in example["module"] for name, body in block.items()}
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    assert variables(pool)["associate_public_ip_address"]["default"] is False
    assert "associate_public_ip_address" not in modules["pool"]
    assert modules["pool"]["subnet_ids"] == ["${module.network.private_subnet_ids[0]}"]
    assert modules["pool"]["security_group_ids"] == ["${module.network.security_group_id}"]
    assert modules["head"]["associate_public_ip_address"] is True


def test_nodes_boot_a_pinned_debian_12_image_not_a_latest_pointer() -> None:
    # The Ansible roles are tested on Debian 12 (tests/hosts) and pin +deb12 package versions.
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    data = {kind: named for b in pool["data"] for kind, named in b.items()}
    assert "aws_ssm_parameter" not in data
    ami = data["aws_ami"]["this"]
    assert ami["owners"] == ["${var.ami_owner}"] and not ami.get("most_recent")
    assert {f["name"]: f["values"] for f in ami["filter"]}["name"] == ["${var.ami_name}"]
    pool_vars = variables(pool)
    assert pool_vars["ami_owner"]["default"] == "136693071363"  # the Debian cloud team's account
    name = pool_vars["ami_name"]
    assert re.fullmatch(r"debian-12-amd64-\d{8}-\d+", name["default"])
    assert "^debian-12-amd64-[0-9]{8}-[0-9]+$" in name["validation"][0]["condition"]
    assert pool_vars["root_device_name"]["default"] == "/dev/xvda"
    example = parse_dir(TERRAFORM / "examples" / "aws_cluster")
    assert variables(example)["ami_name"]["default"] == name["default"]
    spec = parse_dir(TERRAFORM / "modules" / "cluster_spec")
    assert variables(spec)["ssh_user"]["default"] == "admin"  # Debian AMIs' login user


def test_the_example_commits_its_provider_lock_file() -> None:
    lock = TERRAFORM / "examples" / "aws_cluster" / ".terraform.lock.hcl"
    assert lock.exists(), "run terraform init in examples/aws_cluster and commit .terraform.lock.hcl"
    text = lock.read_text()
    assert 'provider "registry.terraform.io/hashicorp/aws"' in text and "hashes = [" in text


def test_gpu_pools_replace_before_destroy_and_rebalance_spot_capacity() -> None:
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    asg = only(pool, "aws_autoscaling_group", "this")
    assert asg["capacity_rebalance"] is True
    assert asg["lifecycle"][0]["create_before_destroy"] is True
    assert only(pool, "aws_launch_template", "this")["lifecycle"][0]["create_before_destroy"] is True
    distribution = asg["mixed_instances_policy"][0]["instances_distribution"][0]
    assert distribution["on_demand_percentage_above_base_capacity"] == "${local.spot ? 0 : 100}"


def test_launch_template_attaches_efa_interfaces_when_the_pool_has_them() -> None:
    pool = parse_dir(TERRAFORM / "modules" / "gpu_node_pool")
    dynamic = only(pool, "aws_launch_template", "this")["dynamic"]
    interfaces = next(d["network_interfaces"] for d in dynamic if "network_interfaces" in d)
    assert interfaces["for_each"] == "${local.network_interfaces}"
    main_tf = (TERRAFORM / "modules" / "gpu_node_pool" / "main.tf").read_text()
    assert 'interface_type     = "efa"' in main_tf
