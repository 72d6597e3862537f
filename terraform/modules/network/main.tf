data "aws_region" "current" {}

locals {
  public_subnets  = { for i, az in var.azs : az => cidrsubnet(var.vpc_cidr, 4, i) }
  private_subnets = { for i, az in var.azs : az => cidrsubnet(var.vpc_cidr, 4, 8 + i) }

  admin_rules = merge([
    for port_name, port in var.admin_ports : {
      for cidr in var.admin_cidrs : "${port_name}-${cidr}" => { port = port, cidr = cidr }
    }
  ]...)
}

################################################################################
# VPC
################################################################################

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = merge({ Name = var.name }, var.tags)
}

# Take over the default security group and leave it without rules, so nothing
# launched without an explicit group gets any traffic.
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id

  tags = merge({ Name = "${var.name}-default-deny" }, var.tags)
}

resource "aws_internet_gateway" "this" {
  vpc_id = aws_vpc.this.id

  tags = merge({ Name = var.name }, var.tags)
}

################################################################################
# Subnets
################################################################################

resource "aws_subnet" "public" {
  for_each = local.public_subnets

  vpc_id            = aws_vpc.this.id
  availability_zone = each.key
  cidr_block        = each.value
  # No automatic public IPs: only the head's launch template asks for one.
  map_public_ip_on_launch = false

  tags = merge({ Name = "${var.name}-public-${each.key}", Tier = "public" }, var.tags)
}

resource "aws_subnet" "private" {
  for_each = local.private_subnets

  vpc_id            = aws_vpc.this.id
  availability_zone = each.key
  cidr_block        = each.value

  tags = merge({ Name = "${var.name}-private-${each.key}", Tier = "private" }, var.tags)
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.this.id

  tags = merge({ Name = "${var.name}-public" }, var.tags)
}

resource "aws_route" "public_internet" {
  route_table_id         = aws_route_table.public.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this.id
}

resource "aws_route_table_association" "public" {
  for_each = aws_subnet.public

  subnet_id      = each.value.id
  route_table_id = aws_route_table.public.id
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id

  tags = merge({ Name = "${var.name}-private" }, var.tags)
}

resource "aws_route_table_association" "private" {
  for_each = aws_subnet.private

  subnet_id      = each.value.id
  route_table_id = aws_route_table.private.id
}

################################################################################
# NAT gateway and S3 endpoint
################################################################################

resource "aws_eip" "nat" {
  count = var.create_nat_gateway ? 1 : 0

  domain = "vpc"

  tags = merge({ Name = "${var.name}-nat" }, var.tags)
}

resource "aws_nat_gateway" "this" {
  count = var.create_nat_gateway ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[var.azs[0]].id

  tags = merge({ Name = var.name }, var.tags)

  depends_on = [aws_internet_gateway.this]
}

resource "aws_route" "private_nat" {
  count = var.create_nat_gateway ? 1 : 0

  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this[0].id
}

resource "aws_vpc_endpoint" "s3" {
  count = var.enable_s3_endpoint ? 1 : 0

  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${data.aws_region.current.name}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id, aws_route_table.public.id]

  tags = merge({ Name = "${var.name}-s3" }, var.tags)
}

################################################################################
# Flow logs
################################################################################

data "aws_caller_identity" "current" {
  count = var.enable_flow_log && var.flow_log_kms_key_arn == null ? 1 : 0
}

data "aws_iam_policy_document" "flow_log_key" {
  count = var.enable_flow_log && var.flow_log_kms_key_arn == null ? 1 : 0

  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:aws:iam::${data.aws_caller_identity.current[0].account_id}:root"]
    }
  }

  statement {
    sid       = "CloudWatchLogsEncrypts"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]

    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_kms_key" "flow_log" {
  count = var.enable_flow_log && var.flow_log_kms_key_arn == null ? 1 : 0

  description         = "${var.name} VPC flow logs"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.flow_log_key[0].json

  tags = merge({ Name = "${var.name}-flow-log" }, var.tags)
}

resource "aws_cloudwatch_log_group" "flow_log" {
  count = var.enable_flow_log ? 1 : 0

  name              = "/aws/vpc-flow-log/${var.name}"
  retention_in_days = var.flow_log_retention_days
  kms_key_id        = coalesce(var.flow_log_kms_key_arn, try(aws_kms_key.flow_log[0].arn, null))

  tags = merge({ Name = "${var.name}-flow-log" }, var.tags)
}

