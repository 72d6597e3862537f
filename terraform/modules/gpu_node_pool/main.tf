locals {
  ami_id = coalesce(var.ami_id, try(data.aws_ami.this[0].id, null))
  spot   = var.capacity_type == "spot"

  # The example finds the pool's instances by these tags.
  tags = merge({ Name = var.name, "gpu-cluster:name" = var.cluster_name, "gpu-cluster:pool" = var.pool_name }, var.tags)

  # EFA on multi-card types: one interface per network card; only the first is
  # device 0 (AWS: other cards attach at device index 1). EC2 refuses
  # AssociatePublicIpAddress (even false) on a launch with several interfaces
  # (InvalidParameterCombination), so it is left unset there.
  network_interfaces = var.efa_interface_count > 0 ? [
    for i in range(var.efa_interface_count) : {
      device_index       = i == 0 ? 0 : 1
      network_card_index = i
      interface_type     = "efa"
      public_ip          = var.efa_interface_count > 1 ? null : var.associate_public_ip_address
    }
    ] : [{
      device_index       = 0
      network_card_index = 0
      interface_type     = null
      public_ip          = var.associate_public_ip_address
  }]
}

# One pinned image, the OS the Ansible roles are tested on (Debian 12): owner and exact
# name, never a "latest" pointer, so a new upstream build changes nothing until chosen.
data "aws_ami" "this" {
  count = var.ami_id == null ? 1 : 0

  owners = [var.ami_owner]

  filter {
    name   = "name"
    values = [var.ami_name]
  }

  filter {
    name   = "architecture"
    values = ["x86_64"]
  }

  filter {
    name   = "state"
    values = ["available"]
  }
}

data "aws_partition" "current" {}

################################################################################
# IAM: the nodes may use the checkpoint bucket and nothing else
################################################################################

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.${data.aws_partition.current.dns_suffix}"]
    }
  }
}

# Each pool reaches only its own key prefixes (checkpoints under ray/), never the whole bucket.
data "aws_iam_policy_document" "checkpoint" {
  statement {
    sid       = "ListOwnPrefixes"
    actions   = ["s3:ListBucket"]
    resources = [var.checkpoint_bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = flatten([for p in var.s3_prefixes : [p, "${p}*"]])
    }
  }

  statement {
    sid = "ReadWriteOwnPrefixes"
    # The multipart actions let pruning abort the uploads a killed save left behind.
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = [for p in var.s3_prefixes : "${var.checkpoint_bucket_arn}/${p}*"]
  }

  # Bucket-wide because S3 offers no s3:prefix condition on this action; it lists the keys
  # and ids of unfinished uploads, never object data.
  statement {
    sid       = "ListUnfinishedUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [var.checkpoint_bucket_arn]
  }

  dynamic "statement" {
    for_each = var.checkpoint_kms_key_arn == null ? [] : [var.checkpoint_kms_key_arn]

    content {
      sid       = "UseCheckpointKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "this" {
  name_prefix        = "${var.name}-"
  assume_role_policy = data.aws_iam_policy_document.assume.json

  tags = local.tags
}

resource "aws_iam_role_policy" "this" {
  name   = "checkpoint-bucket"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.checkpoint.json
}

resource "aws_iam_instance_profile" "this" {
  name_prefix = "${var.name}-"
  role        = aws_iam_role.this.name

  tags = local.tags
}

################################################################################
# Launch template
################################################################################

resource "aws_launch_template" "this" {
  name_prefix            = "${var.name}-"
  description            = "${var.cluster_name} ${var.pool_name} nodes (${var.instance_type})"
  image_id               = local.ami_id
  instance_type          = var.instance_type
  key_name               = var.key_name
  ebs_optimized          = true
  update_default_version = true
  user_data = base64encode(templatefile("${path.module}/templates/user_data.yml.tftpl", {
    cluster_name = var.cluster_name
    pool_name    = var.pool_name
  }))

  iam_instance_profile {
    arn = aws_iam_instance_profile.this.arn
  }

  # IMDSv2 only; one hop, so containers on the node cannot borrow the role.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_size           = var.root_volume_size_gib
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  dynamic "network_interfaces" {
    for_each = local.network_interfaces

    content {
      device_index                = network_interfaces.value.device_index
      network_card_index          = network_interfaces.value.network_card_index
      interface_type              = network_interfaces.value.interface_type
      associate_public_ip_address = network_interfaces.value.public_ip
      security_groups             = var.security_group_ids
      delete_on_termination       = true
    }
  }

  monitoring {
    enabled = var.enable_detailed_monitoring
  }

  tag_specifications {
    resource_type = "instance"
    tags          = local.tags
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }

  tags = local.tags

  lifecycle {
    create_before_destroy = true

    precondition {
      condition     = !(var.associate_public_ip_address && var.efa_interface_count > 1)
      error_message = "associate_public_ip_address needs a single network interface: EC2 gives no public IPv4 address to a node launched with ${var.efa_interface_count} EFA interfaces."
    }
  }
}

################################################################################
# Auto Scaling group
################################################################################

resource "aws_autoscaling_group" "this" {
  name_prefix         = "${var.name}-"
  min_size            = var.node_count
  max_size            = var.node_count
  desired_capacity    = var.node_count
  vpc_zone_identifier = var.subnet_ids
  placement_group     = var.placement_group_name
  health_check_type   = "EC2"
  # Replace spot nodes proactively when AWS signals a rebalance recommendation.
  capacity_rebalance        = true
  wait_for_capacity_timeout = "20m"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = local.spot ? 0 : 100
      spot_allocation_strategy                 = "price-capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.this.id
        version            = aws_launch_template.this.latest_version
      }

      dynamic "override" {
        for_each = distinct(concat([var.instance_type], local.spot ? var.spot_instance_types : []))

        content {
          instance_type = override.value
        }
      }
    }
  }

  dynamic "tag" {
    for_each = local.tags

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  lifecycle {
    create_before_destroy = true
  }
}
