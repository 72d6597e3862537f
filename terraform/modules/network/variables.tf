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

################################################################################
# VPC and subnets
################################################################################

variable "vpc_cidr" {
  description = "IPv4 CIDR of the VPC (/16 to /24)."
  type        = string
  nullable    = false

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && can(regex("/(1[6-9]|2[0-4])$", var.vpc_cidr))
    error_message = "vpc_cidr must be an IPv4 CIDR with a prefix length from /16 to /24, for example 10.42.0.0/16."
  }
}

variable "azs" {
  description = "Availability zones, one public and one private subnet each. GPU pools that use the cluster placement group run in the first one."
  type        = list(string)
  nullable    = false

  validation {
    condition     = length(var.azs) >= 1 && length(var.azs) <= 4
    error_message = "azs must list 1 to 4 availability zones, for example [\"us-east-1a\", \"us-east-1b\"]."
  }
}

variable "create_nat_gateway" {
  description = "Create one NAT gateway so private nodes can reach package mirrors. Disable for air-gapped clusters that use offline repositories and the S3 endpoint only."
  type        = bool
  default     = true
  nullable    = false
}

variable "enable_s3_endpoint" {
  description = "Create an S3 gateway endpoint so checkpoint traffic stays inside the VPC (and off the NAT gateway)."
  type        = bool
  default     = true
  nullable    = false
}

variable "enable_flow_log" {
  description = "Send VPC flow logs (rejected and accepted traffic) to a CloudWatch log group."
  type        = bool
  default     = true
  nullable    = false
}

variable "flow_log_retention_days" {
  description = "Days CloudWatch keeps VPC flow logs."
  type        = number
  default     = 365
  nullable    = false

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "flow_log_retention_days must be one of CloudWatch's values: 1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653."
  }
}

variable "flow_log_kms_key_arn" {
  description = "KMS key ARN encrypting the flow log group; null creates a dedicated key."
  type        = string
  default     = null
}

################################################################################
# Security groups
################################################################################

variable "cluster_ports" {
  description = "Port ranges ({ from, to }, TCP) the nodes use among themselves, keyed by purpose (cluster_spec's security_group_ports output). Opened only with the cluster security group itself as source."
  type = map(object({
    from = number
    to   = number
  }))
  nullable = false

  validation {
    condition     = alltrue([for r in values(var.cluster_ports) : r.from >= 1 && r.to <= 65535 && r.from <= r.to])
    error_message = "Every cluster_ports range must satisfy 1 <= from <= to <= 65535."
  }
}

variable "admin_cidrs" {
  description = "CIDRs allowed to reach the admin ports (SSH, dashboards) on nodes in the admin security group. Never 0.0.0.0/0."
  type        = list(string)
  nullable    = false

  validation {
    condition     = length(var.admin_cidrs) > 0 && alltrue([for c in var.admin_cidrs : can(cidrhost(c, 0)) && !endswith(c, "/0")])
    error_message = "admin_cidrs must be a non-empty list of valid CIDRs, none of them 0.0.0.0/0 or ::/0 (for example [\"203.0.113.7/32\"])."
  }

  # By prefix length, not spelling: 0.0.0.0/1 + 128.0.0.0/1 is the internet too.
  validation {
    condition = alltrue([
      for c in var.admin_cidrs : can(regex("^[0-9.]+/[0-9]+$", c)) && try(tonumber(split("/", c)[1]) >= var.admin_cidr_min_prefix_length, false)
    ])
    error_message = "admin_cidrs must be IPv4 CIDRs no broader than /${var.admin_cidr_min_prefix_length} (admin_cidr_min_prefix_length), for example [\"203.0.113.7/32\"]."
  }
}

variable "admin_cidr_min_prefix_length" {
  description = "Shortest prefix length admin_cidrs may have."
  type        = number
  default     = 8
  nullable    = false

  validation {
    condition     = var.admin_cidr_min_prefix_length >= 1 && var.admin_cidr_min_prefix_length <= 32
    error_message = "admin_cidr_min_prefix_length must be from 1 to 32."
  }
}

variable "admin_ports" {
  description = "TCP ports opened to admin_cidrs on the admin security group (attached to the head node only). SSH only by default: the Ray dashboard, Grafana, MLflow and Prometheus bind loopback or the private address and are reached by SSH tunnel (docs/security.md)."
  type        = map(number)
  default = {
    ssh = 22
  }
  nullable = false

  # The cluster's own service ports (docs/security.md) are for members and SSH tunnels only.
  validation {
    condition = alltrue([
      for p in values(var.admin_ports) : p >= 1 && p <= 65535 && !contains(
        [2514, 3000, 5000, 6379, 8076, 8077, 8080, 8100, 8265, 9090, 9093, 9094, 9100, 9105, 9400, 52365, 52366, 52367], p
      ) && !(p >= 10001 && p <= 19999)
    ])
    error_message = "admin_ports values must be TCP ports 1-65535 other than the cluster's service ports: Ray GCS 6379, dashboard 8265, client 10001, worker ports 10002-19999, raylet 8076-8077, agents 52365-52367, metrics 8080, training targets 8100, MLflow 5000, Prometheus 9090, Alertmanager 9093-9094, Grafana 3000, node exporter 9100, remediation 9105, log shipping 2514, DCGM exporter 9400. Reach those by SSH tunnel (docs/security.md); 22 (SSH) and ports outside these are valid."
  }
}

variable "enable_efa" {
  description = "Allow all traffic inside the cluster security group, as EFA requires (AWS: the group must allow all inbound and outbound traffic to and from itself)."
  type        = bool
  default     = false
  nullable    = false
}

################################################################################
# Placement group
################################################################################

variable "create_placement_group" {
  description = "Create a cluster placement group, so GPU nodes sit close together for NCCL bandwidth."
  type        = bool
  default     = true
  nullable    = false
}
