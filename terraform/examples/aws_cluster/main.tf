data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394:Only used when var.azs is null, and then only its first two names (slice), which a new zone does not change; set azs to pin zones.
  state = "available"
}

data "aws_caller_identity" "current" {}

locals {
  azs         = coalesce(var.azs, slice(data.aws_availability_zones.available.names, 0, 2))
  bucket_name = coalesce(var.checkpoint_bucket_name, "${var.cluster_name}-checkpoints-${data.aws_caller_identity.current.account_id}")
}

################################################################################
# Cluster description (validation, names, inventory)
################################################################################

module "spec" {
  source = "../../modules/cluster_spec"

  cluster_name       = var.cluster_name
  vpc_cidr           = var.vpc_cidr
  admin_cidrs        = var.admin_cidrs
  head_instance_type = var.head_instance_type

  admin_cidr_min_prefix_length = var.admin_cidr_min_prefix_length
  pools                        = var.pools
  ssh_user                     = var.ssh_user

  node_addresses      = local.node_addresses
  head_public_address = try(data.aws_instances.head.public_ips[0], null)
  checkpoint_bucket   = module.storage.bucket_name
  shared_filesystem   = module.storage.shared_filesystem
}

################################################################################
# Network
################################################################################

module "network" {
  source = "../../modules/network"

  name          = module.spec.cluster_name
  vpc_cidr      = module.spec.vpc_cidr
  azs           = local.azs
  admin_cidrs   = module.spec.admin_cidrs
  cluster_ports = module.spec.security_group_ports

  admin_cidr_min_prefix_length = var.admin_cidr_min_prefix_length
  enable_efa                   = module.spec.efa_supported

  tags = var.tags
}

################################################################################
# Storage
################################################################################

module "storage" {
  source = "../../modules/storage"

  name                     = module.spec.cluster_name
  bucket_name              = local.bucket_name
  vpc_id                   = module.network.vpc_id
  subnet_ids               = module.network.private_subnet_ids
  client_security_group_id = module.network.security_group_id
  create_fsx_lustre        = var.create_fsx_lustre

  tags = var.tags
}

################################################################################
# Nodes
################################################################################

# The head: a pool of one CPU node in a public subnet, the SSH entry point
# (admin group) and home of Ray's GCS, Prometheus, Grafana and MLflow.
module "head" {
  source = "../../modules/gpu_node_pool"

  name                        = module.spec.head_node_name
  cluster_name                = module.spec.cluster_name
  pool_name                   = "head"
  instance_type               = module.spec.head_instance_type
  node_count                  = 1
  ami_id                      = var.ami_id
  ami_name                    = var.ami_name
  key_name                    = var.ssh_key_name
  subnet_ids                  = [module.network.public_subnet_ids[0]]
  security_group_ids          = [module.network.security_group_id, module.network.admin_security_group_id]
  associate_public_ip_address = true
  checkpoint_bucket_arn       = module.storage.bucket_arn
  # Ray Train's controller (checkpoint registry, rotation). Not mlflow/: every job on the head
  # can use this role, and MLflow's server reaches its artifacts with its own key (below).
  s3_prefixes          = ["ray/"]
  root_volume_size_gib = 100

  tags = var.tags
}

################################################################################
# MLflow's artifact store
################################################################################

# The MLflow server's own identity for mlflow/ of the bucket, so no job on the head can rewrite
# artifacts behind MLflow's per-experiment permissions. Its access key is made outside Terraform
# (`aws iam create-access-key`, then into the Ansible vault) so the secret never enters the state.
# The bucket uses the AWS-managed aws/s3 key (the storage module's kms_key_arn is not set here),
# which S3 uses for any principal of the account, so no KMS grant is needed.
resource "aws_iam_user" "mlflow_artifacts" {
  #checkov:skip=CKV_AWS_273:MLflow runs on a self-managed host, not AWS SSO; this user's one access key is vaulted and read only by the MLflow server.
  name = "${module.spec.cluster_name}-mlflow-artifacts"

  tags = merge({ Name = "${module.spec.cluster_name}-mlflow-artifacts", "gpu-cluster:name" = module.spec.cluster_name }, var.tags)
}

data "aws_iam_policy_document" "mlflow_artifacts" {
  statement {
    sid       = "ListMlflowPrefix"
    actions   = ["s3:ListBucket"]
    resources = [module.storage.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["mlflow/", "mlflow/*"]
    }
  }

  statement {
    sid       = "ReadWriteMlflowArtifacts"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = ["${module.storage.bucket_arn}/mlflow/*"]
  }
}

resource "aws_iam_user_policy" "mlflow_artifacts" {
  #checkov:skip=CKV_AWS_40:A user of one service with one inline policy scoped to mlflow/; a group or managed policy would only add objects.
  name   = "mlflow-artifacts"
  user   = aws_iam_user.mlflow_artifacts.name
  policy = data.aws_iam_policy_document.mlflow_artifacts.json
}

module "pool" {
  source   = "../../modules/gpu_node_pool"
  for_each = module.spec.pools

  name          = "${module.spec.cluster_name}-${each.key}"
  cluster_name  = module.spec.cluster_name
  pool_name     = each.key
  instance_type = each.value.instance_type
  node_count    = each.value.count
  capacity_type = each.value.capacity_type
  ami_id        = var.ami_id
  ami_name      = var.ami_name
  key_name      = var.ssh_key_name
  # One AZ: a cluster placement group cannot span zones.
  subnet_ids            = [module.network.private_subnet_ids[0]]
  security_group_ids    = [module.network.security_group_id]
  placement_group_name  = module.network.placement_group_name
  efa_interface_count   = each.value.efa_count
  checkpoint_bucket_arn = module.storage.bucket_arn
  # Workers write checkpoints only; MLflow artifacts go through the head's server.
  s3_prefixes = ["ray/"]

  tags = var.tags
}

################################################################################
# Node addresses -> inventory
################################################################################

# The groups wait for capacity, so their instances exist when these are read.
# depends_on defers each read to apply time whenever its group changes (a pool
# grown or shrunk): read at plan time, it would list the old instances and the
# inventory would not match the new node names.
data "aws_instances" "head" {
  instance_tags = {
    "aws:autoscaling:groupName" = module.head.autoscaling_group_name
  }
  instance_state_names = ["running"]

  depends_on = [module.head]
}

data "aws_instances" "pool" {
  for_each = module.pool

  instance_tags = {
    "aws:autoscaling:groupName" = each.value.autoscaling_group_name
  }
  instance_state_names = ["running"]

  depends_on = [module.pool]
}

locals {
  # Each pool's addresses in numeric order: sort() compares strings, where
  # 10.42.128.10 comes before 10.42.128.5, so the key pads every octet to three
  # digits (010.042.128.005) and the address is read back from it.
  pool_addresses = {
    for name, found in data.aws_instances.pool : name => [
      for key in sort([for ip in found.private_ips : join(".", [for octet in split(".", ip) : format("%03d", tonumber(octet))])]) :
      join(".", [for octet in split(".", key) : tostring(tonumber(octet))])
    ]
  }

  # Node names are assigned in address order within each pool; a missing or
  # extra instance makes cluster_spec's inventory precondition fail by name.
  node_addresses = merge(
    { for ip in slice(data.aws_instances.head.private_ips, 0, min(1, length(data.aws_instances.head.private_ips))) : module.spec.head_node_name => ip },
    [
      for name, pool in module.spec.pools : {
        for i, ip in local.pool_addresses[name] : pool.node_names[i] => ip
        if i < length(pool.node_names)
      }
    ]...
  )
}