data "aws_iam_policy_document" "flow_log_assume" {
  count = var.enable_flow_log ? 1 : 0

  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["vpc-flow-logs.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "flow_log" {
  count = var.enable_flow_log ? 1 : 0

  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.flow_log[0].arn}:*"]
  }
}

resource "aws_iam_role" "flow_log" {
  count = var.enable_flow_log ? 1 : 0

  name_prefix        = "${var.name}-flow-log-"
  assume_role_policy = data.aws_iam_policy_document.flow_log_assume[0].json

  tags = merge({ Name = "${var.name}-flow-log" }, var.tags)
}

resource "aws_iam_role_policy" "flow_log" {
  count = var.enable_flow_log ? 1 : 0

  name   = "write-flow-log"
  role   = aws_iam_role.flow_log[0].id
  policy = data.aws_iam_policy_document.flow_log[0].json
}

resource "aws_flow_log" "this" {
  count = var.enable_flow_log ? 1 : 0

  vpc_id          = aws_vpc.this.id
  traffic_type    = "ALL"
  log_destination = aws_cloudwatch_log_group.flow_log[0].arn
  iam_role_arn    = aws_iam_role.flow_log[0].arn

  tags = merge({ Name = var.name }, var.tags)
}

################################################################################
# Cluster security group: members talk to members, nobody else
################################################################################

resource "aws_security_group" "this" {
  #checkov:skip=CKV2_AWS_5:Attached by gpu_node_pool launch templates (another module), which checkov does not follow.
  name_prefix = "${var.name}-cluster-"
  description = "GPU cluster members: Ray, NCCL/EFA, metrics and MLflow traffic among themselves only"
  vpc_id      = aws_vpc.this.id

  tags = merge({ Name = "${var.name}-cluster" }, var.tags)

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "cluster" {
  for_each = var.cluster_ports

  security_group_id            = aws_security_group.this.id
  description                  = "${each.key} from cluster members"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.this.id

  tags = merge({ Name = "${var.name}-${each.key}" }, var.tags)
}

# EFA needs every protocol open to and from the group itself.
resource "aws_vpc_security_group_ingress_rule" "efa" {
  count = var.enable_efa ? 1 : 0

  security_group_id            = aws_security_group.this.id
  description                  = "EFA: all traffic from cluster members"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.this.id

  tags = merge({ Name = "${var.name}-efa-in" }, var.tags)
}

resource "aws_vpc_security_group_egress_rule" "efa" {
  count = var.enable_efa ? 1 : 0

  security_group_id            = aws_security_group.this.id
  description                  = "EFA: all traffic to cluster members"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.this.id

  tags = merge({ Name = "${var.name}-efa-out" }, var.tags)
}

resource "aws_vpc_security_group_egress_rule" "cluster" {
  security_group_id            = aws_security_group.this.id
  description                  = "TCP to cluster members"
  ip_protocol                  = "tcp"
  from_port                    = 1
  to_port                      = 65535
  referenced_security_group_id = aws_security_group.this.id

  tags = merge({ Name = "${var.name}-cluster-out" }, var.tags)
}

resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.this.id
  description       = "HTTPS out: package mirrors, S3, the AWS APIs"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"

  tags = merge({ Name = "${var.name}-https-out" }, var.tags)
}

resource "aws_vpc_security_group_egress_rule" "http" {
  security_group_id = aws_security_group.this.id
  description       = "HTTP out: Debian apt mirrors (packages are signature-checked)"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_ipv4         = "0.0.0.0/0"

  tags = merge({ Name = "${var.name}-http-out" }, var.tags)
}

################################################################################
# Admin security group: SSH (and opted-in ports) from admin_cidrs, head node only
################################################################################

resource "aws_security_group" "admin" {
  #checkov:skip=CKV2_AWS_5:Attached to the head node launch template in gpu_node_pool (another module), which checkov does not follow.
  name_prefix = "${var.name}-admin-"
  description = "SSH and dashboards from the admin CIDRs only"
  vpc_id      = aws_vpc.this.id

  tags = merge({ Name = "${var.name}-admin" }, var.tags)

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "admin" {
  for_each = local.admin_rules

  security_group_id = aws_security_group.admin.id
  description       = "admin ${each.key}"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr

  tags = merge({ Name = "${var.name}-admin-${each.key}" }, var.tags)
}

################################################################################
# Placement group
################################################################################

resource "aws_placement_group" "this" {
  count = var.create_placement_group ? 1 : 0

  name     = "${var.name}-gpu"
  strategy = "cluster"

  tags = merge({ Name = "${var.name}-gpu" }, var.tags)
}
