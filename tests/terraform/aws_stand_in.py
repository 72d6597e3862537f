"""A loopback AWS endpoint for `make tf-e2e`: moto's server plus the few calls moto lacks.

Terraform's AWS provider is pointed at this proxy. Every request goes on to
moto_server unchanged, except the APIs moto 5.2 answers with "not implemented"
(HTTP 500, which the provider retries until its timeout) for resources the
example creates:

- EC2 CreatePlacementGroup / DescribePlacementGroups / DeletePlacementGroup:
  the GPU pools share a cluster placement group (modules/network).
- EFS PutBackupPolicy / DescribeBackupPolicy: the shared file system has
  automatic backups on (modules/storage).

They are answered here from memory, in the shapes of the EC2 and EFS API
references, so the resources are created, read back and destroyed instead of
being turned off for the test.

`python aws_stand_in.py PORT` runs moto_server with four of moto 5.2.5's
behaviours corrected (`fix_moto`), each one a difference from EC2 that made
Terraform plan changes forever after an apply. The proxy passes one request
at a time to moto, whose handlers are not thread-safe: with Terraform's ten
parallel calls it answered AddRoleToInstanceProfile with LimitExceeded and
AuthorizeSecurityGroupIngress with InvalidPermission.Duplicate for requests
made once.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
BACKUP_POLICY_PATH = re.compile(r"^/2015-02-01/file-systems/(?P<fs>fs-[0-9a-f]+)/backup-policy$")
# Headers http.client sets itself, or that describe the proxy's own connection.
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


class StandIn:
    """State of the stand-in APIs: placement groups and EFS backup policies, by region."""

    def __init__(self, account_id: str) -> None:
        self.account_id = account_id
        self.lock = threading.Lock()
        self.placement_groups: dict[tuple[str, str], dict[str, Any]] = {}
        self.backup_policies: dict[str, str] = {}

    # ------------------------------------------------------------------ EC2

    def ec2(self, region: str, params: dict[str, str]) -> tuple[int, str] | None:
        """Answer an EC2 query-protocol call this stand-in owns; None passes it on to moto."""
        action = params.get("Action", "")
        if action == "CreatePlacementGroup":
            return self._create_placement_group(region, params)
        if action == "DescribePlacementGroups":
            return self._describe_placement_groups(region, params)
        if action == "DeletePlacementGroup":
            return self._delete_placement_group(region, params)
        return None

    def _create_placement_group(self, region: str, params: dict[str, str]) -> tuple[int, str]:
        name = params.get("GroupName", "")
        strategy = params.get("Strategy", "")
        if strategy not in ("cluster", "spread", "partition"):
            return _ec2_error(
                "InvalidParameterValue", f"Strategy must be cluster, spread or partition; got {strategy!r}"
            )
        tags = {
            params[k]: params.get(k.replace(".Key", ".Value"), "")
            for k in params
            if re.fullmatch(r"TagSpecification\.\d+\.Tag\.\d+\.Key", k)
        }
        with self.lock:
            if (region, name) in self.placement_groups:
                return _ec2_error("InvalidPlacementGroup.Duplicate", f"The Placement Group '{name}' already exists.")
            group_id = "pg-" + uuid.uuid4().hex[:17]
            group = {
                "groupName": name,
                "groupId": group_id,
                "groupArn": f"arn:aws:ec2:{region}:{self.account_id}:placement-group/{name}",
                "strategy": strategy,
                "state": "available",
                "tags": tags,
            }
            self.placement_groups[(region, name)] = group
        body = f"<return>true</return><placementGroup>{_placement_group_xml(group)}</placementGroup>"
        return 200, _ec2_response("CreatePlacementGroup", body)

    def _describe_placement_groups(self, region: str, params: dict[str, str]) -> tuple[int, str]:
        names = [v for k, v in params.items() if re.fullmatch(r"GroupName\.\d+", k)]
        ids = [v for k, v in params.items() if re.fullmatch(r"GroupId\.\d+", k)]
        with self.lock:
            groups = [g for (r, _), g in self.placement_groups.items() if r == region]
        for wanted, key, kind in ((names, "groupName", "name"), (ids, "groupId", "ID")):
            missing = [w for w in wanted if w not in {g[key] for g in groups}]
            if missing:
                return _ec2_error(
                    "InvalidPlacementGroup.Unknown", f"The Placement Group {kind} '{missing[0]}' is unknown."
                )
            if wanted:
                groups = [g for g in groups if g[key] in wanted]
        items = "".join(f"<item>{_placement_group_xml(g)}</item>" for g in groups)
        return 200, _ec2_response("DescribePlacementGroups", f"<placementGroupSet>{items}</placementGroupSet>")

    def _delete_placement_group(self, region: str, params: dict[str, str]) -> tuple[int, str]:
        name = params.get("GroupName", "")
        with self.lock:
            if self.placement_groups.pop((region, name), None) is None:
                return _ec2_error("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        return 200, _ec2_response("DeletePlacementGroup", "<return>true</return>")

    # ------------------------------------------------------------------ EFS

    def efs(self, method: str, path: str, body: bytes) -> tuple[int, str] | None:
        """Answer EFS's backup-policy calls; None passes everything else on to moto."""
        match = BACKUP_POLICY_PATH.match(path)
        if match is None:
            return None
        fs = match["fs"]
        with self.lock:
            if method == "PUT":
                status = json.loads(body or b"{}").get("BackupPolicy", {}).get("Status", "")
                if status not in ("ENABLED", "DISABLED"):
                    return 400, json.dumps(
                        {
                            "ErrorCode": "ValidationException",
                            "Message": f"BackupPolicy.Status must be ENABLED or DISABLED; got {status!r}",
                        }
                    )
                self.backup_policies[fs] = status
            elif fs not in self.backup_policies:
                return 404, json.dumps(
                    {"ErrorCode": "PolicyNotFound", "Message": f"File system {fs} has no backup policy."}
                )
            return 200, json.dumps({"BackupPolicy": {"Status": self.backup_policies[fs]}})


