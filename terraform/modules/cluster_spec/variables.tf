################################################################################
# Cluster
################################################################################

variable "cluster_name" {
  description = "Name of the cluster; prefixes every node name and AWS resource name. DNS-safe: 1-32 characters from a-z, 0-9 and '-', starting with a letter, not ending with '-'."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$", var.cluster_name))
    error_message = "cluster_name must be DNS-safe: 1-32 characters from a-z, 0-9 and '-', starting with a letter and not ending with '-' (for example \"train-a\")."
  }
}

variable "vpc_cidr" {
  description = "IPv4 CIDR of the cluster VPC, a /16 to /24 network (for example 10.42.0.0/16)."
  type        = string
  nullable    = false

  validation {
    condition = (
      can(cidrhost(var.vpc_cidr, 0)) &&
      can(regex("^[0-9.]+/(1[6-9]|2[0-4])$", var.vpc_cidr)) &&
      try(cidrhost(var.vpc_cidr, 0) == split("/", var.vpc_cidr)[0], false)
    )
    error_message = "vpc_cidr must be an IPv4 network address with a prefix length from /16 to /24 (valid: 10.42.0.0/16 ... 10.42.0.0/24; host bits must be zero)."
  }
}

variable "admin_cidrs" {
  description = "CIDRs allowed to reach SSH and the dashboards (Ray dashboard, Grafana, MLflow, Prometheus). Never the whole internet."
  type        = list(string)
  nullable    = false

  validation {
    condition     = length(var.admin_cidrs) > 0 && alltrue([for c in var.admin_cidrs : can(cidrhost(c, 0))])
    error_message = "admin_cidrs must be a non-empty list of valid CIDRs (for example [\"203.0.113.7/32\"])."
  }

  validation {
    condition     = alltrue([for c in var.admin_cidrs : !endswith(c, "/0")])
    error_message = "admin_cidrs must not contain 0.0.0.0/0 or ::/0: SSH and dashboards are never opened to the whole internet. Valid values are narrower CIDRs such as your office or VPN range (\"203.0.113.0/24\")."
  }

  # By prefix length, not by spelling: 0.0.0.0/1 + 128.0.0.0/1 is the internet too.
  validation {
    condition = alltrue([
      for c in var.admin_cidrs : can(regex("^[0-9.]+/[0-9]+$", c)) && try(tonumber(split("/", c)[1]) >= var.admin_cidr_min_prefix_length, false)
    ])
    error_message = "admin_cidrs must be IPv4 CIDRs with a prefix length of at least admin_cidr_min_prefix_length (/${var.admin_cidr_min_prefix_length}); broader ones such as 0.0.0.0/1 or 10.0.0.0/7 open SSH to too much of the network. Use your address (\"203.0.113.7/32\") or your VPN range."
  }
}

variable "admin_cidr_min_prefix_length" {
  description = "Shortest prefix length admin_cidrs may have (8 admits a /8 at most; raise it to 16 or 24 to forbid wide ranges)."
  type        = number
  default     = 8
  nullable    = false

  validation {
    condition     = var.admin_cidr_min_prefix_length >= 1 && var.admin_cidr_min_prefix_length <= 32 && floor(var.admin_cidr_min_prefix_length) == var.admin_cidr_min_prefix_length
    error_message = "admin_cidr_min_prefix_length must be a whole number from 1 to 32."
  }
}

################################################################################
# Node pools
################################################################################

variable "head_instance_type" {
  description = "EC2 instance type of the Ray head node, which also hosts Prometheus, Grafana and MLflow (a CPU type such as m6i.2xlarge)."
  type        = string
  default     = "m6i.2xlarge"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.(metal|nano|micro|small|medium|large|[0-9]*xlarge)$", var.head_instance_type))
    error_message = "head_instance_type must be an EC2 instance type name such as m6i.2xlarge (family, '.', then nano|micro|small|medium|large|Nxlarge|metal)."
  }
}

