################################################################################
# General
################################################################################

variable "name" {
  description = "Name prefix of every resource (the cluster name)."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$", var.name))
    error_message = "name must be DNS-safe: 1-32 characters from a-z, 0-9 and '-', starting with a letter."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
  nullable    = false
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key ARN for the bucket, EFS and FSx; null uses the AWS-managed keys (aws/s3, aws/elasticfilesystem, aws/fsx)."
  type        = string
  default     = null
}

################################################################################
# Checkpoint bucket
################################################################################

variable "bucket_name" {
  description = "Globally unique name of the S3 checkpoint bucket (3-63 characters: a-z, 0-9, '-', '.')."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-63 characters from a-z, 0-9, '-' and '.', starting and ending with a letter or digit."
  }
}

variable "sse_algorithm" {
  description = "Server-side encryption of the bucket."
  type        = string
  default     = "aws:kms"
  nullable    = false

  validation {
    condition     = contains(["aws:kms", "AES256"], var.sse_algorithm)
    error_message = "sse_algorithm must be one of: \"aws:kms\", \"AES256\"."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds checkpoints. Off by default so checkpoints survive a cluster teardown."
  type        = bool
  default     = false
  nullable    = false
}

variable "noncurrent_version_expiration_days" {
  description = "Days an overwritten or deleted object version is kept before S3 expires it."
  type        = number
  default     = 30
  nullable    = false

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be a whole number >= 1."
  }
}

variable "checkpoint_expiration_days" {
  description = "Days after which objects under checkpoint_prefix expire; null keeps checkpoints until deleted."
  type        = number
  default     = null

  validation {
    condition     = var.checkpoint_expiration_days == null || try(var.checkpoint_expiration_days >= 1, false)
    error_message = "checkpoint_expiration_days must be null (keep forever) or a whole number >= 1."
  }
}

variable "checkpoint_prefix" {
  description = "Key prefix holding checkpoints (what checkpoint_expiration_days applies to)."
  type        = string
  default     = "checkpoints/"
  nullable    = false
}

################################################################################
# Shared file systems
################################################################################

variable "vpc_id" {
  description = "VPC of the cluster (for the file systems' security groups)."
  type        = string
  nullable    = false
}

variable "subnet_ids" {
  description = "Subnets that get an EFS mount target each; FSx for Lustre uses the first one."
  type        = list(string)
  nullable    = false
}

variable "client_security_group_id" {
  description = "Security group of the cluster nodes: the only source allowed to mount the file systems."
  type        = string
  nullable    = false
}

variable "create_efs" {
  description = "Create an encrypted EFS file system with a mount target in every subnet."
  type        = bool
  default     = true
  nullable    = false
}

variable "create_fsx_lustre" {
  description = "Create an FSx for Lustre file system (high-throughput dataset cache) in the first subnet."
  type        = bool
  default     = false
  nullable    = false
}

variable "fsx_storage_capacity_gib" {
  description = "FSx for Lustre capacity in GiB: 1200, or a multiple of 2400 (PERSISTENT_2)."
  type        = number
  default     = 1200
  nullable    = false

  validation {
    condition     = var.fsx_storage_capacity_gib == 1200 || (var.fsx_storage_capacity_gib >= 2400 && var.fsx_storage_capacity_gib % 2400 == 0)
    error_message = "fsx_storage_capacity_gib must be 1200 or a multiple of 2400 (2400, 4800, 7200, ...)."
  }
}

variable "fsx_throughput_per_tib" {
  description = "FSx for Lustre PERSISTENT_2 throughput per TiB of storage (MB/s)."
  type        = number
  default     = 250
  nullable    = false

  validation {
    condition     = contains([125, 250, 500, 1000], var.fsx_throughput_per_tib)
    error_message = "fsx_throughput_per_tib must be one of: 125, 250, 500, 1000."
  }
}