def _placement_group_xml(group: dict[str, Any]) -> str:
    tags = "".join(f"<item><key>{escape(k)}</key><value>{escape(v)}</value></item>" for k, v in group["tags"].items())
    fields = "".join(
        f"<{k}>{escape(str(group[k]))}</{k}>" for k in ("groupName", "groupId", "groupArn", "strategy", "state")
    )
    return f"{fields}<tagSet>{tags}</tagSet>"


def _ec2_response(action: str, body: str) -> str:
    return f'<{action}Response xmlns="{EC2_NS}"><requestId>{uuid.uuid4()}</requestId>{body}</{action}Response>'


def _ec2_error(code: str, message: str) -> tuple[int, str]:
    return 400, (
        f"<Response><Errors><Error><Code>{code}</Code><Message>{escape(message)}</Message></Error></Errors>"
        f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
    )


def _region(authorization: str) -> str:
    """The region from a SigV4 Authorization header's credential scope (us-east-1 when absent)."""
    match = re.search(r"Credential=[^/]+/\d{8}/([a-z0-9-]+)/", authorization)
    return match[1] if match else "us-east-1"


def fix_moto() -> None:
    """Correct moto 5.2.5 where it answers differently from EC2 (checked against the EC2 API reference).

    - DescribeSecurityGroupRules drops the description of a rule whose source is a
      security group (moto reads it from the CIDR range only).
    - CreateLaunchTemplate copies the template's own tags (TagSpecifications of
      type launch-template) into LaunchTemplateData, where EC2 never shows them.
    - CreateLaunchTemplateVersion keeps UserData as a plain string, which moto's
      Auto Scaling then refuses (AssertionError, HTTP 500) when a group launches.
    - UpdateAutoScalingGroup without MixedInstancesPolicy (a resize) drops the
      group's policy; EC2 Auto Scaling keeps every setting a request leaves out.
    """
    from moto.autoscaling.models import FakeAutoScalingGroup
    from moto.core.types import Base64EncodedString
    from moto.ec2.models.launch_templates import LaunchTemplate, LaunchTemplateBackend
    from moto.ec2.models.security_groups import SecurityGroupRule

    def description(rule: SecurityGroupRule) -> str | None:
        return rule.ip_range.get("Description") or (rule.source_group or {}).get("Description")

    SecurityGroupRule.description = property(description)  # type: ignore[assignment,method-assign]

    create_template = LaunchTemplateBackend.create_launch_template

    def create_launch_template(self: Any, name: str, description: str, data: dict[str, Any], tag_spec: Any) -> Any:
        specs = [t for t in data.get("TagSpecifications", []) if t.get("ResourceType") != "launch-template"]
        data = (
            {**data, "TagSpecifications": specs}
            if specs
            else {k: v for k, v in data.items() if k != "TagSpecifications"}
        )
        return create_template(self, name, description, data, tag_spec)

    LaunchTemplateBackend.create_launch_template = create_launch_template  # type: ignore[method-assign]

    create_version = LaunchTemplate.create_version

    def create_launch_template_version(self: Any, data: dict[str, Any], description: str) -> Any:
        if isinstance(data.get("UserData"), str):
            data = {**data, "UserData": Base64EncodedString(data["UserData"])}
        return create_version(self, data, description)

    LaunchTemplate.create_version = create_launch_template_version  # type: ignore[method-assign]

    update_group = FakeAutoScalingGroup.update

    def update(self: Any, *args: Any, mixed_instances_policy: dict[str, Any] | None = None, **kwargs: Any) -> None:
        kept = self.mixed_instances_policy
        update_group(self, *args, mixed_instances_policy=mixed_instances_policy, **kwargs)
        if mixed_instances_policy is None:
            self.mixed_instances_policy = kept

    FakeAutoScalingGroup.update = update  # type: ignore[method-assign]


def serve(moto_port: int, account_id: str = "123456789012") -> tuple[ThreadingHTTPServer, StandIn]:
    """Start the proxy on a free loopback port in a daemon thread; returns it and its state."""
    state = StandIn(account_id)
    one_at_a_time = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            """Quiet: the provider's retries would flood pytest's captured output."""

        def _handle(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = urlsplit(self.path).path
            answer = state.efs(self.command, path, body)
            content_type = "application/json"
            if answer is None and self.command == "POST" and b"Action=" in body:
                params = {k: v[0] for k, v in parse_qs(body.decode(), keep_blank_values=True).items()}
                answer = state.ec2(_region(self.headers.get("Authorization", "")), params)
                content_type = "text/xml"
            if answer is None:
                self._forward(body)
                return
            status, text = answer
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _forward(self, body: bytes) -> None:
            with one_at_a_time:
                status, reason, reply_headers, data = self._ask_moto(body)
            self.send_response(status, reason)
            for k, v in reply_headers:
                if k.lower() not in HOP_HEADERS:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _ask_moto(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", moto_port)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            conn.request(
                self.command, self.path, body=body if body or self.command in ("POST", "PUT") else None, headers=headers
            )
            reply = conn.getresponse()
            data = reply.read()
            conn.close()
            return reply.status, reply.reason, reply.getheaders(), data

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="aws-stand-in", daemon=True).start()
    return server, state


if __name__ == "__main__":
    # moto_server with fix_moto's corrections: python aws_stand_in.py PORT
    import sys

    from moto.server import main

    fix_moto()
    main(["-H", "127.0.0.1", "-p", sys.argv[1]])