variable "pools" {
  description = <<-EOT
    GPU worker pools keyed by pool name (DNS-safe, 1-16 characters). Each pool:
      instance_type - a GPU instance type of family p3, p3dn, p4d, p4de, p5, p5e, p5en, g4dn, g5, g6 or g6e
      count         - number of nodes, 1-32
      gpus_per_node - GPUs per node, 1-8; must match the instance type
      capacity_type - "on_demand" (default) or "spot"
      ray_resources - extra Ray custom resources advertised by every node of the pool
  EOT
  type = map(object({
    instance_type = string
    count         = number
    gpus_per_node = number
    capacity_type = optional(string, "on_demand")
    ray_resources = optional(map(number), {})
  }))
  nullable = false

  validation {
    condition     = length(var.pools) >= 1
    error_message = "pools must define at least one GPU pool, for example { a100 = { instance_type = \"p4d.24xlarge\", count = 2, gpus_per_node = 8 } }."
  }

  validation {
    condition     = alltrue([for name in keys(var.pools) : can(regex("^[a-z]([a-z0-9-]{0,14}[a-z0-9])?$", name))])
    error_message = "Every pool name must be DNS-safe: 1-16 characters from a-z, 0-9 and '-', starting with a letter and not ending with '-' (for example \"a100\" or \"spot-g5\")."
  }

  validation {
    condition     = alltrue([for p in values(var.pools) : p.count >= 1 && p.count <= 32 && floor(p.count) == p.count])
    error_message = "Every pool count must be a whole number from 1 to 32 (valid: 1, 2, ..., 32)."
  }

  validation {
    condition     = alltrue([for p in values(var.pools) : p.gpus_per_node >= 1 && p.gpus_per_node <= 8 && floor(p.gpus_per_node) == p.gpus_per_node])
    error_message = "Every pool gpus_per_node must be a whole number from 1 to 8 (valid: 1, 2, ..., 8)."
  }

  validation {
    condition     = alltrue([for p in values(var.pools) : contains(["on_demand", "spot"], p.capacity_type)])
    error_message = "Every pool capacity_type must be one of: \"on_demand\", \"spot\"."
  }

  validation {
    condition     = alltrue([for p in values(var.pools) : can(regex("^(p3|p3dn|p4d|p4de|p5|p5e|p5en|g4dn|g5|g6|g6e)\\.([0-9]*xlarge|metal)$", p.instance_type))])
    error_message = "Every pool instance_type must be a GPU instance type of family p3, p3dn, p4d, p4de, p5, p5e, p5en, g4dn, g5, g6 or g6e (for example \"p4d.24xlarge\" or \"g5.12xlarge\")."
  }
}

################################################################################
# Inventory
################################################################################

variable "node_addresses" {
  description = "Private IPv4 address of every node, keyed by the node names this module outputs (node_names). Empty while the nodes do not exist yet: the inventory output is then null."
  type        = map(string)
  default     = {}
  nullable    = false

  validation {
    condition     = alltrue([for ip in values(var.node_addresses) : can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$", ip)) && can(cidrhost("${ip}/32", 0))])
    error_message = "node_addresses values must be IPv4 addresses such as 10.42.1.17."
  }
}

variable "head_public_address" {
  description = "Public IPv4 address of the head node, used by Ansible as SSH entry point (workers are reached through it with ProxyJump). Null when the controller reaches the private addresses directly (VPN, peering)."
  type        = string
  default     = null

  validation {
    condition     = var.head_public_address == null || can(cidrhost("${coalesce(var.head_public_address, "x")}/32", 0))
    error_message = "head_public_address must be null or an IPv4 address such as 198.51.100.20."
  }
}

variable "ssh_user" {
  description = "Login user Ansible connects as (the AMI's default user: admin on Debian's official AMIs)."
  type        = string
  default     = "admin"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.ssh_user))
    error_message = "ssh_user must be a POSIX user name (lowercase letters, digits, '_' and '-'), for example \"admin\" (Debian) or \"ec2-user\"."
  }
}

variable "checkpoint_bucket" {
  description = "Name of the S3 bucket holding checkpoints and MLflow artifacts; null renders no storage variables."
  type        = string
  default     = null
}

variable "shared_filesystem" {
  description = "Shared file system every node mounts: type (efs or fsx_lustre), source (EFS DNS name, or FSx 'dns@tcp:/mountname') and mount_point. Null renders none."
  type = object({
    type        = string
    source      = string
    mount_point = optional(string, "/shared")
  })
  default = null

  validation {
    condition     = var.shared_filesystem == null || contains(["efs", "fsx_lustre"], try(var.shared_filesystem.type, ""))
    error_message = "shared_filesystem.type must be one of: \"efs\", \"fsx_lustre\"."
  }
}
