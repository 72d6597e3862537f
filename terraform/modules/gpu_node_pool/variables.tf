################################################################################
# General
################################################################################

variable "name" {
  description = "Name of the pool's resources: <cluster>-<pool> (DNS-safe, at most 40 characters)."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$", var.name))
    error_message = "name must be DNS-safe: 1-40 characters from a-z, 0-9 and '-', starting with a letter."
  }
}

variable "cluster_name" {
  description = "Name of the cluster the pool belongs to (tag gpu-cluster:name)."
  type        = string
  nullable    = false
}

variable "pool_name" {
  description = "Name of the pool inside the cluster (tag gpu-cluster:pool), e.g. head or a100."
  type        = string
  nullable    = false
}

variable "tags" {
  description = "Tags added to every resource and propagated to the instances."
  type        = map(string)
  default     = {}
  nullable    = false
}

################################################################################
# Instances
################################################################################

variable "instance_type" {
  description = "EC2 instance type of the pool's nodes."
  type        = string
  nullable    = false
}

variable "node_count" {
  description = "Number of nodes; the group keeps exactly this many (min = max = desired)."
  type        = number
  nullable    = false

  validation {
    condition     = var.node_count >= 1 && var.node_count <= 32 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number from 1 to 32."
  }
}

variable "capacity_type" {
  description = "Purchase option of the pool's nodes."
  type        = string
  default     = "on_demand"
  nullable    = false

  validation {
    condition     = contains(["on_demand", "spot"], var.capacity_type)
    error_message = "capacity_type must be one of: \"on_demand\", \"spot\"."
  }
}

variable "spot_instance_types" {
  description = "Extra instance types a spot pool may fall back to (same GPU count); the pool's instance_type always comes first."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "ami_id" {
  description = "AMI ID of the nodes (a Debian 12 image); null looks up ami_name from ami_owner in the region."
  type        = string
  default     = null

  validation {
    condition     = var.ami_id == null || can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "ami_id must be null or an AMI ID such as ami-0123456789abcdef0."
  }
}

variable "ami_owner" {
  description = "AWS account publishing the image: 136693071363 is the Debian cloud team's official account."
  type        = string
  default     = "136693071363"
  nullable    = false

  validation {
    condition     = can(regex("^[0-9]{12}$", var.ami_owner))
    error_message = "ami_owner must be a 12-digit AWS account ID (Debian: \"136693071363\")."
  }
}

variable "ami_name" {
  description = "Exact name of the Debian 12 image (the OS the Ansible roles are tested on); no wildcards, so the pool boots this build until you change it. List builds with: aws ec2 describe-images --owners 136693071363 --filters 'Name=name,Values=debian-12-amd64-*'."
  type        = string
  default     = "debian-12-amd64-20240717-1811"
  nullable    = false

  validation {
    condition     = can(regex("^debian-12-amd64-[0-9]{8}-[0-9]+$", var.ami_name))
    error_message = "ami_name must name one Debian 12 amd64 build exactly, such as \"debian-12-amd64-20240717-1811\" (no wildcards: a pattern would boot whatever build is newest)."
  }
}

variable "key_name" {
  description = "EC2 key pair Ansible logs in with; null for none (SSM or a baked key)."
  type        = string
  default     = null
}

variable "root_volume_size_gib" {
  description = "Size of the encrypted root EBS volume in GiB."
  type        = number
  default     = 200
  nullable    = false

  validation {
    condition     = var.root_volume_size_gib >= 50 && var.root_volume_size_gib <= 16384
    error_message = "root_volume_size_gib must be from 50 to 16384."
  }
}

variable "root_device_name" {
  description = "Root device name of the AMI (/dev/xvda on Debian's and Amazon Linux AMIs)."
  type        = string
  default     = "/dev/xvda"
  nullable    = false
}

variable "kms_key_arn" {
  description = "KMS key ARN encrypting the root volume; null uses the account's default EBS key."
  type        = string
  default     = null
}

variable "enable_detailed_monitoring" {
  description = "Enable 1-minute CloudWatch metrics on the instances."
  type        = bool
  default     = true
  nullable    = false
}

################################################################################
# Network
################################################################################

variable "subnet_ids" {
  description = "Subnets of the pool. A pool in a cluster placement group must use one subnet (one AZ)."
  type        = list(string)
  nullable    = false

  validation {
    condition     = length(var.subnet_ids) >= 1
    error_message = "subnet_ids must hold at least one subnet ID."
  }
}

variable "security_group_ids" {
  description = "Security groups of the nodes (the cluster group; the head also gets the admin group)."
  type        = list(string)
  nullable    = false
}

variable "associate_public_ip_address" {
  description = "Give each node a public IPv4 address (the head node, as SSH entry point in a public subnet). Workers stay private."
  type        = bool
  default     = false
  nullable    = false
}

variable "placement_group_name" {
  description = "Cluster placement group of the pool, or null."
  type        = string
  default     = null
}

variable "efa_interface_count" {
  description = "EFA interfaces per node (cluster_spec's pools[*].efa_count): 0 for none; one per network card on multi-card types (p4d: 4, p5: 32)."
  type        = number
  default     = 0
  nullable    = false

  validation {
    condition     = contains([0, 1, 2, 4, 16, 32], var.efa_interface_count)
    error_message = "efa_interface_count must be one of: 0, 1, 2, 4, 16, 32 (the EFA interface counts of EC2 GPU types)."
  }
}

################################################################################
# IAM
################################################################################

variable "checkpoint_bucket_arn" {
  description = "ARN of the checkpoint bucket, the only S3 bucket the nodes may read and write."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:s3:::[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.checkpoint_bucket_arn))
    error_message = "checkpoint_bucket_arn must be an S3 bucket ARN such as arn:aws:s3:::train-a-checkpoints."
  }
}

variable "s3_prefixes" {
  description = "Key prefixes of the checkpoint bucket the pool's nodes may list, read, write and delete (the example gives every pool, the head included, [\"ray/\"]; MLflow's server uses its own IAM user for mlflow/)."
  type        = list(string)
  default     = ["ray/"]
  nullable    = false

  validation {
    condition     = length(var.s3_prefixes) > 0 && alltrue([for p in var.s3_prefixes : can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*/([A-Za-z0-9._-]+/)*$", p))])
    error_message = "s3_prefixes must be a non-empty list of key prefixes such as \"ray/\" or \"mlflow/\": no leading '/', no wildcards, each ending with '/'."
  }
}

variable "checkpoint_kms_key_arn" {
  description = "Customer-managed KMS key of the checkpoint bucket, granted for encrypt/decrypt; null when the bucket uses an AWS-managed key."
  type        = string
  default     = null
}
