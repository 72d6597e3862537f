################################################################################
# Checkpoint bucket
################################################################################

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Access logs need a second bucket per cluster; CloudTrail data events are the audit trail for checkpoint objects.
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles checkpoint storage; checkpoints are reproducible by retraining and versioned here.
  #checkov:skip=CKV2_AWS_62:No consumer of bucket event notifications exists; Ray and the runtime poll the manifest.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy

  tags = merge({ Name = var.bucket_name }, var.tags)
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = var.sse_algorithm
      kms_master_key_id = var.sse_algorithm == "aws:kms" ? var.kms_key_arn : null
    }
    bucket_key_enabled = var.sse_algorithm == "aws:kms"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  #checkov:skip=CKV_AWS_300:Rule expire-noncurrent-versions (empty filter: every key) aborts incomplete uploads after 7 days; checkov judges the optional dynamic rule on its own.
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  dynamic "rule" {
    for_each = var.checkpoint_expiration_days == null ? [] : [var.checkpoint_expiration_days]

    content {
      id     = "expire-old-checkpoints"
      status = "Enabled"

      filter {
        prefix = var.checkpoint_prefix
      }

      expiration {
        days = rule.value
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # Public access block first, so the policy can never land on an open bucket.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

################################################################################
# EFS
################################################################################

resource "aws_efs_file_system" "this" {
  count = var.create_efs ? 1 : 0

  creation_token   = "${var.name}-shared"
  encrypted        = true
  kms_key_id       = var.kms_key_arn
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"

  lifecycle_policy {
    transition_to_ia = "AFTER_30_DAYS"
  }

  tags = merge({ Name = "${var.name}-shared" }, var.tags)
}

resource "aws_efs_backup_policy" "this" {
  count = var.create_efs ? 1 : 0

  file_system_id = aws_efs_file_system.this[0].id

  backup_policy {
    status = "ENABLED"
  }
}

resource "aws_security_group" "efs" {
  count = var.create_efs ? 1 : 0

  name_prefix = "${var.name}-efs-"
  description = "NFS to EFS from cluster nodes only"
  vpc_id      = var.vpc_id

  tags = merge({ Name = "${var.name}-efs" }, var.tags)

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "efs" {
  count = var.create_efs ? 1 : 0

  security_group_id            = aws_security_group.efs[0].id
  description                  = "NFS from cluster nodes"
  ip_protocol                  = "tcp"
  from_port                    = 2049
  to_port                      = 2049
  referenced_security_group_id = var.client_security_group_id

  tags = merge({ Name = "${var.name}-efs-nfs" }, var.tags)
}

# The cluster group allows egress only to its members and to 80/443 (network module):
# without this rule the nodes could not open NFS connections to the mount targets.
resource "aws_vpc_security_group_egress_rule" "efs_clients" {
  count = var.create_efs ? 1 : 0

  security_group_id            = var.client_security_group_id
  description                  = "NFS to the EFS mount targets"
  ip_protocol                  = "tcp"
  from_port                    = 2049
  to_port                      = 2049
  referenced_security_group_id = aws_security_group.efs[0].id

  tags = merge({ Name = "${var.name}-efs-nfs-out" }, var.tags)
}

resource "aws_efs_mount_target" "this" {
  # count, not for_each: subnet IDs are unknown until the VPC exists, their number is not.
  count = var.create_efs ? length(var.subnet_ids) : 0

  file_system_id  = aws_efs_file_system.this[0].id
  subnet_id       = var.subnet_ids[count.index]
  security_groups = [aws_security_group.efs[0].id]
}

################################################################################
# FSx for Lustre
################################################################################

resource "aws_security_group" "fsx" {
  count = var.create_fsx_lustre ? 1 : 0

  name_prefix = "${var.name}-fsx-"
  description = "Lustre to FSx from cluster nodes only"
  vpc_id      = var.vpc_id

  tags = merge({ Name = "${var.name}-fsx" }, var.tags)

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "fsx" {
  # Lustre: 988 (LNET) and 1018-1023 (server-to-client), from the clients and
  # from the file system's own servers.
  for_each = var.create_fsx_lustre ? {
    clients-988       = { from = 988, to = 988, source = var.client_security_group_id }
    clients-1018-1023 = { from = 1018, to = 1023, source = var.client_security_group_id }
    servers-988       = { from = 988, to = 988, source = aws_security_group.fsx[0].id }
    servers-1018-1023 = { from = 1018, to = 1023, source = aws_security_group.fsx[0].id }
  } : {}

  security_group_id            = aws_security_group.fsx[0].id
  description                  = "Lustre ${each.key}"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = each.value.source

  tags = merge({ Name = "${var.name}-fsx-${each.key}" }, var.tags)
}

resource "aws_vpc_security_group_egress_rule" "fsx" {
  count = var.create_fsx_lustre ? 1 : 0

  security_group_id            = aws_security_group.fsx[0].id
  description                  = "Lustre servers to each other"
  ip_protocol                  = "tcp"
  from_port                    = 988
  to_port                      = 1023
  referenced_security_group_id = aws_security_group.fsx[0].id

  tags = merge({ Name = "${var.name}-fsx-out" }, var.tags)
}

# Lustre clients open 988 and 1018-1023 to the servers; the cluster group's egress would
# otherwise drop them (see efs_clients).
resource "aws_vpc_security_group_egress_rule" "fsx_clients" {
  for_each = var.create_fsx_lustre ? { "988" = [988, 988], "1018-1023" = [1018, 1023] } : {}

  security_group_id            = var.client_security_group_id
  description                  = "Lustre ${each.key} to FSx"
  ip_protocol                  = "tcp"
  from_port                    = each.value[0]
  to_port                      = each.value[1]
  referenced_security_group_id = aws_security_group.fsx[0].id

  tags = merge({ Name = "${var.name}-fsx-${each.key}-out" }, var.tags)
}

resource "aws_fsx_lustre_file_system" "this" {
  count = var.create_fsx_lustre ? 1 : 0

  storage_capacity            = var.fsx_storage_capacity_gib
  subnet_ids                  = [var.subnet_ids[0]]
  security_group_ids          = [aws_security_group.fsx[0].id]
  deployment_type             = "PERSISTENT_2"
  per_unit_storage_throughput = var.fsx_throughput_per_tib
  data_compression_type       = "LZ4"
  kms_key_id                  = var.kms_key_arn
  file_system_type_version    = "2.15"

  tags = merge({ Name = "${var.name}-lustre" }, var.tags)
}
